"""report_to through accelerate's trackers, checked by reading back what the real trackers wrote.

tensorboard: the event file read with tensorboard's EventAccumulator; wandb: an offline run's .wandb file read
record by record; trackio (when installed): its local SQLite store. Each must hold exactly metrics.jsonl's numbers
at metrics.jsonl's steps. Nothing here replaces a tracker with a fake; the custom tracker is a real
GeneralTracker subclass, as a user would write one.
"""

import json
import math
import os
import struct
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from accelerate.tracking import GeneralTracker

import grpokit.train.learner as trainer_module
from grpokit.config import ConfigError, GRPOConfig
from grpokit.observe.metrics import MetricsWriter, check_sinks
from grpokit.trainer import GRPOTrainer
from helpers import frac_a, read_jsonl
from procs import run_tree


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"), max_steps=3, logging_steps=2, num_generations=4,
        per_device_train_batch_size=8, max_completion_length=6, learning_rate=1e-2, disable_tqdm=True, seed=0,
        beta=0.04, log_completions=False,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def numbers(row):
    """What a tracker should get from a metrics.jsonl row: its numbers but the step."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) if isinstance(a, float) and math.isnan(a) else a == b


class RecordingTracker(GeneralTracker):
    """A user's tracker: keeps what it is given."""

    name = "recording"
    requires_logging_directory = False
    main_process_only = False

    def __init__(self):
        super().__init__()
        self.calls, self.config, self.logged = [], None, []

    @property
    def tracker(self):
        return self

    def start(self):
        self.calls.append("start")

    def store_init_configuration(self, values):
        self.calls.append("config")
        self.config = values

    def log(self, values, step=None, **kwargs):
        self.logged.append((dict(values), step))

    def finish(self):
        self.calls.append("finish")


# ------------------------------------------------------------------ tensorboard


def read_tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_scalars_are_metrics_jsonl(tmp_path, tiny_model_dir, prompt_dataset):
    pytest.importorskip("tensorboard")
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, report_to=["tensorboard"]), prompt_dataset)
    trainer.train()
    out = tmp_path / "out"
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 3]
    run_dir = out / "runs" / "out"  # OUTPUT_DIR/runs/<run_name>, run_name defaulting to the folder's name
    scalars = read_tensorboard(run_dir)
    expected = {}
    for row in rows:
        for key, value in numbers(row).items():
            expected.setdefault(key, []).append((row["step"], float(np.float32(value))))  # tensorboard keeps fp32
    assert set(scalars) == set(expected) and "loss" in scalars and "rewards/frac_a/mean" in scalars
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert all(same(v, w) for (_, v), (_, w) in zip(got, points)), (tag, got, points)
    # the settings, through accelerate's store_init_configuration: an hparams.yml beside the events
    (hparams,) = run_dir.glob("*/hparams.yml")
    assert "learning_rate: 0.01" in hparams.read_text()


# ------------------------------------------------------------------ wandb (offline)

WANDB_LOG_HEADER = (b":W&B", 0xBEE1)  # leveldb log format with wandb's 7-byte file header
BLOCK = 32768


def wandb_records(path):
    """The protobuf Records of a .wandb file (wandb's LevelDB-log format: 32 KiB blocks of chunks, each with a
    7-byte header crc32c:u32 length:u16 type:u8; type 1 = whole record, 2/3/4 = first/middle/last part)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == WANDB_LOG_HEADER, "not a .wandb file this reader knows"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the end of the block
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            parts = chunk
        else:
            parts += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def history_value(item):
    if item.value_json:
        return json.loads(item.value_json)
    field = item.WhichOneof("value")
    return getattr(item, field) if field and field != "none" else None


def read_wandb_run(wandb_dir):
    # run.finish() returns once the wandb service has the run's records, not once it wrote them: shutting the
    # service down (what a process exit does) is what makes the offline file complete.
    import wandb

    wandb.teardown()
    (path,) = Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")
    history, run, config = {}, None, {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): history_value(i) for i in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    return history, run, config


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb-files"
    wandb_dir.mkdir()
    for key, value in {
        "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
        "WANDB_CACHE_DIR": str(wandb_dir / "cache"), "WANDB_DATA_DIR": str(wandb_dir / "data"),
        "WANDB_CONSOLE": "off", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return wandb_dir


def test_wandb_offline_history_is_metrics_jsonl(tmp_path, tiny_model_dir, prompt_dataset, wandb_offline):
    args = config(tmp_path, report_to=["wandb"], run_name="tiny-run")
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset, eval_dataset=prompt_dataset.select(range(2)))
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 3, 3]  # the eval row is logged at the last step
    history, run, run_config = read_wandb_run(wandb_offline)
    assert sorted(history) == [2, 3]
    for row in rows:  # the eval row joins the last step's history row
        logged = history[row["step"]]
        for key, value in numbers(row).items():
            assert key in logged and same(float(logged[key]), float(value)), (row["step"], key, logged.get(key), value)
    logged_keys = {k for h in history.values() for k in h if not k.startswith("_")}
    assert logged_keys == {k for row in rows for k in numbers(row)}
    assert (run.display_name, run.project) == ("tiny-run", "grpokit")
    assert run_config["learning_rate"] == 0.01 and run_config["run_name"] == "tiny-run"


# ------------------------------------------------------------------ a user's tracker, missing packages


def test_custom_tracker_gets_every_row(tmp_path, tiny_model_dir, prompt_dataset):
    tracker = RecordingTracker()
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, report_to=[tracker]), prompt_dataset)
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert tracker.calls == ["start", "config", "finish"]
    assert tracker.logged == [(numbers(row), row["step"]) for row in rows]
    assert tracker.config["learning_rate"] == 0.01 and tracker.config["output_dir"] == str(tmp_path / "out")
    assert all(v is None or isinstance(v, (bool, int, float, str)) for v in tracker.config.values())
    json.dumps(tracker.config)  # serialisable, the tracker object in report_to included (as text)


@pytest.mark.parametrize("name,modules", [("wandb", ["wandb"]), ("tensorboard", ["tensorboard", "tensorboardX"]),
                                          ("trackio", ["trackio"])])
def test_missing_tracker_package_fails_before_the_model_loads(name, modules, tmp_path, tiny_model_dir,
                                                              prompt_dataset, monkeypatch):
    for module in modules:  # None in sys.modules: find_spec answers None and `import` fails, as when not installed
        monkeypatch.setitem(sys.modules, module, None)

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded before the missing tracker was reported")

    monkeypatch.setattr(trainer_module, "load_policy", forbidden)
    with pytest.raises(ConfigError, match=f"report_to includes '{name}' but it is not installed: pip install {name}$"):
        GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, report_to=[name]), prompt_dataset)


def test_check_sinks_rejects_what_is_not_a_tracker():
    with pytest.raises(ConfigError, match="'mlflow' is not a tracker grpokit knows; choose one of: tensorboard, "):
        check_sinks(["mlflow"])
    with pytest.raises(ConfigError, match="neither a tracker name"):
        check_sinks([42])
    check_sinks([RecordingTracker()])


@pytest.mark.parametrize("report_to, message", [
    (["mlflow"], "report_to entry 'mlflow' is not a tracker grpokit knows; choose one of: tensorboard, trackio, wandb,"),
    ([42], "report_to entry 42 is neither a tracker name nor a tracker object"),
    ({"wandb": 1}, "report_to={'wandb': 1} should be a list of tracker names"),
    (["trackio"], "report_to includes 'trackio' but it is not installed: pip install trackio"),
])
def test_report_to_is_checked_once_when_the_config_is_built(report_to, message, monkeypatch):
    """One check (grpokit.observe.trackers.report_to_problems), one error type, for the config and for check_sinks."""
    monkeypatch.setitem(sys.modules, "trackio", None)  # find_spec answers None, as when it is not installed
    with pytest.raises(ConfigError) as from_config:
        GRPOConfig(report_to=report_to)
    assert message in str(from_config.value)
    if isinstance(report_to, list):
        with pytest.raises(ConfigError) as from_check:
            check_sinks(report_to)
        assert str(from_check.value) == str(from_config.value)


def test_every_report_to_problem_is_named_at_once():
    with pytest.raises(ConfigError) as info:
        GRPOConfig(report_to=["mlflow", 42])
    assert str(info.value).startswith("2 problems in the options:\n  - report_to entry 'mlflow'")


# ------------------------------------------------------------------ values that are not numbers


def test_values_that_are_not_numbers_reach_metrics_jsonl_only(tmp_path):
    pytest.importorskip("tensorboard")
    recording = RecordingTracker()
    settings = {"learning_rate": 0.1, "report_to": ["tensorboard", recording], "kwargs": {"a": [1, 2]},
                "func": frac_a, "none": None}
    writer = MetricsWriter(str(tmp_path), ["tensorboard", recording], settings, run_name="named")
    row = {"step": 1, "loss": torch.tensor(0.5), "kl": np.float32(0.25), "reward": float("nan"), "note": "text",
           "missing": None, "flag": True, "count": 3}
    clean = writer.log(row)
    writer.log({"step": 2, "loss": 0.75})
    writer.close()
    writer.close()  # a second close does nothing
    assert clean == {**row, "loss": 0.5, "kl": 0.25, "reward": clean["reward"]} and math.isnan(clean["reward"])
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["note"] == "text"  # metrics.jsonl keeps every value
    first, step = recording.logged[0]
    assert step == 1 and set(first) == {"loss", "kl", "reward", "flag", "count"} and first["flag"] == 1
    assert recording.config == {"learning_rate": 0.1, "report_to": json.dumps(["tensorboard", str(recording)]),
                                "kwargs": '{"a": [1, 2]}', "func": str(frac_a), "none": None}
    scalars = read_tensorboard(tmp_path / "runs" / "named")  # run_name names the tensorboard folder
    assert set(scalars) == {"loss", "kl", "reward", "flag", "count"}
    assert scalars["loss"] == [(1, 0.5), (2, 0.75)] and math.isnan(scalars["reward"][0][1])


# ------------------------------------------------------------------ trackio (when installed)

TRACKIO_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from grpokit.observe.metrics import MetricsWriter
    from trackio.sqlite_storage import SQLiteStorage

    out = sys.argv[1]
    os.makedirs(out)
    writer = MetricsWriter(out, ["trackio"], {"learning_rate": 0.1, "kwargs": {"a": 1}}, run_name="tiny-run")
    rows = [{"step": 1, "loss": 0.5, "reward": float("nan"), "note": "text", "missing": None},
            {"step": 3, "loss": 0.25, "reward": 1.0}]
    for row in rows:
        writer.log(row)
    writer.close()
    logs = SQLiteStorage.get_logs("grpokit", "tiny-run")
    print("LOGS", json.dumps([{k: v for k, v in log.items() if k in ("step", "loss", "reward", "note", "missing")}
                      for log in logs]))
""")


def test_trackio_logs_are_metrics_jsonl(tmp_path):
    pytest.importorskip("trackio")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    env.pop("TRACKIO_PROJECT", None)
    env.pop("TRACKIO_SPACE_ID", None)
    done = run_tree([sys.executable, "-c", TRACKIO_SCRIPT, str(tmp_path / "out")], timeout=120, env=env,
                    cwd=str(Path(__file__).resolve().parents[1]))
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("LOGS ")]  # trackio prints too
    logs = json.loads(line[len("LOGS "):])
    assert [log["step"] for log in logs] == [1, 3]
    assert [log["loss"] for log in logs] == [0.5, 0.25]
    assert math.isnan(logs[0]["reward"]) and logs[1]["reward"] == 1.0
    assert all("note" not in log and "missing" not in log for log in logs)


def test_resumed_run_replaces_the_interrupted_runs_tensorboard_points(tmp_path, tiny_model_dir, prompt_dataset):
    pytest.importorskip("tensorboard")
    args = config(tmp_path, logging_steps=1, save_strategy="steps", save_steps=2, report_to=["tensorboard"])
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()  # logs 1, 2, 3; checkpoint at 2
    out = tmp_path / "out"
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    scalars = read_tensorboard(out / "runs" / "out")
    for key in ("loss", "reward", "learning_rate"):  # step 3 once: the first run's step 3 purged, not doubled
        assert scalars[key] == [(r["step"], float(np.float32(r[key]))) for r in rows], key
