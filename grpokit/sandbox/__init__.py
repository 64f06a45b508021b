"""Run untrusted, model-written Python in a contained child process.

Each run gets, where the machine allows it (detected once, logged once on logger "grpokit.sandbox"):

- resource limits: RLIMIT_CPU / AS / FSIZE / NOFILE / CORE, and RLIMIT_NPROC for a non-root uid;
- a wall-clock deadline, after which the whole process tree is killed;
- stdout/stderr read incrementally and capped (the run is killed past `max_output_bytes`);
- a clean environment (PATH, HOME, TMPDIR, LANG only) and no_new_privs;
- when started as root: a drop to a per-run unprivileged uid (setgroups([]), setgid, setuid);
- with util-linux `unshare` (as root, or as non-root with user namespaces): new network, pid, mount and IPC
  namespaces. Network: only a down loopback. Pid: our init (`_boot.py`) is pid 1, and its exit kills
  every process left, daemons included. Mount: every mount remounted read-only, and the working directory a
  private, size-capped tmpfs. IPC: System V objects die with the run;
- a seccomp filter on the program (`_boot.seccomp_program`): socket() fails for every family (EACCES), so no
  host service is reachable, not even a Unix socket file; io_uring, ptrace, new namespaces, stop signals and
  priority/affinity changes are refused too;
- one cgroup per run (`_cgroup.py`, v2 or v1): a memory budget for all of the run's processes and all kinds of
  memory (tmpfs and memfd files included; no swap), and a task budget; passing it kills the run ("killed",
  reason "memory");
- host-stall accounting: time the host takes from the run (its processes stopped from outside, or waiting for a
  CPU none of the run's processes was using) moves the deadline; past `max_host_stall_seconds` the run is
  "infra_error" (unknown), so a loaded or frozen machine never scores a program 0.

docs/rewards.md has the table of what each protection stops. Each concurrent run gets its own uid
(`SandboxConfig.uid_base + slot`), unique across every process on the machine (a slot is an flock held on a file
in SLOT_LOCK_DIR), so RLIMIT_NPROC counts only that run's processes and one run can never signal another. A run that could not be started is `status="infra_error"`: callers must treat it as unknown
(None), never as a wrong answer (0.0).

Known limits: reads of world-readable files (installed packages, /etc/passwd) stay possible, and the program
can read its own source (assert tests are judged outside for that reason: grpokit.sandbox.judge). Where there
is neither a pid namespace nor root (for the uid sweep) nor a cgroup, a daemon that calls setsid() can outlive
the run. Without seccomp, a Unix socket file the sandbox user may write to is reachable; without a cgroup,
memory is bounded per process only (docs/rewards.md gives the bound).
"""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, Sequence

from grpokit.sandbox import _cgroup
from grpokit.sandbox._cgroup import RunCgroup

logger = logging.getLogger("grpokit.sandbox")

Status = Literal["ok", "error", "timeout", "killed", "output_limit", "infra_error"]

BOOT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot.py")
WORKDIR_PREFIX = "grpokit-sbx-"
PROGRAM_NAME = "main.py"
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
_READ_CHUNK = 65536
_REAP_SECONDS = 2.0  # how long to wait for the killed process tree to release its pipes
_SCHEDSTAT = os.path.exists("/proc/self/schedstat")  # per-task CPU and run-queue wait (CONFIG_SCHED_INFO)


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed run. Every limit applies to each run separately."""

    timeout_seconds: float = 10.0
    """Wall-clock limit; the whole process tree is killed when it passes (status "timeout")."""
    cpu_seconds: int = 5
    """RLIMIT_CPU per process (soft); SIGXCPU at the soft limit, SIGKILL one second later."""
    memory_bytes: int = 512 * 1024**2
    """The run's memory budget. Where a cgroup is available (`sandbox_protections()["memory_budget"]`): one
    budget for all of the run's processes and all kinds of memory (anonymous, tmpfs/shm files, kernel buffers),
    past which the run is killed (status "killed", reason "memory"). Also RLIMIT_AS per process (a single
    process gets MemoryError first). Without a cgroup only the per-process limit holds: see docs/rewards.md for
    the bound. Python itself needs about 30 MB; numpy/torch imports much more."""
    file_size_bytes: int = 16 * 1024**2
    """RLIMIT_FSIZE: the largest file the program may write."""
    disk_bytes: int = 64 * 1024**2
    """Size of the private tmpfs working directory (only where a mount namespace is available)."""
    max_files: int = 1024
    """Inodes of that tmpfs: files + directories the program may create."""
    max_processes: int = 16
    """Processes + threads of the run: the cgroup's pids.max (plus one for the init) where there is a cgroup, and
    RLIMIT_NPROC for the run's own uid (not enforced for root). Without the uid drop (a non-root caller) the
    kernel counts every process of the caller's uid against RLIMIT_NPROC."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1024**2
    """Cap on each of stdout and stderr; the run is killed when one passes it (status "output_limit")."""
    python_executable: str | None = None
    """Interpreter for the program, started with -I (isolated: no user site, no PYTHON* variables) and -B.
    None: this process's interpreter (same packages) when the sandbox user can run it, else the system `python3`
    on PATH (standard library only; e.g. when Python is installed under root's private home)."""
    uid_base: int = 2_100_000_000
    """When started as root, run k of those in flight at once runs as uid = gid = uid_base + k; pick a range no
    real account uses."""
    max_workers: int = 4
    """Runs in flight at once in `Sandbox.run_many`."""
    max_host_stall_seconds: float | None = None
    """How much wall time the host may take from a run (its processes stopped from outside, or waiting runnable
    for a CPU that none of the run's own processes was using) before the run is given up as "infra_error"
    (scored None). Time taken is added to the deadline, so a stall shorter than this costs no verdict.
    None: 2 x `timeout_seconds`, so that a program that only spins still reaches its CPU limit (a failure) on
    a host that gives it a quarter of a CPU or more. Needs `sandbox_protections()["host_stall_detection"]`."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "file_size_bytes", "disk_bytes", "max_files",
                     "max_processes", "max_open_files", "max_output_bytes", "max_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SandboxConfig.{name} must be a positive int, got {value!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"SandboxConfig.timeout_seconds must be > 0, got {self.timeout_seconds!r}")
        if self.max_host_stall_seconds is not None and not self.max_host_stall_seconds >= 0:
            raise ValueError(
                f"SandboxConfig.max_host_stall_seconds must be >= 0 or None, got {self.max_host_stall_seconds!r}"
            )

    @property
    def host_stall_limit(self) -> float:
        return 2 * self.timeout_seconds if self.max_host_stall_seconds is None else self.max_host_stall_seconds
        if not 0 < self.uid_base < 2**31 - 65536:
            raise ValueError(f"SandboxConfig.uid_base must be in (0, 2**31 - 65536), got {self.uid_base!r}")


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended. `returncode` is the exit code, or -signal when killed by a signal; None when unknown."""

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    reason: str = ""
    """Why the sandbox ended the run, when it did: "timeout", "cpu" (SIGXCPU/SIGKILL at RLIMIT_CPU), "memory"
    (the run passed its memory budget), "output", "host_stall", "setup"; "" otherwise."""
    host_stall_seconds: float = 0.0
    """Wall time the host took from the run (see SandboxConfig.max_host_stall_seconds); 0 where not measured."""
    peak_memory_bytes: int | None = None
    """The run's peak memory, all processes together (cgroup only; None without one)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class _LaunchMode:
    """One way of starting the init process; the detection picks the strongest that works here."""

    namespaces: bool
    user_namespace: bool
    drop_privileges: bool
    read_only_filesystem: bool
    seccomp: bool = True
    cgroup: bool = True

    def unshare_args(self) -> list[str]:
        if not self.namespaces:
            return []
        args = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc"]
        if self.user_namespace:
            args += ["--user", "--map-root-user"]
        return args


@dataclass(frozen=True)
class _Setup:
    """What detection found: the launch mode and interpreter to use (None: nothing works) and their protections."""

    mode: _LaunchMode | None
    python: str | None
    protections: dict[str, bool]


SLOT_LOCK_DIR = "/tmp/grpokit-sandbox-uids"  # fixed, not tempfile.gettempdir(): every process must agree on it


class _UidSlots:
    """Hands out the smallest free slot, machine-wide: a slot is held by an exclusive flock on
    SLOT_LOCK_DIR/<uid>.lock, so runs in other processes (two DDP ranks, two trainers) never get the same uid
    while it is in use. The kernel drops a lock when its holder dies, so a killed trainer frees its slots."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # slot -> the fd holding its lock
        self._lock = threading.Lock()

    def acquire(self, uid_base: int) -> int:
        import fcntl

        os.makedirs(SLOT_LOCK_DIR, mode=0o700, exist_ok=True)
        for slot in range(65536):
            path = os.path.join(SLOT_LOCK_DIR, f"{uid_base + slot}.lock")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # per open file: threads of one process exclude too
            except BlockingIOError:
                os.close(fd)
                continue
            with self._lock:
                self._held[slot] = fd
            return slot
        raise OSError("no free sandbox uid slot (65536 in use)")

    def release(self, slot: int) -> None:
        with self._lock:
            fd = self._held.pop(slot, None)
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops its lock

_SLOTS = _UidSlots()
_DETECT_LOCK = threading.Lock()
_DETECTED: dict[str | None, _Setup] = {}


def _clean_env(workdir: str) -> dict[str, str]:
    return {"PATH": MINIMAL_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _rlimits(config: SandboxConfig, limit_processes: bool) -> list[tuple[str, int, int]]:
    limits = [
        ("RLIMIT_CPU", config.cpu_seconds, config.cpu_seconds + 1),
        ("RLIMIT_AS", config.memory_bytes, config.memory_bytes),
        ("RLIMIT_FSIZE", config.file_size_bytes, config.file_size_bytes),
        ("RLIMIT_NOFILE", config.max_open_files, config.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]
    if limit_processes:
        limits.append(("RLIMIT_NPROC", config.max_processes, config.max_processes))
    return limits


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc), used to reach the init behind `unshare`."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _kill_uid(uid: int, python: str) -> None:
    """SIGKILL every process of `uid` by running kill(-1) as that uid (it may signal only its own processes)."""
    try:
        subprocess.run(
            [python, "-I", "-S", "-c", "import os; os.kill(-1, 9)"],
            user=uid, group=uid, extra_groups=[], env={}, timeout=10,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("could not sweep leftover processes of sandbox uid %d: %s", uid, exc)


def _kill_tree(proc: subprocess.Popen, mode: _LaunchMode, uid: int | None, python: str) -> None:
    """Kill everything the run started.

    With a pid namespace, killing its init (the child of `unshare`) makes the kernel kill the whole namespace.
    Without one, a daemon that called setsid() has left the process group; a uid sweep still reaches it.
    """
    for pid in _children(proc.pid) if mode.namespaces else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if uid is not None and not mode.namespaces:
        _kill_uid(uid, python)


def _decode_status(report: bytes) -> tuple[str | None, int | None]:
    """Parse the init's status-pipe report into (infra error message or None, returncode or None)."""
    if not report.startswith(b"B"):
        return "the sandbox launcher exited before the init process started", None
    body = report[1:]
    if body.startswith(b"E"):
        message = re.sub(rb"X-?\d+$", b"", body[1:])  # the init's exit report follows the child's error
        return "sandbox setup failed: " + message.decode(errors="replace"), None
    if body.startswith(b"X"):
        wait_status = int(body[1:])
        return None, os.waitstatus_to_exitcode(wait_status)
    return None, None  # init killed before the program ended (timeout kill, or killed from inside)


class _Pipes:
    """Non-blocking pump of stdin in and stdout/stderr out, with a byte cap per output stream."""

    def __init__(self, proc: subprocess.Popen, stdin: bytes, cap: int) -> None:
        self.cap = cap
        self.streams = (proc.stdout, proc.stderr)
        self.out = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
        self.selector = selectors.DefaultSelector()
        for fd in self.out:
            os.set_blocking(fd, False)
            self.selector.register(fd, selectors.EVENT_READ)
        self.stdin = proc.stdin
        self.pending = memoryview(stdin)
        if stdin:
            os.set_blocking(proc.stdin.fileno(), False)
            self.selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            self._close_stdin()

    def _close_stdin(self) -> None:
        if self.stdin is not None:
            try:
                self.selector.unregister(self.stdin.fileno())
            except (KeyError, ValueError):
                pass
            try:
                self.stdin.close()
            except OSError:
                pass
            self.stdin = None

    @property
    def reading(self) -> bool:
        return any(fd in self.out for fd in self.selector.get_map())

    def pump(self, wait: float) -> bool:
        """Move data for up to `wait` seconds; return False when an output stream passed the cap."""
        for key, _ in self.selector.select(max(wait, 0.0)):
            fd = key.fd
            if fd in self.out:
                try:
                    chunk = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    self.selector.unregister(fd)
                    continue
                self.out[fd] += chunk
                if len(self.out[fd]) > self.cap:
                    del self.out[fd][self.cap:]
                    return False
            else:
                try:
                    written = os.write(fd, self.pending[:_READ_CHUNK])
                except BlockingIOError:
                    continue
                except OSError:  # the program closed stdin or exited: nothing more to give
                    written = len(self.pending)
                self.pending = self.pending[written:]
                if not self.pending:
                    self._close_stdin()
        return True

    def close(self) -> tuple[str, str]:
        """Close every pipe and return (stdout, stderr) decoded as UTF-8 (invalid bytes replaced)."""
        self._close_stdin()
        self.selector.close()
        for stream in self.streams:
            stream.close()
        stdout, stderr = (bytes(data).decode("utf-8", errors="replace") for data in self.out.values())
        return stdout, stderr


def _read_report(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 8192)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _boot_spec(
    config: SandboxConfig, mode: _LaunchMode, python: str, uid: int | None, workdir: str, status_fd: int,
    cgroup: RunCgroup | None,
) -> dict:
    """What the init (`_boot.py`) needs to know, as JSON-ready data."""
    return {
        "status_fd": status_fd,
        "workdir": workdir,
        "program": PROGRAM_NAME,
        "read_only_root": mode.read_only_filesystem,
        "private_workdir": mode.read_only_filesystem,
        "disk_bytes": config.disk_bytes,
        "max_files": config.max_files,
        "uid": uid,
        "gid": uid,
        "rlimits": _rlimits(config, limit_processes=mode.drop_privileges or os.geteuid() != 0),
        "argv": [python, "-I", "-B", os.path.join(workdir, PROGRAM_NAME)],
        "env": _clean_env(workdir),
        "seccomp": mode.seccomp,
        "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
    }


def _launch(code: str, stdin: str, config: SandboxConfig, mode: _LaunchMode, python: str) -> SandboxResult:
    """One run under `mode`: take a uid slot, a fresh workdir and cgroup, run, then give them all back."""
    start = time.monotonic()
    slot = _SLOTS.acquire(config.uid_base) if mode.drop_privileges else None
    try:
        workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
        try:
            # surrogatepass: a lone surrogate is written as its (invalid UTF-8) bytes, so the program fails to
            # compile, as that source would; the sandbox itself never raises on it
            with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8", errors="surrogatepass") as fh:
                fh.write(code)
            uid = config.uid_base + slot if slot is not None else None
            cgroup = None
            if mode.cgroup:
                parents = _cgroup.parents()
                if parents is None:
                    raise OSError("the run's cgroup cannot be created: no writable memory+pids cgroup any more")
                # +1 task: the init, which joins the cgroup before it starts the program
                cgroup = RunCgroup(parents, config.memory_bytes, config.max_processes + 1)
            try:
                return _start(stdin, config, mode, python, uid, workdir, start, cgroup)
            finally:
                if cgroup is not None:
                    cgroup.remove()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        if slot is not None:
            _SLOTS.release(slot)


def _start(
    stdin: str, config: SandboxConfig, mode: _LaunchMode, python: str, uid: int | None, workdir: str, start: float,
    cgroup: RunCgroup | None,
) -> SandboxResult:
    """Start the init with a private status pipe, supervise the run, and never leave a process behind."""
    status_r, status_w = os.pipe()
    proc = None
    try:
        spec = _boot_spec(config, mode, python, uid, workdir, status_w, cgroup)
        argv = mode.unshare_args() + [python, "-I", "-S", BOOT_SCRIPT, json.dumps(spec)]
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": MINIMAL_PATH}, cwd="/", start_new_session=True, pass_fds=(status_w,),
            )
        except OSError as exc:
            return SandboxResult("infra_error", None, "", f"could not start the sandbox: {exc}", 0.0, "setup")
        finally:
            os.close(status_w)
        return _supervise(proc, stdin.encode("utf-8", errors="surrogatepass"), config, (mode, uid, python), status_r,
                          start, cgroup)
    finally:
        if proc is not None and proc.poll() is None:  # only after an unexpected error in _supervise
            _kill_tree(proc, mode, uid, python)
            proc.wait()
        os.close(status_r)


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime + cutime + cstime of a process (its threads, dead ones included, and reaped children)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return sum(int(f) for f in fields[11:15]) / _CLOCK_TICKS


class _StallMeter:
    """How much wall time the host has taken from a run, sampled from /proc while it runs.

    Taken in an interval: all of it when one of the run's processes is stopped (SIGSTOP/SIGTSTP from outside:
    the seccomp filter refuses stop signals to the program, and ptrace, so it cannot stop itself), else the
    time the program's main thread waited runnable for a CPU (/proc/<pid>/schedstat) minus the CPU time the
    run's other processes and threads used meanwhile (its own children cannot make it look starved). The
    filter also refuses nice/priority/affinity changes, which would make a program wait longer on purpose.
    """

    def __init__(self, root_pid: int, namespaces: bool) -> None:
        self.root = root_pid
        self.namespaces = namespaces
        self.program: int | None = None
        self.last: tuple[float, float, float, float, int] | None = None  # (time, wait, cpu, tree cpu, pid)
        self.stolen = 0.0

    def _launcher_chain(self) -> tuple[int | None, int | None]:
        init = self.root
        if self.namespaces:
            kids = _children(self.root)
            init = kids[0] if kids else None
        if self.program is None and init is not None:
            kids = _children(init)
            self.program = kids[0] if kids else None
        return init, self.program

    def _tree(self) -> tuple[float, bool]:
        """(CPU seconds of every live process under the root, reaped ones included; whether one is stopped)."""
        total, stopped, seen = 0.0, False, set()
        stack = [(self.root, False)]
        while stack:  # post-order: a process is read after its children, so a child reaped meanwhile still counts
            pid, expanded = stack.pop()
            if expanded:
                total += _proc_cpu_seconds(pid) or 0.0
                continue
            if pid in seen:
                continue
            seen.add(pid)
            stack.append((pid, True))
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                        state = fh.read().rsplit(b")", 1)[1].split()[0]
                    stopped |= state in (b"T", b"t")
                    with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                        stack += [(int(c), False) for c in fh.read().split()]
                except (OSError, IndexError, ValueError):
                    continue
        return total, stopped

    @staticmethod
    def _schedstat(pid: int) -> tuple[float, float] | None:
        """(CPU seconds, runnable-wait seconds) of the main thread of `pid`."""
        try:
            with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as fh:
                run_ns, wait_ns, _ = fh.read().split()
            return int(run_ns) / 1e9, int(wait_ns) / 1e9
        except (OSError, ValueError):
            return None

    def sample(self, now: float) -> float:
        """Update and return the total taken so far."""
        init, program = self._launcher_chain()
        watched = program if program is not None else init
        stat = self._schedstat(watched) if watched is not None else None
        tree_cpu, stopped = self._tree()
        if stat is None:
            return self.stolen
        own_cpu, wait = stat
        if self.last is not None and self.last[4] == watched:
            dt = now - self.last[0]
            if stopped:
                self.stolen += dt
            else:
                others = max(0.0, (tree_cpu - self.last[3]) - (own_cpu - self.last[2]))
                self.stolen += max(0.0, (wait - self.last[1]) - others)
        self.last = (now, wait, own_cpu, tree_cpu, watched)
        return self.stolen


def _supervise(
    proc: subprocess.Popen,
    stdin: bytes,
    config: SandboxConfig,
    tree: tuple[_LaunchMode, int | None, str],
    status_r: int,
    start: float,
    cgroup: RunCgroup | None = None,
) -> SandboxResult:
    """Pump the pipes until the run ends, the deadline passes or a limit is hit; then kill what is left.

    tree = (mode, uid, python): what `_kill_tree` needs to reach every process of the run. The deadline moves
    by the time the host takes from the run (`_StallMeter`, only with the seccomp filter)."""
    mode = tree[0]
    meter = _StallMeter(proc.pid, mode.namespaces) if mode.seccomp and _SCHEDSTAT else None
    stall_limit = config.host_stall_limit
    pipes = _Pipes(proc, stdin, config.max_output_bytes)
    verdict: Status | None = None
    reason = ""
    exited_at = None
    stolen = 0.0
    while True:
        now = time.monotonic()
        if meter is not None:
            stolen = meter.sample(now)
            if stolen > stall_limit:
                verdict, reason = "infra_error", "host_stall"
                break
        if cgroup is not None and cgroup.oom_kills():
            verdict, reason = "killed", "memory"
            break
        deadline = start + config.timeout_seconds + stolen
        if now >= deadline:
            verdict, reason = "timeout", "timeout"
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if not pipes.reading:
            # Output closed: wait (to the deadline) for the init to report the exit status; the program may
            # also have closed its stdout and kept running.
            if exited_at is not None:
                break
            try:
                proc.wait(timeout=min(0.05, max(deadline - now, 0.0)))
            except subprocess.TimeoutExpired:
                pass
            continue
        if exited_at is not None and now - exited_at > 0.5:
            break  # the init is gone but something (an escaped daemon) holds the pipes: stop listening
        if not pipes.pump(min(deadline - now, 0.1)):
            verdict, reason = "output_limit", "output"
            break
    _kill_tree(proc, *tree)  # anything left; a no-op when the run ended cleanly inside a pid namespace
    proc.wait()
    if cgroup is not None and verdict is None and cgroup.oom_kills():
        verdict, reason = "killed", "memory"  # a child killed at the budget just before the program exited
    # After the kill, let the dying tree release the pipes, so no process of this run outlives the call.
    reap_deadline = time.monotonic() + _REAP_SECONDS
    while pipes.reading and time.monotonic() < reap_deadline:
        if not pipes.pump(0.05):
            break
    stdout, stderr = pipes.close()
    wall = time.monotonic() - start
    peak = cgroup.peak_bytes() if cgroup is not None else None
    extra = {"host_stall_seconds": round(stolen, 3), "peak_memory_bytes": peak}
    infra, returncode = _decode_status(_read_report(status_r))
    if verdict == "infra_error":
        message = (f"the host stalled the run: it took {stolen:.1f} s of the run's {wall:.1f} s (stopped from "
                   f"outside, or waiting for a CPU), more than max_host_stall_seconds={stall_limit:g}")
        return SandboxResult("infra_error", None, stdout, f"{message}\n{stderr}".strip(), wall, reason, **extra)
    if infra is not None and verdict is None:
        return SandboxResult("infra_error", None, stdout, f"{infra}\n{stderr}".strip(), wall, "setup", **extra)
    if verdict is not None:
        return SandboxResult(verdict, returncode, stdout, stderr, wall, reason, **extra)
    if returncode is None:
        return SandboxResult("killed", None, stdout, stderr, wall, **extra)
    reason = "cpu" if returncode == -signal.SIGXCPU else ""
    status: Status = "ok" if returncode == 0 else ("killed" if returncode < 0 else "error")
    return SandboxResult(status, returncode, stdout, stderr, wall, reason, **extra)


# --- detection ---------------------------------------------------------------------------------------------

_PROBE = """
import errno, json, os, socket
try:
    s = socket.socket()
    sockets = "allowed"
except PermissionError:
    sockets = "refused"
    net = "isolated"
else:
    try:
        s.connect(("127.0.0.1", 9))
        net = "open"
    except OSError as exc:
        net = "isolated" if exc.errno == errno.ENETUNREACH else "open"
cgroups = open("/proc/self/cgroup").read()
print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "net": net, "sockets": sockets,
                  "cgroup": "/grpokit-" in cgroups, "ro": bool(os.statvfs("/").f_flag & os.ST_RDONLY)}))
"""


def _candidate_modes() -> list[_LaunchMode]:
    """Launch modes from strongest to weakest that make sense for this process; each base mode first with the
    seccomp filter and a cgroup (where one can be made), then without what failed."""
    root = os.geteuid() == 0
    bases = []
    if shutil.which("unshare", path=MINIMAL_PATH) is not None:
        bases += [(True, not root, root, True), (True, not root, root, False)]
        if root:
            bases.append((True, False, False, True))
    if root:
        bases.append((False, False, True, False))
    bases.append((False, False, False, False))
    cgroup = _cgroup.parents() is not None
    extras = list(dict.fromkeys([(True, cgroup), (True, False), (False, cgroup), (False, False)]))
    return [_LaunchMode(*base, seccomp=sc, cgroup=cg) for base in bases for sc, cg in extras]


def _candidate_interpreters(requested: str | None) -> list[str]:
    """The requested interpreter only; by default this process's, then the system python3 as a fallback."""
    if requested is not None:
        return [requested]
    system = shutil.which("python3", path=MINIMAL_PATH)
    return list(dict.fromkeys([sys.executable] + ([system] if system else [])))


def _probe(mode: _LaunchMode, python: str) -> dict | None:
    """Run a tiny program under `mode` and report what it could see, or None when the mode does not work."""
    result = _launch(_PROBE, "", SandboxConfig(timeout_seconds=20.0), mode, python)
    if not result.ok:
        logger.debug("sandbox mode %s with %s unavailable: %s %s", mode, python, result.status, result.stderr[-500:])
        return None
    try:
        return json.loads(result.stdout)
    except ValueError:
        return None


def _protections(mode: _LaunchMode | None, probe: dict) -> dict[str, bool]:
    started = mode is not None
    unprivileged = started and (os.geteuid() != 0 or (mode.drop_privileges and probe.get("uid", 0) != 0))
    return {
        "resource_limits": started,
        "wall_clock_kill": started,
        "output_cap": started,
        "clean_environment": started,
        "no_new_privileges": started,
        "unprivileged_user": unprivileged,
        "process_limit": unprivileged or bool(probe.get("cgroup")),
        "network_isolation": probe.get("net") == "isolated",
        "pid_namespace": probe.get("pid") == 2,  # our init is pid 1, the program its first child
        "read_only_filesystem": bool(probe.get("ro")),
        "private_workdir": started and mode.read_only_filesystem,
        "seccomp_filter": probe.get("sockets") == "refused",
        "memory_budget": bool(probe.get("cgroup")),
        "host_stall_detection": probe.get("sockets") == "refused" and _SCHEDSTAT,
    }


def _detect(requested: str | None) -> _Setup:
    """Find (once per requested interpreter) the strongest launch mode that works here; log what it protects."""
    with _DETECT_LOCK:
        if requested in _DETECTED:
            return _DETECTED[requested]
        setup = _Setup(None, None, _protections(None, {}))
        interpreters = _candidate_interpreters(requested)
        for mode in _candidate_modes():
            for python in interpreters:
                found = _probe(mode, python)
                if found is not None:
                    setup = _Setup(mode, python, _protections(mode, found))
                    break
            if setup.mode is not None:
                break
        _DETECTED[requested] = setup
        _log_setup(setup, interpreters)
        return setup


def _log_setup(setup: _Setup, interpreters: list[str]) -> None:
    if setup.mode is None:
        logger.error(
            "the sandbox cannot start programs with %s: every code run will be scored None (unknown). Check that "
            "the interpreter runs, or set SandboxConfig(python_executable=...)", " or ".join(interpreters),
        )
        return
    active = [name for name, on in setup.protections.items() if on]
    missing = [name for name, on in setup.protections.items() if not on]
    logger.info("sandbox runs programs with %s; protections active: %s", setup.python, ", ".join(active))
    if setup.python != interpreters[0]:
        logger.warning(
            "the sandbox user cannot run %s (is it under a private home such as /root?); sandboxed programs use %s "
            "and see only its packages. Set SandboxConfig(python_executable=...) to choose.", interpreters[0],
            setup.python,
        )
    if missing:
        logger.warning(
            "sandbox protections missing: %s. The namespaces need util-linux `unshare` and either root or "
            "unprivileged user namespaces, and an interpreter that other users can run; seccomp_filter and "
            "host_stall_detection need seccomp (x86_64 or aarch64); memory_budget needs a cgroup this process may "
            "create (v2 with memory+pids delegated, or v1). docs/rewards.md says what each missing one allows.",
            ", ".join(missing),
        )


def sandbox_protections(python_executable: str | None = None) -> dict[str, bool]:
    """Which protections runs on this machine get (detected on first use, then cached per interpreter choice)."""
    return dict(_detect(python_executable).protections)


# --- public entry points -----------------------------------------------------------------------------------


def run_python(code: str, stdin: str = "", config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox, feed it `stdin`, and say how it ended.

    Never raises for anything the program does; a sandbox that cannot start gives status "infra_error".
    """
    config = config or SandboxConfig()
    try:
        setup = _detect(config.python_executable)
    except Exception as exc:  # noqa: BLE001 - the machine, not the program: scored None (unknown), never raised
        return SandboxResult("infra_error", None, "", f"sandbox setup failed: {type(exc).__name__}: {exc}", 0.0)
    if setup.mode is None:
        return SandboxResult("infra_error", None, "", "no sandbox launch mode works on this machine", 0.0)
    try:
        return _launch(code, stdin, config, setup.mode, setup.python)
    except OSError as exc:  # e.g. no space for the workdir, out of file descriptors
        return SandboxResult("infra_error", None, "", f"sandbox failed: {type(exc).__name__}: {exc}", 0.0)


class Sandbox:
    """A bounded pool of sandboxed runs: at most `config.max_workers` programs in flight at once."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        return run_python(code, stdin, self.config)

    def run_many(self, codes: Sequence[str], stdins: Sequence[str] | None = None) -> list[SandboxResult]:
        """Run every program (with the matching stdin) and return the results in input order."""
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if len(stdins) != len(codes):
            raise ValueError(f"run_many got {len(codes)} programs but {len(stdins)} stdin texts; pass one per program")
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=min(self.config.max_workers, len(codes))) as pool:
            return list(pool.map(self.run, codes, stdins))
