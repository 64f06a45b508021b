"""Ending a multi-process run without the gloo teardown deadlock.

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
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import logging
import sys
import time

import torch.distributed as dist

logger = logging.getLogger("grpokit")

TEARDOWN_TIMEOUT_S = 60.0


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
