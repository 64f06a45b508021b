"""ConfigError, the error of an option whose value cannot work, and how several of them are reported at once;
SaveError, the error of a file of the run that could not be written, and `writing`, which raises it.

It lives apart from grpokit.config so that the light modules that check values (grpokit.imports, the registries)
and the writers (checkpoints, metrics, the report) can raise these without importing the config.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message names the damaged file and what to do."""


class ConfigError(ValueError):
    """An option has a value that cannot work; the message says which and how to fix it."""


class SaveError(OSError):
    """A file of the run could not be written (a full disk, a read-only or vanished folder); the message names the
    path, the free space there and what was left as it was."""


def problems_message(problems: list[str]) -> str:
    """One problem as it is; several as a numbered heading and one line each."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the options:\n" + "\n".join(f"  - {p}" for p in problems)


def free_space(path: str | Path) -> str:
    """The free space of the filesystem holding `path` (or its nearest existing parent), e.g. '1.20 GiB'."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB"
    except OSError:
        return "unknown"


def is_write_error(exc: BaseException) -> bool:
    """Whether `exc` is how a writer reports a failed write: an OSError (ENOSPC, EROFS, ENOENT, ...), torch.save's
    RuntimeError (a full disk reads 'unexpected pos') or safetensors' SafetensorError ('Error while serializing')."""
    from safetensors import SafetensorError

    return isinstance(exc, (OSError, RuntimeError, SafetensorError))


def save_error(what: str, path: str | Path, reason: str, kept: str) -> SaveError:
    """The SaveError of a failed write: `what` to `path` failed because of `reason` (the writer's error);
    `kept` says what was left as it was and what to do."""
    return SaveError(f"{what} to {path} failed: {reason} ({free_space(path)} free there). {kept}")


@contextmanager
def writing(what: str, path: str | Path, kept: str) -> Iterator[None]:
    """Turn a writer's failure inside the block into save_error(what, path, exc, kept), so that every write of a
    run fails the same way: a SaveError naming the path and the free space, never a raw torch or safetensors error."""
    try:
        yield
    except SaveError:
        raise
    except Exception as exc:  # noqa: BLE001 - only write errors are converted, the rest re-raised as they are
        if not is_write_error(exc):
            raise
        raise save_error(what, path, f"{type(exc).__name__}: {exc}", kept) from exc


def write_text(path: str | Path, text: str, what: str, kept: str) -> None:
    """Write a small text file of the run (a report, a summary, a state file) whole or not at all: into a
    temporary file beside it, renamed over it; a failed write leaves the previous file and no temporary one, and
    raises writing()'s SaveError."""
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    with writing(what, path, kept):
        try:
            partial.write_text(text, encoding="utf-8")
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
