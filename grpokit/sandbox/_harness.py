"""The evaluation harness that runs *inside* the sandbox (standard library only; its source is the first part of
the program the sandbox runs, followed by `run(<payload>)`).

It runs the solution, then the test's steps, and reports what each expression evaluated to, as plain data,
on the result channel (the original stdout; the program's own prints go to stderr). It decides nothing: the
judge (grpokit.sandbox.judge, outside the sandbox) compares the values with what the test expects, and never
sends the expected side in. A program can make this harness report anything it likes, but it cannot know
what to report, so it gains nothing.

Payload: {"code": solution source ("" in a clean run), "steps": [["exec", source] | ["eval", source], ...],
"keep_going": bool}. Record: {"solution": "ok" | "<error>", "values": [encoded value | ["!", "<error>"], ...],
"failed_exec": null | "<error of the first statement that raised>"}. A statement that raises stops the run
unless keep_going (the clean run); an expression that raises is recorded and the run goes on.

Encoding (exact types only; a subclass of int/str/... is refused, so no overridden __eq__ gets through):
None ["N"], bool ["B", b], int ["I", hex], float ["F", float.hex], complex ["C", re.hex, im.hex], str ["S", s],
bytes ["Y", hex], list ["L", [...]], tuple ["T", [...]], dict ["D", [[k, v], ...]], set ["E", [...]],
frozenset ["Z", [...]].
"""


def _encoder(_type):
    """encode(value): a plain value in the record's encoding (see above); TypeError or ValueError for anything
    else. Made by `run` before the solution runs, as a closure the solution cannot reach."""
    plain = {type(None): "N", bool: "B", int: "I", float: "F", complex: "C", str: "S", bytes: "Y", list: "L",
             tuple: "T", dict: "D", set: "E", frozenset: "Z"}

    def encode(value, depth=0):
        if depth > 200:
            raise ValueError("nested more than 200 levels")
        tag = plain.get(_type(value))
        if tag is None:
            raise TypeError(f"a {_type(value).__name__} is not plain data (None, bool, int, float, complex, str, "
                            "bytes, list, tuple, dict, set, frozenset)")
        if tag == "N":
            return ["N"]
        if tag == "B":
            return ["B", bool(value)]
        if tag == "I":
            return ["I", hex(value)]
        if tag == "F":
            return ["F", value.hex()]
        if tag == "C":
            return ["C", value.real.hex(), value.imag.hex()]
        if tag == "S":
            return ["S", value]
        if tag == "Y":
            return ["Y", value.hex()]
        if tag == "D":
            return ["D", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
        return [tag, [encode(item, depth + 1) for item in value]]

    return encode


def run(payload, _type=type, _len=len, _isinstance=isinstance, _BaseException=BaseException):
    import json
    import os

    dumps, write, dup, dup2, exit_now = json.dumps, os.write, os.dup, os.dup2, os._exit
    result_fd = dup(1)
    dup2(2, 1)  # the program's own prints (sys.stdout and fd 1) go to stderr from now on
    encode = _encoder(_type)

    def describe(exc):
        try:
            return f"{_type(exc).__name__}: {exc}"[:500]
        except _BaseException:  # noqa: BLE001 - a hostile exception's __str__
            return "an exception that cannot be printed"

    record = {"solution": "ok", "values": [], "failed_exec": None}
    scope = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": __file__}
    try:
        exec(compile(payload["code"], "solution.py", "exec"), scope)
    except _BaseException as exc:  # noqa: BLE001 - SystemExit included: a solution that exits has no values
        record["solution"] = describe(exc)
    if record["solution"] == "ok":
        for index, (kind, source) in enumerate(payload["steps"]):
            try:
                if kind == "exec":
                    exec(compile(source, "test.py", "exec"), scope)
                else:
                    record["values"].append(encode(eval(compile(source, "test.py", "eval"), scope)))
            except _BaseException as exc:  # noqa: BLE001
                if kind == "eval":
                    record["values"].append(["!", describe(exc)])
                    continue
                if record["failed_exec"] is None:
                    record["failed_exec"] = f"step {index}: {describe(exc)}"
                if not payload["keep_going"]:
                    break
    data = dumps(record).encode()
    while data:
        data = data[write(result_fd, data):]
    exit_now(0)  # no atexit hook, no thread, no finaliser runs after the record
