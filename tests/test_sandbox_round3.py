"""The sandbox's third round (issue 24): the attacks that got through round 2, written as the attacker writes them.

- a datagram socketpair that sends to a world-writable Unix socket of the host;
- a configuration that runs programs as root, or removes a limit, or voids every verdict;
- wrong answers turned into "no score" (None): busy children, and stops the program has the kernel send itself;
- a big int or a deeply nested value that made the judge raise out of the reward;
- a result set crafted to hash-collide, which cost the trainer seconds of CPU per completion;
- and the most important of the round's own probes (docs/rewards.md lists them all).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time

import pytest

from grpokit.rewards import CodeExecutionReward, SandboxConfig, run_python, sandbox_protections
from grpokit.sandbox import _boot
from grpokit.sandbox._config import Bounds
from grpokit.sandbox.judge import RunValues, check_hashing, deferred_program, judge, plan_snippet, read_record
from test_sandbox_isolation import _run_filter  # the classic-BPF interpreter the filter's tests share

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox needs Linux", allow_module_level=True)

PROTECTIONS = sandbox_protections()
WRONG_ADD = "def add(a, b):\n    return a - b\n"
ADD_TEST = [["assert add(1, 2) == 3"]]


def require(*names: str) -> None:
    missing = [name for name in names if not PROTECTIONS.get(name)]
    if missing:
        pytest.skip(f"this machine lacks the sandbox protection(s) {', '.join(missing)}")


def chat(code: str) -> str:
    return f"```python\n{code}\n```"


# --- 1. datagram sockets -----------------------------------------------------------------------------------------


@pytest.fixture
def host_datagram_sockets():
    """A root-owned, world-writable (0666) AF_UNIX SOCK_DGRAM socket in a directory every user may enter, and an
    abstract datagram name; yields their addresses and a function returning what they received."""
    directory = tempfile.mkdtemp(prefix="grpokit-test-dgram-")
    os.chmod(directory, 0o755)
    path = os.path.join(directory, "host.sock")
    named = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    named.bind(path)
    os.chmod(path, 0o666)
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    abstract_name = f"\0grpokit-test-dgram-{os.getpid()}"
    abstract.bind(abstract_name)

    def received() -> list[bytes]:
        got = []
        for sock in (named, abstract):
            sock.setblocking(False)
            while True:
                try:
                    got.append(sock.recv(4096))
                except OSError:
                    break
        return got

    yield {"path": path, "abstract": abstract_name, "received": received}
    named.close()
    abstract.close()
    os.unlink(path)
    os.rmdir(directory)


DATAGRAM_ATTACK = """
import socket
PATH, ABSTRACT = {path!r}, {abstract!r}
def attempt(name, call):
    try:
        call()
        print(name, "sent")
    except OSError as exc:
        print(name, "refused", exc.errno)
def pair(kind):
    a, b = socket.socketpair(socket.AF_UNIX, kind)
    return a
KINDS = (("dgram", socket.SOCK_DGRAM), ("seqpacket", socket.SOCK_SEQPACKET), ("stream", socket.SOCK_STREAM))
for kind_name, kind in KINDS:
    attempt(kind_name + " sendto", lambda: pair(kind).sendto(b"leak", PATH))
    attempt(kind_name + " connect", lambda: (lambda s: (s.connect(PATH), s.send(b"leak")))(pair(kind)))
    attempt(kind_name + " sendmsg", lambda: pair(kind).sendmsg([b"leak"], [], 0, PATH))
    attempt(kind_name + " abstract", lambda: pair(kind).sendto(b"leak", ABSTRACT))
attempt("socket() sendto", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"leak", PATH))
a, b = socket.socketpair()
a.sendall(b"ok")
print("plain socketpair", b.recv(2).decode())
"""


def test_no_datagram_reaches_a_world_writable_unix_socket_of_the_host(host_datagram_sockets):
    require("seccomp_filter")
    program = DATAGRAM_ATTACK.format(path=host_datagram_sockets["path"], abstract=host_datagram_sockets["abstract"])
    result = run_python(program, config=SandboxConfig(timeout_seconds=20))
    assert result.ok, result
    assert host_datagram_sockets["received"]() == []
    assert " sent" not in result.stdout, result.stdout
    assert "plain socketpair ok" in result.stdout  # a connected stream pair still works (multiprocessing, asyncio)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_decisions_on_sockets_and_self_inflicted_stops(machine):
    prog = _boot.seccomp_program(machine, block_memory_files=False)
    arch = _boot.AUDIT_ARCH[machine]
    nr = {name: numbers[0 if machine == "x86_64" else 1] for name, numbers in _boot.SYSCALLS.items()}

    def decide(name: str, *args: int) -> int | None:
        ret = _run_filter(prog, arch, nr[name], args)
        return None if ret == _boot.RET_ALLOW else ret & 0xFFFF

    stream, dgram, seqpacket = socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_SEQPACKET
    assert decide("socketpair", socket.AF_UNIX, stream) is None
    assert decide("socketpair", socket.AF_UNIX, stream | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) is None
    for family, kind in ((socket.AF_UNIX, dgram), (socket.AF_UNIX, seqpacket), (socket.AF_UNIX, dgram | 0x80000),
                         (socket.AF_INET, stream), (socket.AF_NETLINK, stream)):
        assert decide("socketpair", family, kind) == errno.EACCES
    assert decide("connect", 3, 0x1000, 110) == errno.EACCES
    assert decide("sendto", 3, 0x1000, 4, 0, 0, 0) is None  # send(): no address
    assert decide("sendto", 3, 0x1000, 4, 0, 0x7FFF0000, 110) == errno.EACCES
    assert decide("sendto", 3, 0x1000, 4, 0, 1 << 40, 110) == errno.EACCES  # an address above 4 GiB
    for sig in range(signal.SIGSTOP, signal.SIGTTOU + 1):
        assert decide("prctl", 1, sig) == errno.EPERM  # PR_SET_PDEATHSIG
        assert decide("fcntl", 3, 10, sig) == errno.EPERM  # F_SETSIG
        assert decide("clone", 0x1200000 | sig) == errno.EPERM  # fork() with a stop signal as exit signal
    assert decide("prctl", 1, signal.SIGKILL) is None  # the init's own re-arming of the death signal
    assert decide("prctl", 15, signal.SIGSTOP) is None  # PR_SET_NAME: not a signal
    assert decide("fcntl", 3, 4, signal.SIGSTOP) is None  # F_SETFL with O_NONBLOCK-like bits
    assert decide("clone", 0x1200000 | signal.SIGCHLD) is None  # fork()
    for name in ("setsid", "timer_create", "mq_notify"):
        assert decide(name) == errno.EPERM


# --- 2. the sandbox's own configuration ------------------------------------------------------------------------

HOSTILE_CONFIG = [
    ("uid_base", 0), ("uid_base", -5), ("uid_base", 2**40), ("uid_base", 2**31 - 1),
    ("timeout_seconds", math.inf), ("timeout_seconds", math.nan), ("timeout_seconds", 0),
    ("memory_bytes", 1e18), ("memory_bytes", 10**18), ("memory_bytes", 1024),
    ("max_output_bytes", 1e18), ("max_output_bytes", 10**18), ("max_output_bytes", 1),
    ("disk_bytes", 1), ("cpu_seconds", 1.5), ("cpu_seconds", True), ("max_workers", 10**6),
    ("max_processes", 0), ("max_open_files", 3), ("max_files", 1), ("file_size_bytes", -1),
    ("max_host_stall_seconds", math.inf), ("max_host_stall_seconds", -1),
]


@pytest.mark.parametrize("name, value", HOSTILE_CONFIG, ids=[f"{n}={v!r}" for n, v in HOSTILE_CONFIG])
def test_the_config_refuses_values_that_remove_a_protection_or_void_every_verdict(name, value):
    with pytest.raises(ValueError) as raised:
        SandboxConfig(**{name: value})
    message = str(raised.value)
    assert f"SandboxConfig.{name}={value!r} is refused: it must be " in message  # what was wrong, and the range
    assert "Pass a value in that range (the default is " in message  # how to fix it


def test_every_numeric_field_declares_its_bounds_and_its_default_is_inside():
    for spec in dataclasses.fields(SandboxConfig):
        if spec.name == "python_executable":
            continue
        bounds = spec.metadata.get("bounds")
        assert isinstance(bounds, Bounds), f"SandboxConfig.{spec.name} declares no bounds"
        assert bounds.accepts(spec.default), spec.name
    worst_case = 2 * SandboxConfig.__dataclass_fields__["max_output_bytes"].metadata["bounds"].high
    assert worst_case <= 16 * 1024**2  # what one run's output can hold in the trainer, at most


# --- 3. resource pressure scores 0, never None ---------------------------------------------------------------------

FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
BUSY_CHILDREN = """
import os
for _ in range(20):
    try:
        if os.fork() == 0:
            while True:
                pass
    except OSError:
        pass
while True:
    pass
"""
BUSY_THREADS = """
import threading
def spin():
    while True:
        pass
for _ in range(10):
    threading.Thread(target=spin, daemon=True).start()
spin()
"""
FORK_CHURN = """
import os
while True:
    try:
        if os.fork() == 0:
            for _ in range(100000):
                pass
            os._exit(0)
    except OSError:
        pass
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass
"""


def test_fork_bombs_and_busy_children_score_zero_and_a_correct_program_beside_them_passes():
    """Four programs that flood two cores with their own processes, in one batch: each is a wrong answer (0), not
    a host stall (None). The correct program runs beside them and still passes."""
    require("host_stall_detection")
    reward = CodeExecutionReward(SandboxConfig(timeout_seconds=4, cpu_seconds=2, max_workers=4))
    correct = chat("def add(a, b):\n    return a + b\n")
    hostile = [chat(WRONG_ADD + body) for body in (FORK_BOMB, BUSY_CHILDREN, BUSY_THREADS, FORK_CHURN)]
    scores = reward([correct] + hostile, test_cases=ADD_TEST * 5)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_cpu_spread_over_respawned_children_is_one_budget():
    """Each child dies at its own RLIMIT_CPU and the program starts another while it waits (no CPU of its own):
    the run is killed once its processes together pass the budget, instead of burning CPU to the deadline."""
    program = """
import os
while True:
    if os.fork() == 0:
        while True:
            pass
    os.wait()
"""
    result = run_python(program, config=SandboxConfig(timeout_seconds=120, cpu_seconds=1))
    assert (result.status, result.reason) == ("killed", "cpu"), result


SIGEVENT = """class SigEvent(ctypes.Structure):
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("pad", ctypes.c_char * 48)]
"""
# Each has the kernel stop one of the program's own processes, which the stall accounting took for the host.
SELF_STOPS = {
    "parent_death_signal": """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
pid = os.fork()
if pid == 0:
    if os.fork() == 0:
        libc.prctl(1, 19, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGSTOP
        time.sleep(60)
    time.sleep(0.2)
    os._exit(0)
os.waitpid(pid, 0)
""",
    "clone_exit_signal": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
if libc.syscall(56 if os.uname().machine == "x86_64" else 220, 19, 0, 0, 0, 0) == 0:  # clone, exit signal SIGSTOP
    os._exit(0)
""",
    "io_signal": """
import fcntl, os
r, w = os.pipe()
try:
    fcntl.fcntl(r, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(r, 10, 19)  # F_SETSIG, SIGSTOP
    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
except OSError:
    pass
os.write(w, b"x")
""",
    "posix_timer": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
@SIGEVENT@
class ITimerSpec(ctypes.Structure):
    _fields_ = [("i_s", ctypes.c_long), ("i_ns", ctypes.c_long), ("v_s", ctypes.c_long), ("v_ns", ctypes.c_long)]
timer = ctypes.c_void_p()
libc.timer_create(1, ctypes.byref(SigEvent(None, 19, 0)), ctypes.byref(timer))
libc.timer_settime(timer, 0, ctypes.byref(ITimerSpec(0, 0, 0, 200_000_000)), None)
""",
    "message_queue": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
@SIGEVENT@
queue = libc.mq_open(b"/grpokit-test", os.O_CREAT | os.O_RDWR, 0o600, None)
libc.mq_notify(queue, ctypes.byref(SigEvent(None, 19, 0)))
libc.mq_send(queue, b"x", 1, 0)
""",
    "terminal_background_read": """
import fcntl, os, pty, termios, time
if os.fork() == 0:
    try:
        os.setsid()
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        if os.fork() == 0:
            os.setpgid(0, 0)
            os.read(slave, 1)  # a background group reading its terminal: SIGTTIN
    except OSError:
        pass
    time.sleep(60)
""",
    "terminal_ctrl_z": """
import fcntl, os, pty, termios, time
if os.fork() == 0:
    try:
        os.setsid()
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        child = os.fork()
        if child == 0:
            os.setpgid(0, 0)
            time.sleep(60)
        os.setpgid(child, child)
        os.tcsetpgrp(slave, child)
        os.write(master, b"\\x1a")  # ^Z: the line discipline sends SIGTSTP to the foreground group
    except OSError:
        pass
    time.sleep(60)
""",
}


def test_a_program_cannot_stop_itself_to_look_stalled_by_the_host():
    require("host_stall_detection")
    reward = CodeExecutionReward(SandboxConfig(timeout_seconds=1.5, max_workers=4))
    names = list(SELF_STOPS)
    programs = [SELF_STOPS[name].replace("@SIGEVENT@", SIGEVENT) for name in names]
    completions = [chat(WRONG_ADD + program + "\nimport time\ntime.sleep(60)\n") for program in programs]
    scores = reward(completions, test_cases=ADD_TEST * len(names))
    assert dict(zip(names, scores)) == dict.fromkeys(names, 0.0)


def test_a_program_too_large_for_its_disk_is_a_failure_not_an_unknown():
    require("private_workdir")
    config = SandboxConfig(disk_bytes=1024**2)
    huge = chat("def add(a, b):\n    return a + b\n" + "x = 1\n" * 300_000)
    result = run_python("x = 1\n" * 300_000, config=config)
    assert (result.status, result.reason) == ("error", "program_size")
    assert "disk_bytes" in result.stderr
    assert CodeExecutionReward(config)([huge], test_cases=ADD_TEST) == [0.0]


# --- 4. values the judge must write back and read --------------------------------------------------------------


def test_a_big_int_under_a_test_function_gets_a_verdict_not_an_exception():
    """2**20000 has 6,021 digits, past Python's 4,300-digit limit for int <-> str."""
    test = "def same(x, y):\n    return x == y\nassert same(big(), 2**20000)"
    right = chat("def big():\n    return 2**20000\n")
    wrong = chat("def big():\n    return 2**20000 + 1\n")
    nested = chat("def big():\n    value = 0\n    for _ in range(150):\n        value = [value]\n    return value\n")
    scores = CodeExecutionReward(SandboxConfig(timeout_seconds=20))([right, wrong, nested], test_cases=[[test]] * 3)
    assert scores == [1.0, 0.0, 0.0]


def test_the_deferred_run_binds_values_by_statements_and_renders_big_ints_in_hex():
    plan = plan_snippet("def g(x):\n    return x % 7\nassert g(f()) == 2**20000 % 7")
    source, slots = deferred_program(plan, RunValues([(True, 2**20000)]), None)
    assert source is not None and list(slots.values()) == [0]
    assert hex(2**20000) in source


# --- 5. hash-colliding results ---------------------------------------------------------------------------------

MERSENNE_61 = 2**61 - 1  # Python hashes an int n as n mod (2**61 - 1)


def _colliding_record(count: int, tag: str = "E") -> str:
    values = [["I", hex(k * MERSENNE_61 + 1)] for k in range(count)]
    return json.dumps({"solution": "ok", "values": [[tag, values]], "failed_exec": None})


def test_a_hash_colliding_result_set_is_refused_after_a_bounded_number_of_comparisons():
    record = _colliding_record(32_000)
    assert len(record) < 1024**2  # within the default output cap
    started = time.process_time()
    values = read_record(record, 1)
    assert time.process_time() - started < 1.0  # building the set took ~5 s of CPU
    assert "share one hash value" in values.error
    # the same values as a list, made a set by the test itself
    passed, why = judge(plan_snippet("assert set(f()) == {1}"), read_record(_colliding_record(32_000, "L"), 1), None)
    assert not passed and "share one hash value" in why

    class Counted:
        comparisons = 0

        def __init__(self, n: int) -> None:
            self.n = n

        def __hash__(self) -> int:
            return 7

        def __eq__(self, other: object) -> bool:
            Counted.comparisons += 1
            return isinstance(other, Counted) and other.n == self.n

    with pytest.raises(Exception, match="share one hash value"):
        check_hashing(Counted(n) for n in range(10_000))
    assert Counted.comparisons <= 17 * 16  # not 10_000**2 / 2
    check_hashing([5] * 10_000 + list(range(10_000)))  # repeats and ordinary distinct values are fine


QUADRATIC = {  # snippet: (a value that made the judge spend seconds, an ordinary value that passes)
    "import math\nassert math.prod(f()) > 0": (["L", [["I", hex(2**20 - 3)]] * 50_000], ["L", [["I", "0x2"]] * 3]),
    "assert sum(f(), []) != [0]": (["L", [["L", [["I", "0x1"]]]] * 40_000], ["L", [["L", [["I", "0x1"]]]] * 3]),
    "assert f() % (2**2000000 + 1) > 0": (["I", hex(3**2_500_000)], ["I", hex(3**1000)]),
}


def _record(value: list) -> str:
    return json.dumps({"solution": "ok", "values": [value], "failed_exec": None})


@pytest.mark.parametrize("snippet", list(QUADRATIC), ids=["product", "sum_of_lists", "long_division"])
def test_quadratic_judge_operations_on_huge_program_values_are_refused(snippet):
    """Within the output cap: a product of 50,000 ints, a sum of 40,000 lists, a long division of
    4-million-bit ints (each about a second or more of trainer CPU before)."""
    hostile, ordinary = QUADRATIC[snippet]
    assert len(_record(hostile)) < 1024**2
    values = read_record(_record(hostile), 1)
    started = time.process_time()
    passed, why = judge(plan_snippet(snippet), values, None)
    assert time.process_time() - started < 0.5
    assert not passed and "takes too long for the judge" in why
    assert judge(plan_snippet(snippet), read_record(_record(ordinary), 1), None) == (True, "")


def test_a_program_that_forges_a_colliding_record_scores_zero_at_a_bounded_cost():
    forger = chat(f"""
import json, os
record = {_colliding_record(30_000)!r}.encode()
for fd in range(3, 12):
    try:
        view = memoryview(record)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass
os._exit(0)
""")
    reward = CodeExecutionReward(SandboxConfig(timeout_seconds=20, max_output_bytes=2 * 1024**2))
    started = time.process_time()
    assert reward([forger], test_cases=[["assert f() == {1}"]]) == [0.0]
    assert time.process_time() - started < 2.0  # the trainer's CPU: seconds before


# --- 6. the round's own probes (the rest: docs/rewards.md) -------------------------------------------------------

PROBES = {
    "steal_the_status_pipe": ("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
pidfd = libc.syscall(434, os.getppid(), 0)
for fd in range(3, 16):
    got = libc.syscall(438, pidfd, fd, 0)  # pidfd_getfd
    if got >= 0:
        os.write(got, b"BX0")
        print("STOLE", fd)
""", "STOLE"),
    "write_the_inits_memory": ("""
for path in ("/proc/1/mem", "/proc/1/task/1/mem"):
    try:
        open(path, "r+b").write(b"x")
        print("WROTE", path)
    except OSError:
        pass
""", "WROTE"),
    "raise_the_hard_limits": ("""
import resource
for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_NOFILE"):
    try:
        resource.setrlimit(getattr(resource, name), (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("RAISED", name)
    except (ValueError, OSError):
        pass
""", "RAISED"),
    "setuid_mount": ("""
import subprocess
r = subprocess.run(["mount", "-t", "tmpfs", "none", "/tmp"], capture_output=True, timeout=5)
if r.returncode == 0:
    print("MOUNTED")
""", "MOUNTED"),
    "move_the_clocks": ("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
class TimeSpec(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
for clock in (0, 1):
    if libc.clock_settime(clock, ctypes.byref(TimeSpec(10, 0))) == 0:
        print("MOVED", clock)
""", "MOVED"),
}


@pytest.mark.parametrize("name", list(PROBES))
def test_round3_probe_is_contained(name):
    require("unprivileged_user", "seccomp_filter")
    program, escaped = PROBES[name]
    before = time.time()
    result = run_python(program, config=SandboxConfig(timeout_seconds=20))
    assert escaped not in result.stdout, result
    assert result.status == "ok", result  # refused, not crashed: the program went on
    assert abs(time.time() - before) < 60  # the host's clock did not move
