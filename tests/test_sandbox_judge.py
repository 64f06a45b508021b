"""A verdict no program can forge (issue 15, part 2): assert tests are judged outside the sandbox.

The correct solution scores 1.0 on every test form; every forging program (each one a wrong solution plus one
way of cheating) scores exactly 0.0. The expected side of a test never reaches the sandbox.
"""

from __future__ import annotations

import ast
import logging
import sys

import pytest

from grpokit.rewards import CodeExecutionReward, SandboxConfig
from grpokit.rewards.code_reward import parse_test_cases
from grpokit.sandbox.judge import decode_value, judge, plan_snippet, read_record

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox needs Linux", allow_module_level=True)

CONFIG = SandboxConfig(timeout_seconds=5, cpu_seconds=3, memory_bytes=256 * 1024**2, max_output_bytes=256 * 1024)

# Every accepted form of assert test. Expected values are distinctive numbers, so a search for them is meaningful.
TESTS = [
    "assert add(1000, 2345) == 3345",
    "assert add(-4000, 9871) == 5871\nassert add(0, 0) == 0",
    "def ref(a, b):\n    return a + b\nassert add(5000, 6123) == ref(5000, 6123)",
    "import math\nassert math.isclose(add(0.1, 0.2), 0.3)",
    "assert abs(add(2.5, 2.5) - 5.0) < 1e-9",
    "def check(candidate):\n    assert candidate(1017, 2029) == 3046\n    assert candidate(7, 8) != 16\ncheck(add)",
    "for a in range(3):\n    assert add(a, 3001 * a) == 3002 * a",
    "assert add(1, 2) in [3, 4] and not add(1, 1) > 2",
    "expected = 7777\nassert add(7000, 777) == expected",
    "assert add('ab', 'cd') == 'abcd' and add([1], [2]) == [1, 2] and add((1,), (2,)) == (1, 2)",
    "assert type(add(1, 2)) == int and isinstance(add(1.5, 1), float) and add(3, 4) == 7",
    "assert sorted(add([3], [1, 2]), key=lambda v: -v) == [3, 2, 1] and add(30, 12) == 42",
    "def close(a, b):\n    return abs(a - b) < 1e-6\nassert close(add(0.5, 0.25), 0.75) and not close(add(1, 1), 3)",
    "from math import isclose as near\nassert near(add(1.5, 1.5), 3.0)",
]
EXPECTED_LITERALS = ["3345", "5871", "3046", "3002", "7777", "abcd"]
CORRECT = "def add(a, b):\n    return a + b"
WRONG = "def add(a, b):\n    return a - b"

ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __gt__(self, other): return False
    def __le__(self, other): return True
    def __ge__(self, other): return True
    def __hash__(self): return 0
    def __sub__(self, other): return self
    def __abs__(self): return 0
    def __bool__(self): return True
    def __contains__(self, item): return True
def add(a, b):
    return AlwaysEqual()
"""

FAKE_RECORD = '{"solution": "ok", "values": [["B", true], ["B", true], ["B", true]], "failed_exec": null}'

FORGERS = {
    "always_equal_object": ALWAYS_EQUAL,
    "nan": "def add(a, b):\n    return float('nan')",
    "int_subclass_eq": "class I(int):\n    def __eq__(self, o): return True\n    __hash__ = int.__hash__\n"
                       "def add(a, b):\n    return I(0)",
    "str_subclass_eq": "class S(str):\n    def __eq__(self, o): return True\n    __hash__ = str.__hash__\n"
                       "def add(a, b):\n    return S('x')",
    "float_subclass": "class F(float):\n    def __eq__(self, o): return True\n    def __sub__(self, o): return 0.0\n"
                      "    __hash__ = float.__hash__\ndef add(a, b):\n    return F(0.0)",
    "list_subclass": "class L(list):\n    def __eq__(self, o): return True\ndef add(a, b):\n    return L()",
    "generator": "def add(a, b):\n    return (x for x in [a, b])",
    "metaclass_eq": "class M(type):\n    def __eq__(cls, other): return True\n    __hash__ = type.__hash__\n"
                    "class X(metaclass=M):\n    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
                    "def add(a, b):\n    return X()",
    "class_property_lies": "class X:\n    __class__ = property(lambda self: int)\n"
                           "    def __eq__(self, o): return True\n    __hash__ = object.__hash__\n"
                           "def add(a, b):\n    return X()",
    "exit_early_sys": f"{WRONG}\nimport sys\nsys.exit(0)",
    "exit_early_os": f"{WRONG}\nimport os\nos._exit(0)",
    "exit_inside_the_call": "import os\ndef add(a, b):\n    os._exit(0)",
    "system_exit_inside_the_call": "def add(a, b):\n    raise SystemExit(0)",
    "keyboard_interrupt_inside_the_call": "def add(a, b):\n    raise KeyboardInterrupt",
    "unprintable_exception": "class E(Exception):\n    def __str__(self):\n        import os\n        os._exit(0)\n"
                             "def add(a, b):\n    raise E()",
    "print_marker_from_source": "import os, re, sys\nfound = re.findall(r'grpokit-tests-done-[0-9a-f]+', "
                                "open(__file__).read())\nprint(found[-1] if found else 'no marker')\n"
                                "sys.stdout.flush()\nos._exit(0)",
    "print_fake_record": f"{WRONG}\nprint({FAKE_RECORD!r})\nprint('grpokit-tests-done-0123456789abcdef')",
    "write_fake_record_to_every_fd": f"{WRONG}\nimport os\nfor fd in range(1, 64):\n    try:\n"
                                    f"        os.write(fd, {FAKE_RECORD!r}.encode())\n    except OSError:\n"
                                    "        pass\nos._exit(0)",
    "monkeypatch_json": f"{WRONG}\nimport json\njson.dumps = lambda *a, **k: {FAKE_RECORD!r}\n"
                        "json.loads = lambda *a, **k: {'code': '', 'steps': [], 'keep_going': True}",
    "patch_builtins": f"{WRONG}\nimport builtins, math\nbuiltins.abs = lambda x: 0\nbuiltins.len = lambda x: 3\n"
                      "builtins.isinstance = lambda *a: True\nbuiltins.sorted = lambda *a, **k: [3]\n"
                      "math.isclose = lambda *a, **k: True\nbuiltins.hex = lambda x: '0xd11'\n"
                      "builtins.type = lambda x: int",
    "settrace_rewrites_the_record": f"{WRONG}\nimport sys\n"
                                    "def tracer(frame, event, arg):\n"
                                    "    record = frame.f_locals.get('record')\n"
                                    "    if isinstance(record, dict) and 'values' in record:\n"
                                    "        record['values'][:] = [['B', True]] * len(record['values'])\n"
                                    "    return tracer\nsys.settrace(tracer)\nsys.setprofile(tracer)",
    "atexit_hook": f"{WRONG}\nimport atexit, os\natexit.register(lambda: [os.write(fd, {FAKE_RECORD!r}.encode()) "
                   "for fd in (1, 3, 4)])",
    "thread_outlives_the_tests": f"{WRONG}\nimport os, threading, time\n"
                                 "def spam():\n    while True:\n        for fd in range(1, 16):\n"
                                 f"            try:\n                os.write(fd, {FAKE_RECORD!r}.encode())\n"
                                 "            except OSError:\n                pass\n        time.sleep(0.001)\n"
                                 "threading.Thread(target=spam, daemon=True).start()\ntime.sleep(0.05)",
    "close_the_result_channel": f"{WRONG}\nimport os\nfor fd in range(3, 64):\n    try:\n        os.close(fd)\n"
                                "    except OSError:\n        pass",
    "read_source_and_tests": "import os, re, sys, gc\nseen = open(__file__).read()\n"
                             "for path in ['/proc/self/cmdline', '/proc/self/environ', '/proc/1/cmdline']:\n"
                             "    try:\n        seen += open(path, 'rb').read().decode(errors='replace')\n"
                             "    except OSError:\n        pass\n"
                             "for name in os.listdir('.'):\n    try:\n        seen += open(name).read()\n"
                             "    except OSError:\n        pass\n"
                             "seen += repr(sys._getframe(1).f_locals) if sys._getframe(1) else ''\n"
                             "seen += ' '.join(repr(o)[:2000] for o in gc.get_objects()\n"
                             "                 if isinstance(o, (dict, str)))\n"
                             "sys.stderr.write(seen[-200000:])\n"
                             "numbers = [int(n) for n in re.findall(r'\\b\\d{4}\\b', seen)]\n"
                             "def add(a, b):\n    big = [n for n in numbers if n > max(abs(a) if isinstance(a, int) "
                             "else 0, 1)]\n    return big[-1] if big else 0",
    "rebind_the_reference": "def add(a, b):\n    globals()['ref'] = lambda a, b: a - b\n"
                            "    import builtins\n    builtins.ref = globals()['ref']\n    return a - b",
    "deep_nesting": "def add(a, b):\n    x = []\n    for _ in range(10000):\n        x = [x]\n    return x",
    "huge_output": "def add(a, b):\n    return list(range(10**6))",
    "patch_the_encoder_table": f"{WRONG}\nimport gc\nclass AE:\n    def __eq__(s, o): return True\n"
                               "    def __index__(self): return 3345\n"
                               "for o in gc.get_objects():\n    if isinstance(o, dict) and o.get(float) == 'F':\n"
                               "        o[AE] = 'I'\n"
                               "def add(a, b):\n    return AE()",
    "stop_itself_for_none": f"{WRONG}\nimport os, signal\ntry:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                            "except PermissionError:\n    pass",
}


def chat(code: str) -> str:
    return f"```python\n{code}\n```"


@pytest.fixture(scope="module")
def reward():
    return CodeExecutionReward(CONFIG)


def test_the_correct_solution_passes_every_test_form(reward):
    assert reward([chat(CORRECT)], test_cases=[TESTS]) == [1.0]
    assert all(plan_snippet(t).opaque is None for t in TESTS)


def test_every_forging_program_scores_zero(reward):
    names = list(FORGERS)
    scores = reward([chat(FORGERS[n]) for n in names] + [chat(CORRECT)], test_cases=[TESTS] * (len(names) + 1))
    assert dict(zip(names + ["control"], scores)) == {**{n: 0.0 for n in names}, "control": 1.0}


def test_the_expected_side_never_enters_the_sandbox(monkeypatch):
    seen: list[tuple[str, str]] = []
    reward = CodeExecutionReward(CONFIG)
    original = reward.sandbox.run_many

    def spy(codes, stdins=None):
        seen.extend(zip(codes, stdins or [""] * len(codes)))
        return original(codes, stdins)

    monkeypatch.setattr(reward.sandbox, "run_many", spy)
    io_tests = [{"input": "2 3\n", "output": "sum-is-5-9f31c2"}, {"input": "4 4\n", "output": "sum-is-8-9f31c2"}]
    assert reward([chat("a, b = map(int, input().split())\nprint(f'sum-is-{a + b}-9f31c2')")], tests=[io_tests]) \
        == [1.0]
    assert reward([chat(CORRECT)], test_cases=[TESTS]) == [1.0]
    program_runs = [(code, stdin) for code, stdin in seen if "def add" in code or "print(f'sum" in code]
    assert len(program_runs) == 2 + len(TESTS)
    for code, stdin in seen:
        for secret in EXPECTED_LITERALS + ["sum-is-5-9f31c2", "sum-is-8-9f31c2"]:
            if secret.startswith("sum-is"):
                assert secret not in code and secret not in stdin
            elif "def add" in code:  # a program run: no expected value in its source or stdin
                payload = code.split("\nrun(", 1)[1]
                assert secret not in payload and secret not in stdin, (secret, payload)


def test_a_test_function_on_the_programs_values_runs_afterwards_in_a_clean_run():
    from grpokit.sandbox.judge import RunValues, deferred_program

    plan = plan_snippet("def close(a, b):\n    return abs(a - b) < 1e-6\nassert close(f(2), 4.0)")
    assert plan.program_steps == [["eval", "f(2)"]] and plan.deferred == ["__slot1__"]
    source, slots = deferred_program(plan, RunValues([(True, 4.0000001)]), None)
    # the program's value is bound by a statement of its own, after the test's code, then the call runs on it
    assert source.endswith("\"keep_going\": true}'))\n")
    assert '["exec", "__slot0__ = 4.0000001"], ["eval", "close(__slot0__, 4.0)"]' in source
    assert slots == {"__slot1__": 0}
    assert judge(plan, RunValues([(True, 4.0000001)]), None, RunValues([(True, True)]), slots) == (True, "")
    # the program's value raised: nothing to run, the check fails with the program's error
    source, slots = deferred_program(plan, RunValues([(False, "ZeroDivisionError: x")]), None)
    assert source is None
    ok, why = judge(plan, RunValues([(False, "ZeroDivisionError: x")]), None, None, slots)
    assert not ok and "ZeroDivisionError" in why


def test_a_reference_function_runs_without_the_program_and_never_reaches_it():
    plan = plan_snippet("def ref(a, b):\n    return a + b\nassert add(5, 6) == ref(5, 6)")
    assert plan.program_steps == [["eval", "add(5, 6)"]]
    assert plan.clean_steps == [["exec", "def ref(a, b):\n    return a + b"], ["eval", "ref(5, 6)"]]


@pytest.mark.parametrize("snippet, program, checks", [
    ("assert add(1, 2) == 3", [["eval", "add(1, 2)"]], ["__slot0__ == 3"]),
    ("assert f(x)", [["eval", "f(x)"]], ["__slot0__"]),
    ("assert not f(3)", [["eval", "f(3)"]], ["not __slot0__"]),
    ("assert f(2) is None", [["eval", "f(2)"]], ["__slot0__ is None"]),
    ("assert sorted(f([3, 1])) == [1, 3]", [["eval", "f([3, 1])"]], ["sorted(__slot0__) == [1, 3]"]),
    ("assert f(1).strip() == 'a'", [["eval", "f(1).strip()"]], ["__slot0__ == 'a'"]),
    ("data = [3, 1]\nsort_in_place(data)\nassert data == [1, 3]",
     [["exec", "data = [3, 1]"], ["exec", "sort_in_place(data)"], ["eval", "data"]], ["__slot0__ == [1, 3]"]),
    ("x = 3\nassert f(x) == x * 2", [["exec", "x = 3"], ["eval", "f(x)"]], ["__slot0__ == __slot1__ * 2"]),
    ("def check(candidate):\n    assert candidate(1) == 2\ncheck(inc)", [["eval", "inc(1)"]], ["__slot0__ == 2"]),
    ("def close(a, b):\n    return abs(a - b) < 1e-6\nassert close(f(2), 4.0)", [["eval", "f(2)"]], ["__slot1__"]),
    ("for a, b in [(1, 2), (3, 4)]:\n    assert inc(a) == b",
     [["exec", "a = 1"], ["eval", "inc(a)"], ["exec", "a = 3"], ["eval", "inc(a)"]],
     ["__slot0__ == __slot1__", "__slot2__ == __slot3__"]),
])
def test_snippets_split_into_program_leaves_and_judge_side_checks(snippet, program, checks):
    plan = plan_snippet(snippet)
    assert plan.opaque is None
    assert plan.program_steps == program
    assert [ast.unparse(c.expr) for c in plan.checks] == checks


@pytest.mark.parametrize("snippet, why", [
    ("if True:\n    assert f(1) == 1", "an assert inside a If statement"),
    ("try:\n    assert f(1) == 1\nexcept ValueError:\n    pass", "an assert inside a Try statement"),
    ("for x in g():\n    assert f(x)", "an assert inside a loop over values the judge does not know"),
    ("print(f(1))", "no assert at the top level"),
    ("assert (", "the test does not parse"),
])
def test_snippets_the_judge_cannot_split_are_opaque_with_the_reason(snippet, why):
    assert plan_snippet(snippet).opaque.startswith(why)


def test_opaque_snippets_run_whole_with_a_warning_or_fail_when_asked(caplog):
    opaque = ["if True:\n    assert add(1, 2) == 3"]
    with caplog.at_level(logging.WARNING, logger="grpokit.rewards"):
        assert CodeExecutionReward(CONFIG)([chat(CORRECT), chat(WRONG)], test_cases=[opaque] * 2) == [1.0, 0.0]
    assert any("cannot be judged outside the sandbox" in r.getMessage() for r in caplog.records)
    # The documented limit: run whole, such a test's verdict can be faked by a program that reads its source.
    faker = ("import re, sys\nsrc = open(__file__).read()\n"
             "print(re.findall(r'grpokit-tests-done-[0-9a-f]+', src)[-1])\nsys.stdout.flush()\nimport os\nos._exit(0)")
    assert CodeExecutionReward(CONFIG)([chat(faker)], test_cases=[opaque]) == [1.0]
    strict = CodeExecutionReward(CONFIG, opaque_tests="fail")
    assert strict([chat(CORRECT), chat(faker)], test_cases=[opaque + TESTS[:1]] * 2) == [0.5, 0.0]
    with pytest.raises(ValueError, match="opaque_tests must be 'run' or 'fail'"):
        CodeExecutionReward(CONFIG, opaque_tests="maybe")


def test_old_test_case_formats_still_read_and_score():
    reward = CodeExecutionReward(CONFIG)
    assert [t.snippet for t in parse_test_cases('["assert add(1, 2) == 3"]')] == ["assert add(1, 2) == 3"]
    assert reward([chat(CORRECT)], test_cases=["assert add(1, 2) == 3"]) == [1.0]
    assert reward([chat(CORRECT), chat("syntax error(")], test_cases=[["assert True"]] * 2) == [1.0, 0.0]
    assert reward([chat("print(int(input()) * 2)")], tests=[{"inputs": ["2\n"], "outputs": ["4\n"]}]) == [1.0]


def test_strict_decoding_refuses_anything_but_the_documented_encoding():
    assert decode_value(["T", [["I", "0x3"], ["F", (0.5).hex()], ["S", "x"], ["N"], ["B", True]]]) == (3, 0.5, "x",
                                                                                                      None, True)
    assert decode_value(["D", [[["T", [["I", "0x1"]]], ["E", [["I", "0x2"]]]]]]) == {(1,): {2}}
    for bad in (["I", 3], ["X"], ["L", "notalist"], ["E", [["L", []]]], ["B", 1], ["D", [[["I", "0x1"]]]], "I", []):
        with pytest.raises(Exception):  # noqa: B017 - _Bad, or the ValueError/TypeError it wraps
            decode_value(bad)
    assert read_record("garbage", 1).error.startswith("no valid result record")
    assert read_record('{"solution": "ok", "values": [], "failed_exec": null, "extra": 1}', 0).error \
        == "malformed result record"
    two = '{"solution": "ok", "values": [["I", "0x1"], ["I", "0x2"]], "failed_exec": null}'
    assert read_record(two, 1).error == "malformed result record"  # more values than the test asked for


def test_the_judge_refuses_to_build_huge_values_from_program_output():
    plan = plan_snippet("assert f(1) ** f(2) == 3")
    record = read_record('{"solution": "ok", "values": [["I", "0xa"], ["I", "0x5f5e100"]], "failed_exec": null}', 2)
    ok, why = judge(plan, record, None)
    assert not ok and "too large" in why
    plan = plan_snippet("assert f(1) * 10**9 == 'x'")
    record = read_record('{"solution": "ok", "values": [["S", "ab"]], "failed_exec": null}', 1)
    ok, why = judge(plan, record, None)
    assert not ok and "too large" in why


def test_a_short_circuited_value_that_raised_does_not_fail_the_check():
    plan = plan_snippet("assert f(0) is None or f(1) == 2")
    record = read_record('{"solution": "ok", "values": [["N"], ["!", "ZeroDivisionError: x"]], '
                         '"failed_exec": null}', 2)
    assert judge(plan, record, None) == (True, "")
    plan = plan_snippet("assert f(1) == 2")
    record = read_record('{"solution": "ok", "values": [["!", "ZeroDivisionError: x"]], "failed_exec": null}', 1)
    assert judge(plan, record, None)[0] is False


IN_SANDBOX_WINNERS = ["always_equal_object", "int_subclass_eq", "str_subclass_eq", "float_subclass", "list_subclass",
                      "metaclass_eq", "class_property_lies", "print_marker_from_source", "patch_builtins",
                      "rebind_the_reference", "patch_the_encoder_table"]


def test_the_same_forgers_beat_a_verdict_taken_inside_the_sandbox():
    """Why the judge is outside: run whole inside the sandbox (the opaque path, the old design), these forgers
    get reward on the very tests where the judge gives them 0."""
    whole = ["if True:\n" + "\n".join("    " + line for line in t.splitlines()) for t in TESTS]
    scores = CodeExecutionReward(CONFIG)([chat(FORGERS[n]) for n in IN_SANDBOX_WINNERS],
                                         test_cases=[whole] * len(IN_SANDBOX_WINNERS))
    assert all(score > 0 for score in scores), dict(zip(IN_SANDBOX_WINNERS, scores))
