"""I/O reliability, written as the attacks are: full disks at every write, two runs on one output_dir, a
launcher killed under its workers, and checkpoints whose state or manifest was damaged.

Full disks are real where this process may mount a small tmpfs (root), and injected (the writer raises what it
raises on ENOSPC: torch's RuntimeError "unexpected pos", safetensors' SafetensorError, OSError 28) everywhere,
so the tests also run in CI without root.
"""

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors import SafetensorError
from transformers import TrainerCallback

import grpokit.observe.metrics as metrics_module
from grpokit.config import ConfigError
from grpokit.observe.metrics import MetricsWriter
from grpokit.train.checkpointer import MANIFEST_FILE, STATE_FILE, CheckpointError, OutputLock, damage
from grpokit.trainer import GRPOTrainer, SaveError
from helpers import frac_a, read_jsonl
from procs import kill_tree, wait_for
from test_trainer import config

ROOT = Path(__file__).resolve().parent.parent
TRAIN_TINY = str(ROOT / "tests" / "scripts" / "train_tiny.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
ENOSPC = OSError(errno.ENOSPC, "No space left on device")
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 49344 vs 49296"


def checkpoint_run(tmp_path, tiny_model_dir, prompt_dataset, **options):
    """A 4-step run with checkpoints at steps 2 and 4; returns its output_dir."""
    args = config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, **options)
    GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset).train()
    return Path(args.output_dir)


def resume(tmp_path, tiny_model_dir, prompt_dataset, target=True, **options):
    args = config(tmp_path, **{"max_steps": 6, "save_strategy": "steps", "save_steps": 2, **options})
    return GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset).train(resume_from_checkpoint=target)


def files_of(folder):
    return {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}


# ---------------------------------------------------------------- 8. full disks, for real (root: a small tmpfs)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs mounted at tmp_path/disk; skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the injected-ENOSPC tests below cover the same paths")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                             text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


def fill(disk, leave=0):
    """Fill the filesystem of `disk` until `leave` bytes are free (a ballast file)."""
    free = shutil.disk_usage(disk).free - leave
    with open(disk / "ballast", "ab") as handle:
        try:
            while free > 0:
                free -= handle.write(b"\0" * min(free, 1 << 16))
                handle.flush()
        except OSError:
            pass


class FillAfterSave(TrainerCallback):
    """Fills the disk after the first checkpoint, leaving room for metrics rows but not for another checkpoint."""

    def __init__(self, disk):
        self.disk = disk

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 1:
            fill(self.disk, leave=64 << 10)


def test_a_checkpoint_on_a_full_disk_raises_save_error_removes_staging_and_keeps_the_last(
        small_disk, tiny_model_dir, prompt_dataset):
    out = small_disk / "out"
    args = config(small_disk, max_steps=3, save_strategy="steps", save_steps=1)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset, callbacks=[FillAfterSave(small_disk)])
    with pytest.raises(SaveError, match=rf"Saving checkpoint-2 to {out}/\.checkpoint-2\.tmp failed: "
                                        r"\w+Error: .* \(0\.00 GiB free there\)\. Earlier checkpoints are unchanged"):
        trainer.train()
    assert not list(out.glob(".checkpoint-*")) and damage(out / "checkpoint-1") is None
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    (small_disk / "ballast").unlink()
    assert resume(small_disk, tiny_model_dir, prompt_dataset, max_steps=3).global_step == 3


def test_a_final_save_on_a_full_disk_raises_save_error_and_keeps_the_previous_model(
        small_disk, tiny_model_dir, prompt_dataset):
    out = checkpoint_run(small_disk, tiny_model_dir, prompt_dataset, save_total_limit=1)
    before = files_of(out)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(small_disk, max_steps=6), prompt_dataset)
    fill(small_disk, leave=20 << 10)  # room for config.json, not for the weights: safetensors' own error
    with pytest.raises(SaveError, match=rf"Saving the model to {out} failed: SafetensorError: Error while serializing: "
                                        r".*\(0\.00 GiB free there\)\. The files already in that folder are unchanged"):
        trainer.save_model(str(out))
    assert files_of(out) == before and not list(small_disk.glob(".*staging"))


def test_a_metrics_row_on_a_full_disk_raises_save_error_and_leaves_whole_rows(small_disk):
    writer = MetricsWriter(str(small_disk), [], {})
    writer.log({"step": 1, "loss": 0.5})
    fill(small_disk)
    before = (small_disk / "metrics.jsonl").read_bytes()
    with pytest.raises(SaveError, match=rf"Appending rows to {small_disk}/metrics.jsonl failed: OSError: \[Errno 28\]"):
        writer.log({"step": 2, "text": "x" * 20000})  # longer than what is left of the file's page
    assert (small_disk / "metrics.jsonl").read_bytes() == before


# ---------------------------------------------------------------- 8. full disks, injected (any user)


def torch_save_failing_on(name, monkeypatch):
    """torch.save as on a full disk for files called `name`: part of the file is written, then torch's error."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if Path(f).name == name:
            Path(f).write_bytes(b"PK\x03\x04" * 1000)
            raise RuntimeError(TORCH_FULL_DISK)
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


@pytest.mark.parametrize("name", ["optimizer.pt", "rng_state_0.pt"])
def test_torch_save_failing_in_a_checkpoint_is_a_save_error_and_the_run_resumes(
        name, tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    args = config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset)
    out = Path(args.output_dir)
    original = trainer.checkpointer.save

    def fail_the_second(step, parts):
        if step == 4:
            torch_save_failing_on(name, monkeypatch)
        return original(step, parts)

    monkeypatch.setattr(trainer.checkpointer, "save", fail_the_second)
    with pytest.raises(SaveError, match=rf"Saving checkpoint-4 to {out}/\.checkpoint-4\.tmp failed: RuntimeError: "
                                        r".*unexpected pos .* GiB free there\)"):
        trainer.train()
    monkeypatch.undo()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".checkpoint", "checkpoint"))) == ["checkpoint-2"]
    assert damage(out / "checkpoint-2") is None
    assert resume(tmp_path, tiny_model_dir, prompt_dataset).global_step == 6


def test_safetensors_failing_in_the_final_save_is_a_save_error(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    out = checkpoint_run(tmp_path, tiny_model_dir, prompt_dataset)
    before = files_of(out)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=6), prompt_dataset)
    real = trainer._write_model

    def disk_full(folder):
        real(folder)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(trainer, "_write_model", disk_full)
    with pytest.raises(SaveError, match=rf"Saving the model to {out} failed: SafetensorError: Error while serializing"):
        trainer.save_model(str(out))
    assert files_of(out) == before and not list(tmp_path.glob("out/.*staging"))


def test_a_folder_in_the_way_of_the_final_model_replaces_no_file(tmp_path, tiny_model_dir, prompt_dataset):
    out = checkpoint_run(tmp_path, tiny_model_dir, prompt_dataset)
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").mkdir()
    before = files_of(out)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=6), prompt_dataset)
    with pytest.raises(SaveError, match=rf"Saving the model to {out} failed: IsADirectoryError: .*tokenizer.json"):
        trainer.save_model(str(out))
    assert files_of(out) == before and not list(tmp_path.glob("out/.*staging"))


def test_the_best_model_on_a_full_disk_keeps_the_previous_best(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    args = config(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval/reward",
                  greater_is_better=False)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset, eval_dataset=prompt_dataset.select(range(4)))
    state, best = trainer.state, Path(args.output_dir) / "best"
    trainer.checkpointer.track_best({"step": 1, "eval/reward": 0.5}, state, trainer._write_model)
    before = files_of(best)
    def disk_full(folder):
        raise ENOSPC

    monkeypatch.setattr(trainer, "_write_model", disk_full)
    with pytest.raises(SaveError, match=rf"Saving the best model to {best} failed: OSError: \[Errno 28\].* The "
                                        "previous best model is unchanged"):
        trainer.checkpointer.track_best({"step": 2, "eval/reward": 0.1}, state, trainer._write_model)
    assert files_of(best) == before and json.loads(before["best.json"]) == {"step": 0, "eval/reward": 0.5}
    assert state.best_metric == 0.5 and not (best.parent / ".best-staging").exists()


def test_a_failed_append_leaves_no_half_row(tmp_path, monkeypatch):
    writer = MetricsWriter(str(tmp_path), [], {})
    writer.log({"step": 1, "loss": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real = os.write

    def half_then_full(fd, data):
        real(fd, bytes(data[: len(data) // 2]))
        raise ENOSPC

    monkeypatch.setattr(metrics_module.os, "write", half_then_full)
    with pytest.raises(SaveError, match=rf"Appending rows to {tmp_path}/metrics.jsonl failed: .*No space left on device "
                                        r"\(.* GiB free there\)\. The rows already in it are unchanged"):
        writer.log({"step": 2, "loss": 0.25})
    with pytest.raises(SaveError, match="completions.jsonl failed"):
        writer.log_completions([{"step": 2, "completion": "a"}])
    assert (tmp_path / "metrics.jsonl").read_bytes() == before and not (tmp_path / "completions.jsonl").read_bytes()


def test_a_read_only_or_vanished_folder_is_a_save_error(tmp_path):
    from grpokit.train.hub import push_model

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "taken").write_text("a file where the copy's folder would go")
    with pytest.raises(SaveError, match=rf"Copying the model to {tmp_path}/taken/copy failed: .*Errno"):
        push_model(str(tmp_path / "run"), str(tmp_path / "taken" / "copy"))
    writer = MetricsWriter(str(tmp_path / "gone"), [], {})
    with pytest.raises(SaveError, match=r"gone/metrics.jsonl failed: FileNotFoundError"):
        writer.log({"step": 1})


def test_the_report_and_the_summary_on_a_full_disk_are_save_errors(tmp_path, monkeypatch, capsys):
    from grpokit.cli import main
    from grpokit.demo.run import write_summary
    from grpokit.observe.report import write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.5, "loss": 0.1}) + "\n")
    (tmp_path / "report.html").write_text("the earlier report")
    (tmp_path / "summary.json").write_text("{}")
    real = Path.write_text

    def disk_full(path, *args, **kwargs):
        if path.name.endswith(".tmp"):
            real(path, "half a page")
            raise ENOSPC
        return real(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(SaveError, match=rf"Writing the report to {tmp_path}/report.html failed: OSError: \[Errno 28\]"):
        write_report(tmp_path)
    assert main(["report", str(tmp_path)]) == 1 and "grpo report: error: Writing the report to" in capsys.readouterr().err
    with pytest.raises(SaveError, match=rf"Writing the summary to {tmp_path}/summary.json failed: .* GiB free there"):
        write_summary(tmp_path, {"reward": float("nan")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "report.html", "summary.json"]
    assert (tmp_path / "report.html").read_text() == "the earlier report" and (tmp_path / "summary.json").read_text() == "{}"


# ---------------------------------------------------------------- 10. the manifest covers every file


def edit(path, old, new):
    text = path.read_text()
    assert old in text, (old, text[:300])
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("flip, named", [
    (lambda c: edit(c / STATE_FILE, '"global_step": 4,', '"global_step": 5,'), f"{STATE_FILE} changed since it was saved"),
    (lambda c: edit(c / STATE_FILE, '"index": 8', '"index": 9'), f"{STATE_FILE} changed since it was saved"),
    (lambda c: edit(c / MANIFEST_FILE, '"sha256": "', '"sha256": "0'), f"{MANIFEST_FILE} is damaged: its checksum"),
    (lambda c: (c / MANIFEST_FILE).unlink(), f"{MANIFEST_FILE} is missing"),
    (lambda c: shutil.copy(c.parent / "checkpoint-2" / MANIFEST_FILE, c / MANIFEST_FILE),
     f"{MANIFEST_FILE} is the manifest of checkpoint-2, not of checkpoint-4"),
    (lambda c: shutil.copy(c / "rng_state_0.pt", c / "rng_state_1.pt"), "rng_state_1.pt was not part of the saved"),
], ids=["global_step", "sampler_index", "manifest_hash", "manifest_missing", "manifest_of_another", "unlisted_file"])
def test_a_damaged_state_or_manifest_is_named_and_fallback_takes_the_older(
        flip, named, tmp_path, tiny_model_dir, prompt_dataset, caplog):
    out = checkpoint_run(tmp_path, tiny_model_dir, prompt_dataset)
    flip(out / "checkpoint-4")
    with pytest.raises(CheckpointError, match=rf"Cannot resume from {out}/checkpoint-4: {out}/checkpoint-4/{named}"):
        resume(tmp_path, tiny_model_dir, prompt_dataset)
    assert resume(tmp_path, tiny_model_dir, prompt_dataset, resume_fallback=True).global_step == 6
    assert f"Resuming from {out / 'checkpoint-2'}" in caplog.text
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def to_old_layout(checkpoint, with_manifest):
    """A checkpoint as written before manifest.json: the list of every file but the state file inside
    trainer_state.json (with_manifest), or no list at all (the oldest)."""
    files = json.loads((checkpoint / MANIFEST_FILE).read_text())["files"]
    (checkpoint / MANIFEST_FILE).unlink()
    state = json.loads((checkpoint / STATE_FILE).read_text())
    del state["manifest"]
    if with_manifest:
        state["manifest"] = {name: digest for name, digest in files.items() if name != STATE_FILE}
    (checkpoint / STATE_FILE).write_text(json.dumps(state, indent=2))


@pytest.mark.parametrize("with_manifest", [True, False], ids=["state_manifest", "no_manifest"])
def test_checkpoints_of_the_old_layout_still_resume(with_manifest, tmp_path, tiny_model_dir, prompt_dataset, caplog):
    import logging

    out = checkpoint_run(tmp_path, tiny_model_dir, prompt_dataset)
    to_old_layout(out / "checkpoint-4", with_manifest)
    with caplog.at_level(logging.INFO, logger="grpokit"):
        assert resume(tmp_path, tiny_model_dir, prompt_dataset).global_step == 6
    assert f"Resumed from {out / 'checkpoint-4'} at step 4." in caplog.text
    assert (out / "checkpoint-6" / MANIFEST_FILE).is_file()


def test_an_old_layout_checkpoint_with_a_changed_file_is_still_named(tmp_path, tiny_model_dir, prompt_dataset):
    out = checkpoint_run(tmp_path, tiny_model_dir, prompt_dataset)
    to_old_layout(out / "checkpoint-4", with_manifest=True)
    data = bytearray((out / "checkpoint-4" / "optimizer.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "checkpoint-4" / "optimizer.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="optimizer.pt changed since it was saved"):
        resume(tmp_path, tiny_model_dir, prompt_dataset)


# ---------------------------------------------------------------- 9. one run per output_dir


HOLD_LOCK = """
import sys, time
from grpokit.train.checkpointer import OutputLock
lock = OutputLock(sys.argv[1])
assert lock.acquire() is None
print("held", flush=True)
time.sleep(120)
"""


def test_the_output_lock_refuses_a_second_holder_and_names_the_first(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env=ENV, start_new_session=True)
    try:
        assert holder.stdout.readline() == "held\n"
        problem = OutputLock(tmp_path).acquire()
        assert problem is not None and f"in use by another training run (pid {holder.pid} on host " in problem
        assert f"kill {holder.pid}" in problem
        holder.kill()  # a holder killed with -9 leaves no lock behind
        holder.wait(timeout=30)
        lock = OutputLock(tmp_path)
        assert lock.acquire() is None
        assert json.loads((tmp_path / ".grpokit.lock").read_text())["pid"] == os.getpid()
        assert "pid" in OutputLock(tmp_path).acquire()  # even within one process, a second holder is refused
        lock.release()
        assert not (tmp_path / ".grpokit.lock").exists()  # a finished run leaves nothing in output_dir
        assert OutputLock(tmp_path).acquire() is None
    finally:
        kill_tree(holder.pid)
        holder.wait(timeout=30)


def test_deleting_the_lock_file_does_not_let_a_second_run_in(tmp_path):
    first = OutputLock(tmp_path)
    assert first.acquire() is None
    (tmp_path / ".grpokit.lock").unlink()  # "a stale lock file": the lock is on the folder, not on this file
    problem = OutputLock(tmp_path).acquire()
    assert problem is not None and "in use by another training run (pid unknown" in problem
    first.release()


def test_where_a_folder_cannot_be_flocked_the_lock_file_is(tmp_path, monkeypatch):
    import fcntl
    import stat

    import grpokit.train.output_lock as output_lock

    real = fcntl.flock

    def nfs_flock(fd, operation):  # NFS: POSIX-lock emulation refuses a folder opened read-only
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, operation)

    monkeypatch.setattr(output_lock.fcntl, "flock", nfs_flock)
    first = OutputLock(tmp_path)
    assert first.acquire() is None
    assert f"pid {os.getpid()}" in OutputLock(tmp_path).acquire()
    first.release()
    assert (tmp_path / ".grpokit.lock").is_file()  # the locked file stays: unlinking it would split later locks
    assert OutputLock(tmp_path).acquire() is None


@pytest.mark.slow
def test_a_resume_is_refused_while_the_first_run_trains(tmp_path, tiny_model_dir, prompt_dataset):
    out = tmp_path / "out"
    command = [sys.executable, TRAIN_TINY, tiny_model_dir, str(out), "--max_steps", "50", "--save_strategy", "steps",
               "--save_steps", "1", "--reward-sleep", "0.2"]
    first = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                             start_new_session=True)
    try:
        wait_for(lambda: (out / "checkpoint-1" / STATE_FILE).is_file(), first)
        args = config(tmp_path, max_steps=50, save_strategy="steps", save_steps=1)
        second = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset)
        with pytest.raises(ConfigError, match=rf"in use by another training run \(pid {first.pid} on host "):
            second.train(resume_from_checkpoint=True)
        first.send_signal(signal.SIGTERM)  # saves a checkpoint, releases the lock
        _, stderr = first.communicate(timeout=120)
        assert first.returncode == 0, stderr[-3000:]
    finally:
        kill_tree(first.pid)
    steps = [row["step"] for row in read_jsonl(out / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1))  # no row twice: the refused run wrote nothing
    assert second.train(resume_from_checkpoint=True).global_step == 50


@pytest.mark.slow
def test_killing_the_accelerate_launcher_stops_its_workers(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
               TRAIN_TINY, tiny_model_dir, str(out), "--per_device_train_batch_size", "8", "--max_steps", "400",
               "--reward-sleep", "0.2", "--log_completions", "false"]
    with open(tmp_path / "log", "w") as log:
        launcher = subprocess.Popen(command, stdout=log, stderr=log, env=ENV, start_new_session=True)
    workers = []
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().endswith("\n"),
                 launcher, timeout=180, what="the first step")
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if TRAIN_TINY in p.cmdline()]
        assert len(workers) == 2
        launcher.kill()
        launcher.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=240)
        assert not alive, (tmp_path / "log").read_text()[-3000:]
    finally:
        for process in [launcher, *workers]:
            kill_tree(process.pid)
    log = (tmp_path / "log").read_text()
    assert "The launcher of this worker" in log and "checkpoint saved" in log, log[-3000:]
    last = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    assert last < 400 and (out / f"checkpoint-{last}" / MANIFEST_FILE).is_file()  # stopped early, with a checkpoint


FAIL_ON_RANK_1 = """
import os, sys
sys.path[:0] = [os.environ["TESTS"]]
import torch
import grpokit.train.checkpointer as checkpointer
real = checkpointer.RandomState.save

def save(self, folder):  # process 1's disk is full at step 2: torch's error, after part of the file
    if self.rank == 1 and folder.name == ".checkpoint-2.tmp":
        (folder / "rng_state_1.pt").write_bytes(b"PK")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 49344 vs 49296")
    return real(self, folder)

checkpointer.RandomState.save = save
import runpy
runpy.run_path(os.environ["TRAIN_TINY"], run_name="__main__")
"""


@pytest.mark.slow
def test_a_checkpoint_write_failing_on_one_process_is_the_same_save_error_on_both(tmp_path, tiny_model_dir):
    from procs import run_tree

    script = tmp_path / "fail_on_rank_1.py"
    script.write_text(FAIL_ON_RANK_1)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
               str(script), tiny_model_dir, str(out), "--per_device_train_batch_size", "8", "--max_steps", "3",
               "--save_strategy", "steps", "--save_steps", "1", "--log_completions", "false"]
    env = dict(ENV, TESTS=str(ROOT / "tests"), TRAIN_TINY=TRAIN_TINY)
    result = run_tree(command, 300, env=env)  # a process left waiting in a barrier would time out here
    assert result.returncode != 0
    message = rf"SaveError: Saving checkpoint-2 to {out}/\.checkpoint-2\.tmp failed: RuntimeError: .*unexpected pos " \
              r"49344 vs 49296 \(process 1\) \(.* GiB free there\)"
    assert len(re.findall(message, result.stderr)) == 2, result.stderr[-3000:]  # raised by both processes
    assert sorted(p.name for p in out.glob("*checkpoint*")) == ["checkpoint-1"] and damage(out / "checkpoint-1") is None
