"""Telemetry: metrics file, TensorBoard fallback, progress bar, phase timings, plots."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwise.telemetry import (
    MetricsWriter,
    PhaseTimer,
    Progress,
    peak_memory_bytes,
    plot_metrics,
    read_metrics,
)
from shardwise.telemetry.metrics import _tensorboard_writer_class
from shardwise.telemetry.plots import _series, val_panels
from shardwise.telemetry.progress import format_postfix_value

SRC = Path(__file__).resolve().parents[1] / "src"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TENSORBOARD_IMPORTABLE = _tensorboard_writer_class() is not None


def _strict_json(line: str) -> dict:
    """json.loads that rejects NaN/Infinity literals, as any non-Python JSON reader would."""

    def reject(name: str) -> None:
        raise AssertionError(f"non-JSON constant {name} in {line!r}")

    return json.loads(line, parse_constant=reject)


def _raw_lines(path: Path) -> list[dict]:
    return [_strict_json(line) for line in path.read_text().splitlines()]


# --- MetricsWriter -------------------------------------------------------------------


def test_each_log_call_appends_one_line_with_step_values_and_time(tmp_path):
    t0 = time.time()
    with MetricsWriter(tmp_path, enabled=True) as writer:
        writer.log(1, {"loss": 2.5, "lr": 3e-4})
        writer.log(2, {"loss": 2.25, "tokens": 4096, "phase": "train", "skipped": False})
        writer.log(3, {})
    t1 = time.time()

    lines = _raw_lines(tmp_path / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if k != "time"} for r in lines] == [
        {"step": 1, "loss": 2.5, "lr": 3e-4},
        {"step": 2, "loss": 2.25, "tokens": 4096, "phase": "train", "skipped": False},
        {"step": 3},
    ]
    assert all(t0 <= r["time"] <= t1 for r in lines)
    assert list(lines[0]) == ["step", "loss", "lr", "time"]  # step first, time last
    assert read_metrics(tmp_path / "metrics.jsonl") == lines
    assert read_metrics(tmp_path) == lines  # a run directory works too


def test_torch_and_numpy_scalars_are_written_as_python_numbers(tmp_path):
    with MetricsWriter(tmp_path, enabled=True) as writer:
        writer.log(
            np.int64(5),
            {
                "t_float": torch.tensor(1.5),
                "t_bf16": torch.tensor(0.25, dtype=torch.bfloat16),
                "t_int": torch.tensor([7]),
                "t_grad": torch.tensor(2.0, requires_grad=True) * 2,
                "np_float32": np.float32(0.5),
                "np_float64": np.float64(0.125),
                "np_int": np.int32(-3),
                "np_bool": np.bool_(True),
            },
        )
    line = (tmp_path / "metrics.jsonl").read_text()
    record = _strict_json(line)
    assert record["step"] == 5 and type(record["step"]) is int
    expected = {
        "t_float": 1.5,
        "t_bf16": 0.25,
        "t_int": 7,
        "t_grad": 4.0,
        "np_float32": 0.5,
        "np_float64": 0.125,
        "np_int": -3,
        "np_bool": True,
    }
    for key, value in expected.items():
        assert record[key] == value, key
        assert type(record[key]) is type(value), key


def test_a_tensor_with_many_elements_is_rejected_by_name(tmp_path):
    with MetricsWriter(tmp_path, enabled=True) as writer:
        with pytest.raises(TypeError, match="'grad_norm'.*shape \\(3,\\)"):
            writer.log(1, {"grad_norm": torch.ones(3)})
        with pytest.raises(TypeError, match="'cfg'.*dict"):
            writer.log(1, {"cfg": {"a": 1}})
        with pytest.raises(ValueError, match="'time' is reserved"):
            writer.log(1, {"time": 1.0})
        with pytest.raises(TypeError):
            writer.log(1.5, {"loss": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # a rejected call writes nothing


def test_non_finite_floats_are_strings_in_the_file_and_floats_when_read(tmp_path):
    with MetricsWriter(tmp_path, enabled=True) as writer:
        writer.log(
            1,
            {
                "nan": float("nan"),
                "inf": math.inf,
                "ninf": -math.inf,
                "t_nan": torch.tensor(float("nan")),
                "np_inf": np.float32("inf"),
                "fine": 1.0,
            },
        )
    raw = _raw_lines(tmp_path / "metrics.jsonl")[0]  # strict: no NaN/Infinity literals
    assert (raw["nan"], raw["inf"], raw["ninf"], raw["t_nan"], raw["np_inf"]) == (
        "nan",
        "inf",
        "-inf",
        "nan",
        "inf",
    )
    back = read_metrics(tmp_path)[0]
    assert math.isnan(back["nan"]) and math.isnan(back["t_nan"])
    assert back["inf"] == math.inf and back["np_inf"] == math.inf
    assert back["ninf"] == -math.inf
    assert back["fine"] == 1.0


def test_a_disabled_writer_creates_no_file_and_ignores_bad_values(tmp_path):
    run_dir = tmp_path / "run"
    with MetricsWriter(run_dir, enabled=False) as writer:
        writer.log(1, {"loss": 1.0})
        writer.log(2, {"loss": torch.ones(3)})  # not even read on other ranks
    assert not run_dir.exists()
    assert writer.tensorboard_dir is None


def test_lines_survive_a_process_that_dies_without_close(tmp_path):
    script = textwrap.dedent(
        f"""
        import os
        from shardwise.telemetry import MetricsWriter
        writer = MetricsWriter({str(tmp_path)!r}, enabled=True)
        for step in range(3):
            writer.log(step, {{"loss": 1.0 / (step + 1)}})
        os._exit(1)  # no close, no interpreter shutdown: buffers are not flushed for us
        """
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert result.returncode == 1, result.stderr.decode()
    records = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]


def test_a_second_writer_appends_to_the_same_file(tmp_path):
    with MetricsWriter(tmp_path, enabled=True) as writer:
        writer.log(1, {"loss": 3.0})
    with MetricsWriter(tmp_path, enabled=True) as writer:  # resumed run
        writer.log(2, {"loss": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_log_after_close_raises(tmp_path):
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.close()
    writer.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        writer.log(1, {"loss": 1.0})


def test_read_metrics_drops_a_truncated_last_line_and_rejects_a_bad_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert read_metrics(path) == [{"step": 1, "loss": 2.0}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=":2: not a JSON line"):
        read_metrics(path)


@pytest.mark.skipif(TENSORBOARD_IMPORTABLE, reason="tensorboard is installed here")
def test_without_tensorboard_only_the_jsonl_is_written(tmp_path):
    with pytest.raises(ImportError):
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    with MetricsWriter(tmp_path, enabled=True, tensorboard=True) as writer:
        writer.log(1, {"loss": 1.0})
    assert writer.tensorboard_dir is None
    assert not (tmp_path / "tensorboard").exists()
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.0]


class _RecordingSummaryWriter:
    """Stands in for SummaryWriter: records what MetricsWriter sends to TensorBoard."""

    instances: list[_RecordingSummaryWriter] = []

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.scalars: list[tuple] = []
        self.closed = False
        self.instances.append(self)

    def add_scalar(self, tag, value, global_step, walltime):
        self.scalars.append((tag, value, global_step, walltime))

    def close(self):
        self.closed = True


def test_tensorboard_gets_numbers_only_with_step_and_the_same_time(tmp_path, monkeypatch):
    # Replaces shardwise's own lookup (not the import system) so this path runs everywhere.
    monkeypatch.setattr(
        "shardwise.telemetry.metrics._tensorboard_writer_class", lambda: _RecordingSummaryWriter
    )
    _RecordingSummaryWriter.instances.clear()
    with MetricsWriter(tmp_path, enabled=True, tensorboard=True) as writer:
        writer.log(7, {"loss": torch.tensor(1.5), "phase": "train", "ok": True, "g": math.inf})
    (tb,) = _RecordingSummaryWriter.instances
    assert tb.log_dir == str(tmp_path / "tensorboard") and tb.closed
    assert writer.tensorboard_dir == tmp_path / "tensorboard"
    line_time = read_metrics(tmp_path)[0]["time"]
    assert tb.scalars == [("loss", 1.5, 7, line_time), ("g", math.inf, 7, line_time)]

    _RecordingSummaryWriter.instances.clear()
    with MetricsWriter(tmp_path / "off", enabled=True, tensorboard=False) as writer:
        writer.log(1, {"loss": 1.0})
    assert _RecordingSummaryWriter.instances == [] and writer.tensorboard_dir is None


@pytest.mark.skipif(not TENSORBOARD_IMPORTABLE, reason="tensorboard is not installed")
def test_with_tensorboard_scalars_go_to_an_event_file(tmp_path):
    with MetricsWriter(tmp_path, enabled=True, tensorboard=True) as writer:
        writer.log(1, {"loss": 1.0, "phase": "train"})
    assert writer.tensorboard_dir == tmp_path / "tensorboard"
    events = list(writer.tensorboard_dir.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    with MetricsWriter(tmp_path / "off", enabled=True, tensorboard=False) as writer:
        writer.log(1, {"loss": 1.0})
    assert not (tmp_path / "off" / "tensorboard").exists()


# --- Progress, memory, timings -------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (2.3456789, "2.346"),
        (0.0, "0"),
        (3e-4, "3.00e-04"),
        (0.0012, "0.0012"),
        (2e-5, "2.00e-05"),
        (12345.6, "12.3k"),
        (-12345.6, "-12.3k"),
        (2.5e6, "2.50M"),
        (7, "7"),
        (1_234_567, "1.23M"),
        (float("nan"), "nan"),
        (torch.tensor(1.5), "1.5"),
        (np.float32(0.25), "0.25"),
        ("warmup", "warmup"),
    ],
)
def test_postfix_values_are_compact(value, text):
    assert format_postfix_value(value) == text


def test_progress_bar_goes_to_stderr_with_postfix_when_enabled(capfd):
    with Progress(total=10, enabled=True, desc="train") as bar:
        bar.update(1, loss=2.3456789, **{"tok/s": 12345.6})
        bar.update(2)
        assert bar.n == 3
    out, err = capfd.readouterr()
    assert out == ""
    assert "train" in err
    assert "3/10" in err
    assert "loss=2.346" in err and "tok/s=12.3k" in err


def test_progress_bar_prints_nothing_when_disabled(capfd):
    with Progress(total=10, enabled=False, desc="train") as bar:
        bar.update(5, loss=1.0)
        assert bar.n == 0
    assert capfd.readouterr() == ("", "")


def test_progress_bar_resumes_from_initial(capfd):
    with Progress(total=100, enabled=True, desc="train", initial=40) as bar:
        bar.update(10)
        assert bar.n == 50
    assert "50/100" in capfd.readouterr().err


def test_cpu_peak_memory_is_in_bytes_and_covers_a_large_allocation():
    big = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB, touched by ones()
    peak = peak_memory_bytes("cpu")
    assert peak >= big.numel() * big.element_size()
    assert peak_memory_bytes(torch.device("cpu")) >= peak


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_counts_tensor_bytes():
    torch.cuda.reset_peak_memory_stats()
    x = torch.empty(16 * 1024 * 1024, dtype=torch.float32, device="cuda")  # 64 MiB
    assert peak_memory_bytes("cuda") >= x.numel() * 4
    assert peak_memory_bytes(torch.cuda.current_device()) >= x.numel() * 4


def test_phase_timer_sums_repeats_per_phase_and_resets():
    timings = PhaseTimer()
    for _ in range(2):
        with timings("generate"):
            time.sleep(0.02)
    with timings("train"):
        with timings("backward"):  # different phases may nest
            time.sleep(0.01)
    result = timings.as_dict()
    assert set(result) == {"time/generate", "time/train", "time/backward"}
    assert result["time/generate"] >= 0.04
    assert 0.01 <= result["time/backward"] <= result["time/train"]
    assert result["time/train"] < result["time/generate"]
    timings.reset()
    assert timings.as_dict() == {}


def test_phase_timer_counts_a_phase_that_raises_and_refuses_self_nesting():
    timings = PhaseTimer()
    with pytest.raises(KeyError):
        with timings("load"):
            time.sleep(0.01)
            raise KeyError("boom")
    assert timings.as_dict()["time/load"] >= 0.01
    with pytest.raises(ValueError, match="already being timed"):
        with timings("step"):
            with timings("step"):
                pass
    with timings("step"):  # the failed nesting left no stale state
        pass


# --- plots ---------------------------------------------------------------------------


def _write_run(run_dir: Path) -> Path:
    with MetricsWriter(run_dir, enabled=True) as writer:
        for step in range(1, 6):
            writer.log(step, {"loss": 3.0 / step, "lr": 1e-4 * step})
            if step % 2 == 0:
                writer.log(step, {"eval/loss": 3.5 / step})
    return run_dir / "metrics.jsonl"


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG IHDR chunk."""
    header = path.read_bytes()[:24]
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def test_plot_metrics_writes_a_png_with_one_row_per_panel(tmp_path):
    metrics = _write_run(tmp_path / "run")
    one = plot_metrics(metrics, tmp_path / "one.png", [("loss", ["loss", "eval/loss"])])
    two = plot_metrics(
        metrics, tmp_path / "plots" / "two.png", [("loss", ["loss"]), ("learning rate", ["lr"])]
    )
    assert two == tmp_path / "plots" / "two.png"
    for png in (one, two):
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size > 1000
    assert _png_size(two)[1] > _png_size(one)[1] * 1.5


def test_plot_metrics_skips_absent_keys_with_a_warning(tmp_path):
    metrics = _write_run(tmp_path / "run")
    with pytest.warns(UserWarning, match="'los' \\(did you mean 'loss'\\?\\)"):
        out = plot_metrics(metrics, tmp_path / "p.png", [("loss", ["loss", "los"]), ("x", ["x"])])
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_plot_metrics_raises_when_no_requested_key_appears(tmp_path):
    metrics = _write_run(tmp_path / "run")
    with pytest.raises(ValueError, match="'grad_norm'.*present: eval/loss, loss, lr"):
        plot_metrics(metrics, tmp_path / "p.png", [("grad", ["grad_norm"])])
    assert not (tmp_path / "p.png").exists()
    with pytest.raises(ValueError, match="at least one panel"):
        plot_metrics(metrics, tmp_path / "p.png", [])


def test_plotted_series_is_sorted_by_step_and_a_relogged_step_keeps_the_last_value():
    records = [
        {"step": 1, "loss": 3.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 1.0, "phase": "x"},
        {"step": 2, "loss": 2.5},  # resumed from step 1's checkpoint
        {"step": 3, "loss": float("nan")},
        {"step": 4, "phase": "eval"},
    ]
    steps, values = _series(records, "loss")
    assert steps == [1, 2, 3]
    assert values[:2] == [3.0, 2.5] and math.isnan(values[2])
    assert _series(records, "phase") is None  # strings are not plotted


def test_val_panels_group_the_sparse_validation_keys_and_plot_beside_the_training_ones(tmp_path):
    with MetricsWriter(tmp_path, enabled=True) as writer:
        for step in range(0, 5):
            if step:
                writer.log(step, {"loss": 3.0 / step})
            if step % 2 == 0:  # the evaluations: their own lines, at steps 0, 2, 4
                writer.log(step, {"val/loss": 2.0 + step, "val/ppl": math.exp(2.0 + step), "val/accuracy": 0.1,
                                  "val/pass@16": 0.5, "val/pass@2": 0.3, "val/reward_mean": 0.2,
                                  "val/gsm8k/accuracy": 0.2, "val/math/accuracy": 0.0, "val/gsm8k/pass@2": 0.1,
                                  "time/eval": 1.5})
    records = read_metrics(tmp_path)
    panels = val_panels(records)
    assert panels == [("validation loss", ["val/loss"]), ("validation perplexity", ["val/ppl"]),
                      ("validation accuracy", ["val/accuracy", "val/pass@2", "val/pass@16"]),
                      ("validation reward", ["val/reward_mean"]),
                      ("validation accuracy by data source", ["val/gsm8k/accuracy", "val/math/accuracy"])]
    assert val_panels([r for r in records if "loss" in r]) == []
    assert _series(records, "val/loss") == ([0, 2, 4], [2.0, 4.0, 6.0])  # training lines have no val key
    alone = plot_metrics(tmp_path, tmp_path / "train.png", [("loss", ["loss"])])
    both = plot_metrics(tmp_path, tmp_path / "both.png", [("loss", ["loss"]), *panels])
    assert _png_size(both)[1] > _png_size(alone)[1] * 3


def test_libraries_output_goes_to_the_log_file_and_shardwise_stays_on_the_console(tmp_path, capsys, monkeypatch):
    """Issue 30, item 10, the controller's side (the workers': the rl CLI tests): within
    ThirdPartyToFile a library's log line (even from a logger the library left without
    handlers, as ray.init does) and a library's warning go to the file; shardwise's log
    lines and warnings stay on the console; everything is put back after."""
    import logging
    import warnings

    import torch.distributed as dist

    from shardwise.telemetry.logs import ThirdPartyToFile

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # the command line configures none (pytest does)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    path = tmp_path / "logs" / "controller.log"
    libraries = [logging.getLogger(name) for name in ("ray", "transformers")]
    before = [(lg.propagate, list(lg.handlers)) for lg in libraries]
    last_resort, showwarning = logging.lastResort, warnings.showwarning
    with ThirdPartyToFile(path):
        warnings.simplefilter("always")
        ray_log = logging.getLogger("ray._private.worker")
        logging.getLogger("ray").propagate = False  # what Ray's import does (and ray.init clears its handlers)
        ray_log.warning("ray says hello")
        logging.getLogger("transformers.modeling_utils").warning("transformers says hello")
        logging.getLogger("shardwise.jobs.rl").warning("shardwise says hello")
        _ = dist.reduce_op.SUM  # torch's FutureWarning
        assert len(read_metrics(metrics)) == 1  # shardwise's warning: a truncated last line
    err, text = capsys.readouterr().err, path.read_text()
    assert "ray says hello" in text and "transformers says hello" in text and "reduce_op" in text, text
    assert "shardwise says hello" in err and "dropping truncated last line" in err, err
    assert not any(x in err for x in ("ray says", "transformers says", "reduce_op")), err
    assert "shardwise says" not in text and "truncated" not in text, text
    assert logging.lastResort is last_resort and warnings.showwarning is showwarning
    assert [(lg.propagate, list(lg.handlers)) for lg in libraries] == before


def test_heartbeat_speaks_only_while_work_is_slow(capsys):
    """Data preparation that may be slow by size (one huge conversation) says it is working;
    quick preparation prints nothing (issue 30)."""
    from shardwise.telemetry.progress import Heartbeat

    with Heartbeat("data", 3, enabled=True, delay=60) as beat:
        beat.done = 3
    with Heartbeat("data", 3, enabled=False, delay=0) as beat:
        time.sleep(0.05)
    assert capsys.readouterr().err == ""
    with Heartbeat("data", 3, enabled=True, delay=0, interval=60) as beat:
        end = time.monotonic() + 30
        while not beat._spoke and time.monotonic() < end:  # the thread's first line, after `delay`
            time.sleep(0.01)
        beat.done = 3
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("shardwise: data: 0 of 3 prepared (") and lines[-1].startswith("shardwise: data: 3 of 3")
