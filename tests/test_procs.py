"""The test harness's process-tree kill: a worker in a session of its own (as torchrun starts them) dies too."""

import os
import sys
import time

import pytest

from procs import TreeTimeout, run_tree

# A launcher that starts a worker in its own session and waits for it, like torchrun; both sleep forever.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
open(sys.argv[1], "w").write(str(worker.pid))
worker.wait()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_timeout_kills_a_worker_in_its_own_session(tmp_path):
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    with pytest.raises(TreeTimeout, match="did not finish within 3 s"):
        run_tree([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=3)
    assert time.monotonic() - started < 30
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker), "the worker outlived the harness's kill"


def test_a_finished_command_returns_its_output():
    result = run_tree([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def test_close_process_group_drains_and_destroys(tmp_path):
    import torch
    import torch.distributed as dist

    from grpokit.distributed import close_process_group

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    handle = dist.all_reduce(torch.ones(3), async_op=True)  # a collective whose Python tensor is dropped at once
    del handle
    close_process_group(timeout_s=30)
    assert not dist.is_initialized()
    close_process_group()  # a second call (atexit after the CLI's own) is a no-op
