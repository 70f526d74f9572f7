"""MLflow tracking: one parent run per pipeline run, one nested run per stage.

The flow creates the parent run and passes its id to stages in ``CHATPIPE_PARENT_RUN_ID``;
a stage started without it (plain ``dvc repro``) gets a top-level run. Only rank 0 logs.
Every stage opens its run with :func:`tracked_run`, which yields a :class:`StageRun`: stages log through its methods (``run.log_metrics``,
``run.log_text``, ...), which do nothing when tracking is off or on ranks other than 0, so no stage
imports MLflow or guards its calls. Per-step metrics go through :meth:`StageRun.log`, MLflow's
asynchronous logging (``synchronous=False``): its queue gathers them for ``METRICS_BUFFER_S`` and
sends each window's as one batch from a thread, so the training loop never waits on the store; the
run flushes that queue before it ends. Every stage
run also records MLflow's system metrics (``system/cpu_utilization_percentage``, memory, GPU).

Run names say what ran: ``pretrain · tiny`` under a pipeline run named ``pipeline · tiny · <time>``;
a stage that ``dvc exp run`` started (DVC sets ``DVC_EXP_NAME``) is named ``pretrain · tiny · exp
<name>`` and nested under one parent run per DVC experiment, so every experiment reads as one run.

The experiment is tagged ``mlflow.experimentKind = custom_model_development`` so the MLflow UI opens
it as model training (runs, metrics, models), not in its GenAI view (traces, evaluations).

Artifact locations: with the store inside the project (a relative sqlite path) and a relative
``tracking.artifact_root``, the experiment's location is ``store:artifacts``, relative to the
store's directory (:mod:`chatpipe.project_artifacts`, an MLflow artifact-repository plugin), so a
moved or copied project reads and writes its own ``mlruns/`` and nothing rewrites MLflow's tables.
Everything else goes through MLflow's public API; the few names it reads from MLflow that are not
documented API are checked against the pinned version by tests/test_tracking.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatpipe.io import load_yaml
from chatpipe.procs import process_start
from chatpipe.runtime import thread_params
from chatpipe.settings import TrackingSettings, active_profile, load_section

if TYPE_CHECKING:
    from chatpipe.runtime import Runtime

PARENT_ENV = "CHATPIPE_PARENT_RUN_ID"
# MLflow 3.x UI: the experiment tag that picks its view; "custom_model_development" is model training
# (the other values it knows include "genai_development", "finetuning", "forecasting").
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# the configured (usually relative) artifact root an experiment was created with
ARTIFACT_ROOT_TAG = "chatpipe.artifact_root"
DVC_EXP_ENV, DVC_BASELINE_ENV = "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV"
SEP = " · "
# Seconds between system-metric samples (MLflow's default is 10; MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
# in the environment wins). MLflow's monitor publishes a sample only if the run is still RUNNING
# when the interval is over, so a run that ends sooner would show none: such a run gets one psutil
# sample as it ends (:func:`_publish_a_system_sample`) instead of waiting out the interval.
SYSTEM_METRICS_INTERVAL_S = 1.0
# Seconds MLflow's async queue gathers per-step metrics before it writes them (MLflow's
# MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS; a value in the environment wins). Unset, MLflow writes each
# step's metrics as its own store transaction, and its queue thread polls an empty queue once a
# second, so flushing the queue and ending the run each waited out up to a second of that poll
# (~2 s of every stage process, measured). Buffered, it writes a batch per window and a flush wakes it at once;
# the UI shows a metric at most this much later.
METRICS_BUFFER_S = 2  # whole seconds: MLflow reads the variable as an int (a "2.0" kills its queue thread)
BUFFERING_ENV = "MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS"
log = logging.getLogger(__name__)


# MLflow's own source tag for the commit (documented with its system tags; MLflow sets it itself only
# when the main script sits in a git repo, which a stage started by pytest or torchrun may not)
GIT_COMMIT_TAG = "mlflow.source.git.commit"


def _git_state() -> tuple[str, bool] | None:
    """(HEAD commit, uncommitted changes to tracked files?) of the working tree; None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        ).stdout.strip()
        return sha, bool(dirty)
    except (OSError, subprocess.CalledProcessError):
        return None


def git_commit() -> str:
    """HEAD commit of the working tree (with ``-dirty`` when there are uncommitted changes), for
    files that record it (eval results, the export's lineage); runs carry it as :func:`source_tags`."""
    state = _git_state()
    return "unknown" if state is None else state[0] + ("-dirty" if state[1] else "")


def source_tags() -> dict[str, str]:
    """MLflow's commit source tag plus ``dirty`` ("true"/"false"); none outside a git checkout."""
    state = _git_state()
    return {} if state is None else {GIT_COMMIT_TAG: state[0], "dirty": str(state[1]).lower()}


def dvc_lock_hash(path: Path = Path("dvc.lock")) -> str:
    """sha256 (12 hex) of dvc.lock, the fingerprint of every stage's inputs and outputs."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.exists() else "none"


def dvc_stage_hash(stage: str, path: Path = Path("dvc.lock")) -> str:
    """sha256 (12 hex) of one stage's entry in dvc.lock (its deps, params and outs hashes)."""
    return dvc_stage_hashes(path).get(stage, "none")


def dvc_stage_hashes(path: Path = Path("dvc.lock")) -> dict[str, str]:
    """:func:`dvc_stage_hash` of every stage in dvc.lock (``"none"`` for an empty entry), from one read."""
    if not path.exists():
        return {}
    stages = (load_yaml(path.read_text()) or {}).get("stages", {}) or {}
    return {
        s: hashlib.sha256(repr(entry).encode()).hexdigest()[:12] if entry else "none" for s, entry in stages.items()
    }


def configure(settings) -> str:
    """Point MLflow at the store in ``settings`` (a TrackingSettings) and return the experiment id.

    Creates the experiment on first use (tagged as model training; artifacts at
    :func:`artifact_location`); on later uses makes sure the tag is there and warns when the stored
    artifact location is not this project's (see :func:`check_location`).
    """
    import mlflow

    uri = settings.uri
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///")).resolve()
        db.parent.mkdir(parents=True, exist_ok=True)
        # absolute: MLflow keeps one open store per URI string, and a relative one would keep
        # pointing at the first directory a process used it from
        uri = f"sqlite:///{db}"
    mlflow.set_tracking_uri(uri)
    exp = mlflow.get_experiment_by_name(settings.experiment)
    artifacts = Path(settings.artifact_root).resolve()
    if exp is None:
        artifacts.mkdir(parents=True, exist_ok=True)
        tags = {EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, ARTIFACT_ROOT_TAG: settings.artifact_root}
        try:
            return mlflow.create_experiment(
                settings.experiment, artifact_location=artifact_location(settings), tags=tags
            )
        except Exception:  # another process created it first
            exp = mlflow.get_experiment_by_name(settings.experiment)
    client = mlflow.MlflowClient()
    if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:  # experiments made before the tag existed
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    check_location(settings, exp)
    return exp.experiment_id


def moves_with_project(settings) -> bool:
    """True when store and artifacts both live inside the project (a relative sqlite path, a relative
    artifact root): then artifact locations are stored relative to it. A store at an absolute path
    may be shared by several checkouts, and a tracking server owns its own locations."""
    db = settings.uri.removeprefix("sqlite:///")
    return (
        settings.uri.startswith("sqlite:///")
        and not Path(db).is_absolute()
        and not Path(settings.artifact_root).is_absolute()
    )


def artifact_location(settings) -> str:
    """The artifact location a new experiment gets: inside the project, the root relative to the store
    (``store:artifacts``, :mod:`chatpipe.project_artifacts`), else the root's absolute ``file://`` URI."""
    from chatpipe.project_artifacts import store_uri  # imports MLflow: not at the top of this module

    if moves_with_project(settings):
        return store_uri(Path(settings.artifact_root), settings.uri)
    return Path(settings.artifact_root).resolve().as_uri()


def check_location(settings, exp) -> bool:
    """Warn when ``exp`` keeps its artifacts somewhere other than :func:`artifact_location` says; True if it does.

    MLflow fixes an experiment's artifact location when it creates it, and chatpipe does not rewrite
    its store: an experiment made with another ``artifact_root`` (or, inside the project, by a
    chatpipe that stored absolute paths) keeps its location. A new ``tracking.experiment`` name
    starts one at the configured root.
    """
    stored, wanted = exp.artifact_location or "", artifact_location(settings)
    if stored == wanted or not stored.startswith(("file:", "/", wanted.split(":", 1)[0] + ":")):
        return True
    log.warning(
        "tracking.artifact_root = %r but experiment %r keeps its artifacts in %s (MLflow fixes an "
        "experiment's artifact location when it is created): set tracking.experiment to a new name "
        "to use %s",
        settings.artifact_root,
        settings.experiment,
        stored,
        wanted,
    )
    return False


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
    tags = {"stage": stage, "profile": profile, **source_tags(), "dvc_lock": dvc_lock_hash()}
    if os.environ.get(DVC_EXP_ENV):
        tags["dvc_exp"] = os.environ[DVC_EXP_ENV]
    return tags


def stage_run_name(stage: str, profile: str) -> str:
    """``pretrain · tiny``, or ``pretrain · tiny · exp <name>`` inside ``dvc exp run``."""
    exp = os.environ.get(DVC_EXP_ENV)
    return SEP.join([stage, profile, *([f"exp {exp}"] if exp else [])])


def pipeline_run_name(profile: str) -> str:
    """The flow's parent run: ``pipeline · tiny · 2026-11-23 21:17``."""
    return SEP.join(["pipeline", profile, time.strftime("%Y-%m-%d %H:%M")])


def first_run(client, experiment_id: str, filter_string: str, *, oldest: bool = False) -> Any | None:
    """The newest run (``oldest``: the oldest) of the experiment that matches ``filter_string``, or None."""
    order = "ASC" if oldest else "DESC"
    found = client.search_runs(
        [experiment_id], filter_string, order_by=[f"attributes.start_time {order}"], max_results=1
    )
    return found[0] if found else None


def dvc_exp_parent(experiment_id: str, profile: str) -> str | None:
    """Inside ``dvc exp run``: the id of the parent run of this DVC experiment (created by its first stage).

    DVC runs an experiment's stages one after another, each in its own process, with the same
    ``DVC_EXP_NAME``; finding the parent by that tag groups them into one run. None outside DVC.
    """
    name = os.environ.get(DVC_EXP_ENV)
    if not name:
        return None
    import mlflow

    client = mlflow.MlflowClient()
    baseline = os.environ.get(DVC_BASELINE_ENV, "")
    found = first_run(client, experiment_id, f"tags.dvc_exp = '{name}' and tags.stage = 'dvc exp'", oldest=True)
    if found:
        return found.info.run_id
    tags = {
        **base_tags("dvc exp", profile),
        "dvc_exp": name,
        "dvc_exp_baseline": baseline,
        "mlflow.note.content": f"`dvc exp run` experiment **{name}** (baseline {baseline[:7] or '?'}): "
        "one nested run per stage it ran.",
    }
    return client.create_run(experiment_id, run_name=SEP.join([f"exp {name}", profile]), tags=tags).info.run_id


class StageRun:
    """The MLflow run of a stage, or its stand-in when tracking is off: then every method does nothing.

    Wraps the active run that :func:`tracked_run` opened. ``id`` and ``info`` are None when disabled;
    ``client`` is an ``MlflowClient`` for what the methods do not cover (the registry, other runs).
    """

    def __init__(self, active: Any = None) -> None:
        self._active, self._mlflow = active, None
        if active is not None:  # imported only for a real run: a stage with tracking off never loads MLflow
            import mlflow

            self._mlflow = mlflow

    @property
    def enabled(self) -> bool:
        """True when there is a real run to log to."""
        return self._active is not None

    @property
    def info(self) -> Any:
        """MLflow's ``RunInfo`` of the run (run_id, experiment_id, artifact_uri), or None."""
        return self._active.info if self._active is not None else None

    @property
    def id(self) -> str | None:
        """The run id, or None when tracking is off."""
        return self._active.info.run_id if self._active is not None else None

    @property
    def client(self) -> Any:
        """An ``MlflowClient`` on the configured store (None when tracking is off)."""
        return self._mlflow.MlflowClient() if self._mlflow else None

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log ``metrics`` (one value each, at ``step`` or 0) on this run."""
        if self._mlflow:
            self._mlflow.log_metrics(metrics, step=step, run_id=self.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue per-step ``metrics`` without waiting on the store (MLflow's async logging batches them)."""
        if self._mlflow:
            self._mlflow.log_metrics(metrics, step=step, run_id=self.id, synchronous=False)

    def flush(self) -> None:
        """Wait until every queued metric is in the store."""
        if self._mlflow:
            self._mlflow.flush_async_logging()

    def log_text(self, text: str, artifact_file: str) -> None:
        """Save ``text`` as the artifact ``artifact_file`` of this run."""
        if self._mlflow:
            self._mlflow.log_text(text, artifact_file, run_id=self.id)

    def log_dict(self, dictionary: dict[str, Any], artifact_file: str) -> None:
        """Save ``dictionary`` as a JSON or YAML artifact (by the file's extension) of this run."""
        if self._mlflow:
            self._mlflow.log_dict(dictionary, artifact_file, run_id=self.id)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Copy one file into this run's artifacts (under ``artifact_path`` when given)."""
        if self._mlflow:
            self._mlflow.log_artifact(str(local_path), artifact_path, run_id=self.id)

    def log_artifacts(
        self, local_dir: str | Path, artifact_path: str | None = None, *, run_id: str | None = None
    ) -> None:
        """Copy a directory's files into the artifacts of this run, or of ``run_id`` (e.g. the parent run)."""
        if self._mlflow:
            self.client.log_artifacts(run_id or self.id, str(local_dir), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        """Set ``tags`` on this run."""
        if self._mlflow:
            client = self.client
            for key, value in tags.items():
                client.set_tag(self.id, key, value)


@contextmanager
def tracked_run(stage: str, params: dict[str, Any], rt: Runtime | None = None) -> Iterator[StageRun]:
    """The MLflow run of ``stage`` with the tracking settings and profile of params.yaml, ``params``
    logged as its parameters. A no-op run on ranks other than 0 of ``rt``; ``rt`` None is a
    single-process stage. The one way a stage opens its run (see :func:`_stage_run`)."""
    enabled = rt is None or rt.is_main
    params = {**params, **thread_params()}  # the intra-op threads the process chose: runtime/threads
    with _stage_run(stage, load_section(TrackingSettings), params, profile=active_profile(), enabled=enabled) as run:
        yield run


@contextmanager
def _stage_run(
    stage: str, settings, params: dict[str, Any], *, profile: str, enabled: bool = True
) -> Iterator[StageRun]:
    """Open the MLflow run of a stage (nested under the flow's parent run when there is one) with
    the given tracking ``settings`` and ``profile``.

    Yields a :class:`StageRun`, a no-op one when tracking is disabled (e.g. ranks other than 0). First closes
    this stage's runs that a killed process left RUNNING (:func:`close_stale_runs`). The run ends
    FINISHED, KILLED (SIGTERM/Ctrl-C: ``SystemExit``/``KeyboardInterrupt``) or FAILED (any other
    exception); a process killed outright is closed by the stage's next run.
    """
    if not enabled or not settings.enabled:
        yield StageRun()
        return
    import mlflow
    from mlflow.environment_variables import MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL

    experiment_id = configure(settings)
    close_stale_runs(mlflow.MlflowClient(), experiment_id, stage)
    exp_parent = None if os.environ.get(PARENT_ENV) else dvc_exp_parent(experiment_id, profile)
    parent = os.environ.get(PARENT_ENV) or exp_parent
    tags = {**base_tags(stage, profile), **process_tags()}
    if parent:
        tags["mlflow.parentRunId"] = parent
    if MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL.get() is None:
        mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_INTERVAL_S)
    os.environ.setdefault(BUFFERING_ENV, str(METRICS_BUFFER_S))  # read by the queue's thread each round
    run = mlflow.start_run(
        experiment_id=experiment_id, run_name=stage_run_name(stage, profile), tags=tags, log_system_metrics=True
    )
    status = "FAILED"
    try:
        # log_params sends one log_batch, which MLflow splits into its 100-param requests and whose
        # values over its 6000-character limit it truncates (MLFLOW_TRUNCATE_LONG_VALUES)
        mlflow.log_params(flatten(params))
        yield StageRun(run)
        status = "FINISHED"
    except (KeyboardInterrupt, SystemExit):
        status = "KILLED"
        raise
    finally:
        # the queued async metrics reach the store before the run is marked ended (and the
        # process exits); end_run then stops the system-metrics thread, which sends its last batch
        with contextlib.suppress(Exception):
            mlflow.flush_async_logging()
        mlflow.end_run(status)
        if status == "FINISHED":  # not when stopping: a cancel publishes nothing more
            with contextlib.suppress(Exception):  # a sample is not worth failing a finished stage for
                _publish_a_system_sample(run.info.run_id)
        if exp_parent:  # the DVC experiment's run ends (for now) with its latest stage
            mlflow.MlflowClient().set_terminated(exp_parent, status=status)


# One psutil sample under the names MLflow's monitor gives it, so the UI shows it with the others.
def _system_sample() -> dict[str, float]:
    import psutil

    mem = psutil.virtual_memory()
    return {
        "system/cpu_utilization_percentage": psutil.cpu_percent(),  # since the last call (the monitor's first sample)
        "system/system_memory_usage_megabytes": (mem.total - mem.available) / 2**20,
        "system/system_memory_usage_percentage": mem.percent,
    }


def _publish_a_system_sample(run_id: str) -> None:
    """Give an ended run that MLflow's system-metrics monitor published nothing for one sample.

    The monitor samples, waits out its interval, then publishes; a stage shorter than that ends with
    no system metrics. After ``end_run`` (which stops the monitor and flushes what it had), this asks
    the store whether the run has any ``system/`` metric and, if not, logs one psutil sample as
    ordinary metrics: MLflow's public client only, no monitor internals.
    """
    import mlflow

    client = mlflow.MlflowClient()
    if not any(k.startswith("system/") for k in client.get_run(run_id).data.metrics):
        mlflow.log_metrics(_system_sample(), step=0, run_id=run_id)


def process_tags() -> dict[str, str]:
    """Tags that identify the process owning a run, so a later run can tell it died."""
    return {"host": socket.gethostname(), "pid": str(os.getpid()), "pid_start": str(process_start(os.getpid()))}


def run_is_orphaned(tags: dict[str, str]) -> bool:
    """True when the process that owns a RUNNING run is gone (same host: PID missing or reused).

    Runs from another host are never judged (we cannot see its processes); runs without the
    process tags (older code) are judged orphaned, since a stage's runs never overlap under DVC's lock.
    """
    if "pid" not in tags:
        return True
    if tags.get("host") != socket.gethostname():
        return False
    return process_start(int(tags["pid"])) != tags.get("pid_start")


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
