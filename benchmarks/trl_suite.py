"""How much of TRL's own GRPO test suite passes against grpokit.

Usage (from the repository root; TRL's tests are read from a TRL checkout at run time, never stored here):

    mkdir -p /tmp/trl_src && git -C /path/to/trl archive HEAD tests | tar -x -C /tmp/trl_src
    .venv/bin/python benchmarks/trl_suite.py --trl-src /tmp/trl_src --work /tmp/trl_suite \\
        --out /tmp/trl_suite/report.json --markdown /tmp/trl_suite/report.md

What it does:

1. Builds offline stand-ins for the hub ids the tests load (`benchmarks/trl_suite_standins.py`): tiny random-init
   models, local tokenizers with our own chat templates, and a local `zen` dataset folder. Cached under
   `WORK/cache`; vision models and image datasets are not built.
2. Copies `tests/test_grpo_trainer.py` and the tests-package files it needs (`__init__.py`, `conftest.py`, and the
   modules it imports relatively, e.g. `testing_utils.py`) twice under `WORK/runs/`: `trl/` changes only the hub ids
   (the baseline), `grpokit/` also changes the line `from trl import GRPOConfig, GRPOTrainer` to import from grpokit.
   No other edit is made to TRL's files. A small pytest plugin of ours deselects the set-aside tests and, where the
   checkout's helper files import an `is_X_available` that the installed trl lacks, defines it (version skew).
3. Sets aside (deselects) the tests that need a hub id with no stand-in: found by reading each test's source, so a
   parametrized test loses only the parameters that name such an id. Tests needing a GPU, liger, kernels,
   bitsandbytes... are skipped by TRL's own `require_*` marks and counted as skipped.
4. Runs pytest on both copies (concurrently by default, one torch thread each), offline, each in its own process
   session with a wall-clock limit; the whole process group is killed on timeout or any other exit.
5. Parses both junit files and reports: tests collected, TRL passed/failed/skipped, how many TRL-passing tests pass on
   grpokit (the target is >= 90%), grpokit's failures among those grouped by normalized first message line, and the
   tests that fail on TRL too (they do not count). Markdown goes to stdout and `--markdown`, JSON to `--out`.

`--skip-run` re-renders the report from the junit files of the last run; `-k EXPR` narrows both runs (for debugging
the harness on a subset; the report then covers only that subset).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import trl_suite_standins as standins  # noqa: E402

TEST_FILE = "test_grpo_trainer.py"
TRL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
GRPOKIT_IMPORT = "from grpokit import GRPOConfig, GRPOTrainer"
HUB_ID = re.compile(r"\b(trl-internal-testing/[A-Za-z0-9_.-]+)")
# A quoted "org/name" whose org has a capital or a hyphen (Qwen/..., HuggingFaceTB/..., kernels-community/...); metric
# keys such as "completions/mean_length" don't match.
ANY_HUB_ID = re.compile(r"^(?=[^/]*[A-Z-])[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
RUNS = ("trl", "grpokit")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_MODE": "disabled",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
}

# pytest plugin written next to the adapted tests. It (1) deselects the set-aside tests listed in
# $TRL_SUITE_SET_ASIDE and (2) bridges version skew between the TRL checkout's helper files and the installed trl: an
# `is_X_available` that `testing_utils.py` imports from `trl.import_utils` but the installed trl lacks is defined as
# "module X is importable", and recorded in $TRL_SUITE_SHIMS. The test file itself is never touched.
PLUGIN = '''import ast
import importlib
import importlib.util
import json
import os
from pathlib import Path


def _shim_missing_availability_checks():
    shimmed = []
    for helper in ("testing_utils.py", "conftest.py"):
        path = Path(__file__).parent / "tests" / helper
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.module == "trl.import_utils"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                name = alias.name
                if not hasattr(module, name) and name.startswith("is_") and name.endswith("_available"):
                    package = name[len("is_") : -len("_available")]
                    setattr(module, name, lambda *a, _p=package, **k: importlib.util.find_spec(_p) is not None)
                    shimmed.append(f"trl.import_utils.{name}")
    Path(os.environ["TRL_SUITE_SHIMS"]).write_text(json.dumps(shimmed))


_shim_missing_availability_checks()


def pytest_collection_modifyitems(config, items):
    with open(os.environ["TRL_SUITE_SET_ASIDE"]) as f:
        rules = json.load(f)
    keep, drop = [], []
    for item in items:
        key = (item.cls.__name__ + "::" if item.cls else "") + item.originalname
        param_id = item.callspec.id if hasattr(item, "callspec") else ""
        whole = key in rules["functions"]
        by_param = any(hub_id in param_id for hub_id in rules["params"].get(key, []))
        (drop if whole or by_param else keep).append(item)
    Path(os.environ["TRL_SUITE_DESELECTED"]).write_text(json.dumps([item.nodeid for item in drop]))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
'''


# ------------------------------------------------------------------------------------------------ adapt the tests


def relative_imports(source: str) -> list[str]:
    """Module names the test file imports from its own package (`from .testing_utils import ...`)."""
    tree = ast.parse(source)
    return sorted({n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 1 and n.module})


def rewrite_hub_ids(source: str, mapping: dict[str, str]) -> str:
    return HUB_ID.sub(lambda m: mapping.get(m.group(1), m.group(1)), source)


def adapt_copy(trl_tests: Path, dest: Path, mapping: dict[str, str], to_grpokit: bool) -> None:
    """Write `dest/tests/` (the adapted test file plus TRL's helper files, unchanged) and a minimal pytest.ini."""
    source = (trl_tests / TEST_FILE).read_text()
    source = rewrite_hub_ids(source, mapping)
    if to_grpokit:
        if source.count(TRL_IMPORT) != 1:
            raise SystemExit(f"expected exactly one line {TRL_IMPORT!r} in {TEST_FILE}")
        source = source.replace(TRL_IMPORT, GRPOKIT_IMPORT)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "tests").mkdir(parents=True)
    (dest / "tests" / TEST_FILE).write_text(source)
    helpers = ["__init__", "conftest", *relative_imports(source)]
    for name in helpers:
        if (trl_tests / f"{name}.py").exists():
            shutil.copy(trl_tests / f"{name}.py", dest / "tests" / f"{name}.py")
    (dest / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: TRL's slow tests\n")
    (dest / "trl_suite_plugin.py").write_text(PLUGIN)


# ------------------------------------------------------------------------------------------------------ set aside


def hub_ids_in(nodes) -> set[str]:
    return {
        n.value
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and ANY_HUB_ID.match(n.value)
    }


def set_aside_rules(source: str, mapping: dict[str, str]) -> dict:
    """Which tests need a hub id that has no stand-in: whole functions (the id is in the body) and single parameters
    (the id is only in a decorator, i.e. a parametrize value). Returns the rules for the pytest plugin plus reasons."""
    functions, params = {}, defaultdict(list)
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or not fn.name.startswith("test"):
                continue
            key = f"{cls.name}::{fn.name}"
            body_missing = sorted(hub_ids_in(fn.body) - set(mapping))
            if body_missing:
                functions[key] = "needs " + ", ".join(body_missing)
                continue
            for hub_id in sorted(hub_ids_in(fn.decorator_list) - set(mapping)):
                params[key].append(hub_id)
    return {"functions": functions, "params": dict(params)}


# ------------------------------------------------------------------------------------------------------- run pytest


def has_module(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({module!r}) else 1)"
    return subprocess.run([python, "-c", code], timeout=120, capture_output=True).returncode == 0


def pytest_command(args, run_dir: Path) -> list[str]:
    cmd = [args.python, "-m", "pytest", f"tests/{TEST_FILE}", "-v", "--tb=short", "-p", "no:cacheprovider"]
    cmd += ["-p", "trl_suite_plugin", f"--junitxml={run_dir / 'junit.xml'}", f"--basetemp={run_dir / 'tmp'}"]
    if args.k:
        cmd += ["-k", args.k]
    if args.test_timeout and has_module(args.python, "pytest_timeout"):
        cmd += [f"--timeout={args.test_timeout}"]
    return cmd


def run_env(work: Path, run_dir: Path, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HF_TOKEN"))}
    env.update(OFFLINE_ENV)
    env["HF_HOME"] = str(work / "hf_home")
    env["PYTHONPATH"] = os.pathsep.join([str(run_dir), str(REPO_ROOT)])  # this checkout's grpokit, not another's
    env["TRL_SUITE_SET_ASIDE"] = str(work / "set_aside.json")
    env["TRL_SUITE_SHIMS"] = str(run_dir / "shims.json")
    env["TRL_SUITE_DESELECTED"] = str(run_dir / "deselected.json")
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def start_run(args, work: Path, label: str, threads: int) -> tuple[subprocess.Popen, float]:
    run_dir = work / "runs" / label
    (run_dir / "junit.xml").unlink(missing_ok=True)
    shutil.rmtree(run_dir / "tmp", ignore_errors=True)
    log = open(run_dir / "pytest.log", "w")
    proc = subprocess.Popen(
        pytest_command(args, run_dir),
        cwd=run_dir,
        env=run_env(work, run_dir, threads),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    log.close()
    return proc, time.monotonic()


def run_all(args, work: Path, labels: list[str]) -> dict[str, dict]:
    """Run the labelled copies (`--jobs` at a time), each under the wall-clock limit; returns exit info per label."""
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    pending, running, results = list(labels), {}, {}
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                label = pending.pop(0)
                print(f"running pytest on the {label} copy (log: {work / 'runs' / label / 'pytest.log'})", flush=True)
                running[label] = start_run(args, work, label, threads)
            time.sleep(2)
            for label, (proc, t0) in list(running.items()):
                elapsed = time.monotonic() - t0
                if proc.poll() is None and elapsed < args.timeout:
                    continue
                timed_out = proc.poll() is None
                kill_group(proc)  # the timed-out run, or stray children of a finished one (dataloader workers, ...)
                results[label] = {"returncode": proc.returncode, "timed_out": timed_out, "seconds": round(elapsed)}
                print(f"  {label}: exit {proc.returncode}{' (timed out)' if timed_out else ''}, {elapsed:.0f}s")
                del running[label]
    finally:
        for proc, _ in running.values():
            kill_group(proc)
    return results


# ------------------------------------------------------------------------------------------------------ parse junit

VERBOSE_LINE = re.compile(r"^tests/\S+?::(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def parse_junit(path: Path) -> dict[str, dict]:
    """test name (Class::test[param]) -> {"status": passed|failed|error|skipped, "message": first line}."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{cls}::{case.get('name')}" if cls else case.get("name")
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = first_line(node.get("message") or node.text or "")
                break
        if name in results and results[name]["status"] != "passed":  # a setup error and a call failure: keep first
            continue
        results[name] = {"status": status, "message": message, "seconds": float(case.get("time") or 0)}
    return results


def parse_verbose_log(path: Path) -> dict[str, dict]:
    """Fallback when pytest was killed before writing junit: the per-test lines of `pytest -v`."""
    results = {}
    for line in path.read_text(errors="replace").splitlines():
        match = VERBOSE_LINE.match(line)
        if match:
            status = {"XFAIL": "skipped", "XPASS": "failed"}.get(match.group(2), match.group(2).lower())
            results[match.group(1)] = {"status": status, "message": "(no junit: run was killed; see pytest.log)"}
    return results


def first_line(text: str) -> str:
    """The message's first line; one ending in ':' (a list follows) takes the next line along."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"
    return lines[0] if lines else ""


def load_results(work: Path, label: str) -> dict[str, dict]:
    run_dir = work / "runs" / label
    if (run_dir / "junit.xml").exists():
        return parse_junit(run_dir / "junit.xml")
    if (run_dir / "pytest.log").exists():
        return parse_verbose_log(run_dir / "pytest.log")
    return {}


# ----------------------------------------------------------------------------------------------------------- report


def normalize(message: str, reverse: dict[str, str]) -> str:
    """Group key for a failure message: local paths back to hub ids, then paths, addresses and numbers masked."""
    for local, hub_id in reverse.items():
        message = message.replace(local, hub_id)
    pieces = HUB_ID.split(message)  # odd pieces are hub ids, kept as they are
    for i in range(0, len(pieces), 2):
        piece = re.sub(r"0x[0-9a-fA-F]+", "<addr>", pieces[i])
        piece = re.sub(r"(?<![\w/-])/(?:[\w.+-]+/)*[\w.+-]+", "<path>", piece)
        pieces[i] = re.sub(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", "<n>", piece)
    return "".join(pieces)[:300]


def counts(results: dict[str, dict]) -> dict[str, int]:
    out = {"collected": len(results), "passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for r in results.values():
        out[r["status"]] += 1
    return out


def build_report(trl: dict, grpokit: dict, rules: dict, missing: dict, reverse: dict, meta: dict) -> dict:
    show = lambda name: normalize_name(name, reverse)  # noqa: E731
    trl_passing = sorted(n for n, r in trl.items() if r["status"] == "passed")
    kept = [n for n in trl_passing if grpokit.get(n, {}).get("status") == "passed"]
    lost = [n for n in trl_passing if n not in kept]
    groups = defaultdict(list)
    for name in lost:
        r = grpokit.get(name, {"status": "missing", "message": "not run in the grpokit copy"})
        prefix = "" if r["status"] in ("failed", "error") else f"[{r['status']}] "
        groups[prefix + normalize(r["message"], reverse)].append(show(name))
    failure_groups = [
        {"message": msg, "count": len(tests), "tests": tests}
        for msg, tests in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ]
    trl_failures = [
        {"test": show(n), "status": r["status"], "message": normalize(r["message"], reverse),
         "grpokit_status": grpokit.get(n, {}).get("status", "missing")}
        for n, r in sorted(trl.items()) if r["status"] in ("failed", "error")
    ]  # fmt: skip
    return {
        **meta,
        "trl": counts(trl),
        "grpokit": counts(grpokit),
        "metric": {
            "trl_passing": len(trl_passing),
            "grpokit_passing_of_those": len(kept),
            "percent": round(100 * len(kept) / len(trl_passing), 1) if trl_passing else 0.0,
            "target_percent": 90,
        },
        "failure_groups": failure_groups,
        "trl_failures": trl_failures,
        "grpokit_only_passes": [show(n) for n, r in sorted(grpokit.items())
                                if r["status"] == "passed" and trl.get(n, {}).get("status") != "passed"],
        "trl_skipped": {show(n): r["message"] for n, r in sorted(trl.items()) if r["status"] == "skipped"},
        "slowest_trl_tests": [
            {"test": show(n), "seconds": round(r.get("seconds", 0))}
            for n, r in sorted(trl.items(), key=lambda kv: -kv[1].get("seconds", 0))[:10]
        ],
        "set_aside": {"functions": rules["functions"], "params": rules["params"]},
        "stand_ins_missing": missing,
    }  # fmt: skip


def normalize_name(name: str, reverse: dict[str, str]) -> str:
    for local, hub_id in reverse.items():
        name = name.replace(local, hub_id)
    return name


def render_markdown(rep: dict) -> str:
    t, g, m = rep["trl"], rep["grpokit"], rep["metric"]
    out = [
        "# TRL GRPO test suite against grpokit",
        "",
        f"- TRL tests: `{rep['trl_test_file']}` ({rep['trl_version_installed']} installed)",
        f"- grpokit: {rep['grpokit_rev']}",
        f"- Command: `{rep['command']}`",
        f"- Wall time: {rep['wall_seconds']}s; runs: "
        + ", ".join(f"{k} exit {v['returncode']}{' TIMED OUT' if v['timed_out'] else ''} in {v['seconds']}s"
                    for k, v in rep["runs"].items()),
        "",
        "| | collected | passed | failed | error | skipped |",
        "|---|---|---|---|---|---|",
        f"| TRL | {t['collected']} | {t['passed']} | {t['failed']} | {t['error']} | {t['skipped']} |",
        f"| grpokit | {g['collected']} | {g['passed']} | {g['failed']} | {g['error']} | {g['skipped']} |",
        "",
        f"**Of the {m['trl_passing']} tests that pass on TRL, {m['grpokit_passing_of_those']} pass on grpokit: "
        f"{m['percent']}%** (target {m['target_percent']}%).",
        "",
        f"## grpokit failures among TRL-passing tests ({m['trl_passing'] - m['grpokit_passing_of_those']}), "
        "by first message line",
        "",
    ]  # fmt: skip
    for i, grp in enumerate(rep["failure_groups"], 1):
        out.append(f"{i}. **{grp['count']}** × `{grp['message']}`")
        out += [f"   - {name}" for name in grp["tests"]]
    out += ["", f"## Tests that fail on TRL too (not counted): {len(rep['trl_failures'])}", ""]
    out += [f"- {f['test']} [{f['status']}; grpokit: {f['grpokit_status']}]: `{f['message']}`"
            for f in rep["trl_failures"]]  # fmt: skip
    if rep["grpokit_only_passes"]:
        out += ["", "## Pass on grpokit but not on TRL", ""] + [f"- {n}" for n in rep["grpokit_only_passes"]]
    out += ["", f"## Skipped on TRL: {len(rep['trl_skipped'])}", ""]
    by_reason = defaultdict(int)
    for reason in rep["trl_skipped"].values():
        by_reason[reason] += 1
    out += [f"- {n} × {reason}" for reason, n in sorted(by_reason.items(), key=lambda kv: -kv[1])]
    out += ["", "## Slowest tests on TRL", ""] + [f"- {t['seconds']}s {t['test']}" for t in rep["slowest_trl_tests"]]
    sa = rep["set_aside"]
    out += ["", f"## Set aside (deselected: need a hub id with no stand-in): {rep['set_aside_count']} tests", ""]
    out += [f"- {fn}: {why}" for fn, why in sorted(sa["functions"].items())]
    out += [f"- {fn} (parameters naming {', '.join(ids)})" for fn, ids in sorted(sa["params"].items())]
    if rep["shims"]:
        out += ["", "## Version-skew shims (TRL helper files vs installed trl)", ""]
        out += [f"- {name}: not in the installed trl; defined as 'the module is importable'" for name in rep["shims"]]
    out += ["", "## Hub ids without a stand-in", ""]
    out += [f"- {hub_id}: {why}" for hub_id, why in sorted(rep["stand_ins_missing"].items())]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------------------------------------- main


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=30).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "grpokit"], capture_output=True,
                               text=True, timeout=30).stdout.strip()  # fmt: skip
        return rev + (" (grpokit/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def count_set_aside(work: Path) -> int:
    """Tests the plugin deselected in the trl run (those needing a hub id with no stand-in)."""
    path = work / "runs" / "trl" / "deselected.json"
    return len(json.loads(path.read_text())) if path.exists() else 0


def read_shims(work: Path) -> list[str]:
    path = work / "runs" / "trl" / "shims.json"
    return json.loads(path.read_text()) if path.exists() else []


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trl-src", required=True, type=Path, help="directory holding TRL's tests/ folder")
    p.add_argument("--work", type=Path, default=Path("/tmp/trl_suite"), help="scratch dir (outside this repo)")
    p.add_argument("--out", type=Path, help="JSON report path (default WORK/report.json)")
    p.add_argument("--markdown", type=Path, help="markdown report path (default WORK/report.md)")
    p.add_argument("--timeout", type=int, default=2400, help="wall-clock limit per pytest run, seconds")
    p.add_argument("--test-timeout", type=int, default=600, help="per-test limit if pytest-timeout is installed")
    p.add_argument("--jobs", type=int, default=2, choices=(1, 2), help="pytest runs at once")
    p.add_argument("--python", default=sys.executable, help="interpreter with trl, grpokit and pytest")
    p.add_argument("-k", help="pytest -k expression applied to both runs (debugging a subset)")
    p.add_argument("--only", choices=RUNS, help="run only this copy (the other's last results are reused)")
    p.add_argument("--skip-run", action="store_true", help="only rebuild the report from the last runs' results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    work = args.work.resolve()
    if work == REPO_ROOT or REPO_ROOT in work.parents:
        raise SystemExit(f"--work must be outside the repository ({REPO_ROOT})")
    trl_tests = args.trl_src.resolve() / "tests"
    if not (trl_tests / TEST_FILE).exists():
        raise SystemExit(f"{trl_tests / TEST_FILE} not found: --trl-src must hold TRL's tests/ folder")
    work.mkdir(parents=True, exist_ok=True)

    mapping, missing = standins.build_all(work / "cache")
    reverse = {local: hub_id for hub_id, local in sorted(mapping.items(), key=lambda kv: -len(kv[1]))}
    rules = set_aside_rules((trl_tests / TEST_FILE).read_text(), mapping)
    (work / "set_aside.json").write_text(json.dumps(rules, indent=2))
    runs_path = work / "runs.json"
    runs = json.loads(runs_path.read_text()) if runs_path.exists() else {}
    if not args.skip_run:
        labels = [args.only] if args.only else list(RUNS)
        shutil.rmtree(work / "hf_home", ignore_errors=True)  # datasets' cache of the zen folder may be stale
        for label in labels:
            adapt_copy(trl_tests, work / "runs" / label, mapping, to_grpokit=label == "grpokit")
        runs.update(run_all(args, work, labels))
        runs_path.write_text(json.dumps(runs, indent=2))
        last_run = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "wall_seconds": round(time.monotonic() - started), "grpokit_rev": git_rev()}  # fmt: skip
        (work / "last_run.json").write_text(json.dumps(last_run))
    last_run = json.loads((work / "last_run.json").read_text()) if (work / "last_run.json").exists() else {}

    import trl  # only for the version in the report

    meta = {
        "command": last_run.get("command", "?"),
        "trl_test_file": str(trl_tests / TEST_FILE),
        "trl_version_installed": f"trl {trl.__version__}",
        "grpokit_rev": last_run.get("grpokit_rev", "?"),
        "wall_seconds": last_run.get("wall_seconds", "?"),
        "runs": runs,
        "set_aside_count": count_set_aside(work),
        "pytest_timeout_plugin": importlib.util.find_spec("pytest_timeout") is not None,
        "shims": read_shims(work),
    }
    report = build_report(load_results(work, "trl"), load_results(work, "grpokit"), rules, missing, reverse, meta)
    markdown = render_markdown(report)
    out = args.out or work / "report.json"
    md = args.markdown or work / "report.md"
    out.write_text(json.dumps(report, indent=2))
    md.write_text(markdown)
    print(markdown)
    print(f"JSON report: {out}\nmarkdown report: {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
