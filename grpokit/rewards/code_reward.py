"""Execute the completion's Python code against the sample's test cases, in the sandbox.

    r = None                      when the sample has no test cases, or the sandbox could not run a test
    r = 0.0                       when the completion has no ```python code block
    r = passed_tests / all_tests  otherwise

Test cases come from the `test_cases` column (else `tests`), one entry per sample, in one of these forms:

- a list of Python snippets, usually asserts (["assert add(1, 2) == 3", ...]), HumanEval's
  ``def check(candidate): ...`` + ``check(f)`` included: each is judged by grpokit.sandbox.judge, outside the
  sandbox. Only the parts that need the program run inside (after the solution, in their own process); the
  program reports their values as plain data and the judge compares them with the expected side, which never
  enters the sandbox. So nothing a program does to itself (exiting early, printing a fake result, overriding
  __eq__, patching builtins or json, reading its source) makes a wrong answer pass. A snippet the judge cannot
  split (an assert inside an if/try/with or a non-check function) is "opaque": with opaque_tests="run" (the
  default) it runs whole after the solution and passes when the run reaches its end (a verdict a determined
  program can fake; a warning says so once), with opaque_tests="fail" it fails;
- a list of {"input": str, "output": str} dicts: the solution runs with that stdin and passes when its stdout
  equals the expected output, compared line by line with trailing whitespace ignored;
- a dict {"inputs": [...], "outputs": [...]} (the APPS layout), read as the list of pairs above;
- a JSON string holding any of those, or one snippet string (a single test).

Each test is a separate sandboxed run, so one test's infinite loop costs only that test.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence

from grpokit.sandbox import Sandbox, SandboxConfig, SandboxResult
from grpokit.sandbox.judge import Plan, deferred_program, harness_program, judge, plan_snippet, read_record
from grpokit.rewards.text import completion_text, extract_code_block

logger = logging.getLogger("grpokit.rewards")

TEST_COLUMNS = ("test_cases", "tests")


@dataclass(frozen=True)
class CodeTest:
    """One test: a snippet run after the solution (`snippet`), or a stdin -> expected stdout pair."""

    snippet: str | None = None
    stdin: str = ""
    expected_stdout: str | None = None


def _io_pair(item: Mapping[str, Any]) -> CodeTest:
    stdin = item.get("input", item.get("stdin", ""))
    expected = item.get("output", item.get("stdout", item.get("expected_output")))
    if expected is None:
        raise ValueError(
            f"code_execution: test case {item!r} has no 'output'; expected {{'input': ..., 'output': ...}}"
        )
    return CodeTest(stdin=str(stdin), expected_stdout=str(expected))


def parse_test_cases(raw: Any) -> list[CodeTest]:
    """Read one sample's test cases in any of the accepted forms (see the module docstring)."""
    if raw is None:
        return []
    if isinstance(raw, str):
        stripped = raw.strip()
        if stripped[:1] in ("[", "{"):
            try:
                return parse_test_cases(json.loads(stripped))
            except ValueError:
                pass
        return [CodeTest(snippet=raw)] if stripped else []
    if isinstance(raw, Mapping):
        if "inputs" in raw and "outputs" in raw:
            if len(raw["inputs"]) != len(raw["outputs"]):
                raise ValueError(
                    f"code_execution: {len(raw['inputs'])} inputs but {len(raw['outputs'])} outputs in {raw!r:.200}"
                )
            return [_io_pair({"input": i, "output": o}) for i, o in zip(raw["inputs"], raw["outputs"])]
        return [_io_pair(raw)]
    if isinstance(raw, Sequence):
        return [CodeTest(snippet=item) if isinstance(item, str) else _io_pair(item) for item in raw]
    raise ValueError(
        f"code_execution: cannot read test cases of type {type(raw).__name__}; use a list of assert strings, a list "
        "of {'input': ..., 'output': ...} dicts, or {'inputs': [...], 'outputs': [...]}"
    )


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def build_program(code: str, test: CodeTest, marker: str) -> str:
    """The program for one test: the solution, then the snippet and a completion marker (snippet tests only)."""
    if test.snippet is None:
        return code
    return f"{code}\n\n{test.snippet}\n\nprint({marker!r})\n"


def passes_test(result: SandboxResult, test: CodeTest, marker: str) -> bool:
    """Whether a finished run passed its test (see the module docstring for the rule of each form)."""
    if not result.ok:
        return False
    if test.snippet is not None:
        lines = _lines(result.stdout)
        return bool(lines) and lines[-1] == marker
    return _lines(result.stdout) == _lines(test.expected_stdout or "")


def _eval_count(steps: list[list[str]]) -> int:
    return sum(kind == "eval" for kind, _ in steps)


def _snippet_values(plan: Plan, program: SandboxResult, clean: SandboxResult | None):
    program_values = read_record(program.stdout, _eval_count(plan.program_steps))
    clean_values = read_record(clean.stdout, _eval_count(plan.clean_steps)) if clean is not None else None
    return program_values, clean_values


def judge_snippet(
    plan: Plan, program: SandboxResult, clean: SandboxResult | None, deferred: SandboxResult | None = None,
    deferred_slots: dict | None = None,
) -> tuple[bool, str]:
    """Verdict for a judged snippet from its program run, its clean run and its deferred run (when it has them)."""
    runs = ((program, "the program run"), (clean, "the test's clean run"), (deferred, "the test's clean run"))
    for run, what in runs:
        if run is not None and not run.ok:
            return False, f"{what} ended {run.status}"
    program_values, clean_values = _snippet_values(plan, program, clean)
    deferred_values = None
    if deferred is not None:
        deferred_values = read_record(deferred.stdout, sum(isinstance(i, int) for i in (deferred_slots or {}).values()))
    return judge(plan, program_values, clean_values, deferred_values, deferred_slots)


class CodeExecutionReward:
    """Fraction of the sample's tests that the completion's code passes; runs go through a bounded sandbox pool.

    config: a SandboxConfig, or a dict of its fields (e.g. {"timeout_seconds": 5}); column: the test-case column
    (default: `test_cases`, else `tests`); opaque_tests: "run" or "fail" for snippets the judge cannot split
    (see the module docstring).
    """

    def __init__(
        self,
        config: SandboxConfig | Mapping[str, Any] | None = None,
        column: str | None = None,
        opaque_tests: Literal["run", "fail"] = "run",
    ) -> None:
        if isinstance(config, Mapping):
            config = SandboxConfig(**config)
        if opaque_tests not in ("run", "fail"):
            raise ValueError(f"code_execution: opaque_tests must be 'run' or 'fail', got {opaque_tests!r}")
        self.sandbox = Sandbox(config)
        self.columns = (column,) if column else TEST_COLUMNS
        self.opaque_tests = opaque_tests
        self._warned_opaque = False
        self.__name__ = "code_execution"

    def _tests_column(self, columns: Mapping[str, Any]) -> Sequence[Any]:
        for name in self.columns:
            if columns.get(name) is not None:
                return columns[name]
        raise ValueError(
            f"code_execution needs a test-case column named one of {list(self.columns)}; the dataset has "
            f"{sorted(columns)}. Rename the column or pass column=... to CodeExecutionReward."
        )

    def _plans(self, tests_per_sample: list[list[CodeTest]]) -> dict[str, Plan]:
        plans = {t.snippet: plan_snippet(t.snippet) for tests in tests_per_sample for t in tests
                 if t.snippet is not None}
        opaque = {snippet: plan.opaque for snippet, plan in plans.items() if plan.opaque}
        if opaque and not self._warned_opaque:
            self._warned_opaque = True
            snippet, why = next(iter(opaque.items()))
            logger.warning(
                "code_execution: %d test snippet(s) cannot be judged outside the sandbox (e.g. %r: %s); %s",
                len(opaque), snippet[:200], why,
                "they run whole inside the sandbox, where a determined program can fake a pass"
                if self.opaque_tests == "run" else "they count as failed (opaque_tests='fail')",
            )
        return plans

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | None]:
        tests_per_sample = [parse_test_cases(raw) for raw in self._tests_column(columns)]
        codes = [extract_code_block(completion_text(c)) for c in completions]
        marker = f"grpokit-tests-done-{secrets.token_hex(8)}"
        plans = self._plans(tests_per_sample)
        programs, stdins, jobs = self._jobs(codes, tests_per_sample, plans, marker)
        results = self.sandbox.run_many(programs, stdins)
        # Second phase: calls of the tests' own functions on the values the programs returned, in clean runs.
        second, second_programs = _deferred_jobs(plans, jobs, results)
        second_results = self.sandbox.run_many(second_programs) if second_programs else []
        passed, unknown = _tally(len(completions), plans, jobs, results, second, second_results, marker)
        scores: list[float | None] = []
        for i, tests in enumerate(tests_per_sample):
            if not tests or unknown[i]:
                scores.append(None)
            elif codes[i] is None:
                scores.append(0.0)
            else:
                scores.append(passed[i] / len(tests))
        return scores

    def _jobs(self, codes: list[str | None], tests_per_sample: list[list[CodeTest]], plans: dict[str, Plan],
              marker: str) -> tuple[list[str], list[str], list[tuple]]:
        """The first phase's sandbox runs: their programs and stdins, and per test of a sample with code its job
        (sample, test, program job, clean job); the program job is None for an opaque snippet with
        opaque_tests="fail"."""
        programs: list[str] = []
        stdins: list[str] = []

        def add(program: str, stdin: str = "") -> int:
            programs.append(program)
            stdins.append(stdin)
            return len(programs) - 1

        clean_jobs: dict[str, int] = {}  # one clean run per distinct snippet: it does not depend on the program
        jobs = []  # (sample, test, program job, clean job)
        for i, (code, tests) in enumerate(zip(codes, tests_per_sample)):
            if code is None:
                continue
            for test in tests:
                plan = plans.get(test.snippet) if test.snippet is not None else None
                if plan is None:
                    jobs.append((i, test, add(code, test.stdin), None))
                elif plan.opaque:
                    if self.opaque_tests == "run":
                        jobs.append((i, test, add(build_program(code, test, marker)), None))
                    else:
                        jobs.append((i, test, None, None))
                else:
                    clean = None
                    if _eval_count(plan.clean_steps):
                        if test.snippet not in clean_jobs:
                            clean_jobs[test.snippet] = add(harness_program("", plan.clean_steps, keep_going=True))
                        clean = clean_jobs[test.snippet]
                    jobs.append((i, test, add(harness_program(code, plan.program_steps, keep_going=False)), clean))
        return programs, stdins, jobs


def _deferred_jobs(plans: dict[str, Plan], jobs: list[tuple], results: list[SandboxResult]):
    """The second phase's programs (the tests' own functions called on the values the programs returned), and per
    program job its (index in the second phase's results, -1 when nothing is left to run; deferred slot map)."""
    second: dict[int, tuple[int, dict]] = {}  # job -> (index in second_results, deferred slot map)
    second_programs = []
    for i, test, job, clean in jobs:
        plan = plans.get(test.snippet) if test.snippet is not None else None
        if job is None or plan is None or plan.opaque or not plan.deferred or not results[job].ok:
            continue
        if clean is not None and not results[clean].ok:
            continue
        source, slots = deferred_program(plan, *_snippet_values(plan, results[job],
                                                                results[clean] if clean is not None else None))
        if source is not None:
            second[job] = (len(second_programs), slots)
            second_programs.append(source)
        else:
            second[job] = (-1, slots)
    return second, second_programs


def _tally(count: int, plans: dict[str, Plan], jobs: list[tuple], results: list[SandboxResult],
           second: dict[int, tuple[int, dict]], second_results: list[SandboxResult], marker: str):
    """Per sample: the tests passed, and whether the sandbox could not run one of its tests (infra_error)."""
    passed = [0] * count
    unknown = [False] * count
    for i, test, job, clean in jobs:
        if job is None:  # an opaque snippet with opaque_tests="fail"
            continue
        result, clean_result = results[job], results[clean] if clean is not None else None
        index, slots = second.get(job, (-1, None))
        deferred_result = second_results[index] if index >= 0 else None
        if any(r is not None and r.status == "infra_error" for r in (result, clean_result, deferred_result)):
            unknown[i] = True
            continue
        plan = plans.get(test.snippet) if test.snippet is not None else None
        if plan is None or plan.opaque:
            passed[i] += passes_test(result, test, marker)
        else:
            passed[i] += judge_snippet(plan, result, clean_result, deferred_result, slots)[0]
    return passed, unknown
