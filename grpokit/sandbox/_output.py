"""The run's pipes: stdin fed in, stdout/stderr read incrementally and capped at `max_output_bytes`."""

from __future__ import annotations

import os
import selectors
import subprocess

_READ_CHUNK = 65536


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
