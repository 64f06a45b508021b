"""Per-run uids, unique machine-wide: run k of those in flight runs as `SandboxConfig.uid_base + k`.

A slot is an flock held on a file in SLOT_LOCK_DIR, so two processes (two DDP ranks, two trainers) never hand
out the same uid while it is in use: RLIMIT_NPROC then counts only that run's processes, and one run can never
signal another.
"""

from __future__ import annotations

import os
import threading

from grpokit.sandbox._config import UID_SLOTS

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
        for slot in range(UID_SLOTS):
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
        raise OSError(f"no free sandbox uid slot ({UID_SLOTS} in use)")

    def release(self, slot: int) -> None:
        with self._lock:
            fd = self._held.pop(slot, None)
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops its lock

_SLOTS = _UidSlots()
