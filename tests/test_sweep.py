"""Sweeps end to end on a tiny grid: dedup, resume after SIGTERM, concurrency (and each point's share of
the cores), MLflow, and bad input.

One project copy; the sweep is run three times: killed (SIGTERM) after some points finished while
another is mid-training, finished by a second run, then re-run. Training processes are counted as the
pretrain stage's MLflow runs (one per process), not log lines.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from chatpipe.settings import ParamsError
from chatpipe.sweep.spec import expand, load_sweep
from chatpipe.testing.project import REPO, make_project, project_env

PRETRAIN = {
    "sequence_len": 64,
    "device_batch_size": 8,
    "total_batch_size": 512,
    "max_steps": -1,
    "target_param_data_ratio": -1,
    "eval_every": 0,
    "eval_tokens": 2048,
    "checkpoint_every": 10,
    "sample_every": 0,
    "log_every": 10,
    "compile": False,
}
SWEEP = {
    "name": "t",
    "profile": "tiny",
    "settings": {"pretrain": PRETRAIN},
    # depth 3 at 3e10 FLOPs: 6 steps; depth 1 at 6e10 FLOPs: 217 steps (checkpoints every 10: killable midway)
    "grid": {"pretrain.target_flops": [3.0e10, 6.0e10], "pretrain.depth": [3, 2, 1]},
    "stages": ["data", "tokenizer", "pretrain"],
    "metrics": ["pretrain.val_bpb", "pretrain.tokens"],
    "concurrency": 2,
}


def write_sweep(path: Path, **changes) -> Path:
    path.write_text(yaml.safe_dump({**SWEEP, **changes}, sort_keys=False))
    return path


def sweep_cmd(project: Path) -> list[str]:
    return [sys.executable, "-m", "flows.sweep", "sweep.yaml", "--runs-dir", "runs"]


def on_two_cores() -> None:
    """Make the sweep's machine a 2-core one, whatever this one is: it and its processes run on two CPUs."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])


def runs_df(project: Path):
    """Every MLflow run of the project's store (a fresh import per call: the store is another process's)."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{project}/mlruns/mlflow.db")
    return mlflow.search_runs(experiment_names=["chatpipe"])


def done_points(project: Path) -> set[str]:
    return {p.parent.name for p in (project / "runs").glob("target_flops*/done.json")}


def pretrain_runs_by_point(df) -> dict[str, list]:
    """Point name -> its pretrain stage runs (nested under the point's child runs), oldest first."""
    children = df[df["tags.stage"] == "sweep-point"].set_index("run_id")["tags.sweep.point"]
    stage = df[df["tags.stage"] == "pretrain"].sort_values("start_time")
    out: dict[str, list] = {}
    for _, r in stage.iterrows():
        out.setdefault(children[r["tags.mlflow.parentRunId"]], []).append(r)
    return out


def kill_midway(project: Path, env: dict[str, str]) -> tuple[set[str], set[str]]:
    """Start the sweep; SIGTERM it once 2 points are done and an unfinished one has a checkpoint.

    Returns the point directories finished before the stop, and the point names stopped past a checkpoint.
    """
    proc = subprocess.Popen(
        sweep_cmd(project),
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=on_two_cores,
    )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        done = done_points(project)
        midway = [
            p
            for p in (project / "runs").glob("target_flops*/checkpoints/pretrain/step_*")
            if p.parents[2].name not in done
        ]
        if len(done) >= 2 and midway:
            break
        time.sleep(0.2)
    assert proc.poll() is None, f"the sweep ended before it could be killed:\n{proc.stdout.read().decode()[-3000:]}"
    killed_at = done_points(project)
    stopped = {p.parents[2].name.rsplit("-", 1)[0] for p in midway}
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode != 0, out[-2000:]
    assert killed_at <= done_points(project)
    return killed_at, stopped


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    dest = make_project(tmp_path_factory.mktemp("sweep") / "proj")
    write_sweep(dest / "sweep.yaml")
    return dest


def test_killed_sweep_trains_only_the_rest_and_a_rerun_trains_nothing(project, prefect_server):
    env = project_env(project, PREFECT_API_URL=prefect_server)  # the flow's subject here is not its server
    del env["OMP_NUM_THREADS"]  # as a user runs it: each point takes its share of the 2 cores
    killed_at, stopped = kill_midway(project, env)
    assert 1 <= len(killed_at) < 6
    df = runs_df(project)
    assert list(df[df["tags.stage"] == "sweep"]["status"]) == ["KILLED"]

    subprocess.run(sweep_cmd(project), cwd=project, env=env, check=True, capture_output=True, preexec_fn=on_two_cores)
    df = runs_df(project)
    by_point = pretrain_runs_by_point(df)
    assert len(done_points(project)) == 6 and len(by_point) == 6
    for point, runs in by_point.items():
        if any(d.startswith(point + "-") for d in killed_at):
            assert len(runs) == 1, f"{point} was finished before the stop but trained again"
    resumed = [by_point[name][-1] for name in stopped if len(by_point[name]) == 2]
    assert resumed, f"no point was stopped mid-training: {stopped}"
    import mlflow

    client = mlflow.MlflowClient()
    for run in resumed:  # its loss curve starts past a checkpoint, not at step 1
        steps = [m.step for m in client.get_metric_history(run["run_id"], "train/loss")]
        assert min(steps) > 10, steps

    before = len(df[df["tags.stage"] == "pretrain"])
    subprocess.run(sweep_cmd(project), cwd=project, env=env, check=True, capture_output=True, preexec_fn=on_two_cores)
    df = runs_df(project)
    assert len(df[df["tags.stage"] == "pretrain"]) == before  # no training process started
    last = df[df["tags.stage"] == "sweep"].sort_values("start_time").iloc[-1]
    children = df[df["tags.mlflow.parentRunId"] == last["run_id"]]
    assert len(children) == 6 and set(children["tags.cached"]) == {"true"}


def test_one_parent_per_sweep_run_with_a_child_per_point_overlapping_and_the_fit(project):
    df = runs_df(project)
    parents = df[df["tags.stage"] == "sweep"].sort_values("start_time")
    assert list(parents["status"]) == ["KILLED", "FINISHED", "FINISHED"]
    finished = parents.iloc[1]
    children = df[df["tags.mlflow.parentRunId"] == finished["run_id"]]
    assert len(children) == 6
    assert set(children["params.pretrain.depth"]) == {"1", "2", "3"}
    assert children["metrics.pretrain/val_bpb"].notna().all() and children["metrics.flops"].notna().all()
    trained = children[children["tags.cached"] == "false"].sort_values("start_time")
    spans = list(zip(trained["start_time"], trained["end_time"]))
    assert any(a0 < b1 and b0 < a1 for i, (a0, a1) in enumerate(spans) for b0, b1 in spans[i + 1 :]), spans
    import mlflow

    names = {a.path for a in mlflow.MlflowClient().list_artifacts(finished["run_id"], "sweep")}
    assert {"sweep/results.csv", "sweep/isoflop.png", "sweep/scaling.png"} <= names
    table = list(csv.DictReader((project / "runs" / "t-results" / "results.csv").open()))
    assert len(table) == 6 and all(float(r["pretrain.val_bpb"]) > 0 for r in table)
    result = json.loads(
        Path(mlflow.MlflowClient().download_artifacts(finished["run_id"], "sweep/result.json")).read_text()
    )
    assert result["budgets_used"] == 2 and {"a", "b", "ratio", "ratio_total"} <= set(result)
    # points never wrote into each other's files: each directory's final model is its own depth's
    for row in table:
        meta = json.loads((project / row["dir"] / "artifacts" / "base" / "meta.json").read_text())
        assert meta["model_config"]["n_layer"] == int(row["pretrain.depth"])


def test_two_points_at_a_time_on_two_cores_train_with_one_thread_each(project):
    # each training process's intra-op threads, read from torch in the process and logged as its
    # MLflow param; left to torch's default, each took both cores and the points ran 10-19x slower
    stage = runs_df(project).query("`tags.stage` == 'pretrain'")
    # a run the first sweep's SIGTERM stopped before it logged its params has none (CI once saw one)
    logged = stage.dropna(subset=["params.runtime/threads"])
    assert len(logged) >= 6 and len(stage) - len(logged) <= 1
    assert list(logged["params.runtime/threads"].unique()) == ["1"]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"settings": {"pretrain": {**PRETRAIN, "dpeth": 2}}}, "pretrain.dpeth = 2: unknown settings key"),
        ({"grid": {}}, "the grid is empty"),
        ({"grid": {"pretrain.depth": []}}, "grid key 'pretrain.depth' has no values"),
        (
            {"grid": {"pretrain.target_flops": [1.0e5], "pretrain.depth": [2]}},
            "point target_flops1e05-depth2: pretrain.target_flops = 1e+05 is too small for one step",
        ),
    ],
)
def test_bad_sweeps_fail_before_training_naming_the_key_or_point(tmp_path, monkeypatch, change, message):
    monkeypatch.chdir(REPO)
    path = write_sweep(tmp_path / "bad.yaml", **change)
    with pytest.raises(ParamsError) as err:
        expand(load_sweep(path))
    assert message in str(err.value)
    from flows.sweep import main

    with pytest.raises(SystemExit) as stop:
        main([str(path), "--runs-dir", str(tmp_path / "runs")])
    assert stop.value.code == 2 and not (tmp_path / "runs").exists()


def test_the_shipped_sweeps_validate_and_price(monkeypatch):
    monkeypatch.chdir(REPO)
    from chatpipe.sweep.spec import format_plan

    speedrun = load_sweep(REPO / "sweeps" / "isoflop_speedrun.yaml")
    assert len(speedrun.grid["pretrain.depth"]) * len(speedrun.grid["pretrain.target_flops"]) == 24
    speedrun.grid = {"pretrain.target_flops": [1.0e19], "pretrain.depth": [20]}  # one point: d20 on meta is slow
    points = expand(speedrun)
    out = format_plan(speedrun, points)
    # nanochat's d20 at 1e19 FLOPs: its automatic batch is 2**20 tokens, ~3.3k steps
    assert points[0].counts["total_batch_size"] == 1 << 20 and 3000 < points[0].counts["steps"] < 3600
    assert "target_flops1e19-depth20" in out and "GPU-hours" in out
    tiny = expand(load_sweep(REPO / "sweeps" / "isoflop_tiny.yaml"))
    assert len(tiny) >= 9 and all(p.counts["steps"] >= 1 for p in tiny)


def test_a_point_is_its_content_hash_whatever_its_name_or_placement(tmp_path):
    from chatpipe.sweep.points import WorkDir

    params = {"data": {"source": "synthetic"}, "pretrain": {"depth": 2}, "launch": {"scheduler": "local_cwd"}}
    first = WorkDir(tmp_path, "depth2-a", params, ["pretrain"], code="c1")
    first.path.mkdir(parents=True)
    assert WorkDir(tmp_path, "other-name", params, ["pretrain"], code="c1").path == first.path
    slurm = {**params, "launch": {"scheduler": "slurm"}, "tracking": {"enabled": False}}
    assert WorkDir(tmp_path, "x", slurm, ["pretrain"], code="c1").path == first.path  # where it runs: same point
    for changed, code in (({**params, "pretrain": {"depth": 3}}, "c1"), (params, "c2")):
        assert WorkDir(tmp_path, "depth2-a", changed, ["pretrain"], code=code).key != first.key
    data = {**params, "data": {"source": "synthetic", "seed": 7}}
    assert WorkDir(tmp_path, "depth2-a", data, ["pretrain"], code="c1").key != first.key


def test_running_points_get_distinct_rendezvous_ports_that_skip_ports_already_bound():
    """Another program holding ``base + 1`` must not make a point's rendezvous fail with EADDRINUSE."""
    import contextlib
    import socket

    from flows.sweep import RdzvPorts

    ports, held = RdzvPorts(), []
    with contextlib.ExitStack() as running:
        base, other = _free_port_with_the_next_one_bound()  # ``other`` is someone else's server on base + 1
        running.callback(other.close)
        for _ in range(3):
            held.append(running.enter_context(ports.take(base)))
        assert len(set(held)) == 3 and base + 1 not in held
        for port in held:  # each is free to bind right now
            with socket.socket() as s:
                s.bind(("", port))
    with ports.take(base) as again:  # released ports are handed out again
        assert again == base


def _free_port_with_the_next_one_bound():
    """A free port ``base`` and a listening socket on ``base + 1``. Tests running in parallel take
    ports too, so a pair is retried until both halves are ours (a CI run once found base + 1 taken)."""
    import socket

    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("", 0))
            base = probe.getsockname()[1]
        other = socket.socket()
        try:
            other.bind(("", base + 1))
        except OSError:
            other.close()
            continue
        other.listen()
        return base, other
    raise RuntimeError("no free pair of neighbouring ports in 100 tries")
