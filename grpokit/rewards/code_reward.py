"""Execute the completion's Python code against the sample's test cases, in the sandbox.

    r = None                      when the sample has no test cases, or the sandbox could not run a test
    r = 0.0                       when the completion has no ```python code block
    r = passed_tests / all_tests  otherwise

Test cases come from the `test_cases` column (else `tests`), one entry per sample, in one of these forms:

- a list of Python snippets, usually asserts (["assert add(1, 2) == 3", ...]): each runs after the solution
  code in its own process and passes when the program ends normally *and* reaches the line after the snippet
  (so a solution that calls sys.exit(0) / os._exit(0) early does not pass);
- a list of {"input": str, "output": str} dicts: the solution runs with that stdin and passes when its stdout
  equals the expected output, compared line by line with trailing whitespace ignored;
- a dict {"inputs": [...], "outputs": [...]} (the APPS layout), read as the list of pairs above;
- a JSON string holding any of those, or one snippet string (a single test).

Each test is a separate sandboxed run, so one test's infinite loop costs only that test.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from grpokit.sandbox import Sandbox, SandboxConfig, SandboxResult
from grpokit.rewards.text import completion_text, extract_code_block

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


class CodeExecutionReward:
    """Fraction of the sample's tests that the completion's code passes; runs go through a bounded sandbox pool.

    config: a SandboxConfig, or a dict of its fields (e.g. {"timeout_seconds": 5}); column: the test-case column
    (default: `test_cases`, else `tests`).
    """

    def __init__(self, config: SandboxConfig | Mapping[str, Any] | None = None, column: str | None = None) -> None:
        if isinstance(config, Mapping):
            config = SandboxConfig(**config)
        self.sandbox = Sandbox(config)
        self.columns = (column,) if column else TEST_COLUMNS
        self.__name__ = "code_execution"

    def _tests_column(self, columns: Mapping[str, Any]) -> Sequence[Any]:
        for name in self.columns:
            if columns.get(name) is not None:
                return columns[name]
        raise ValueError(
            f"code_execution needs a test-case column named one of {list(self.columns)}; the dataset has "
            f"{sorted(columns)}. Rename the column or pass column=... to CodeExecutionReward."
        )

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | None]:
        tests_per_sample = [parse_test_cases(raw) for raw in self._tests_column(columns)]
        codes = [extract_code_block(completion_text(c)) for c in completions]
        marker = f"grpokit-tests-done-{secrets.token_hex(8)}"
        jobs = [
            (i, test)
            for i, (code, tests) in enumerate(zip(codes, tests_per_sample))
            if code is not None
            for test in tests
        ]
        results = self.sandbox.run_many(
            [build_program(codes[i], test, marker) for i, test in jobs], [test.stdin for _, test in jobs]
        )
        passed = [0] * len(completions)
        unknown = [False] * len(completions)
        for (i, test), result in zip(jobs, results):
            unknown[i] |= result.status == "infra_error"
            passed[i] += passes_test(result, test, marker)
        scores: list[float | None] = []
        for i, tests in enumerate(tests_per_sample):
            if not tests or unknown[i]:
                scores.append(None)
            elif codes[i] is None:
                scores.append(0.0)
            else:
                scores.append(passed[i] / len(tests))
        return scores
