"""The sandbox's init process: prepares the isolation, starts the untrusted program, reports how it ended.

Run by `grpokit.sandbox` as ``python -I -S _boot.py SPEC_JSON``, usually as pid 1 of fresh
network/pid/mount namespaces made by ``unshare``. It uses only the standard library and imports nothing from
grpokit, because it runs before any isolation exists and with the launcher's privileges.

Steps, in order:
1. Write b"B" to the status pipe (proves the launcher got this far).
2. When given cgroups (the run's memory/pids budget): join them, so that the program and everything it starts
   are counted there (this init too: ~10 MB); make this process the child subreaper (orphans come back to it).
3. When asked (mount namespace present): remount every mount point read-only, then mount a size-capped tmpfs
   over the working directory and copy the program into it. The host copy of the directory stays empty.
4. Fork. The child sets the resource limits, drops to the unprivileged uid/gid (setgroups([]), setgid, setuid),
   sets no_new_privs, installs the seccomp filter (see `seccomp_program`), and execs the interpreter on the
   program. If anything before the exec fails, the child writes b"E" + message and exits 127.
5. The parent (this process, still privileged, never signalled by the child's uid) reaps every child that
   reaches it until the program itself exits, writes b"X" + its raw wait status, and exits. When this process is
   pid 1 of the namespace, its exit makes the kernel kill every process left in the namespace (daemons too).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import resource
import sys

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
# statvfs f_flag bits that have the same value as the MS_* flags they mirror; they must be kept on a bind
# remount (clearing a locked one fails with EPERM inside a user namespace).
KEPT_MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # noatime, nodiratime, relatime
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SIGKILL = 9

# --- seccomp ---------------------------------------------------------------------------------------------------
# The filter is a classic BPF program over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6];}.
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000
LD_ABS_W, JEQ, JGE, JGT, JSET, RET, AND = 0x20, 0x15, 0x35, 0x25, 0x45, 0x06, 0x54
STOP_SIGNALS = (19, 22)  # SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU: the ones whose default action stops a process
NAMESPACE_CLONE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
CLONE_EXIT_SIGNAL = 0xFF  # CSIGNAL: the low byte of clone's flags, the signal the parent gets when the child exits
AF_UNIX, SOCK_STREAM, SOCK_TYPE_MASK = 1, 1, 0xF
PR_SET_PDEATHSIG_OPTION, F_SETSIG = 1, 10
# syscall -> (x86_64 number, aarch64 number)
SYSCALLS = {
    "socket": (41, 198), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "unshare": (272, 97), "setns": (308, 268), "clone": (56, 220),
    "clone3": (435, 435), "bpf": (321, 280), "userfaultfd": (323, 282), "perf_event_open": (298, 241),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218), "mount": (165, 40),
    "umount2": (166, 39), "pivot_root": (155, 41), "memfd_secret": (447, 447), "memfd_create": (319, 279),
    "shmget": (29, 194), "msgget": (68, 186), "setpriority": (141, 140), "sched_setparam": (142, 118),
    "sched_setscheduler": (144, 119), "sched_setaffinity": (203, 122), "sched_setattr": (314, 274),
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240), "pidfd_send_signal": (424, 424), "socketpair": (53, 199),
    "connect": (42, 203), "sendto": (44, 206), "setsid": (112, 157), "timer_create": (222, 107),
    "mq_notify": (244, 184), "prctl": (157, 167), "fcntl": (72, 25),
}
# Refused outright (errno). socket(): every family, so no host service is reachable (a Unix socket file, an
# abstract name, TCP/UDP, netlink); connect(): every socket the program can have is a connected socketpair, so
# connect only ever names a new peer (a host's Unix socket file). io_uring can open sockets and files outside the
# syscall filter. The rest: ways out of the namespaces, into other processes, or into kernel memory the run's
# budget may not count; scheduling changes that would make the program look starved by the host (see the
# host-stall accounting in grpokit.sandbox); and ways to have the kernel stop one of the run's own processes,
# which the host would take for a stall: setsid() (a session leader can take a terminal, whose job control sends
# SIGTSTP/SIGTTIN/SIGTTOU), POSIX timers and mq_notify (their signal number sits in memory the filter cannot read).
DENIED = {
    "socket": 13, "connect": 13, "setsid": 1, "timer_create": 1, "mq_notify": 1, "io_uring_setup": 1,
    "io_uring_enter": 1, "io_uring_register": 1, "ptrace": 1,
    "process_vm_readv": 1, "process_vm_writev": 1, "unshare": 1, "setns": 1, "bpf": 1, "userfaultfd": 1,
    "perf_event_open": 1, "keyctl": 1, "add_key": 1, "request_key": 1, "mount": 1, "umount2": 1,
    "pivot_root": 1, "memfd_secret": 1, "shmget": 1, "msgget": 1, "setpriority": 1, "sched_setparam": 1,
    "sched_setscheduler": 1, "sched_setaffinity": 1, "sched_setattr": 1,
    "clone3": 38,  # ENOSYS: its flags sit in memory the filter cannot read; libc then falls back to clone()
}
# Signal-sending calls and the argument that holds the signal: stop signals are refused, so only something
# outside the run can stop one of its processes.
SIGNAL_ARG = {"kill": 1, "tkill": 1, "tgkill": 2, "rt_sigqueueinfo": 1, "rt_tgsigqueueinfo": 2,
              "pidfd_send_signal": 1}
EPERM = 1


def _insn(code: int, jt: int, jf: int, k: int) -> tuple[int, int, int, int]:
    return (code, jt, jf, k)


def seccomp_program(machine: str, block_memory_files: bool) -> list[tuple[int, int, int, int]]:
    """The filter for this architecture. Another architecture's calling convention (i386 int 0x80, x32) kills."""
    column = 0 if machine == "x86_64" else 1
    nr = {name: numbers[column] for name, numbers in SYSCALLS.items()}
    denied = dict(DENIED)
    if block_memory_files:  # no memory cgroup: memfd pages would escape RLIMIT_AS (see docs/rewards.md)
        denied["memfd_create"] = EPERM
    prog = [_insn(LD_ABS_W, 0, 0, 4), _insn(JEQ, 1, 0, AUDIT_ARCH[machine]), _insn(RET, 0, 0, RET_KILL_PROCESS),
            _insn(LD_ABS_W, 0, 0, 0)]
    if machine == "x86_64":
        prog += [_insn(JGE, 0, 1, X32_SYSCALL_BIT), _insn(RET, 0, 0, RET_KILL_PROCESS)]
    for name, err in denied.items():
        prog += [_insn(JEQ, 0, 1, nr[name]), _insn(RET, 0, 0, RET_ERRNO | err)]
    for name, arg in SIGNAL_ARG.items():
        prog += [_insn(JEQ, 0, 5, nr[name]), _arg(arg), *_refuse_stop_signal(), _insn(LD_ABS_W, 0, 0, 0)]
    # Stop signals the kernel sends on the program's behalf: at its parent's death, at a child's exit, on I/O.
    for name, option, arg in (("prctl", (0, PR_SET_PDEATHSIG_OPTION), 1), ("fcntl", (1, F_SETSIG), 2)):
        prog += [_insn(JEQ, 0, 7, nr[name]), _arg(option[0]), _insn(JEQ, 0, 4, option[1]), _arg(arg),
                 *_refuse_stop_signal(), _insn(LD_ABS_W, 0, 0, 0)]
    prog += _socket_rules(nr)
    prog += [
        _insn(JEQ, 0, 8, nr["clone"]),
        _arg(0),  # flags, args[0] on both architectures
        _insn(JSET, 0, 1, NAMESPACE_CLONE_FLAGS),
        _insn(RET, 0, 0, RET_ERRNO | EPERM),
        _insn(AND, 0, 0, CLONE_EXIT_SIGNAL),
        *_refuse_stop_signal(),
        _insn(LD_ABS_W, 0, 0, 0),
        _insn(RET, 0, 0, RET_ALLOW),
    ]
    return prog


def _arg(index: int, high: bool = False) -> tuple[int, int, int, int]:
    """Load the low (or high) 32 bits of syscall argument `index` (seccomp_data is little-endian here)."""
    return _insn(LD_ABS_W, 0, 0, 16 + 8 * index + (4 if high else 0))


def _refuse_stop_signal() -> list[tuple[int, int, int, int]]:
    """Three instructions: EPERM when the accumulator is a stop signal, else fall through past them."""
    return [_insn(JGE, 0, 2, STOP_SIGNALS[0]), _insn(JGT, 1, 0, STOP_SIGNALS[1]), _insn(RET, 0, 0, RET_ERRNO | EPERM)]


def _socket_rules(nr: dict[str, int]) -> list[tuple[int, int, int, int]]:
    """socketpair only as AF_UNIX SOCK_STREAM (a connected pair, which the kernel never lets send to an address:
    sendmsg/sendto with one fail with EISCONN), and sendto only without an address. A datagram socketpair could
    send to any path-named Unix socket of the host (the network namespace does not scope those)."""
    refuse = RET_ERRNO | DENIED["socket"]
    return [
        _insn(JEQ, 0, 7, nr["socketpair"]),
        _arg(0), _insn(JEQ, 0, 3, AF_UNIX),
        _arg(1), _insn(AND, 0, 0, SOCK_TYPE_MASK), _insn(JEQ, 1, 0, SOCK_STREAM),
        _insn(RET, 0, 0, refuse),
        _insn(LD_ABS_W, 0, 0, 0),
        _insn(JEQ, 0, 6, nr["sendto"]),
        _arg(4), _insn(JEQ, 0, 2, 0),  # dest_addr: a pointer, both halves must be 0
        _arg(4, high=True), _insn(JEQ, 1, 0, 0),
        _insn(RET, 0, 0, refuse),
        _insn(LD_ABS_W, 0, 0, 0),
    ]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def install_seccomp(block_memory_files: bool) -> None:
    """Load the filter into this process (inherited by everything it execs and forks). Needs no_new_privs."""
    machine = os.uname().machine
    if machine not in AUDIT_ARCH:
        raise OSError(f"no seccomp filter for architecture {machine}")
    prog = seccomp_program(machine, block_memory_files)
    array = (_SockFilter * len(prog))(*[_SockFilter(*insn) for insn in prog])
    fprog = _SockFprog(len(prog), array)
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_points() -> list[str]:
    """Mount points of this mount namespace, from /proc/self/mountinfo (field 5, octal escapes decoded)."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8") as fh:
        for line in fh:
            raw = line.split()[4]
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), raw))
    return list(dict.fromkeys(points))


def make_filesystem_read_only() -> None:
    """Bind-remount every mount point read-only, keeping its nosuid/nodev/noexec/atime flags."""
    for point in _mount_points():
        try:
            kept = os.statvfs(point).f_flag & KEPT_MOUNT_FLAGS
        except OSError:
            continue  # covered by a later mount or gone: unreachable either way
        ret = _libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept, None)
        if ret != 0 and ctypes.get_errno() not in (errno.ENOENT, errno.EINVAL):
            _check(ret, f"remount {point!r} read-only")


def mount_private_workdir(workdir: str, program: str, spec: dict) -> None:
    """Mount a size-capped tmpfs over `workdir` and put the program file into it, owned by the sandbox user."""
    with open(os.path.join(workdir, program), "rb") as fh:
        source = fh.read()
    options = f"size={spec['disk_bytes']},nr_inodes={spec['max_files']},mode=0700"
    if spec["uid"] is not None:
        options += f",uid={spec['uid']},gid={spec['gid']}"
    ret = _libc.mount(b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())
    _check(ret, f"mount tmpfs on {workdir!r}")
    path = os.path.join(workdir, program)
    with open(path, "wb") as fh:
        fh.write(source)
    if spec["uid"] is not None:
        os.chown(path, spec["uid"], spec["gid"])


def start_program(spec: dict, status_fd: int) -> None:
    """In the forked child: limits, privilege drop, exec. Never returns."""
    try:
        os.chdir(spec["workdir"])
        for name, soft, hard in spec["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
            if os.getuid() != spec["uid"] or os.geteuid() != spec["uid"]:
                raise OSError("privilege drop did not take effect")
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        if spec["seccomp"]:
            install_seccomp(block_memory_files=not spec["cgroup_procs"])
        # The uid change cleared any parent-death signal; re-arm it so the program dies with this init even
        # where no pid namespace exists, and close the race with an init that already died.
        _check(_libc.prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != spec["init_pid"]:
            raise OSError("the sandbox init exited before the program started")
        os.set_inheritable(status_fd, False)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - everything must be reported, the host decides
        os.write(status_fd, b"E" + f"{type(exc).__name__}: {exc}".encode(errors="replace")[:4000])
    finally:
        os._exit(127)


def main() -> None:
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    init_pid = os.getpid()
    os.write(status_fd, b"B")
    try:
        for procs_file in spec["cgroup_procs"]:  # before anything else: every process after this is counted
            with open(procs_file, "w", encoding="ascii") as fh:
                fh.write(str(init_pid))
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
        if spec["read_only_root"]:
            make_filesystem_read_only()
        if spec["private_workdir"]:
            mount_private_workdir(spec["workdir"], spec["program"], spec)
        elif spec["uid"] is not None:
            os.chown(spec["workdir"], spec["uid"], spec["gid"])
            os.chown(os.path.join(spec["workdir"], spec["program"]), spec["uid"], spec["gid"])
        child = os.fork()
    except BaseException as exc:  # noqa: BLE001
        os.write(status_fd, b"E" + f"{type(exc).__name__}: {exc}".encode(errors="replace")[:4000])
        os._exit(127)
    if child == 0:
        start_program(dict(spec, init_pid=init_pid), status_fd)
    # This process keeps no stdio: the program's output must reach EOF as soon as the program's side closes.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == child:
            os.write(status_fd, b"X%d" % status)
            os._exit(0)


if __name__ == "__main__":
    main()
