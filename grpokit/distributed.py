"""Ending a multi-process run: without the gloo teardown deadlock, and with the launcher.

The deadlock (seen about twice in 70 two-process CPU runs): the main thread destroys the gloo process group and,
holding the GIL, joins gloo's worker threads in ~ProcessGroupGloo, while one worker is still releasing the last
reference to a finished collective's tensors. A tensor created in Python owns a Python object, so freeing it needs
the GIL: the worker waits for the main thread, the main thread for the worker, forever. The window opens when a
collective (e.g. `wait_for_everyone` at the end of training) returns just before the group is destroyed: gloo's
barrier holds the earlier collectives until its own worker lets go of them.

`close_process_group` removes the window: every collective is drained by two barriers (the second waits until
the first one's worker has let go of everything earlier), garbage is collected while the workers can still take
the GIL, and only then is the group destroyed. As a last resort, a watchdog that needs no GIL (faulthandler)
dumps every thread's stack and ends the process if the teardown still blocks, so a run can never hang at exit.

`die_with_launcher` ends a worker whose launcher is gone. torchrun (and `accelerate launch`, which runs it) starts
each worker in a session of its own, so a SIGKILL of the launcher leaves its workers training to the end of the
run, writing into output_dir beside any run started meanwhile. A thread in each worker notices when its parent
changes (the launcher died and the worker was re-parented) and stops the worker as SIGTERM does: after the
current step, with a checkpoint. A worker still alive LAUNCHER_GRACE_S later prints its stacks and exits.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

logger = logging.getLogger("grpokit")

TEARDOWN_TIMEOUT_S = 60.0
LAUNCHER_GRACE_S = 300.0  # a step, a checkpoint and the teardown, after the launcher died
_launcher_watch: threading.Thread | None = None


def close_process_group(timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
    """Drain and destroy the default process group; a no-op when none exists. Call it on every rank, after the
    last collective and before the interpreter exits (GRPOTrainer registers it with atexit after train())."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    try:
        for _ in range(2):
            if dist.get_backend() == "gloo":  # a barrier that gives up when a peer has died
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s / 2))
            else:
                dist.barrier()
        gc.collect()
        time.sleep(0.05)  # the GIL is free: a worker finishing a release gets it now, not inside the join
        dist.destroy_process_group()
    except Exception as exc:  # a peer already gone: nothing left to drain
        logger.warning("Process-group teardown skipped the drain: %s", exc)
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        faulthandler.cancel_dump_traceback_later()


def die_with_launcher(grace_s: float = LAUNCHER_GRACE_S, poll_s: float = 1.0) -> threading.Thread | None:
    """In a worker started by torchrun (TORCHELASTIC_RUN_ID is set), start the thread that stops this process when
    its launcher dies (once per process; later calls return the same thread); None elsewhere: a script started
    from a shell must outlive the shell (nohup) as it always did."""
    global _launcher_watch
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    if _launcher_watch is None:
        _launcher_watch = threading.Thread(target=_watch_launcher, args=(os.getppid(), grace_s, poll_s),
                                           name="grpokit-launcher-watch", daemon=True)
        _launcher_watch.start()
    return _launcher_watch


def _watch_launcher(launcher: int, grace_s: float, poll_s: float) -> None:
    """Wait until this process's parent is no longer `launcher`, then SIGTERM this process (the trainer stops after
    the step with a checkpoint; outside train() the process ends at once); if it is still alive `grace_s` later,
    dump every thread's stack and exit with status 1."""
    while os.getppid() == launcher:
        time.sleep(poll_s)
    logger.warning("The launcher of this worker (pid %d) is gone: stopping this worker (SIGTERM: a checkpoint after "
                   "the current step).", launcher)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"grpokit: this worker did not stop within {grace_s:.0f} s of its launcher's death; exiting.",
          file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr)
    os._exit(1)
