"""The code sandbox: normal runs, then a suite of hostile programs that must stay contained.

Every hostile case asserts the *host* effect did not happen (no file outside, no connection, the test process and
a sentinel process alive, no secret in the output, no process of the run left, no workdir left) and that the run
ended promptly. Cases whose protection this machine lacks are skipped with the missing protection named.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass

import pytest

from grpokit.rewards import CodeExecutionReward, Sandbox, SandboxConfig, run_python, sandbox_protections
import grpokit.sandbox as sandbox_module
from grpokit.sandbox import _detection, _launcher, _run, _uid_slots

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox needs Linux", allow_module_level=True)

CONFIG = SandboxConfig(
    timeout_seconds=2.5,
    cpu_seconds=1,
    memory_bytes=256 * 1024**2,
    file_size_bytes=1024**2,
    disk_bytes=8 * 1024**2,
    max_processes=8,
    max_output_bytes=64 * 1024,
)
PROTECTIONS = sandbox_protections()
ROOT = os.geteuid() == 0
# What the protections add up to for each kind of attack (the keys the hostile cases require).
CONTAINMENT = {
    **PROTECTIONS,
    # Other processes (the test, its parent, a sentinel) are out of reach: another pid namespace, or another uid.
    "signal_isolation": PROTECTIONS["pid_namespace"] or (ROOT and PROTECTIONS["unprivileged_user"]),
    "root_files_protected": not ROOT or PROTECTIONS["unprivileged_user"] or PROTECTIONS["read_only_filesystem"],
    "shadow_protected": not ROOT or PROTECTIONS["unprivileged_user"],
}
SLOT_UIDS = range(CONFIG.uid_base, CONFIG.uid_base + 4096)


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _status_fields(pid: str) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            return dict(line.rstrip("\n").split(":\t", 1) for line in fh if ":\t" in line)
    except OSError:
        return {}


def sandbox_processes(marker: str = "") -> list[str]:
    """Live processes of a sandbox run: a sandbox uid, a workdir in the cmdline, or the marker.

    Zombies are dead (they only wait for whichever init adopted them to reap them), so they do not count."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        fields = _status_fields(pid)
        if not fields or fields.get("State", "").startswith("Z"):
            continue
        cmd = _cmdline(pid)
        uid = int(fields["Uid"].split()[0])
        if sandbox_module.WORKDIR_PREFIX in cmd or (marker and marker in cmd) or uid in SLOT_UIDS:
            found.append(f"{pid}: {cmd[:120]}")
    return found


def wait_until_gone(marker: str, seconds: float = 1.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        left = sandbox_processes(marker)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def workdirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), sandbox_module.WORKDIR_PREFIX + "*")))


def require(*names: str) -> None:
    missing = [n for n in names if not CONTAINMENT[n]]
    if missing:
        pytest.skip(f"protection(s) {missing} not available on this machine: {PROTECTIONS}")


# --- normal behaviour ----------------------------------------------------------------------------------------


def test_protections_report_every_documented_key_and_limits_always():
    assert set(PROTECTIONS) == {
        "resource_limits", "wall_clock_kill", "output_cap", "clean_environment", "no_new_privileges",
        "unprivileged_user", "process_limit", "network_isolation", "pid_namespace", "read_only_filesystem",
        "private_workdir", "seccomp_filter", "memory_budget", "host_stall_detection",
    }
    assert all(isinstance(v, bool) for v in PROTECTIONS.values())
    assert PROTECTIONS["resource_limits"], "the sandbox could not start any program on this machine"


def test_runs_a_program_with_stdin_and_captures_both_streams():
    code = "import sys\nname = input()\nprint('hello', name)\nprint('warn', file=sys.stderr)\n"
    result = run_python(code, stdin="grpo\n", config=CONFIG)
    assert (result.status, result.returncode) == ("ok", 0)
    assert result.stdout == "hello grpo\n"
    assert result.stderr == "warn\n"
    assert 0 < result.wall_seconds < 5.0


def test_nonzero_exit_is_error_with_its_code_and_traceback():
    result = run_python("raise ValueError('boom')", config=CONFIG)
    assert (result.status, result.returncode) == ("error", 1)
    assert "ValueError: boom" in result.stderr
    assert run_python("import sys; sys.exit(7)", config=CONFIG).returncode == 7


def test_program_can_use_its_working_directory_and_tempfile_and_it_is_removed():
    before = workdirs()
    code = (
        "import os, tempfile\n"
        "open('a.txt', 'w').write('x' * 10)\n"
        "with tempfile.NamedTemporaryFile(dir=None) as f: f.write(b'y')\n"
        "print(os.path.getsize('a.txt'), sorted(os.listdir('.')))\n"
    )
    result = run_python(code, config=CONFIG)
    assert result.stdout == "10 ['a.txt', 'main.py']\n", result.stderr
    assert workdirs() == before


def test_environment_is_clean():
    result = run_python("import os; print(sorted(os.environ))", config=CONFIG)
    assert result.stdout == "['HOME', 'LANG', 'PATH', 'TMPDIR']\n"


def test_unread_large_stdin_does_not_deadlock():
    result = run_python("print('done')", stdin="x" * (8 * 1024**2), config=CONFIG)
    assert (result.status, result.stdout) == ("ok", "done\n")
    assert result.wall_seconds < 5.0


def test_run_many_keeps_order_and_bounds_concurrency():
    sandbox = Sandbox(SandboxConfig(timeout_seconds=10, max_workers=2))
    program = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint({i}, start, time.time())"
    results = sandbox.run_many([program.format(i=i) for i in range(5)])
    rows = [r.stdout.split() for r in results]
    assert [row[0] for row in rows] == ["0", "1", "2", "3", "4"]
    spans = [(float(row[1]), float(row[2])) for row in rows]
    # The wall clock is shared with the sandbox; count the runs alive at each start: exactly 2 at the busiest.
    most = max(sum(a <= begin < b for a, b in spans) for begin, _ in spans)
    assert most == 2
    with pytest.raises(ValueError, match="2 programs but 1 stdin"):
        sandbox.run_many(["1", "2"], ["x"])


def test_config_rejects_bad_limits_with_the_field_name():
    with pytest.raises(ValueError, match=r"SandboxConfig.cpu_seconds=0 is refused: it must be an integer in \[1, "):
        SandboxConfig(cpu_seconds=0)
    with pytest.raises(ValueError, match=r"timeout_seconds=0 is refused: it must be a finite number in \(0, "):
        SandboxConfig(timeout_seconds=0)
    with pytest.raises(ValueError, match=r"max_host_stall_seconds=-1 is refused: it must be None or a finite number"):
        SandboxConfig(max_host_stall_seconds=-1)
    assert SandboxConfig(timeout_seconds=3).host_stall_limit == 6
    assert SandboxConfig(timeout_seconds=3, max_host_stall_seconds=0.5).host_stall_limit == 0.5


def test_unusable_interpreter_is_infra_error_and_scores_none(monkeypatch):
    monkeypatch.setattr(_detection, "_DETECTED", {})
    config = SandboxConfig(python_executable="/nonexistent/python3")
    result = run_python("print(1)", config=config)
    assert result.status == "infra_error"
    assert result.returncode is None
    reward = CodeExecutionReward(config)
    completion = "```python\ndef answer():\n    return 42\n```"
    assert reward([completion], test_cases=[["assert answer() == 42"]]) == [None]


def test_setup_failure_inside_the_launcher_is_infra_error(monkeypatch):
    setup = _detection._detect(None)
    spec = _launcher._boot_spec
    # a limit the init cannot set: its setup fails before the program starts
    monkeypatch.setattr(_launcher, "_boot_spec", lambda *args: {**spec(*args), "rlimits": [("RLIMIT_BOGUS", 1, 1)]})
    result = _launcher._launch("print(1)", "", SandboxConfig(), setup.mode, setup.python)
    assert result.status == "infra_error"
    assert "sandbox setup failed" in result.stderr


def test_detection_logs_protections_once(monkeypatch, caplog):
    monkeypatch.setattr(_detection, "_DETECTED", {})
    with caplog.at_level(logging.INFO, logger="grpokit.sandbox"):
        run_python("print(1)", config=CONFIG)
        run_python("print(2)", config=CONFIG)
    lines = [r.getMessage() for r in caplog.records if "protections active" in r.getMessage()]
    assert len(lines) == 1
    for name, on in sandbox_protections().items():
        assert (name in lines[0]) == on, (name, lines[0])


# --- hostile programs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hostile:
    name: str
    code: str
    statuses: tuple[str, ...]  # acceptable statuses: containment shows as one of these
    requires: tuple[str, ...] = ()
    max_seconds: float = 3.0  # generous: other work may share these 2 cores; the status tells what happened


MARKER = f"grpokit-hostile-{uuid.uuid4().hex[:12]}"
OUTSIDE_ROOT = f"/root/{MARKER}"
OUTSIDE_TMP = os.path.join(tempfile.gettempdir(), MARKER)
SENTINEL_FILE = os.path.join(tempfile.gettempdir(), MARKER + "-daemon")
SLOW = CONFIG.timeout_seconds + 2.5



def daemon_program(delay: float, then: str) -> str:
    """Double fork + setsid; the daemon execs a process carrying MARKER that writes SENTINEL_FILE after `delay`."""
    return f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c",
                 "import time; time.sleep({delay}); open({SENTINEL_FILE!r}, 'w').write('escaped')", {MARKER!r}])
    os._exit(0)
time.sleep(0.2)
{then}
"""


# Daemon delays outlast the run by > 1 s, so a daemon that survived would still be alive when the test looks.
DAEMON_CRASH_DELAY = 2.0
DAEMON_HANG_DELAY = CONFIG.timeout_seconds + 2.0

HOSTILE = [
    Hostile("infinite_loop", "while True:\n    pass", ("killed", "timeout"), max_seconds=SLOW),
    Hostile("ignores_sigxcpu", "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
            ("killed", "timeout"), max_seconds=SLOW),
    Hostile("fork_bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            ("timeout", "killed"), requires=("process_limit",), max_seconds=SLOW),
    Hostile("memory_bomb", "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024**2))", ("error", "killed")),
    Hostile("huge_file", "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 2**20)",
            ("error", "killed")),
    Hostile("write_root", f"open({OUTSIDE_ROOT!r}, 'w').write('owned')", ("error",),
            requires=("root_files_protected",)),
    Hostile("write_tmp", f"open({OUTSIDE_TMP!r}, 'w').write('owned')", ("error",), requires=("read_only_filesystem",)),
    Hostile("read_secrets", "import os\nseen = repr(dict(os.environ))\nfor pid in os.listdir('/proc'):\n"
            "    try:\n        seen += open(f'/proc/{pid}/environ', 'rb').read().decode(errors='replace')\n"
            "    except OSError:\n        pass\nprint(seen)\n"
            "raise SystemExit(0 if 'GRPOKIT_TEST_SECRET' in seen else 3)",
            ("error",), requires=("signal_isolation",)),
    Hostile("read_shadow", "print(open('/etc/shadow').read())", ("error",), requires=("shadow_protected",)),
    Hostile("network",
            "import socket\ns = socket.create_connection(('127.0.0.1', PORT), timeout=2)\ns.sendall(b'leak')",
            ("error",), requires=("network_isolation",)),
    Hostile("kill_parent", "import os\nos.kill(os.getppid(), 9)\nraise SystemExit(3)", ("error",),
            requires=("signal_isolation",)),
    Hostile("killpg_parent", "import os\nos.killpg(os.getpgid(os.getppid()), 9)\nraise SystemExit(3)",
            ("error", "killed"), requires=("signal_isolation",)),
    Hostile("kill_everything", "import os\nos.kill(-1, 9)\nraise SystemExit(3)", ("killed", "error"),
            requires=("signal_isolation",)),
    Hostile("kill_test_process", "import os\nos.kill(TEST_PID, 9)\nos.kill(SENTINEL_PID, 9)\nraise SystemExit(3)",
            ("error",), requires=("signal_isolation",)),
    Hostile("sleep_forever", "import time\ntime.sleep(3600)", ("timeout",), max_seconds=SLOW),
    Hostile("stdout_flood", "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", ("output_limit",)),
    Hostile("stderr_flood", "import os\nwhile True:\n    os.write(2, b'y' * 65536)", ("output_limit",)),
    Hostile("deep_recursion", "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)",
            ("error", "killed"), max_seconds=SLOW),
    Hostile("daemon_then_crash", daemon_program(DAEMON_CRASH_DELAY, "raise SystemExit(3)"), ("error",),
            requires=("pid_namespace",)),
    Hostile("daemon_then_hang", daemon_program(DAEMON_HANG_DELAY, "time.sleep(3600)"), ("timeout",),
            requires=("pid_namespace",), max_seconds=SLOW),
    # --- sockets: no host service is reachable, whatever the family (seccomp refuses socket() itself) ---------
    Hostile("unix_socket_file", "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect(UNIX_PATH)\n"
            "s.sendall(b'leak')", ("error",), requires=("seccomp_filter",)),
    Hostile("abstract_unix_socket", "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect(ABSTRACT_NAME)\n"
            "s.sendall(b'leak')", ("error",), requires=("seccomp_filter",)),
    Hostile("netlink_socket", "import socket\nsocket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)",
            ("error",), requires=("seccomp_filter",)),
    Hostile("io_uring", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "params = ctypes.create_string_buffer(120)\nfd = libc.syscall(425, 8, params)\n"
            "raise SystemExit(3 if fd >= 0 else 1)", ("error",), requires=("seccomp_filter",)),
    Hostile("socketpair_is_harmless_but_socket_is_not",
            "import socket\na, b = socket.socketpair()\na.sendall(b'x')\nassert b.recv(1) == b'x'\n"
            "socket.create_connection(('127.0.0.1', PORT), timeout=2)", ("error",), requires=("seccomp_filter",)),
    # --- escapes that the filter refuses -------------------------------------------------------------------
    Hostile("ptrace_parent", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "raise SystemExit(3 if libc.ptrace(16, os.getppid(), 0, 0) == 0 else 1)", ("error",),
            requires=("seccomp_filter",)),
    Hostile("new_user_namespace", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "raise SystemExit(3 if libc.unshare(0x10000000) == 0 else 1)", ("error",), requires=("seccomp_filter",)),
    Hostile("sysv_shared_memory", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "raise SystemExit(3 if libc.shmget(0, 64 * 1024**2, 0o1600) >= 0 else 1)", ("error",),
            requires=("seccomp_filter",)),
    Hostile("cgroup_escape", "import os\nfor d, _, files in os.walk('/sys/fs/cgroup'):\n"
            "    if 'cgroup.procs' in files:\n"
            "        open(os.path.join(d, 'cgroup.procs'), 'w').write(str(os.getpid()))",
            ("error",), requires=("read_only_filesystem",)),
    # --- a wrong program must not turn its 0 into None (unknown) by faking a host stall ---------------------
    Hostile("stops_itself", "import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
            "except PermissionError:\n    pass\ntime.sleep(3600)", ("timeout",),
            requires=("host_stall_detection",), max_seconds=SLOW),
    Hostile("child_stops_parent", "import os, signal, time\nif os.fork() == 0:\n"
            "    try:\n        os.kill(os.getppid(), signal.SIGTSTP)\n    finally:\n        os._exit(0)\n"
            "time.sleep(3600)", ("timeout",), requires=("host_stall_detection",), max_seconds=SLOW),
    Hostile("renices_itself_and_spins", "import os\ntry:\n    os.nice(19)\nexcept PermissionError:\n    pass\n"
            "try:\n    os.sched_setaffinity(0, {0})\nexcept PermissionError:\n    pass\nwhile True:\n    pass",
            ("killed", "timeout"), requires=("host_stall_detection",), max_seconds=SLOW),
    # --- one memory budget for the whole run, all kinds of memory --------------------------------------------
    Hostile("forked_children_share_the_budget", "import os, time\nkids = []\nfor _ in range(6):\n"
            "    pid = os.fork()\n    if pid == 0:\n        b = bytearray(int(0.6 * MEMORY))\n"
            "        b[::4096] = b'x' * len(b[::4096])\n        time.sleep(30)\n        os._exit(0)\n"
            "    kids.append(pid)\nfor k in kids:\n    os.waitpid(k, 0)", ("killed",),
            requires=("memory_budget",)),
    Hostile("tmpfs_fill", "with open('fill', 'wb') as f:\n    for _ in range(2 * MEMORY // 2**20):\n"
            "        f.write(b'x' * 2**20)\nimport time\ntime.sleep(30)",
            ("killed", "error")),  # the budget, the tmpfs size or RLIMIT_FSIZE: whichever comes first
    Hostile("memfd_fill", "import os, time\nfd = os.memfd_create('m')\nfor _ in range(2 * MEMORY // 2**20):\n"
            "    os.write(fd, b'x' * 2**20)\ntime.sleep(30)", ("killed", "error"), requires=("seccomp_filter",)),
    Hostile("dev_shm_write", "open('/dev/shm/grpokit-x', 'wb').write(b'x' * 2**20)", ("error",),
            requires=("read_only_filesystem",)),
]


@pytest.fixture
def host_watch(monkeypatch):
    """A listening server (counts connections), a secret in our environment, and a sentinel process."""
    monkeypatch.setenv("GRPOKIT_TEST_SECRET", "s3cr3t-" + MARKER)
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
    connections: list = []
    stop = threading.Event()
    # Host services on Unix sockets: a socket file every user may connect to (0666, in a 0755 directory), and an
    # abstract name.
    unix_dir = tempfile.mkdtemp(prefix="grpokit-test-sock-")
    os.chmod(unix_dir, 0o755)
    unix_path = os.path.join(unix_dir, "service.sock")
    unix_server = socket.socket(socket.AF_UNIX)
    unix_server.bind(unix_path)
    os.chmod(unix_path, 0o666)
    abstract_name = "\0grpokit-test-" + MARKER
    abstract_server = socket.socket(socket.AF_UNIX)
    abstract_server.bind(abstract_name)
    for extra in (unix_server, abstract_server):
        extra.listen()
        extra.settimeout(0.1)
    threads = [threading.Thread(target=accept_loop, args=(srv, connections, stop), daemon=True)
               for srv in (server, unix_server, abstract_server)]
    for t in threads:
        t.start()
    sentinel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield {"port": server.getsockname()[1], "connections": connections, "sentinel": sentinel,
           "unix_path": unix_path, "abstract_name": abstract_name}
    stop.set()
    for t in threads:
        t.join(timeout=10)
    for srv in (server, unix_server, abstract_server):
        srv.close()
    shutil.rmtree(unix_dir, ignore_errors=True)
    sentinel.kill()
    sentinel.wait(timeout=30)


def accept_loop(server: socket.socket, connections: list, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            connections.append(server.accept())
        except OSError:
            pass


def _program(case: Hostile, watch: dict) -> str:
    return (
        case.code.replace("PORT", str(watch["port"]))
        .replace("TEST_PID", str(os.getpid()))
        .replace("SENTINEL_PID", str(watch["sentinel"].pid))
        .replace("UNIX_PATH", repr(watch["unix_path"]))
        .replace("ABSTRACT_NAME", repr(watch["abstract_name"]))
        .replace("MEMORY", str(CONFIG.memory_bytes))
    )


def _assert_host_untouched(watch: dict, result_text: str) -> None:
    assert not os.path.exists(OUTSIDE_ROOT)
    assert not os.path.exists(OUTSIDE_TMP)
    assert not os.path.exists(SENTINEL_FILE)
    assert watch["connections"] == []
    assert watch["sentinel"].poll() is None, "the sandboxed program killed a host process"
    assert "s3cr3t-" + MARKER not in result_text


@pytest.mark.parametrize("case", HOSTILE, ids=[c.name for c in HOSTILE])
def test_hostile_program_is_contained(case, host_watch):
    require(*case.requires)
    before = workdirs()
    start = time.monotonic()
    result = run_python(_program(case, host_watch), config=CONFIG)
    elapsed = time.monotonic() - start

    assert result.status in case.statuses, (result.status, result.returncode, result.stderr[-500:])
    assert elapsed < case.max_seconds, f"took {elapsed:.1f}s"
    assert len(result.stdout.encode()) <= CONFIG.max_output_bytes
    assert len(result.stderr.encode()) <= CONFIG.max_output_bytes
    assert wait_until_gone(MARKER) == []
    assert workdirs() == before
    if case.name.startswith("daemon"):
        time.sleep(max(start + 0.3 + DAEMON_CRASH_DELAY - time.monotonic(), 0.0))  # past a survivor's write
    _assert_host_untouched(host_watch, result.stdout + result.stderr)


def test_code_execution_reward_scores_every_hostile_program_zero(host_watch):
    cases = [c for c in HOSTILE if all(CONTAINMENT[n] for n in c.requires)]
    reward = CodeExecutionReward(CONFIG)
    completions = [f"```python\n{_program(c, host_watch)}\n```" for c in cases]
    completions.append("```python\ndef answer():\n    return 42\n```")  # control: a correct program still passes
    start = time.monotonic()
    scores = reward(completions, test_cases=[["assert answer() == 42"]] * len(completions))
    elapsed = time.monotonic() - start
    assert dict(zip([c.name for c in cases] + ["control"], scores)) == {
        **{c.name: 0.0 for c in cases}, "control": 1.0
    }
    assert elapsed < 20
    assert wait_until_gone(MARKER) == []
    _assert_host_untouched(host_watch, "")


# --- the degraded mode: root without namespaces relies on the uid drop and the uid sweep -------------------


@pytest.fixture
def without_namespaces(monkeypatch):
    if not ROOT:
        pytest.skip("the namespace-free fallback with a uid drop exists only for root")
    python = _detection._detect(None).python
    mode = _launcher._LaunchMode(namespaces=False, user_namespace=False, drop_privileges=True,
                                 read_only_filesystem=False)
    probe = _detection._probe(mode, python)
    if probe is None:
        pytest.skip("this machine cannot drop to an unprivileged uid")
    setup = _detection._Setup(mode, python, _detection._protections(mode, probe))
    monkeypatch.setattr(_detection, "_DETECTED", {None: setup})
    return setup


def test_fallback_without_namespaces_sweeps_daemons_by_uid(without_namespaces, host_watch):
    start = time.monotonic()
    result = run_python(daemon_program(DAEMON_CRASH_DELAY, "raise SystemExit(3)"), config=CONFIG)
    assert result.status == "error"
    assert result.wall_seconds < DAEMON_CRASH_DELAY - 0.1  # the run did not wait for the daemon to finish
    assert wait_until_gone(MARKER) == []
    time.sleep(max(start + 0.3 + DAEMON_CRASH_DELAY - time.monotonic(), 0.0))
    assert not os.path.exists(SENTINEL_FILE)


def test_fallback_without_namespaces_still_blocks_root_files_and_parent_kill(without_namespaces, host_watch):
    assert run_python(f"open({OUTSIDE_ROOT!r}, 'w')", config=CONFIG).status == "error"
    assert run_python("import os; os.kill(os.getppid(), 9)", config=CONFIG).status == "error"
    assert run_python(f"import os; os.kill({host_watch['sentinel'].pid}, 9)", config=CONFIG).status == "error"
    _assert_host_untouched(host_watch, "")


def test_a_lone_surrogate_in_code_or_stdin_is_the_programs_problem_not_the_sandboxs():
    bad_source = run_python("print('\ud800')", config=CONFIG)  # the source is not valid UTF-8 once written
    assert bad_source.status == "error" and "SyntaxError" in bad_source.stderr
    read = run_python("import sys\ndata = sys.stdin.buffer.read()\nprint(len(data), data[:1].hex())",
                      stdin="a\udc80b", config=CONFIG)
    assert (read.status, read.stdout) == ("ok", "5 61\n")  # a, the surrogate's 3 bytes, b: fed as given
    reward = CodeExecutionReward(CONFIG)
    scores = reward(["```python\nprint('\ud800')\n```"], tests=[{"input": "\ud800", "output": "x"}])
    assert scores == [0.0]


def test_a_sandbox_setup_failure_scores_none(monkeypatch):
    def broken(requested):
        raise PermissionError("cannot probe the interpreter")

    monkeypatch.setattr(_run, "_detect", broken)
    result = run_python("print(1)", config=CONFIG)
    assert result.status == "infra_error" and "cannot probe the interpreter" in result.stderr
    assert CodeExecutionReward(CONFIG)(["```python\nprint(1)\n```"], tests=[{"input": "", "output": "1"}]) \
        == [None]


def test_uid_slots_are_unique_across_processes_and_freed_when_a_holder_dies():
    import random

    from procs import kill_tree

    base = 1_900_000_000 + random.randrange(1_000_000) * 64  # apart from any real run's uids
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom grpokit.sandbox._uid_slots import _SLOTS\n"
         f"print(_SLOTS.acquire({base}), flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "0"  # the other process holds slot 0
        slots = _uid_slots._UidSlots()
        assert [slots.acquire(base), slots.acquire(base)] == [1, 2]  # and this process's threads do not share
        slots.release(1)
        assert slots.acquire(base) == 1
    finally:
        kill_tree(holder.pid)
        holder.wait(timeout=30)
    assert slots.acquire(base) == 0  # the kernel dropped the dead holder's lock
    for slot in range(3):
        slots.release(slot)
        os.unlink(os.path.join(sandbox_module.SLOT_LOCK_DIR, f"{base + slot}.lock"))
