"""issue 15: MLflow runs that end abnormally are closed, never left RUNNING (real sqlite store in a temp dir)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatpipe import tracking
from chatpipe.settings import TrackingSettings
from chatpipe.testing.project import make_project, project_env, run

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
        with tracking._stage_run("data", store, {"a": 1}, profile="tiny") as run:
            run_id = run.info.run_id
            raise exc
    assert _status(store, run_id) == status


KILLED_WORKER = r"""
import os, sys
sys.path.insert(0, sys.argv[2])
from chatpipe import tracking
from chatpipe.settings import TrackingSettings
s = TrackingSettings(uri=sys.argv[1], artifact_root="art", experiment="t", enabled=True)
with tracking._stage_run("pretrain", s, {}, profile="tiny") as run:
    print(run.info.run_id, flush=True)
    os.kill(os.getpid(), 9)  # as a kill -9 of the worker: no finally, no end_run
"""


def test_the_next_run_of_a_stage_closes_a_killed_runs_running_entry(store):
    done = subprocess.run([sys.executable, "-c", KILLED_WORKER, store.uri, str(REPO)], capture_output=True, text=True)
    assert done.returncode == -9, done.stderr
    dead = done.stdout.split()[0]
    assert _status(store, dead) == "RUNNING"
    with tracking._stage_run("midtrain", store, {}, profile="tiny"):
        pass  # another stage's run does not touch pretrain's
    assert _status(store, dead) == "RUNNING"
    with tracking._stage_run("pretrain", store, {}, profile="tiny") as run:
        live = run.info.run_id
        assert _status(store, dead) == "KILLED"
    assert _status(store, live) == "FINISHED"


def test_a_live_runs_entry_is_not_closed(store):
    import mlflow

    with tracking._stage_run("sft", store, {}, profile="tiny") as run:
        assert tracking.close_stale_runs(mlflow.MlflowClient(), run.info.experiment_id, "sft") == []
        assert _status(store, run.info.run_id) == "RUNNING"


def test_a_run_shorter_than_the_sampling_interval_gets_a_system_sample_without_waiting(store, monkeypatch):
    """MLflow's monitor publishes only after a whole interval; a shorter stage publishes one sample
    itself as it ends, and does not sleep out the interval."""
    import types

    import mlflow

    waits: list[float] = []
    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in ("monotonic", "perf_counter", "time", "strftime")})
    clock.sleep = waits.append
    monkeypatch.setattr(tracking, "time", clock)
    with tracking._stage_run("tokenizer", store, {}, profile="tiny") as run:
        run_id = run.info.run_id
    assert waits == []
    assert _status(store, run_id) == "FINISHED"
    metrics = mlflow.MlflowClient().get_run(run_id).data.metrics  # _status pointed MLflow at the store
    assert "system/cpu_utilization_percentage" in metrics, sorted(metrics)


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


def stop_once_open(cwd: Path, stage: str, env: dict[str, str], uri: str, experiment: str) -> tuple[int, str, str]:
    """Start ``python -m stages.<stage>`` in ``cwd``, SIGTERM it once its MLflow run is open (RUNNING,
    params logged) and return its exit code, the run's status in the store, and its output.

    The store must already exist: a client polling a store the stage is still creating could race it."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    proc = subprocess.Popen(
        [sys.executable, "-m", f"stages.{stage}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        open_run, deadline = None, time.monotonic() + 300
        while open_run is None and time.monotonic() < deadline:
            assert proc.poll() is None, f"{stage} ended before its run was open:\n{proc.stdout.read()[-3000:]}"
            exp = client.get_experiment_by_name(experiment)
            runs = client.search_runs([exp.experiment_id], f"tags.stage = '{stage}'") if exp else []
            open_run = next((r for r in runs if r.info.status == "RUNNING" and r.data.params), None)
            time.sleep(0.2)
        assert open_run is not None, f"{stage} never opened its MLflow run"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, client.get_run(open_run.info.run_id).info.status, out


def test_sigterm_to_a_single_process_stage_ends_its_run_killed(store, tmp_path):
    """The data stage (no process group) under SIGTERM, as DVC or a cancelled flow stops it: it unwinds
    and its run ends KILLED, not RUNNING until the stage's next run closes it."""
    experiment = "sigterm-data"
    tracking.configure(store.model_copy(update={"experiment": experiment}))  # the store exists before the stage
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATPIPE_", "MLFLOW_"))}
    env.update(
        CHATPIPE_PARAMS=str(REPO / "params.yaml"),
        CHATPIPE_TRACKING__URI=store.uri,
        CHATPIPE_TRACKING__ARTIFACT_ROOT=store.artifact_root,
        CHATPIPE_TRACKING__EXPERIMENT=experiment,
        CHATPIPE_DATA__SOURCE="synthetic",
        CHATPIPE_DATA__NUM_DOCS="5000000",  # minutes of work: still running when the signal comes
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
    )
    code, status, out = stop_once_open(tmp_path, "data", env, store.uri, experiment)
    assert (code, status) == (128 + signal.SIGTERM, "KILLED"), out[-3000:]
    # stopped before it wrote anything, and its finally blocks ran: the half-written shards are gone
    assert not (tmp_path / "artifacts" / "data").exists() and not list((tmp_path / "artifacts").glob(".data.tmp*"))


@pytest.mark.slow
def test_sigterm_to_a_training_stage_ends_its_run_killed(tmp_path):
    """pretrain (a distributed stage, here one process) under SIGTERM mid-training: its run ends KILLED."""
    project = make_project(tmp_path, {"pretrain": {"max_steps": 100000, "checkpoint_every": 0, "eval_every": 0}})
    run(project, "python", "-m", "stages.data")  # creates the project's store, before anyone polls it
    run(project, "python", "-m", "stages.tokenizer")
    uri = f"sqlite:///{project}/mlruns/mlflow.db"
    code, status, out = stop_once_open(project, "pretrain", project_env(project), uri, "chatpipe")
    assert (code, status) == (128 + signal.SIGTERM, "KILLED"), out[-3000:]
