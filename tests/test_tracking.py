"""MLflow tracking: the experiment opens as model training, runs have readable names, a ``dvc exp run``
groups its stage runs, and a moved or copied project writes artifacts into its own ``mlruns/``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chatpipe import tracking
from chatpipe.settings import TrackingSettings

mlflow = pytest.importorskip("mlflow")


def settings_at(root: Path, **kw) -> TrackingSettings:
    # absolute URI: MLflow caches one store per URI string across tests in this process
    return TrackingSettings.model_construct(
        uri=f"sqlite:///{root}/mlruns/mlflow.db",
        artifact_root=kw.pop("artifact_root", "mlruns/artifacts"),
        experiment="chatpipe",
        enabled=True,
    )


@pytest.fixture()
def clean_env(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith(("CHATPIPE_", "DVC_EXP_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    yield tmp_path
    mlflow.set_tracking_uri(None)


def test_experiment_is_tagged_as_model_training_even_if_it_existed_before(clean_env):
    settings = settings_at(clean_env)
    mlflow.set_tracking_uri(settings.uri)
    old = mlflow.create_experiment("chatpipe")  # as the code before the tag made it
    assert tracking.configure(settings) == old
    tags = mlflow.MlflowClient().get_experiment(old).tags
    assert tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_new_experiment_gets_kind_tag_and_configured_root(clean_env):
    exp_id = tracking.configure(settings_at(clean_env))
    exp = mlflow.MlflowClient().get_experiment(exp_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert exp.tags[tracking.ARTIFACT_ROOT_TAG] == "mlruns/artifacts"
    assert exp.artifact_location == (clean_env / "mlruns/artifacts").as_uri()


def test_stage_runs_of_a_dvc_experiment_share_a_named_parent(clean_env, monkeypatch):
    settings = settings_at(clean_env)
    monkeypatch.setenv("DVC_EXP_NAME", "flabby-bass")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", "0123456789abcdef")
    ids = []
    for stage in ("data", "pretrain"):
        with tracking._stage_run(stage, settings, {"x": 1}, profile="tiny") as run:
            ids.append(run.info.run_id)
    client = mlflow.MlflowClient()
    runs = [client.get_run(i) for i in ids]
    assert [r.info.run_name for r in runs] == ["data · tiny · exp flabby-bass", "pretrain · tiny · exp flabby-bass"]
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parents) == 1
    parent = client.get_run(parents.pop())
    assert parent.info.run_name == "exp flabby-bass · tiny"
    assert parent.data.tags["dvc_exp"] == "flabby-bass" and parent.data.tags["dvc_exp_baseline"] == "0123456789abcdef"
    assert parent.info.status == "FINISHED" and all(r.data.tags["dvc_exp"] == "flabby-bass" for r in runs)


def test_run_names_outside_dvc_and_under_a_pipeline(clean_env, monkeypatch):
    settings = settings_at(clean_env)
    with tracking._stage_run("sft", settings, {}, profile="tiny") as run:
        pass
    run = mlflow.MlflowClient().get_run(run.info.run_id)
    assert run.info.run_name == "sft · tiny" and "mlflow.parentRunId" not in run.data.tags
    assert tracking.pipeline_run_name("speedrun").startswith("pipeline · speedrun · 20")


# One process of a project: log an artifact on a new run and read back every run's artifacts.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import mlflow
    from chatpipe import tracking
    from chatpipe.settings import TrackingSettings

    settings = TrackingSettings.model_construct(
        uri="sqlite:///mlruns/mlflow.db", artifact_root="mlruns/artifacts", experiment="chatpipe", enabled=True
    )
    with tracking._stage_run("data", settings, {}, profile="tiny") as run:
        mlflow.log_text(sys.argv[1], "note.txt")
    client = mlflow.MlflowClient()
    runs = client.search_runs([run.info.experiment_id])
    notes = {r.info.run_id: mlflow.artifacts.load_text(r.info.artifact_uri + "/note.txt") for r in runs}
    print(json.dumps({"run": run.info.run_id, "artifact_uri": run.info.artifact_uri, "notes": notes}))
    """
)


def run_in(project: Path, note: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATPIPE_", "DVC_EXP_", "MLFLOW_"))}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, note], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_moved_project_writes_and_reads_its_own_mlruns(tmp_path):
    original, moved = tmp_path / "original", tmp_path / "moved"
    original.mkdir()
    first = run_in(original, "one")
    # stored relative to the store (no absolute path in MLflow's tables to rewrite after a move)
    assert first["artifact_uri"].startswith("store:artifacts/")
    assert (original / "mlruns" / first["artifact_uri"].removeprefix("store:") / "note.txt").read_text() == "one"

    shutil.copytree(original, moved)  # cp -r: the original stays, untouched from now on
    before = sorted(p.relative_to(original) for p in original.rglob("*") if p.suffix != ".db")
    second = run_in(moved, "two")
    assert (moved / "mlruns" / second["artifact_uri"].removeprefix("store:") / "note.txt").read_text() == "two"
    assert not (original / "mlruns" / second["artifact_uri"].removeprefix("store:")).exists()
    # and a process elsewhere that opens the copy's store by its absolute path reads them too
    mlflow.set_tracking_uri(f"sqlite:///{moved}/mlruns/mlflow.db")
    try:
        assert mlflow.artifacts.load_text(second["artifact_uri"] + "/note.txt") == "two"
        assert mlflow.MlflowClient().list_artifacts(second["run"])[0].path == "note.txt"
    finally:
        mlflow.set_tracking_uri(None)
    assert sorted(p.relative_to(original) for p in original.rglob("*") if p.suffix != ".db") == before
    # the copy reads the earlier run's artifacts from its own mlruns/, even with the original gone
    shutil.rmtree(original)
    third = run_in(moved, "three")
    assert third["notes"] == {first["run"]: "one", second["run"]: "two", third["run"]: "three"}
    assert not original.exists()


def test_an_experiment_with_a_location_elsewhere_is_kept_and_warned_about(clean_env, caplog):
    # made by a chatpipe that stored absolute paths, or with another artifact_root: MLflow fixes the
    # location at creation and chatpipe does not rewrite the store, so it says what to do instead
    mlflow.set_tracking_uri(f"sqlite:///{clean_env}/mlruns/mlflow.db")  # absolute: see settings_at
    (clean_env / "mlruns").mkdir()
    old = mlflow.create_experiment("chatpipe", artifact_location="/elsewhere/mlruns/artifacts")
    settings = TrackingSettings.model_construct(
        uri="sqlite:///mlruns/mlflow.db", artifact_root="mlruns/artifacts", experiment="chatpipe", enabled=True
    )
    with caplog.at_level("WARNING", logger="chatpipe.tracking"):
        assert tracking.configure(settings) == old
    assert mlflow.MlflowClient().get_experiment(old).artifact_location == "/elsewhere/mlruns/artifacts"
    assert "set tracking.experiment to a new name to use store:artifacts" in caplog.text


def test_no_code_writes_mlflows_tables():
    for path in sorted((Path(tracking.__file__).parent).rglob("*.py")):
        text = path.read_text().lower()
        assert "sqlite3" not in text and "update runs set" not in text, path


def test_the_mlflow_names_chatpipe_relies_on_are_still_there():
    """Pinned-version guard: names chatpipe takes from MLflow beyond its documented functions."""
    from mlflow.server import BACKEND_STORE_URI_ENV_VAR
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT

    from chatpipe.project_artifacts import SERVER_STORE_ENV, ProjectArtifactRepository

    assert tracking.GIT_COMMIT_TAG == MLFLOW_GIT_COMMIT, (
        f"MLflow {mlflow.__version__} renamed its git commit source tag to {MLFLOW_GIT_COMMIT!r}: "
        "update tracking.GIT_COMMIT_TAG"
    )
    assert SERVER_STORE_ENV == BACKEND_STORE_URI_ENV_VAR, (
        f"MLflow {mlflow.__version__}'s server keeps its backend store in {BACKEND_STORE_URI_ENV_VAR}: "
        "update chatpipe.project_artifacts.SERVER_STORE_ENV"
    )
    repo = get_artifact_repository("store:artifacts", tracking_uri="sqlite:////p/mlruns/mlflow.db")
    assert isinstance(repo, ProjectArtifactRepository), (
        f"MLflow {mlflow.__version__} did not pick chatpipe's store: artifact repository from the "
        f"mlflow.artifact_repository entry point (reinstall chatpipe: bash scripts/install.sh), got {type(repo)}"
    )
    assert Path(repo.artifact_dir) == Path("/p/mlruns/artifacts"), (
        f"MLflow {mlflow.__version__} no longer hands its tracking URI to artifact repositories, or its "
        "LocalArtifactRepository no longer keeps its directory in artifact_dir"
    )


def test_runs_carry_mlflows_commit_tag_and_dirty(clean_env):
    repo = Path(__file__).resolve().parents[1]
    os.chdir(repo)  # clean_env's monkeypatch.chdir puts the cwd back
    with tracking._stage_run("data", settings_at(clean_env), {}, profile="tiny") as run:
        pass
    tags = mlflow.MlflowClient().get_run(run.id).data.tags
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    assert tags["mlflow.source.git.commit"] == head
    assert tags["dirty"] == ("true" if dirty.stdout.strip() else "false")
    assert "git_commit" not in tags  # MLflow's own tag, not a copy of it
    assert tracking.git_commit() == head + ("-dirty" if tags["dirty"] == "true" else "")


def test_a_run_of_a_dead_process_is_orphaned_and_a_live_one_is_not():
    import socket

    from chatpipe.procs import process_start

    live = tracking.process_tags()
    assert live["pid_start"] == process_start(os.getpid()) != "None"
    assert not tracking.run_is_orphaned(live)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = {"host": socket.gethostname(), "pid": done.stdout.strip(), "pid_start": live["pid_start"]}
    assert process_start(int(gone["pid"])) is None and tracking.run_is_orphaned(gone)
    reused = {**live, "pid_start": "12.00"}  # our PID, but another process's start time: PID reused
    assert tracking.run_is_orphaned(reused)


def test_a_store_at_an_absolute_path_is_not_rebased(clean_env, monkeypatch):
    # an absolute sqlite path may be shared by several checkouts: none of them may claim it
    settings = settings_at(clean_env)
    exp_id = tracking.configure(settings)
    elsewhere = clean_env / "other-checkout"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert tracking.configure(settings) == exp_id
    location = mlflow.MlflowClient().get_experiment(exp_id).artifact_location
    assert location == (clean_env / "mlruns/artifacts").as_uri()


def test_a_disabled_run_does_nothing(clean_env):
    # tracking off in params, or a rank other than 0: the stage logs through the same calls
    off = settings_at(clean_env).model_copy(update={"enabled": False})
    for settings, enabled in ((off, True), (settings_at(clean_env), False)):
        with tracking._stage_run("pretrain", settings, {"x": 1}, profile="tiny", enabled=enabled) as run:
            assert not run.enabled and run.id is None and run.info is None and run.client is None
            run.log_metrics({"a": 1.0}, step=3)
            run.log_text("t", "t.txt")
            run.log_dict({"a": 1}, "d.json")
            run.log_artifact(clean_env / "missing.txt")  # not even looked at
            run.log_artifacts(clean_env, "dir", run_id="someone-else")
            run.set_tags({"k": "v"})
            run.log({"loss": 1.0}, step=1)
            run.flush()
    assert not (clean_env / "mlruns").exists()  # no store was created or touched


def test_a_real_run_logs_metrics_artifacts_and_tags(clean_env):
    settings = settings_at(clean_env)
    (clean_env / "out").mkdir()
    (clean_env / "out" / "report.md").write_text("# report")
    (clean_env / "one.json").write_text("{}")
    params = {"x": 1, "long": "y" * 7000, "many": {f"p{i}": i for i in range(150)}}  # MLflow chunks and truncates
    with tracking._stage_run("report", settings, params, profile="tiny") as run:
        assert run.enabled and run.id == run.info.run_id
        other = run.client.create_run(run.info.experiment_id).info.run_id  # e.g. the pipeline's parent run
        run.log_metrics({"summary/a": 1.5})
        run.log_metrics({"b": 2.0}, step=7)
        run.log_text("hello", "samples/step_000001.txt")
        run.log_dict({"k": 1}, "d.json")
        run.log_artifact(clean_env / "one.json")
        run.log_artifacts(clean_env / "out", "report", run_id=other)
        run.set_tags({"registered_model": "models:/chatpipe/1"})
        run.log({"train/loss": 3.0}, step=1)
        run.log({"train/loss": 2.0}, step=2)  # async: in the store once the run has ended
    client = mlflow.MlflowClient()
    got = client.get_run(run.id)
    own = {k: v for k, v in got.data.metrics.items() if not k.startswith("system/")}
    assert own == {"summary/a": 1.5, "b": 2.0, "train/loss": 2.0}
    assert [(m.step, m.value) for m in client.get_metric_history(run.id, "b")] == [(7, 2.0)]
    assert [m.step for m in client.get_metric_history(run.id, "train/loss")] == [1, 2]
    assert got.data.params["x"] == "1" and got.data.params["long"] == "y" * 6000 and len(got.data.params) == 152
    assert got.data.tags["registered_model"] == "models:/chatpipe/1"
    assert {f.path for f in client.list_artifacts(run.id)} == {"samples", "d.json", "one.json"}
    assert mlflow.artifacts.load_text(f"{got.info.artifact_uri}/samples/step_000001.txt") == "hello"
    assert [f.path for f in client.list_artifacts(other, "report")] == ["report/report.md"]
    assert client.list_artifacts(run.id, "report") == []


def test_per_step_metrics_reach_the_store_in_a_few_batches(clean_env, monkeypatch):
    """StageRun.log queues each step's metrics; MLflow's async queue sends what arrived within its
    buffering window as one batch (one store transaction) instead of one write per step."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    monkeypatch.delenv("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", raising=False)  # the stage's default applies
    batches = []
    log_batch = SqlAlchemyStore.log_batch

    def counting(self, run_id, metrics, params, tags):
        if any(m.key == "train/loss" for m in metrics):
            batches.append(len(metrics))
        return log_batch(self, run_id, metrics, params, tags)

    monkeypatch.setattr(SqlAlchemyStore, "log_batch", counting)
    with tracking._stage_run("pretrain", settings_at(clean_env), {"x": 1}, profile="tiny") as run:
        for step in range(20):
            run.log({"train/loss": 1.0 / (step + 1)}, step=step)
    history = mlflow.MlflowClient().get_metric_history(run.id, "train/loss")
    assert sorted(m.step for m in history) == list(range(20))
    assert 1 <= len(batches) <= 3, batches  # one write per step before: 20


def test_a_relative_store_is_the_one_in_the_current_directory_each_time(clean_env, monkeypatch):
    # MLflow keeps one open store per URI string, so a relative sqlite URI used from a second
    # directory in the same process would still write the first directory's database
    settings = TrackingSettings.model_construct(
        uri="sqlite:///mlruns/mlflow.db", artifact_root="mlruns/artifacts", experiment="chatpipe", enabled=True
    )
    for project in (clean_env / "a", clean_env / "b"):
        project.mkdir()
        monkeypatch.chdir(project)
        tracking.configure(settings)
        with mlflow.start_run(experiment_id=mlflow.get_experiment_by_name("chatpipe").experiment_id):
            mlflow.log_param("project", project.name)
        assert (project / "mlruns/mlflow.db").exists()
        runs = mlflow.search_runs(experiment_names=["chatpipe"], output_format="list")
        assert [r.data.params["project"] for r in runs] == [project.name]
