"""Tools: call formats, the toolbox's error handling (every failure is a message the model reads), built-ins."""

import json
import time

import pytest

from grpokit.tools import (
    TOOL_CALL_FORMATS,
    ToolCall,
    ToolError,
    ToolResult,
    Toolbox,
    calculator,
    resolve_format,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"boom: {reason}")


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "late"


async def fetch(key: str) -> dict:
    """Look a key up (a coroutine tool).

    Args:
        key: The key.
    """
    return {"key": key, "value": len(key)}


def error_of(result: ToolResult) -> str:
    assert result.failed
    return json.loads(result.content)["error"]


# ---------------------------------------------------------------- formats
def test_qwen_format_reads_every_call_in_order_and_flags_unreadable_ones():
    text = (
        'Let me compute. <tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{"name": "add", "arguments": {"a": 7'
    )
    calls = resolve_format("qwen").parse(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("add", {"a": 2, "b": 3}, True), ("add", {"a": 1, "b": 1}, True)]
    assert "not valid JSON" in calls[2].error
    assert "must be a JSON object" in calls[3].error
    assert calls[4].error == "the tool call's arguments must be a JSON object"
    assert "not valid JSON" in calls[5].error  # cut off mid-call: still a call, with an error
    assert resolve_format("qwen").parse("The answer is 5.") == []
    assert resolve_format("hermes").parse('<tool_call>{"name": "x"}</tool_call>') == [ToolCall("x", {})]


def test_formats_write_results_back_as_text():
    results = [ToolResult("add", "5"), ToolResult("add", '{"error": "x"}', failed=True)]
    assert resolve_format("qwen").render_results(results) == (
        "<tool_response>\n5\n</tool_response>\n<tool_response>\n{\"error\": \"x\"}\n</tool_response>\n")
    assert resolve_format("compact").render_results(results[:1]) == "<result>5</result>"


def test_compact_format_passes_one_positional_argument():
    calls = resolve_format("compact").parse("<call>calculator(12*34)</call> then <call>oops</call>")
    assert calls[0] == ToolCall("calculator", positional="12*34")
    assert "must look like" in calls[1].error
    assert Toolbox([calculator]).run(calls[:1]) == [ToolResult("calculator", "408")]


def test_a_user_format_registers_and_resolves_by_name_and_import_path():
    @TOOL_CALL_FORMATS.register("test_upper")
    class Upper:
        name = "test_upper"

        def parse(self, text):
            return [ToolCall("add", {"a": 1, "b": 2})] if "CALL" in text else []

        def render_results(self, results):
            return "|".join(r.content for r in results)

    assert resolve_format("test_upper").parse("CALL") == [ToolCall("add", {"a": 1, "b": 2})]
    assert resolve_format("grpokit.tools.formats:CompactFormat").name == "compact"
    with pytest.raises(ValueError, match="tool_call_format"):
        resolve_format("no_such_format")


# ---------------------------------------------------------------- the toolbox
def test_schemas_come_from_type_hints_and_docstrings():
    box = Toolbox([add, "calculator"])
    schema = box.schemas[0]["function"]
    assert schema["name"] == "add" and schema["description"] == "Add two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first."}
    assert schema["parameters"]["required"] == ["a", "b"]
    assert [s["function"]["name"] for s in box.schemas] == ["add", "calculator"]


def test_a_tool_without_docstring_or_hints_or_with_a_taken_name_is_refused_up_front():
    def bare(x):
        return x

    with pytest.raises(ToolError, match="'bare' cannot be described.*Args:"):
        Toolbox([bare])
    with pytest.raises(ToolError, match="Two tools are named 'add'"):
        Toolbox([add, add])
    with pytest.raises(ToolError, match="not callable"):
        Toolbox([42])
    with pytest.raises(ValueError, match="tools='no_such_tool'"):
        Toolbox(["no_such_tool"])


def test_every_kind_of_tool_failure_becomes_a_message_not_a_crash():
    box = Toolbox([add, explode, slow], timeout=0.3)
    started = time.perf_counter()
    results = box.run([
        ToolCall("", error="the tool call is not valid JSON (Expecting value at character 0)"),
        ToolCall("search", {"q": "x"}),
        ToolCall("explode", {"reason": "test"}),
        ToolCall("slow", {"seconds": 5}),
        ToolCall("add", {"a": 1}),
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),
        ToolCall("add", {"a": 20, "b": 22}),
    ])
    assert time.perf_counter() - started < 2.0  # the hung call did not hold the rollout for its 5 s
    assert "not valid JSON" in error_of(results[0])
    assert error_of(results[1]) == "unknown tool 'search'; available tools: add, explode, slow"
    assert error_of(results[2]) == "RuntimeError: boom: test"
    assert error_of(results[3]) == "tool 'slow' did not return within 0.3 s"
    assert "missing 1 required positional argument: 'b'" in error_of(results[4])
    assert "unexpected keyword argument 'c'" in error_of(results[5])
    assert results[6] == ToolResult("add", "42")


def test_results_are_text_json_for_structures_and_coroutine_tools_are_awaited():
    box = Toolbox([fetch, add])
    assert box.run([ToolCall("fetch", {"key": "abc"})]) == [ToolResult("fetch", '{"key": "abc", "value": 3}')]
    assert box.run([ToolCall("add", {"a": 1, "b": 1})])[0].content == "2"


# ---------------------------------------------------------------- built-in tools
@pytest.mark.parametrize("expression, expected", [
    ("47*38", "1786"), ("(12 + 3) * 45", "675"), ("7/2", "3.5"), ("8/2", "4"), ("-3**2", "-9"),
    ("10 // 3", "3"), ("10 % 3", "1"), ("2**100", str(2**100)),
])
def test_calculator_is_exact(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("2**10**9", "more than 1000 digits"),
    ("1 +", "not an arithmetic expression"), ("'a' * 3", "only numbers"),
])
def test_calculator_refuses_anything_but_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        calculator(expression)


def test_python_tool_runs_code_in_the_sandbox():
    box = Toolbox(["python"], timeout=30)
    ok, failing = box.run([ToolCall("python", {"code": "print(sum(range(10)))"}),
                           ToolCall("python", {"code": "raise SystemExit('bad input')"})])
    assert ok == ToolResult("python", "45\n")
    assert not failing.failed and failing.content.startswith("[error]") and "bad input" in failing.content


def test_a_flood_of_calls_or_a_huge_result_is_bounded():
    from grpokit.tools.toolbox import MAX_CALLS_PER_TURN, MAX_RESULT_CHARS

    def big(n: int) -> str:
        """A long text.

        Args:
            n: Its length.
        """
        return "x" * n

    box = Toolbox([add, big])
    results = box.run([ToolCall("add", {"a": 1, "b": i}) for i in range(MAX_CALLS_PER_TURN + 3)])
    assert [r.content for r in results[:MAX_CALLS_PER_TURN]] == [str(1 + i) for i in range(MAX_CALLS_PER_TURN)]
    assert all("more than 32 tool calls in one turn" in error_of(r) for r in results[MAX_CALLS_PER_TURN:])
    (result,) = box.run([ToolCall("big", {"n": 10 * MAX_RESULT_CHARS})])
    assert len(result.content) < MAX_RESULT_CHARS + 100 and result.content.endswith("[cut: 500000 characters in all]")


def test_unreadable_calls_and_unprintable_results_become_messages():
    huge = "9" * 5000
    calls = resolve_format("qwen").parse(
        f'<tool_call>{{"name": "add", "arguments": {{"a": {huge}, "b": 1}}}}</tool_call>'
        + "<tool_call>" + "[" * 5000 + "</tool_call>"
        + '<tool_call>{"name": "add", "arguments": "' + "[" * 5000 + '"}</tool_call>')
    assert "cannot be read (ValueError)" in calls[0].error
    assert "cannot be read (RecursionError)" in calls[1].error
    assert "arguments must be a JSON object" in calls[2].error

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no")

        __repr__ = __str__

    class Odd(Exception):
        def __str__(self):
            raise RuntimeError("no")

    def weird(kind: str):
        """Return something awkward.

        Args:
            kind: Which.
        """
        if kind == "raise":
            raise Odd()
        nested = []
        for _ in range(5000):
            nested = [nested]
        return {"big": 10**5000, "nested": nested, "object": Unprintable()}[kind]

    box = Toolbox([weird])
    big, nested, obj, odd = box.run([ToolCall("weird", {"kind": k}) for k in ("big", "nested", "object", "raise")])
    assert (big.content, nested.content) == ("<unprintable int>", "<unprintable list>")  # too long / too deep
    assert obj.content == "<unprintable Unprintable>"
    assert error_of(odd).startswith("Odd: ")


def test_a_tool_that_mutates_its_arguments_does_not_change_the_transcript():
    def grab(items: list) -> int:
        """Take everything.

        Args:
            items: The items.
        """
        items.clear()
        return 0

    call = ToolCall("grab", {"items": [1, 2]})
    Toolbox([grab]).run([call])
    assert call.arguments == {"items": [1, 2]}
