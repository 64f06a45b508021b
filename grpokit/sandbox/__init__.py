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
- a seccomp filter on the program (`_boot.seccomp_program`): socket() and connect() fail for every family
  (EACCES) and socketpair() makes only connected AF_UNIX stream pairs, so no host service is reachable, not even
  a world-writable Unix socket file; io_uring, ptrace, new namespaces, stop signals (and every way to have the
  kernel send one: a death or exit signal, F_SETSIG, POSIX timers, mq_notify, setsid and a terminal) and
  priority/affinity changes are refused too;
- one cgroup per run (`_cgroup.py`, v2 or v1): a memory budget for all of the run's processes and all kinds of
  memory (tmpfs and memfd files included; no swap), and a task budget; passing it kills the run ("killed",
  reason "memory");
- a CPU budget for the run's processes together (`cpu_seconds`, read from /proc), so forking buys no CPU;
- host-stall accounting (`_stall.py`): time the host takes from the run (its processes stopped from outside, or
  its main thread waiting for a CPU beyond what the run's own other tasks used or waited for) moves the deadline;
  past `max_host_stall_seconds` the run is "infra_error" (unknown), so a loaded or frozen machine never scores a
  program 0, while pressure the program makes itself (CPU, processes, memory, output, disk) always scores 0.

docs/rewards.md has the table of what each protection stops. Each concurrent run gets its own uid
(`SandboxConfig.uid_base + slot`), unique across every process on the machine (`_uid_slots.py`), so
RLIMIT_NPROC counts only that run's processes and one run can never signal another. A run that could not be
started is `status="infra_error"`: callers must treat it as unknown (None), never as a wrong answer (0.0).

Known limits: reads of world-readable files (installed packages, /etc/passwd) stay possible, and the program
can read its own source (assert tests are judged outside for that reason: grpokit.sandbox.judge). Where there
is neither a pid namespace nor root (for the uid sweep) nor a cgroup, a daemon that calls setsid() can outlive
the run. Without seccomp, a Unix socket file the sandbox user may write to is reachable; without a cgroup,
memory is bounded per process only (docs/rewards.md gives the bound).

Layout: `_config.py` (SandboxConfig, the limits and their checks), `_result.py` (Status, SandboxResult),
`_run.py` (run_python, Sandbox), `_detection.py` (the launch mode and interpreter chosen once,
sandbox_protections), `_launcher.py` (one run: workdir, cgroup, the init behind `unshare`), `_uid_slots.py`
(per-run uids), `_supervisor.py` (deadline, limits, verdict), `_output.py` (pipes and the output cap),
`_stall.py` (host-stall accounting), `_process_tree.py` (killing what a run left), `_boot.py` (the init, inside
the isolation), `_cgroup.py` (the per-run cgroup), `judge.py` (with `_judge_plan.py`, `_judge_eval.py`) and
`_harness.py` (assert tests judged outside).
"""

from grpokit.sandbox._config import SandboxConfig
from grpokit.sandbox._detection import sandbox_protections
from grpokit.sandbox._launcher import WORKDIR_PREFIX
from grpokit.sandbox._result import SandboxResult, Status
from grpokit.sandbox._run import Sandbox, run_python
from grpokit.sandbox._uid_slots import SLOT_LOCK_DIR

__all__ = [
    "SLOT_LOCK_DIR",
    "WORKDIR_PREFIX",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "Status",
    "run_python",
    "sandbox_protections",
]
