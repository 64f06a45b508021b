"""The sandbox's init process: prepares the isolation, starts the untrusted program, reports how it ended.

Run by `grpokit.sandbox` as ``python -I -S _boot.py SPEC_JSON``, usually as pid 1 of fresh
network/pid/mount namespaces made by ``unshare``. It uses only the standard library and imports nothing from
grpokit, because it runs before any isolation exists and with the launcher's privileges.

Steps, in order:
1. Write b"B" to the status pipe (proves the launcher got this far).
2. When asked (mount namespace present): remount every mount point read-only, then mount a size-capped tmpfs
   over the working directory and copy the program into it. The host copy of the directory stays empty.
3. Fork. The child sets the resource limits, drops to the unprivileged uid/gid (setgroups([]), setgid, setuid),
   sets no_new_privs, and execs the interpreter on the program. If anything before the exec fails, the child
   writes b"E" + message and exits 127.
4. The parent (this process, still privileged, never signalled by the child's uid) reaps every child that
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
SIGKILL = 9

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
