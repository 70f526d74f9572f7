"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

The flow creates the parent run and passes its id to stages in ``CHATPIPE_PARENT_RUN_ID``;
a stage started without it (plain ``dvc repro``) gets a top-level run. Only rank 0 logs.
Per-step metrics go through :class:`MetricBuffer`, which sends them in batches so the training
loop never waits on the store for each metric.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PARENT_ENV = "CHATPIPE_PARENT_RUN_ID"
log = logging.getLogger(__name__)


def git_commit() -> str:
    """HEAD commit of the working tree (with ``-dirty`` when there are uncommitted changes)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dvc_lock_hash(path: Path = Path("dvc.lock")) -> str:
    """sha256 (12 hex) of dvc.lock, the fingerprint of every stage's inputs and outputs."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else "none"


def dvc_stage_hash(stage: str, path: Path = Path("dvc.lock")) -> str:
    """sha256 (12 hex) of one stage's entry in dvc.lock (its deps, params and outs hashes)."""
    import yaml

    if not path.exists():
        return "none"
    entry = (yaml.safe_load(path.read_text()) or {}).get("stages", {}).get(stage)
    return hashlib.sha256(repr(entry).encode()).hexdigest()[:12] if entry else "none"


def configure(settings) -> str:
    """Point MLflow at the store in ``settings`` (a TrackingSettings) and return the experiment id."""
    import mlflow

    if settings.uri.startswith("sqlite:///"):
        Path(settings.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(settings.uri)
    exp = mlflow.get_experiment_by_name(settings.experiment)
    if exp is not None:
        return exp.experiment_id
    artifacts = Path(settings.artifact_root).resolve()
    artifacts.mkdir(parents=True, exist_ok=True)
    try:
        return mlflow.create_experiment(settings.experiment, artifact_location=artifacts.as_uri())
    except Exception:  # another process created it first
        return mlflow.get_experiment_by_name(settings.experiment).experiment_id


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` for MLflow params."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def numeric_leaves(d: dict[str, Any]) -> dict[str, float]:
    """The numeric leaves of a nested dict as ``a.b`` keys (for MLflow metrics)."""
    return {k: float(v) for k, v in flatten(d).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def base_tags(stage: str, profile: str) -> dict[str, str]:
    """Tags that trace a number back to what produced it."""
    return {"stage": stage, "profile": profile, "git_commit": git_commit(), "dvc_lock": dvc_lock_hash()}


@contextmanager
def stage_run(stage: str, settings, params: dict[str, Any], *, profile: str, enabled: bool = True) -> Iterator[Any]:
    """Open the MLflow run of a stage (nested under the flow's parent run when there is one).

    Yields the active run, or None when tracking is disabled (e.g. ranks other than 0). First closes
    this stage's runs that a killed process left RUNNING (:func:`close_stale_runs`). The run ends
    FINISHED, KILLED (SIGTERM/Ctrl-C: ``SystemExit``/``KeyboardInterrupt``) or FAILED (any other
    exception); a process killed outright is closed by the stage's next run.
    """
    if not enabled or not settings.enabled:
        yield None
        return
    import mlflow

    experiment_id = configure(settings)
    close_stale_runs(mlflow.MlflowClient(), experiment_id, stage)
    parent = os.environ.get(PARENT_ENV) or None
    tags = {**base_tags(stage, profile), **process_tags()}
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = mlflow.start_run(experiment_id=experiment_id, run_name=stage, tags=tags)
    try:
        flat = {k: str(v)[:6000] for k, v in flatten(params).items()}
        items = list(flat.items())
        for i in range(0, len(items), 100):  # log_params takes at most 100 per call
            mlflow.log_params(dict(items[i : i + 100]))
        yield run
    except (KeyboardInterrupt, SystemExit):
        mlflow.end_run("KILLED")
        raise
    except BaseException:
        mlflow.end_run("FAILED")
        raise
    else:
        mlflow.end_run("FINISHED")


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_tags() -> dict[str, str]:
    """Tags that identify the process owning a run, so a later run can tell it died."""
    return {"host": socket.gethostname(), "pid": str(os.getpid()), "pid_start": str(_process_start(os.getpid()))}


def run_is_orphaned(tags: dict[str, str]) -> bool:
    """True when the process that owns a RUNNING run is gone (same host: PID missing or reused).

    Runs from another host are never judged (we cannot see its processes); runs without the
    process tags (older code) are judged orphaned, since a stage's runs never overlap under DVC's lock.
    """
    if "pid" not in tags:
        return True
    if tags.get("host") != socket.gethostname():
        return False
    return _process_start(int(tags["pid"])) != tags.get("pid_start")


def close_stale_runs(client, experiment_id: str, stage: str) -> list[str]:
    """Mark KILLED this stage's RUNNING runs whose process is gone; returns their ids."""
    closed = []
    for r in client.search_runs([experiment_id], f"tags.stage = '{stage}' and attributes.status = 'RUNNING'"):
        if run_is_orphaned(r.data.tags):
            client.set_terminated(r.info.run_id, status="KILLED")
            closed.append(r.info.run_id)
    if closed:
        log.warning("closed %d %s run(s) a killed process left RUNNING: %s", len(closed), stage, ", ".join(closed))
    return closed


def tag_stage_runs(parent_run_id: str, stage: str, tags: dict[str, str]) -> int:
    """Set ``tags`` on the runs of ``stage`` nested under ``parent_run_id``; returns how many.

    The flow calls this after DVC has written the stage's entry to dvc.lock, so each stage run
    records the exact lock hash of the inputs, params and outputs that produced its numbers.
    """
    import mlflow

    client = mlflow.MlflowClient()
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}' and tags.stage = '{stage}'"
    )
    for r in runs:
        for key, value in tags.items():
            client.set_tag(r.info.run_id, key, value)
    return len(runs)


class MetricBuffer:
    """Collects step metrics and writes them with one ``log_batch`` call every few seconds."""

    def __init__(self, run, flush_every_s: float = 5.0, max_items: int = 500) -> None:
        self.run_id = run.info.run_id if run is not None else None
        self.flush_every_s, self.max_items = flush_every_s, max_items
        self.items: list = []
        self.last_flush = time.monotonic()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue metrics for ``step``; flushes when the buffer is old or full."""
        if self.run_id is None:
            return
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.items.extend(Metric(k, float(v), now_ms, step) for k, v in metrics.items())
        if len(self.items) >= self.max_items or time.monotonic() - self.last_flush > self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Send everything queued (MLflow accepts up to 1000 metrics per batch)."""
        if self.run_id is None or not self.items:
            return
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        for i in range(0, len(self.items), 1000):
            client.log_batch(self.run_id, metrics=self.items[i : i + 1000])
        self.items.clear()
        self.last_flush = time.monotonic()
