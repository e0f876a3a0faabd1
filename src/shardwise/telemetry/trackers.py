"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``run.loggers`` names them (`shardwise.registry.TRACKERS`); `MetricsWriter` feeds each the
same numbers it writes to the JSON-lines file. A tracker receives, from rank 0 (the
controller in RL) only:

- the resolved config once at the start (`Tracker.log_config`): TensorBoard a text panel,
  wandb its run config, MLflow flattened params (``train.lr``) plus a ``config.json``
  artifact;
- every logged step's numeric metrics, with their step and wall time (`Tracker.log_metrics`);
- the run's summary at the end (`Tracker.log_summary`): TensorBoard a text panel, wandb
  its run summary (flattened, ``final/loss``), MLflow a ``summary.json`` artifact and each
  number as a metric ``summary/<key>``;
- an evaluation's first ``eval.samples_logged`` samples (prompt, response, ground truth,
  reward, ...: `Tracker.log_samples`): TensorBoard a Markdown table in the text panel
  ``samples`` at that step, wandb a Table ``samples``, MLflow an artifact
  ``samples/step_XXXXXXX.json``.

Where they write, with nothing set: ``run.dir/tensorboard/``; ``run.dir/wandb/`` (online
when wandb has credentials, ``WANDB_API_KEY`` or ``wandb login``; offline otherwise, or as
``WANDB_MODE`` says); MLflow ``sqlite:///<run.dir>/mlflow.db`` with artifacts in
``run.dir/mlartifacts/``, or the server / store of ``MLFLOW_TRACKING_URI`` (a server that
does not accept a connection within `SERVER_PROBE_S` leaves MLflow out at once, and MLflow's
retries during the run are bounded: `MLFLOW_HTTP_BOUNDS`). A resumed job
continues the same wandb and MLflow runs: their ids are kept in ``run.dir/trackers.json``.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import json
import logging
import os
import re
import socket
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.registry import TRACKERS

__all__ = ["IDS_FILE", "Tracker", "TrackerRun", "flatten", "open_trackers", "sample_table", "samples_artifact"]

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
"""In run.dir: the wandb run id and the MLflow run id (with its tracking URI) of the run,
so that a resumed job continues them."""


@dataclass(frozen=True)
class TrackerRun:
    """The run a tracker records: where, under which name, and whether it continues."""

    run_dir: Path
    name: str
    """The run's name in wandb and MLflow (``run.name``, default the run folder's name)."""
    project: str | None
    """wandb project / MLflow experiment (``run.project``); None: the tool's environment
    variable (``WANDB_PROJECT``, ``MLFLOW_EXPERIMENT_NAME``), else ``shardwise``."""
    after_step: int | None
    """The step the job starts after: > 0 for a resumed job, which continues the tracker
    runs recorded in `IDS_FILE` (and TensorBoard drops its events of later steps)."""

    @property
    def resumed(self) -> bool:
        return bool(self.after_step)


class Tracker:
    """One experiment tracker of a run. Every method may raise: `MetricsWriter` switches a
    tracker that raised off (one warning) and the run goes on with the others."""

    name = ""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved config (nested dicts of JSON values), once at the start."""

    def log_metrics(self, step: int, metrics: Mapping[str, float], walltime: float) -> None:
        """One step's numbers (non-finite floats included); `walltime` in unix seconds."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (nested dicts of JSON values), once at the end."""

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Samples of the evaluation at `step` (one dict per answer: prompt, response,
        ground_truth, reward, ...; see `shardwise.engine.evaluate`); trackers without
        tables or text ignore them."""

    def close(self, failed: bool = False) -> None:
        """Flush and end the run; `failed`: the job is ending with an error."""


def open_trackers(names: Sequence[str], run: TrackerRun) -> list[Tracker]:
    """The trackers of `names` (``jsonl``, the file itself, is none of them), started. One
    that cannot start (no network, a server that refuses) is left out with a warning: a
    tracker never stops a run."""
    trackers = []
    for name in dict.fromkeys(names):
        try:
            tracker = TRACKERS.get(name)(run)
        except Exception as exc:  # noqa: BLE001 - whatever the tool raises, the run goes on
            log.warning("%s could not start (%s: %s); the run goes on without it (metrics.jsonl has every step)",
                        name, type(exc).__name__, exc)
            continue
        if tracker is not None:
            trackers.append(tracker)
    return trackers


def flatten(tree: Mapping[str, Any], sep: str, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a<sep>b": 1, "c": [1, 2]}``: nested mappings
    joined into one level of keys; other values (lists included) kept as they are."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep, name + sep))
        else:
            out[name] = value
    return out


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_text(tree: Mapping[str, Any]) -> str:
    """JSON as a Markdown code block (TensorBoard's text panel renders Markdown)."""
    return "\n".join("    " + line for line in json.dumps(tree, indent=2, default=str).splitlines())


def sample_table(rows: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, data) of sample rows: the columns are every key met, in order of first
    appearance. A cell is the row's value when a string, a number or a bool, its JSON text
    otherwise (a chat prompt's list of messages), None when the row has none; a column whose
    values are of more than one of those kinds holds them all as text (a table column has
    one type)."""
    columns = list(dict.fromkeys(k for row in rows for k in row))

    def cell(value: Any) -> Any:
        if value is None or isinstance(value, (str, int, float, bool)):
            return value
        return json.dumps(value, default=str, ensure_ascii=False)

    def kind(value: Any) -> str:
        return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else "text"

    data = [[cell(row.get(c)) for c in columns] for row in rows]
    for j in range(len(columns)):
        if len({kind(r[j]) for r in data if r[j] is not None}) > 1:
            for r in data:
                r[j] = None if r[j] is None else str(r[j])
    return columns, data


def _markdown_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table (TensorBoard's text panel renders it); a cell's ``|``
    is escaped and its line breaks become <br>."""
    columns, data = sample_table(rows)

    def esc(value: Any) -> str:
        return ("" if value is None else str(value)).replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "<br>").replace("\n", "<br>")

    lines = ["| " + " | ".join(esc(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(esc(v) for v in row) + " |" for row in data]
    return "\n".join(lines)


def samples_artifact(step: int) -> str:
    """The artifact path of an evaluation's samples in MLflow: ``samples/step_0000012.json``."""
    return f"samples/step_{step:07d}.json"


def _saved_ids(run_dir: Path) -> dict[str, Any]:
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _save_ids(run_dir: Path, tracker: str, ids: dict[str, Any]) -> None:
    saved = _saved_ids(run_dir)
    saved[tracker] = ids
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / (IDS_FILE + ".tmp")
    tmp.write_text(json.dumps(saved, indent=2))
    os.replace(tmp, run_dir / IDS_FILE)


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@TRACKERS.register("jsonl", missing=list, extra=None)
def _jsonl(run: TrackerRun) -> None:
    """No tracker: ``metrics.jsonl`` is written by `MetricsWriter` itself, listed in
    run.loggers or not."""


def tensorboard_writer_class() -> type | None:
    """`torch.utils.tensorboard.SummaryWriter`, or None when the tensorboard package is absent."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # torch's module imports the `tensorboard` package at import time
        return None
    return SummaryWriter


@TRACKERS.register("tensorboard", missing=lambda: _missing("tensorboard"), extra="tensorboard")
class TensorBoardTracker(Tracker):
    """Scalars to event files in ``run.dir/tensorboard/``; the config and the summary as
    text panels. A resumed job purges the events of steps after its checkpoint."""

    name = "tensorboard"

    def __init__(self, run: TrackerRun, writer_class: type | None = None):
        writer_class = writer_class or tensorboard_writer_class()
        if writer_class is None:
            raise ImportError("tensorboard is not installed (pip install 'shardwise[tensorboard]')")
        self.log_dir = run.run_dir / "tensorboard"
        kwargs = {"purge_step": run.after_step + 1} if run.resumed else {}
        self._tb = writer_class(log_dir=str(self.log_dir), **kwargs)

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._tb.add_text("config", _as_text(config))

    def log_metrics(self, step: int, metrics: Mapping[str, float], walltime: float) -> None:
        for key, value in metrics.items():
            self._tb.add_scalar(key, value, global_step=step, walltime=walltime)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._tb.add_text("summary", _as_text(summary))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self._tb.add_text("samples", _markdown_table(rows), global_step=step)

    def close(self, failed: bool = False) -> None:
        self._tb.close()


def _wandb_mode(wandb: Any) -> str | None:
    """None when ``WANDB_MODE`` is set (wandb reads it); else online with credentials,
    offline without (a launch never stops at wandb's login prompt)."""
    if os.environ.get("WANDB_MODE"):
        return None
    if wandb.login(prompt=False, verify=False):
        return "online"
    log.warning("wandb: no credentials (WANDB_API_KEY or `wandb login`), so the run is written offline "
                "under run.dir/wandb/; `wandb sync` uploads it. Set WANDB_MODE to choose.")
    return "offline"


@TRACKERS.register("wandb", missing=lambda: _missing("wandb"), extra="wandb")
class WandbTracker(Tracker):
    """A Weights & Biases run in ``run.dir/wandb/`` (see the module docstring for its mode)."""

    name = "wandb"

    def __init__(self, run: TrackerRun):
        import wandb

        saved = _saved_ids(run.run_dir).get("wandb", {}) if run.resumed else {}
        run_id = saved.get("id") or uuid.uuid4().hex[:8]
        # a resumed job continues its run, in its project and under its name (as MLflow's
        # does): run.name and run.project cannot change on resume (shardwise.jobs.resume)
        project = saved.get("project") or run.project or os.environ.get("WANDB_PROJECT") or "shardwise"
        self._run = wandb.init(
            project=project, name=saved.get("name", run.name), id=run_id, resume="allow", dir=str(run.run_dir),
            mode=_wandb_mode(wandb),
        )
        self._folder = Path(self._run.settings.sync_dir) if self._run.offline else None
        """The offline run's folder (what ``wandb sync`` uploads); None online."""
        _save_ids(run.run_dir, "wandb", {"id": self._run.id, "project": project, "name": saved.get("name", run.name)})

    def _check_folder(self) -> None:
        """An offline run whose folder was deleted (wandb writes on into the deleted file,
        silently): FileNotFoundError, and `MetricsWriter` switches the tracker off."""
        if self._folder is not None and not self._folder.is_dir():
            raise FileNotFoundError(f"its offline folder {self._folder} was deleted during the run, so what it "
                                    "recorded is lost and there is nothing for wandb sync to upload")

    def log_config(self, config: Mapping[str, Any]) -> None:
        self._check_folder()
        # a resumed job may have changed a value (train.max_steps, to train longer)
        self._run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, metrics: Mapping[str, float], walltime: float) -> None:
        self._check_folder()
        self._run.log(dict(metrics), step=step)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self._check_folder()
        self._run.summary.update(flatten(summary, "/"))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        import wandb

        self._check_folder()
        columns, data = sample_table(rows)
        self._run.log({"samples": wandb.Table(columns=columns, data=data)}, step=step)

    def close(self, failed: bool = False) -> None:
        try:
            self._check_folder()
        except FileNotFoundError:
            # wandb's closing lines would tell the user to `wandb sync` the folder that is gone
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                self._run.finish(exit_code=1)
            raise
        self._run.finish(exit_code=1 if failed else 0)


MLFLOW_PARAM_CHARS = 6000
"""MLflow's longest param value; a longer one (a long list) is cut (config.json has it whole)."""
_MLFLOW_BAD_KEY = re.compile(r"[^\w\-. /:]")


def _mlflow_key(key: str) -> str:
    """`key` with the characters MLflow refuses in a metric or param name replaced by _."""
    return _MLFLOW_BAD_KEY.sub("_", key)


def _mlflow_missing() -> list[str]:
    # the default local store is SQLite, which needs SQLAlchemy and Alembic beside mlflow-skinny
    return _missing("mlflow") + ([] if os.environ.get("MLFLOW_TRACKING_URI") else _missing("sqlalchemy", "alembic"))


def _local_store(uri: str) -> Path | None:
    """The file (SQLite) or folder (file store) of a ``sqlite:///`` or ``file:`` MLflow
    tracking URI; None for anything else (a server, a database elsewhere, ``databricks``)."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///"):].split("?", 1)[0]
        return None if path in ("", ":memory:") else Path(path)
    if uri.startswith("file:"):
        path = urllib.parse.unquote(urllib.parse.urlparse(uri).path)
        return Path(path) if path else None
    return None


def _check_local_store(uri: str) -> None:
    """Raise PermissionError (or the OSError met) at once when a local store cannot be
    written: MLflow itself retries a SQLite store it cannot open for ~100 s, with a warning
    of several lines each time, before it gives up."""
    store = _local_store(uri)
    if store is None:
        return
    folder = store.parent if uri.startswith("sqlite:") else store
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
        if store.is_file():
            with open(store, "r+b"):
                pass
        elif store.exists() and folder is not store:
            raise IsADirectoryError(errno.EISDIR, "a folder, not a SQLite file")
    except OSError as e:
        raise PermissionError(f"its store {store} cannot be written ({e.strerror or e})") from None


SERVER_PROBE_S = 5.0
"""How long the MLflow tracker waits for its server to accept a connection before it is left
out (MLflow's own client retries a server that is down for minutes: 4 min 20 s was seen)."""

MLFLOW_HTTP_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
"""MLflow's HTTP retries and per-request timeout during the run, unless the environment sets
them (MLflow's defaults, 7 retries with backoff and 120 s per request, hold a training step
for minutes when the server goes away mid-run): a call gives up within about a minute and
the tracker is switched off with one warning."""


def _check_server(uri: str, timeout_s: float = SERVER_PROBE_S) -> None:
    """Raise ConnectionError at once when the server of an ``http(s)://`` MLflow tracking URI
    does not accept a connection within `timeout_s` seconds (refused, unreachable, a host
    name that does not resolve); other URIs are not checked here."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout_s):
            pass
    except OSError as e:
        reason = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e) or type(e).__name__)
        raise ConnectionError(f"its server {parsed.hostname}:{port} ({uri}) did not accept a connection "
                              f"within {timeout_s:g} s: {reason}") from None


@TRACKERS.register("mlflow", missing=_mlflow_missing, extra="mlflow")
class MlflowTracker(Tracker):
    """An MLflow run, in ``MLFLOW_TRACKING_URI`` or a SQLite store in run.dir."""

    name = "mlflow"

    def __init__(self, run: TrackerRun):
        env_uri = os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = env_uri or f"sqlite:///{(run.run_dir / 'mlflow.db').resolve()}"
        _check_local_store(self.tracking_uri)  # before mlflow's import, which takes seconds
        _check_server(self.tracking_uri)
        for key, value in MLFLOW_HTTP_BOUNDS.items():
            os.environ.setdefault(key, value)

        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=self.tracking_uri)
        saved = _saved_ids(run.run_dir).get("mlflow", {}) if run.resumed else {}
        if saved.get("run_id") and saved.get("tracking_uri") == self.tracking_uri:
            self.run_id = saved["run_id"]
            client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = run.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "shardwise"
            found = client.get_experiment_by_name(experiment)
            if found is not None:
                experiment_id = found.experiment_id
            else:  # a local store keeps its artifacts in run.dir too (MLflow's default: ./mlruns of the cwd)
                where = None if env_uri else str((run.run_dir / "mlartifacts").resolve())
                experiment_id = client.create_experiment(experiment, artifact_location=where)
            self.run_id = client.create_run(experiment_id, run_name=run.name,
                                            tags={"shardwise.run_dir": str(run.run_dir.resolve())}).info.run_id
        _save_ids(run.run_dir, "mlflow", {"run_id": self.run_id, "tracking_uri": self.tracking_uri})

    def log_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = {_mlflow_key(k): (v if isinstance(v, str) else json.dumps(v))[:MLFLOW_PARAM_CHARS]
                  for k, v in flatten(config, ".").items()}
        # A param cannot change once logged: a resumed job adds the new keys, and its
        # config.json artifact (replaced) holds the values it ran with.
        before = self._client.get_run(self.run_id).data.params
        changed = sorted(k for k, v in params.items() if k in before and before[k] != v)
        if changed:
            log.warning("mlflow: params keep their first values; changed on resume: %s (config.json has the new ones)",
                        ", ".join(changed))
        new = [Param(k, v) for k, v in params.items() if k not in before]
        for i in range(0, len(new), 100):  # MLflow takes at most 100 params per call
            self._client.log_batch(self.run_id, params=new[i:i + 100])
        self._client.log_dict(self.run_id, dict(config), "config.json")

    def log_metrics(self, step: int, metrics: Mapping[str, float], walltime: float) -> None:
        from mlflow.entities import Metric

        stamp = int(walltime * 1000)
        batch = [Metric(_mlflow_key(k), float(v), stamp, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # at most 1000 metrics per call
            self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        self._client.log_dict(self.run_id, dict(summary), "summary.json")
        stamp = int(time.time() * 1000)
        numbers = [Metric(_mlflow_key("summary/" + k), float(v), stamp, 0)
                   for k, v in flatten(summary, "/").items() if _is_number(v)]
        for i in range(0, len(numbers), 1000):
            self._client.log_batch(self.run_id, metrics=numbers[i:i + 1000])

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        rows = json.loads(json.dumps([dict(r) for r in rows], default=str))  # JSON values only
        self._client.log_dict(self.run_id, rows, samples_artifact(step))

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
