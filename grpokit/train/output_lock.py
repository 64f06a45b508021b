"""The output_dir lock: one training run per output_dir (`OutputLock`, held by grpokit.train.checkpointer's
`Checkpointer.holding_output_dir`)."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from contextlib import suppress
from pathlib import Path

LOCK_FILE = ".grpokit.lock"


class OutputLock:
    """An exclusive flock on output_dir itself, held by a run's main process while it trains, so that a second run
    on the same folder (a --resume started while the first still trains) is refused instead of interleaving its
    checkpoints and metrics rows with the first's. The kernel drops a flock when the process holding it ends,
    however it ends, so a killed run never leaves a lock in the way, and there is no lock file whose deletion
    would let a second run in: OUTPUT_DIR/.grpokit.lock, there while the lock is held, only names the holder (pid,
    host, start time) for the refusal. Where a folder cannot be flocked (NFS emulates flock with POSIX locks, which need a file open for
    writing), that file is locked instead."""

    def __init__(self, output_dir: str | Path) -> None:
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock; None when taken, else why not (the holder, what to do)."""
        try:
            self.fd = self._locked()
        except BlockingIOError:
            return self.refusal()
        except OSError as exc:
            return f"output_dir {str(self.folder)!r} cannot be locked for this run ({exc.strerror})."
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:  # who holds it, for the refusal's message only: a full disk must not stop the run here
            self.path.write_text(json.dumps(holder))
        except OSError:
            pass
        return None

    def _locked(self) -> int:
        """A descriptor holding the flock: of the folder, else of the lock file; BlockingIOError when it is held."""
        try:
            return _flock(os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY))
        except OSError as exc:
            if isinstance(exc, BlockingIOError):
                raise
        return _flock(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644))

    def refusal(self) -> str:
        """The message for a run that found the lock held."""
        try:
            holder = json.loads(self.path.read_text())
            pid, host, since = holder["pid"], holder["host"], holder["since"]
        except (OSError, ValueError, TypeError, KeyError):
            pid, host, since = "unknown", "unknown", "unknown"
        return (f"output_dir {str(self.folder)!r} is in use by another training run (pid {pid} on host {host}, "
                f"since {since}): two runs in one folder would interleave their checkpoints and metrics. Wait for "
                f"that run to end, or stop it (`kill {pid}` on {host} saves a checkpoint and stops it; then resume), "
                "or choose another output_dir.")

    def release(self) -> None:
        """Drop the lock (closing the only descriptor drops the flock) and, when the lock was on the folder, the
        holder file, so a finished run leaves nothing behind; a locked lock file stays: unlinking it could let two
        later runs lock two different files."""
        if self.fd is None:
            return
        if stat.S_ISDIR(os.fstat(self.fd).st_mode):
            with suppress(OSError):
                self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None


def _flock(fd: int) -> int:
    """`fd`, holding an exclusive flock (without waiting); closed when the lock cannot be taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd
