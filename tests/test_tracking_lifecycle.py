"""issue 15: MLflow runs that end abnormally are closed, never left RUNNING (real sqlite store in a temp dir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe import tracking
from chatpipe.settings import TrackingSettings

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One store for the module: creating MLflow's tables takes ~15 s on a loaded 2-core machine."""
    import mlflow

    tmp_path = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        mp.setenv("CHATPIPE_PARAMS", str(REPO / "params.yaml"))
        mp.delenv(tracking.PARENT_ENV, raising=False)
        settings = TrackingSettings(
            uri=f"sqlite:///{tmp_path}/mlflow.db", artifact_root=str(tmp_path / "art"), experiment="t", enabled=True
        )
        yield settings
    mlflow.set_tracking_uri(settings.uri)  # leave no active run behind for the next test
    while mlflow.active_run():
        mlflow.end_run()


def _status(settings, run_id: str) -> str:
    import mlflow

    mlflow.set_tracking_uri(settings.uri)
    return mlflow.MlflowClient().get_run(run_id).info.status


@pytest.mark.parametrize(
    ("exc", "status"), [(SystemExit(143), "KILLED"), (KeyboardInterrupt(), "KILLED"), (ValueError("x"), "FAILED")]
)
def test_a_run_ended_by_a_signal_or_error_is_killed_or_failed(store, exc, status):
    with pytest.raises(type(exc)):
        with tracking.stage_run("data", store, {"a": 1}, profile="tiny") as run:
            run_id = run.info.run_id
            raise exc
    assert _status(store, run_id) == status


KILLED_WORKER = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from chatpipe import tracking
from chatpipe.settings import TrackingSettings
s = TrackingSettings(uri=sys.argv[1], artifact_root="art", experiment="t", enabled=True)
with tracking.stage_run("pretrain", s, {}, profile="tiny") as run:
    print(run.info.run_id, flush=True)
    os.kill(os.getpid(), 9)  # as a kill -9 of the worker: no finally, no end_run
"""


def test_the_next_run_of_a_stage_closes_a_killed_runs_running_entry(store):
    done = subprocess.run([sys.executable, "-c", KILLED_WORKER, store.uri, str(REPO)], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    dead = done.stdout.split()[0]
    assert _status(store, dead) == "RUNNING"
    with tracking.stage_run("midtrain", store, {}, profile="tiny"):
        pass  # another stage's run does not touch pretrain's
    assert _status(store, dead) == "RUNNING"
    with tracking.stage_run("pretrain", store, {}, profile="tiny") as run:
        live = run.info.run_id
        assert _status(store, dead) == "KILLED"
    assert _status(store, live) == "FINISHED"


def test_a_live_runs_entry_is_not_closed(store):
    import mlflow

    with tracking.stage_run("sft", store, {}, profile="tiny") as run:
        assert tracking.close_stale_runs(mlflow.MlflowClient(), run.info.experiment_id, "sft") == []
        assert _status(store, run.info.run_id) == "RUNNING"


def test_a_stage_run_records_system_metrics(tmp_path):
    """A real stage (``python -m stages.data``, synthetic and small) in its own process: its MLflow
    run shows MLflow's system metrics beside its own, and ended FINISHED."""
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATPIPE_", "MLFLOW_"))}
    env.update(
        CHATPIPE_PARAMS=str(REPO / "params.yaml"),
        CHATPIPE_TRACKING__URI=uri,
        CHATPIPE_TRACKING__ARTIFACT_ROOT=str(tmp_path / "art"),
        CHATPIPE_TRACKING__EXPERIMENT="sysmetrics",
        CHATPIPE_DATA__SOURCE="synthetic",
        CHATPIPE_DATA__NUM_DOCS="200",
        CHATPIPE_DATA__VAL_DOCS="20",
        CHATPIPE_DATA__DOCS_PER_SHARD="100",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "stages.data"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    (run,) = client.search_runs([client.get_experiment_by_name("sysmetrics").experiment_id])
    assert run.info.status == "FINISHED"
    system = {k for k in run.data.metrics if k.startswith("system/")}
    assert "system/cpu_utilization_percentage" in system, sorted(run.data.metrics)
    assert "system/system_memory_usage_megabytes" in system
    assert {"num_docs.train", "num_docs.val", "seconds"} <= set(run.data.metrics)  # the stage's own, beside them
