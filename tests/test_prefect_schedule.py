"""A scheduled run, end to end, the way a user sets it up: a real Prefect server, `prefect deploy --all`
from prefect.yaml, a process worker; the schedule fires, the worker runs the pipeline, and the flow run
and the MLflow parent run point at each other.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from chatpipe.testing.project import BIN, make_project, project_env

POOL = "chatpipe-local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child in its own process group, stopped (group and all) by :meth:`stop`; output to a log file."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def wait_http(url: str, proc: Proc, timeout_s: float = 180) -> None:
    """Wait until ``url`` answers 200; fail with the server's log when it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.proc.poll() is None, f"server exited:\n{proc.tail()}"
        assert time.monotonic() < deadline, f"{url} not up in {timeout_s} s:\n{proc.tail()}"
        time.sleep(1)


@pytest.fixture
def stack(tmp_path):
    """A project copy whose nightly deployment runs every 20 s (data stage only), a server and env."""
    project = make_project(tmp_path / "project")
    config = yaml.safe_load((project / "prefect.yaml").read_text())
    nightly = next(d for d in config["deployments"] if d["name"] == "nightly")
    # what a user does to try a schedule: edit prefect.yaml (seconds instead of 03:00; one short stage).
    # The first run is due at the interval's next tick, so a short interval is a short wait.
    nightly["schedules"] = [{"interval": 20}]
    nightly["parameters"] = {"profile": "tiny", "stages": ["data"]}
    (project / "prefect.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    port = free_port()
    env = project_env(
        project,
        CHATPIPE_HOME=str(project),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",  # schedule runs soon after deploy
        PREFECT_WORKER_QUERY_SECONDS="2",  # and pick them up soon after they are due
    )
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the flow's stage lines reach the API (checked below)
    server = Proc(
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        project,
        env,
        tmp_path / "server.log",
    )
    procs = [server]
    try:
        wait_http(f"{env['PREFECT_API_URL']}/health", server)
        yield project, env, procs, tmp_path
    finally:
        for p in reversed(procs):
            p.stop()


def prefect(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(BIN / "prefect"), "--no-prompt", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (
        f"prefect {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


def api(env: dict[str, str], method: str, path: str, body: dict | None = None):
    r = httpx.request(method, env["PREFECT_API_URL"] + path, json=body, timeout=30)
    r.raise_for_status()
    return r.json()


@pytest.mark.slow
def test_scheduled_deployment_fires_runs_on_a_worker_and_links_mlflow(stack):
    project, env, procs, tmp = stack
    prefect(env, project, "work-pool", "create", POOL, "--type", "process")
    deploy = prefect(env, project, "deploy", "--all")
    assert "chatpipe/nightly" in deploy.stdout and "chatpipe/speedrun" in deploy.stdout

    deployments = {d["name"]: d for d in api(env, "POST", "/deployments/filter", {"limit": 10})}
    assert set(deployments) == {"nightly", "speedrun"}
    assert [s["schedule"]["interval"] for s in deployments["nightly"]["schedules"]] == [20.0]
    assert deployments["speedrun"]["schedules"] == []

    worker = Proc(
        [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--limit", "1"], project, env, tmp / "worker.log"
    )
    procs.append(worker)

    # the scheduler creates runs from the interval; the worker picks the first up and runs it
    nightly_id = deployments["nightly"]["id"]
    deadline, run = time.monotonic() + 540, None
    while time.monotonic() < deadline:
        runs = api(
            env,
            "POST",
            "/flow_runs/filter",
            {"deployments": {"id": {"any_": [nightly_id]}}, "sort": "EXPECTED_START_TIME_ASC", "limit": 20},
        )
        # the scheduler's loop creates the runs; allow it two minutes before calling the schedule dead
        assert runs or time.monotonic() < deadline - 420, "the schedule created no run in 120 s"
        done = [r for r in runs if r["state_type"] in ("COMPLETED", "FAILED", "CRASHED")]
        if done:
            run = done[0]
            break
        assert worker.proc.poll() is None, f"worker exited:\n{worker.tail()}"
        time.sleep(1)
    assert run is not None, f"no scheduled run finished in time\nworker:\n{worker.tail()}\nserver:\n{procs[0].tail()}"
    assert run["state_type"] == "COMPLETED", f"run {run['name']} is {run['state_type']}\nworker:\n{worker.tail()}"
    assert run["auto_scheduled"] and run["parameters"]["stages"] == ["data"]

    # Prefect -> MLflow: the flow run carries the parent run's id; its task runs carry no tag (each
    # tag would be a concurrency lease per task), their stage runs name them instead (below)
    links = [t.removeprefix("mlflow_run:") for t in run["tags"] if t.startswith("mlflow_run:")]
    assert len(links) == 1, run["tags"]
    parent_id = links[0]
    tasks = api(env, "POST", "/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}, "limit": 50})
    assert {t["name"] for t in tasks} >= {"profile", "data"}
    assert all(t["tags"] == [] for t in tasks), [t["tags"] for t in tasks]

    # MLflow -> Prefect: the parent run names the flow run (id, name, UI URL); the stage run nests under it
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{project}/mlruns/mlflow.db")
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.info.lifecycle_stage == "active"
    assert parent.data.tags["prefect.flow_run_id"] == run["id"]
    assert parent.data.tags["prefect.flow_run_name"] == run["name"]
    url = parent.data.tags["prefect.flow_run_url"]
    assert url.startswith(env["PREFECT_API_URL"].removesuffix("/api")) and url.endswith(f"/flow-run/{run['id']}")
    assert parent.data.tags["prefect.deployment"] == "chatpipe/nightly"
    assert parent.data.tags["stages_ran"] == "data"
    nested = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert [r.data.tags["stage"] for r in nested] == ["data"]
    data_task = next(t for t in tasks if t["name"] == "data")
    assert nested[0].data.tags["prefect.task_run_id"] == data_task["id"]  # stage run -> its task run
    stages = json.loads(Path(client.download_artifacts(parent_id, "stages.json", str(tmp))).read_text())
    assert stages == {"profile": "ran", "data": "ran"}

    # the flow's log holds the stage output, without DVC's git advice
    logs = api(env, "POST", "/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "limit": 200})
    text = "\n".join(entry["message"] for entry in logs)
    assert "Running stage 'data'" in text and "git add dvc.lock" not in text and "core.autostage" not in text
