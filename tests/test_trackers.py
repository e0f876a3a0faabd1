"""Experiment trackers (``run.loggers``): a real `shardwise train` run sends TensorBoard,
wandb (offline) and MLflow (a SQLite store in run.dir) the numbers of metrics.jsonl, the
resolved config and the run's summary; a resumed run continues the same tracker runs; a
tracker that fails is switched off with one warning while the run goes on; an unknown or
uninstalled logger is refused before anything starts."""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import shutil
import socket
import struct
import sys
import time

import pytest
from dist.common import TINY_QWEN3, import_optional
from dist.launcher import REPO_ROOT, run_cli

from shardwise.config import load_config
from shardwise.errors import ConfigError
from shardwise.telemetry import MetricsWriter, Tracker, read_metrics
from shardwise.telemetry import trackers as trackers_module
from shardwise.telemetry.trackers import (
    IDS_FILE,
    TensorBoardTracker,
    TrackerRun,
    _markdown_table,
    flatten,
    open_trackers,
    sample_table,
)

for _module, _extra in [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"),
                        ("sqlalchemy", "mlflow")]:  # make test installs them all (SHARDWISE_REQUIRED_MODULES)
    import_optional(_module, f"pip install 'shardwise[{_extra}]'")
event_accumulator = importlib.import_module("tensorboard.backend.event_processing.event_accumulator")
wandb_pb = importlib.import_module("wandb.proto.wandb_internal_pb2")
mlflow_tracking = importlib.import_module("mlflow.tracking")


# --- reading back what each tracker stored ----------------------------------------------

def _wandb_records(path):
    """The protobuf records of a wandb ``.wandb`` file (a LevelDB-style log: a 7-byte
    header, then 32 KiB blocks of chunks with a 7-byte header each: crc, length, type)."""
    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, (ident, magic)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _finished_records(path, wait_s: float = 30.0) -> list:
    """The records of an offline run's file once wandb has written its ``exit`` record.
    `run.finish()` returns before wandb's service process has written everything: under
    load the file was read without its history row (which appeared a moment later)."""
    deadline = time.monotonic() + wait_s
    while True:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record {wait_s:.0f} s after the run finished"
        time.sleep(0.1)


def _wandb_run(run_dir):
    """{"id", "config", "history" (step -> {key: value}), "summary"} of each offline run
    folder under run_dir/wandb, oldest first."""
    runs = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (path,) = folder.glob("run-*.wandb")
        out = {"id": None, "config": {}, "history": {}, "summary": {}}
        for record in _finished_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["id"] = record.run.run_id
                out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                row = {_item_key(i): json.loads(i.value_json) for i in record.history.item}
                out["history"][row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "summary":
                out["summary"].update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
        runs.append(out)
    return runs


def _tensorboard(run_dir):
    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0,
                                                                                          "tensors": 0})
    acc.Reload()
    return acc


def _mlflow(run_dir):
    ids = json.loads((run_dir / IDS_FILE).read_text())["mlflow"]
    assert ids["tracking_uri"] == f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    return mlflow_tracking.MlflowClient(tracking_uri=ids["tracking_uri"]), ids["run_id"]


def _series(records, key):
    return [(r["step"], r[key]) for r in records if key in r]


def _trained(records):
    """The training steps' lines (each evaluation has a line of its own)."""
    return [r for r in records if "loss" in r]


# --- a real run through every tracker ------------------------------------------------------

ARGV = ["train", str(REPO_ROOT / "examples" / "sft_arithmetic.yaml"), TINY_QWEN3, "train.global_batch_size=8",
        "train.micro_batch_size=8", "train.log_every=1", "checkpoint.every_steps=0", "checkpoint.async=false",
        "checkpoint.export_hf=false", "data.max_length=16", "run.loggers=[jsonl,tensorboard,wandb,mlflow]",
        "run.project=trackers-test"]
METRICS = ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "skipped", "peak_memory_bytes")


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """3 SFT steps with every tracker, then resumed to 4: (run_dir, metrics after 3 steps,
    metrics after 4). Each run ends with the held-out evaluation of builtin:arithmetic (its
    metrics line, and its first 16 samples to every tracker), at steps 3 and 4."""
    from shardwise.cli import main

    run_dir = tmp_path_factory.mktemp("tracked") / "sft_tiny"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("WANDB_MODE", "offline")  # no network: what a user without credentials gets too
        mp.setenv("WANDB_SILENT", "true")
        for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "WANDB_DIR"):
            mp.delenv(var, raising=False)
        assert main(ARGV + [f"run.dir={run_dir}", "train.max_steps=3"]) == 0
        first = read_metrics(run_dir)
        ids = json.loads((run_dir / IDS_FILE).read_text())
        assert main(ARGV + [f"run.dir={run_dir}", "train.max_steps=4"]) == 0  # resumes from step 3
    return run_dir, first, read_metrics(run_dir), ids


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tracked_run):
    run_dir, _, records, _ = tracked_run
    acc = _tensorboard(run_dir)
    for key in METRICS:
        got = [(e.step, e.value) for e in acc.Scalars(key)]
        want = _series(records, key)
        assert [s for s, _ in got] == [1, 2, 3, 4], key
        assert all(math.isclose(g, w, rel_tol=1e-6) for (_, g), (_, w) in zip(got, want)), (key, got, want)
    texts = {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"]}
    config = texts["config/text_summary"][-1].tensor_proto.string_val[0].decode()
    summary = texts["summary/text_summary"][-1].tensor_proto.string_val[0].decode()
    assert '"max_steps": 4' in config and '"steps": 4' in summary
    # the held-out evaluations' samples: a Markdown table at each step that evaluated
    tables = acc.Tensors("samples/text_summary")
    assert [t.step for t in tables] == [3, 4]
    rows = tables[-1].tensor_proto.string_val[0].decode().splitlines()
    assert rows[0].startswith("| step | index | sample | greedy | prompt | response | ground_truth | reward |")
    assert len(rows) == 2 + 16  # eval.samples_logged rows
    assert [(e.step, e.value) for e in acc.Scalars("val/accuracy")] == \
        [(r["step"], pytest.approx(r["val/accuracy"])) for r in records if "val/accuracy" in r]


def test_wandb_offline_run_holds_the_metrics_config_and_summary_and_resumes_by_id(tracked_run):
    run_dir, first, records, ids = tracked_run
    runs = _wandb_run(run_dir)
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"] == ids["wandb"]["id"]
    before, after = runs
    for step, metrics in [(r["step"], r) for r in _trained(first)]:
        logged = set(before["history"][step])
        assert logged == set(METRICS) if step < 3 else set(METRICS) < logged  # 3: the evaluation's too
        for key in METRICS:
            assert math.isclose(before["history"][step][key], metrics[key], rel_tol=1e-9), (step, key)
    (held_out,) = [r for r in first if "val/accuracy" in r]
    assert before["history"][3]["val/accuracy"] == held_out["val/accuracy"]
    assert before["history"][3]["samples/_type"] == "table-file" and before["history"][3]["samples/nrows"] == 16
    assert sorted(after["history"]) == [4]  # the resumed job logs only its own steps
    assert math.isclose(after["history"][4]["loss"], _trained(records)[-1]["loss"], rel_tol=1e-9)
    assert before["config"]["train"]["max_steps"] == 3 and after["config"]["train"]["max_steps"] == 4
    assert before["config"]["run"]["loggers"] == ["jsonl", "tensorboard", "wandb", "mlflow"]
    assert after["summary"]["steps"] == 4 and math.isclose(after["summary"]["final/loss"], _trained(records)[-1]["loss"])
    assert "accuracy" in after["summary"]


def test_mlflow_run_holds_the_metrics_params_and_summary_and_resumes_by_id(tracked_run):
    run_dir, _, records, ids = tracked_run
    client, run_id = _mlflow(run_dir)
    assert run_id == ids["mlflow"]["run_id"]  # the resumed job continued the same run
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "sft_tiny"
    assert client.get_experiment(run.info.experiment_id).name == "trackers-test"
    for key in METRICS:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        want = _series(records, key)
        assert [s for s, _ in got] == [1, 2, 3, 4], key
        assert all(math.isclose(g, float(w), rel_tol=1e-9) for (_, g), (_, w) in zip(got, want)), key
    params = run.data.params
    assert params["train.global_batch_size"] == "8" and params["data.source"] == "builtin:arithmetic"
    assert params["train.max_steps"] == "3"  # params keep their first value; config.json has the new one
    assert json.loads(params["run.loggers"]) == ["jsonl", "tensorboard", "wandb", "mlflow"]
    artifacts = run_dir / "mlartifacts"
    (config_json,) = artifacts.rglob("config.json")
    (summary_json,) = artifacts.rglob("summary.json")
    assert json.loads(config_json.read_text())["train"]["max_steps"] == 4
    summary = json.loads(summary_json.read_text())
    assert summary["steps"] == 4 and run.data.metrics["summary/steps"] == 4
    assert math.isclose(run.data.metrics["summary/final/loss"], _trained(records)[-1]["loss"], rel_tol=1e-9)
    for step in (3, 4):  # each held-out evaluation's first 16 samples, as in run.dir/samples
        (artifact,) = artifacts.rglob(f"samples/step_{step:07d}.json")
        on_disk = [json.loads(x) for x in (run_dir / f"samples/step_{step:07d}.jsonl").read_text().splitlines()]
        assert json.loads(artifact.read_text()) == on_disk[:16]


def test_the_rl_controller_sends_its_steps_and_summary_to_the_trackers(tmp_path):
    """`shardwise rl`: the controller (not a Ray worker) logs; the summary goes without the
    per-step history, which the trackers have as metrics; each evaluation (3 held-out
    prompts, greedy, at steps 0 and 2) its val/* and its first eval.samples_logged rows."""
    pytest.importorskip("ray", reason="shardwise rl needs ray: pip install 'shardwise[rl]'")
    run_dir = tmp_path / "grpo_tiny"
    res = run_cli(["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "--nproc", "1", f"run.dir={run_dir}",
                   "model.path=null", TINY_QWEN3, "train.global_batch_size=2", "train.micro_batch_size=8",
                   "rl.rollout.n=2", "rl.rollout.max_new_tokens=2", "train.max_steps=2", "rl.heldout_eval=false",
                   "checkpoint.export_hf=false", "checkpoint.async=false", "run.loggers=[mlflow,wandb]",
                   "eval.source=builtin:arithmetic", "eval.num_prompts=3", "eval.n=0", "eval.samples_logged=2"],
                  timeout=300, env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": None,
                                    "MLFLOW_EXPERIMENT_NAME": None, "WANDB_PROJECT": None})
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    records = [r for r in read_metrics(run_dir) if "time/eval" not in r]
    assert [r["step"] for r in records] == [1, 2]
    client, run_id = _mlflow(run_dir)
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/accuracy")) == [0, 2]
    for step in (0, 2):  # the first 2 rows of the step's samples file
        (artifact,) = (run_dir / "mlartifacts").rglob(f"step_{step:07d}.json")
        rows = [json.loads(x) for x in (run_dir / "samples" / f"step_{step:07d}.jsonl").read_text().splitlines()]
        assert len(rows) == 3 and json.loads(artifact.read_text()) == rows[:2]
    for key in ("reward/mean", "actor/pg_loss", "time/step"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert got == [(r["step"], pytest.approx(float(r[key]), rel=1e-9)) for r in records], key
    run = client.get_run(run_id)
    assert run.data.params["rl.algorithm"] == "grpo" and run.data.metrics["summary/steps"] == 2
    (summary_json,) = (run_dir / "mlartifacts").rglob("summary.json")
    assert "history" not in json.loads(summary_json.read_text())
    (wandb_run,) = _wandb_run(run_dir)
    assert sorted(wandb_run["history"]) == [0, 1, 2] and wandb_run["summary"]["steps"] == 2  # 0: the evaluation
    assert all(wandb_run["history"][s]["samples/nrows"] == 2 for s in (0, 2))
    assert wandb_run["config"]["rl"]["rollout"]["n"] == 2


SAMPLE_ROWS = [
    {"step": 3, "index": 0, "sample": 0, "greedy": True, "prompt": [{"role": "user", "content": "12+3|4\n="}],
     "response": "15", "ground_truth": "15", "reward": 1.0, "pred": "15", "data_source": "arithmetic"},
    {"step": 3, "index": 1, "sample": 0, "greedy": True, "prompt": "7+8=", "response": "16", "ground_truth": "15",
     "reward": 0.0, "pred": None, "data_source": "arithmetic", "format_ok": 1},
]


def test_sample_rows_become_a_table_of_one_type_per_column_and_go_to_every_tracker(tmp_path):
    """What `Tracker.log_samples` gets (the real trackers' tables and artifacts: `tracked_run`'s
    tests): `sample_table` unifies a column's types (wandb refuses a column of numbers and
    text), the Markdown table escapes | and line breaks, and `MetricsWriter.log_samples`
    fans the rows out at their step (a tracker without tables: the no-op default)."""
    columns, data = sample_table(SAMPLE_ROWS)
    assert columns == [*SAMPLE_ROWS[0], "format_ok"]
    assert json.loads(data[0][columns.index("prompt")]) == SAMPLE_ROWS[0]["prompt"]  # a chat prompt: its JSON
    assert [r[columns.index("pred")] for r in data] == ["15", None] and data[0][-1] is None
    mixed = sample_table([{"pred": 15}, {"pred": "x"}, {"pred": True}, {}])[1]
    assert mixed == [["15"], ["x"], ["True"], [None]]
    table = _markdown_table(SAMPLE_ROWS).splitlines()
    assert len(table) == 2 + len(SAMPLE_ROWS) and table[0].endswith("| format_ok |")
    assert r'"12+3\|4\\n="' in table[2] and "| 7+8= | 16 | 15 | 0.0 |  | arithmetic | 1 |" in table[3]

    class Samples(_Recording):
        def __init__(self):
            super().__init__()
            self.samples = []

        def log_samples(self, step, rows):
            self.samples.append((step, list(rows)))

    taker, plain = Samples(), Tracker()
    with MetricsWriter(tmp_path, enabled=True, trackers=[taker, plain]) as writer:
        writer.log_samples(3, SAMPLE_ROWS)
        writer.log_samples(4, [])  # nothing to send
    assert taker.samples == [(3, SAMPLE_ROWS)] and writer.trackers == []
    MetricsWriter(tmp_path / "off", enabled=False).log_samples(3, SAMPLE_ROWS)  # other ranks: nothing


# --- failures -----------------------------------------------------------------------------

class _Recording(Tracker):
    name = "recording"

    def __init__(self, fail_at_step: int | None = None):
        self.fail_at_step = fail_at_step
        self.steps: list[int] = []
        self.summary = None
        self.closed: list[bool] = []

    def log_metrics(self, step, metrics, walltime):
        if step == self.fail_at_step:
            raise ConnectionError("server went away")
        self.steps.append(step)

    def log_summary(self, summary):
        self.summary = dict(summary)

    def close(self, failed=False):
        self.closed.append(failed)


def test_a_failing_tracker_is_switched_off_with_one_warning_and_the_run_goes_on(tmp_path, caplog):
    broken, fine = _Recording(fail_at_step=2), _Recording()
    broken.name = "broken"
    with caplog.at_level(logging.WARNING, logger="shardwise.telemetry.metrics"), \
            MetricsWriter(tmp_path, enabled=True, trackers=[broken, fine]) as writer:
        for step in range(1, 5):
            writer.log(step, {"loss": 1.0 / step})
        writer.log_summary({"steps": 4})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert fine.steps == [1, 2, 3, 4] and fine.summary == {"steps": 4} and fine.closed == [False]
    assert broken.steps == [1] and broken.summary is None and broken.closed == [True]
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "shardwise.telemetry.metrics"]
    assert len(warnings) == 1 and "broken failed at step 2" in warnings[0] and "server went away" in warnings[0]


def test_trackers_end_their_runs_as_failed_when_the_job_raises(tmp_path):
    tracker = _Recording()
    with pytest.raises(RuntimeError), MetricsWriter(tmp_path, enabled=True, trackers=[tracker]) as writer:
        writer.log(1, {"loss": 1.0})
        raise RuntimeError("a rank died")
    assert tracker.closed == [True]


def test_a_tracker_that_cannot_start_is_left_out_with_a_warning(tmp_path, monkeypatch, caplog):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/a_file/mlflow.db")  # a file is no folder
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING, logger="shardwise.telemetry.trackers"):
        trackers = open_trackers(["jsonl", "mlflow", "tensorboard"], TrackerRun(tmp_path, "r", None, 0))
    assert [t.name for t in trackers] == ["tensorboard"]
    (warning,) = [r.getMessage() for r in caplog.records
                  if r.levelno == logging.WARNING and r.name == "shardwise.telemetry.trackers"]
    assert warning.startswith("mlflow could not start") and "metrics.jsonl" in warning
    for t in trackers:
        t.close()


@pytest.mark.parametrize("store", [
    "sqlite:////proc/self/shardwise/mlflow.db",  # a place nothing may write (root included): a read-only disk
    "sqlite:///{tmp}/a_folder",  # a folder where the SQLite file should be
    "file:///proc/self/shardwise/mlruns",  # MLflow's file store (MLflow 3 takes it with MLFLOW_ALLOW_FILE_STORE)
], ids=["sqlite-read-only", "sqlite-a-folder", "file-store-read-only"])
def test_an_mlflow_store_that_cannot_be_written_is_left_out_in_one_line_without_retries(store, tmp_path, monkeypatch,
                                                                                        caplog):
    # MLflow retries a SQLite store it cannot open 10 times over ~100 s, with a warning of
    # several lines each time: the tracker finds out itself first, and says so in one line.
    (tmp_path / "a_folder").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.replace("{tmp}", str(tmp_path)))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    with caplog.at_level(logging.WARNING):
        assert open_trackers(["mlflow"], TrackerRun(tmp_path / "run", "r", None, 0)) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith("mlflow could not start (PermissionError: its store ")
    assert "cannot be written" in warnings[0] and "the run goes on without it" in warnings[0], warnings


def test_a_wandb_folder_deleted_mid_run_is_said_in_one_line_and_the_run_goes_on(tmp_path, monkeypatch, caplog,
                                                                                 capfd):
    # wandb writes on into the deleted file without a word, and its closing lines tell the
    # user to `wandb sync` the folder that is gone.
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # its closing lines, as a user sees them
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tracker,) = open_trackers(["wandb"], TrackerRun(run_dir, "r", None, 0))
    with caplog.at_level(logging.WARNING, logger="shardwise.telemetry.metrics"), \
            MetricsWriter(run_dir, enabled=True, trackers=[tracker]) as writer:
        writer.log(1, {"loss": 1.0})
        shutil.rmtree(run_dir / "wandb")
        for step in (2, 3):
            writer.log(step, {"loss": 1.0 / step})
        writer.log_summary({"steps": 3})
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert writer.trackers == []
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("shardwise")]
    assert "wandb failed at step 2" in warning and "was deleted during the run" in warning, warning
    assert "metrics.jsonl has every step" in warning
    out, err = capfd.readouterr()
    assert "wandb sync" not in out + err, out + err


def test_wandb_without_credentials_or_wandb_mode_writes_offline_with_one_warning(tmp_path, monkeypatch, caplog):
    """A launch never stops at wandb's login prompt: no key, no WANDB_MODE -> offline."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING, logger="shardwise.telemetry.trackers"):
        (tracker,) = open_trackers(["wandb"], TrackerRun(tmp_path / "run", "r", None, 0))
    tracker.log_metrics(1, {"loss": 2.0}, walltime=1.0)
    tracker.close()
    (warning,) = [r.getMessage() for r in caplog.records
                  if r.levelno == logging.WARNING and r.name == "shardwise.telemetry.trackers"]
    assert "offline" in warning and "wandb sync" in warning
    (run,) = _wandb_run(tmp_path / "run")
    assert run["history"] == {1: {"loss": 2.0}}


def test_a_resumed_tensorboard_run_replaces_the_steps_after_its_checkpoint(tmp_path):
    """A job that crashed after logging step 4 and resumes from the checkpoint of step 2
    logs 3 and 4 again: TensorBoard shows the new values only, as metrics.jsonl does."""
    first = TensorBoardTracker(TrackerRun(tmp_path, "r", None, 0))
    for step in (1, 2, 3, 4):
        first.log_metrics(step, {"loss": float(step)}, walltime=1000.0 + step)
    first.close()
    again = TensorBoardTracker(TrackerRun(tmp_path, "r", None, 2))
    for step in (3, 4):
        again.log_metrics(step, {"loss": 10.0 * step}, walltime=2000.0 + step)
    again.close()
    assert [(e.step, e.value) for e in _tensorboard(tmp_path).Scalars("loss")] == \
        [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_flatten_joins_nested_keys():
    assert flatten({"a": {"b": 1, "c": {"d": [1]}}, "e": {}, "f": None}, ".") == \
        {"a.b": 1, "a.c.d": [1], "e": {}, "f": None}


# --- bad input: refused before anything starts ---------------------------------------------

def test_an_unknown_logger_is_refused_naming_the_key_and_the_nearest_name():
    with pytest.raises(ConfigError, match=r"run.loggers.*'wandbb' is not a valid choice.*did you mean wandb"):
        load_config(None, ["run.loggers=[jsonl,wandbb]"])


@pytest.mark.parametrize("name, module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard"),
                                          ("mlflow", "sqlalchemy")])
def test_a_logger_that_is_not_installed_is_refused_with_its_extra(name, module, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # how Python marks a module that cannot be imported
    with pytest.raises(ConfigError, match=rf"run.loggers.*'{name}' needs {module}.*pip install 'shardwise\[{name}\]'"):
        load_config(None, [f"run.loggers=[{name}]"])


def test_the_cli_refuses_an_uninstalled_logger_in_one_line_with_exit_2(tmp_path, monkeypatch, capsys):
    from shardwise.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["train", str(REPO_ROOT / "examples" / "sft_arithmetic.yaml"), f"run.dir={tmp_path / 'run'}",
                 "run.loggers=[jsonl,wandb]", "--nproc", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "run.loggers" in err[0] and "pip install 'shardwise[wandb]'" in err[0]
    assert not (tmp_path / "run").exists()


def test_an_mlflow_server_that_is_down_is_left_out_in_one_line_at_once(tmp_path, monkeypatch, caplog):
    # MLflow's client retried a refused server for 4 min 20 s before the first step (7
    # retries with backoff); the tracker tries one connection itself first.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    for key in trackers_module.MLFLOW_HTTP_BOUNDS:
        monkeypatch.delenv(key, raising=False)
    with caplog.at_level(logging.WARNING):
        assert open_trackers(["mlflow"], TrackerRun(tmp_path / "run", "r", None, 0)) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"mlflow could not start (ConnectionError: its server 127.0.0.1:{port} "), warnings
    assert "the run goes on without it" in warnings[0]
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # set only for a tracker that started
