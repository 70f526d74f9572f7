"""Stages as jobs on a real two-node Slurm cluster (scripts/slurm-local.sh), faults included.

The cluster is the one `scripts/slurm-local.sh up` starts (CI runs it before pytest); when it is not
up, the first test here starts it and the session stops it at the end. Where it cannot start (not
root, packages missing) every test skips with the script's reason; with CHATPIPE_REQUIRE_SLURM=1
(CI) that is a failure instead.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from chatpipe.testing.project import (
    PIPELINE_PARAMS,
    REPO,
    assert_bitwise_equal,
    final_weights,
    loss_curve,
    make_project,
    plotted_curve,
    prefect_task_runs,
    processes_in,
    project_env,
    rl_ready_project,
    run,
)

SCRIPT = REPO / "scripts" / "slurm-local.sh"
MULTI = ("pretrain", "midtrain", "sft", "rl", "eval")  # stages that run as 2 nodes x 1 process


@pytest.fixture(scope="session")
def slurm_cluster():
    """SLURM_CONF of the running local cluster; started here (and stopped after) when it was not up."""
    status = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True)
    started = False
    if status.returncode != 0:
        up = subprocess.run(["bash", str(SCRIPT), "up"], capture_output=True, text=True, timeout=600)
        if up.returncode != 0:
            reason = f"local Slurm cluster cannot start: {up.stderr.strip() or up.stdout.strip()}"
            print(reason)
            if os.environ.get("CHATPIPE_REQUIRE_SLURM"):
                pytest.fail(reason)
            pytest.skip(reason)
        started = True
    conf = subprocess.run(["bash", str(SCRIPT), "env"], capture_output=True, text=True, check=True).stdout
    conf = conf.strip().split("=", 1)[1]
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = conf
    try:
        yield conf
    finally:
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old
        if started:
            subprocess.run(["bash", str(SCRIPT), "down"], check=False)


def rendezvous_base(span: int = 16) -> int:
    """A rendezvous base port with ``span`` free ports from it (a sweep hands its points base, base + 1,
    ...), below the kernel's ephemeral range. A port from that range (one bound to port 0) races every
    outgoing connection on the host: in CI of b0287a4 one took base + 3 between the sweep's check and
    torchrun's bind seconds later, and the point's first Slurm job failed with EADDRINUSE."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    for _ in range(200):
        base = random.randrange(20000, low - span)
        if all(_bindable(port) for port in range(base, base + span)):
            return base
    raise RuntimeError(f"no {span} free ports in a row between 20000 and {low}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def slurm_env(project: Path, **extra: str) -> dict[str, str]:
    """The project's environment plus the cluster's config and a rendezvous port no one else uses."""
    return {"SLURM_CONF": os.environ["SLURM_CONF"], "CHATPIPE_LAUNCH__RDZV_PORT": str(rendezvous_base()), **extra}


def project_jobs(project: Path) -> list[dict[str, str]]:
    """Every Slurm job component submitted from ``project``, from accounting (sacct -X)."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-S", "now-6hours", "--format=JobID,JobName,State,NodeList,WorkDir"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [dict(zip(("id", "name", "state", "nodes", "workdir"), r.split("|"))) for r in out.splitlines()]
    return [r for r in rows if r.get("workdir") == str(project)]


def queued(project: Path) -> list[str]:
    """Jobs of ``project`` the controller still has (pending, running or completing)."""
    out = subprocess.run(["squeue", "-h", "-o", "%i|%T|%Z"], capture_output=True, text=True, check=True).stdout
    return [r for r in out.splitlines() if r.endswith(f"|{project}")]


def workers(project: Path, stage: str = "pretrain") -> list[psutil.Process]:
    """The stage's worker processes (not torchrun) running in ``project``."""
    return [
        p
        for p, cmd in processes_in(project)
        if f"stages.{stage}" in cmd and "torchrun" not in cmd and "bash -c" not in cmd
    ]


def copy_project(src: Path, dest: Path, forget: tuple[str, ...] = ()) -> Path:
    """A copy of a finished project; the stages in ``forget`` lose outputs, checkpoints and cache, so they re-run."""
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns("logs"))
    shutil.rmtree(dest / ".dvc" / "cache", ignore_errors=True)  # or DVC restores instead of running
    outs = {"pretrain": "base", "midtrain": "mid", "sft": "sft", "rl": "rl", "eval": "eval", "report": "report"}
    for stage in forget:
        shutil.rmtree(dest / "artifacts" / outs[stage], ignore_errors=True)
        shutil.rmtree(dest / "checkpoints" / stage, ignore_errors=True)
    return dest


# --------------------------------------------------------------------------- fast: cluster pieces


def test_worker_without_the_repository_names_path_and_node(slurm_cluster, tmp_path):
    """The shared-filesystem guard every worker runs first, on node n2 with a path it cannot see."""
    from chatpipe.slurm import NO_SHARED_FS_EXIT, shared_fs_guard

    missing = tmp_path / "not-mounted" / "repo"
    guard = shared_fs_guard(missing, missing / "logs" / "slurm" / ".repo-x", "x")
    proc = subprocess.run(
        ["srun", "-w", "n2", "-N1", "-n1", "--chdir=/tmp", "bash", "-c", guard + "echo reached"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == NO_SHARED_FS_EXIT, (proc.returncode, proc.stdout, proc.stderr)
    assert "reached" not in proc.stdout
    assert f"node n2 cannot see the repository at {missing}" in proc.stderr, proc.stderr
    # and the guard lets a worker that sees the repository through, in the repository
    marker = tmp_path / ".repo-y"
    marker.write_text("y")
    ok = subprocess.run(
        [
            "srun",
            "-w",
            "n1",
            "-N1",
            "-n1",
            "--chdir=/tmp",
            "bash",
            "-c",
            shared_fs_guard(tmp_path, marker, "y") + "pwd",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == str(tmp_path), (ok.stdout, ok.stderr)


def test_cancelled_by_uid_is_a_state_here_not_an_assertion(slurm_cluster, tmp_path):
    """sacct says ``CANCELLED by 0`` after scancel: torchx 0.7's describe asserts, job_status reports it."""
    from torchx.schedulers.slurm_scheduler import SlurmScheduler

    from chatpipe.slurm import cancel, job_status

    job = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", f"--output={tmp_path}/out", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    deadline = time.monotonic() + 60
    while (st := job_status(job)) is None or st.state not in ("RUNNING",):
        assert time.monotonic() < deadline, f"job {job} never ran: {st}"
        time.sleep(0.5)
    status = cancel(job)
    deadline = time.monotonic() + 30
    while not (status and status.done and status.components[0].state.startswith("CANCELLED by")):
        assert time.monotonic() < deadline, f"accounting never recorded the cancel: {status}"
        time.sleep(0.5)
        status = job_status(job)
    assert status.state == "CANCELLED"
    with pytest.raises(AssertionError, match="CANCELLED by"):
        SlurmScheduler("t").describe(job)  # the torchx 0.7 bug worked around by job_status


# --------------------------------------------------------------------------- the pipeline on Slurm


@pytest.fixture(scope="module")
def slurm_pipeline(slurm_cluster, prefect_server, tmp_path_factory) -> Path:
    """A project on which `python -m flows.pipeline --profile slurm` has run every stage."""
    project = make_project(tmp_path_factory.mktemp("slurm") / "proj", PIPELINE_PARAMS)
    t0 = time.perf_counter()
    env = slurm_env(project, PREFECT_API_URL=prefect_server)
    out = run(project, "python", "-m", "flows.pipeline", "--profile", "slurm", **env)
    print(f"slurm pipeline: {time.perf_counter() - t0:.1f} s")
    assert "'report': 'ran'" in out.stdout, out.stdout[-3000:]
    return project


@pytest.mark.slow
def test_pipeline_runs_every_stage_as_slurm_jobs_and_matches_local(slurm_pipeline, tmp_path):
    project = slurm_pipeline
    jobs = project_jobs(project)
    by_stage: dict[str, set[str]] = {}
    for j in jobs:
        stage = j["name"].rpartition("-")[0]
        by_stage.setdefault(stage, set()).add(j["id"].partition("+")[0])
    stages = ("data", "tokenizer", "pretrain", "midtrain", "sft", "rl", "eval", "report")
    assert {s: len(by_stage.get(s, ())) for s in stages} == dict.fromkeys(stages, 1), jobs  # one job per stage run
    for stage in MULTI:
        nodes = sorted(j["nodes"] for j in jobs if j["name"].startswith(f"{stage}-"))
        assert nodes == ["n1", "n2"], (stage, nodes)  # both nodes used
    assert all(j["state"] == "COMPLETED" for j in jobs), jobs

    # The same math locally: one node with 2 gloo processes (same world size, same data shards, same
    # all-reduce of 2 addends, which is commutative in floating point), so every metric is bitwise equal.
    local = copy_project(project, tmp_path / "local", forget=MULTI + ("report",))
    env = {"CHATPIPE_PROFILE": "tiny", "CHATPIPE_LAUNCH__NPROC_PER_NODE": "2"}
    for stage in (*MULTI, "report"):
        run(local, "python", "-m", "chatpipe.launch", stage, **env)
    slurm_report = json.loads((project / "artifacts" / "report" / "report.json").read_text())["summary"]
    local_report = json.loads((local / "artifacts" / "report" / "report.json").read_text())["summary"]
    assert slurm_report == local_report
    assert any(v is not None for cols in slurm_report.values() for v in cols.values())
    assert_bitwise_equal(final_weights(local), final_weights(project))


@pytest.mark.slow
def test_two_slurm_nodes_match_one_local_process_with_grad_accum(slurm_pipeline, tmp_path):
    """2 nodes x 1 gloo process as a Slurm job == 1 local process accumulating 2 micro-batches."""
    project = copy_project(slurm_pipeline, tmp_path / "accum", forget=("pretrain",))
    args = ["--", "--max_steps=8", "--eval_every=0", "--checkpoint_every=0", "--log_every=1"]
    curves = {}
    for name, launch in (
        ("slurm", []),
        ("local", ["--scheduler", "local_cwd", "--nnodes", "1", "--nproc_per_node", "1"]),
    ):
        shutil.rmtree(project / "checkpoints", ignore_errors=True)
        # the Slurm job tracked: its rank 0, on a node, logs every step to the project's MLflow store
        tracked = {"CHATPIPE_TRACKING__ENABLED": "true"} if name == "slurm" else {}
        env = slurm_env(project, **tracked)
        out = run(project, "python", "-m", "chatpipe.launch", "pretrain", *launch, *args, **env)
        assert "SUCCEEDED" in out.stdout, out.stdout[-3000:]
        world = "world 2" if name == "slurm" else "world 1"
        assert world in out.stdout and ("grad accum 2" in out.stdout) == (name == "local"), out.stdout[-2000:]
        curves[name] = plotted_curve(project)
        if tracked:
            assert loss_curve(project) == pytest.approx(curves[name], abs=1e-6)  # the plot rounds to 6 places
    assert len(curves["slurm"]) == len(curves["local"]) == 8
    for a, b in zip(curves["local"], curves["slurm"]):
        assert abs(a - b) <= 1e-4 * abs(a), curves
    assert curves["local"][-1] < curves["local"][0]


# --------------------------------------------------------------------------- faults, from the Prefect flow


def newest_checkpoint(project: Path, stage: str = "pretrain") -> int | None:
    """The step of the stage's newest complete checkpoint, or None."""
    ckpt = project / "checkpoints" / stage
    steps = [p for p in sorted(ckpt.glob("step_*")) if (p / "meta.json").exists()] if ckpt.exists() else []
    return int(steps[-1].name.split("_")[1]) if steps else None


def wait_for_checkpoint(project: Path, stage: str = "pretrain", timeout_s: float = 600) -> int:
    """Block until the stage's first complete checkpoint exists; its step."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (step := newest_checkpoint(project, stage)) is not None:
            return step
        time.sleep(0.05)
    raise AssertionError(f"no {stage} checkpoint within {timeout_s}s")


def running_job(project: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = [r.split("|") for r in queued(project)]
        ids = {jid.partition("+")[0] for jid, state, _ in rows if state == "RUNNING"}
        if ids:
            return ids.pop()
        time.sleep(0.2)
    raise AssertionError(f"no running job from {project}")


def scancel_job(project: Path) -> str:
    wait_for_checkpoint(project)
    job = running_job(project)
    subprocess.run(["scancel", job], check=True)
    return f"scancel {job}"


def node2_worker(project: Path) -> psutil.Process | None:
    """The pretrain worker that Slurm started on node n2, if one runs now."""
    for p in workers(project):
        try:
            node = dict(kv.split("=", 1) for kv in open(f"/proc/{p.pid}/environ").read().split("\0") if "=" in kv)
        except OSError:
            continue
        if node.get("SLURMD_NODENAME") == "n2":
            return p
    return None


def kill_node2_worker(project: Path, timeout_s: float = 600) -> str:
    """kill -9 the n2 worker as soon as the first checkpoint is complete. The worker is found while the
    run heads for that checkpoint: a scan of the processes after it, on a loaded machine, once came too
    late (the tiny pretrain's last 16 steps had already ended)."""
    deadline, worker = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        worker = worker or node2_worker(project)
        if worker is not None and newest_checkpoint(project) is not None:
            worker.send_signal(signal.SIGKILL)
            return f"kill -9 {worker.pid} on n2"
        time.sleep(0.01 if worker else 0.05)
    raise AssertionError(f"no pretrain worker on n2 reached a checkpoint within {timeout_s}s")


@pytest.mark.slow
@pytest.mark.parametrize("fault", [scancel_job, kill_node2_worker], ids=["scancel", "kill-9-node2-worker"])
def test_flow_retries_a_faulted_slurm_pretrain_to_identical_weights(
    fault, slurm_pipeline, prefect_api_here, tmp_path, monkeypatch
):
    """The fault fails the task, Prefect retries it, the retry resumes from the newest checkpoint."""
    from flows.pipeline import pipeline

    reference = final_weights(slurm_pipeline)  # the uninterrupted Slurm run
    project = copy_project(slurm_pipeline, tmp_path / "fault", forget=("pretrain",))
    for key, value in {**project_env(project), **slurm_env(project)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(project)
    done: list[str] = []
    thread = threading.Thread(target=lambda: done.append(fault(project)), daemon=True)
    thread.start()
    state = pipeline(stages=["pretrain"], return_state=True)
    thread.join(timeout=5)
    assert done, "the fault was never injected"
    assert state.is_completed(), state

    runs = prefect_task_runs("pretrain", state.state_details.flow_run_id)
    assert len(runs) == 1 and runs[0].run_count == 2, [(r.name, r.run_count) for r in runs]
    jobs = sorted({j["id"].partition("+")[0] for j in project_jobs(project)}, key=int)
    assert len(jobs) == 2, jobs  # the faulted job and the retry's
    first = {j["state"].split()[0] for j in project_jobs(project) if j["id"].startswith(f"{jobs[0]}+")}
    assert first & {"CANCELLED", "FAILED"}, first
    retry_log = (project / "logs" / "slurm" / f"pretrain-{jobs[1]}-pretrain-0.out").read_text()
    assert re.search(r"resuming from checkpoints/pretrain/step_\d+", retry_log), retry_log[-2000:]
    assert_bitwise_equal(final_weights(project), reference)


@pytest.mark.slow
def test_sigterm_to_the_flow_leaves_no_job_and_no_worker(slurm_pipeline, prefect_server, tmp_path):
    """The flow exits only after its launcher has cancelled the job (an earlier flow exited when DVC did,
    and a launcher still cancelling then could lose its log pipe, and with it the cancel)."""
    project = copy_project(slurm_pipeline, tmp_path / "term", forget=("pretrain",))
    env = project_env(
        project, **slurm_env(project, CHATPIPE_PRETRAIN__MAX_STEPS="100000", PREFECT_API_URL=prefect_server)
    )
    proc = subprocess.Popen(
        ["python", "-m", "flows.pipeline", "--stages", "pretrain"],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_checkpoint(project)
        running_job(project)
        assert workers(project), "no worker running"
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=180)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    live = [r for r in queued(project) if r.split("|")[1] in ("PENDING", "RUNNING", "CONFIGURING")]
    assert not live, ("the flow exited while its job still ran", live, out[-3000:])
    deadline = time.monotonic() + 30
    while (queued(project) or workers(project)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not queued(project), (queued(project), out[-3000:])
    assert not workers(project), out[-3000:]
    states = {j["state"].split()[0] for j in project_jobs(project)}
    assert states == {"CANCELLED"}, (states, out[-3000:])  # scancelled: it could never have finished


def test_failure_report_names_the_worker_that_failed(tmp_path):
    """The launcher's last words on a failed job: node, exit code and the failed worker's rank and signal."""
    from chatpipe.slurm import Component, JobStatus, describe_failure

    err = tmp_path / "pretrain-7-pretrain-1.err"
    err.write_text(  # what torchrun 2.13 writes when a worker is SIGKILLed (abridged)
        "E1123 22:01:49 api.py:1002] failed (exitcode: -9) local_rank: 0 (pid: 16529) of binary: python3\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-23_22:01:49\n  host      : localhost\n"
        "  rank      : 1 (local_rank: 0)\n  exitcode  : -9 (pid: 16529)  (SIGKILL)\n"
    )
    status = JobStatus("7", [Component(0, "FAILED", 0, 15, "n1"), Component(1, "FAILED", 1, 0, "n2")])
    lines = describe_failure(status, [(tmp_path / "a.out", tmp_path / "a.err"), (tmp_path / "b.out", err)], tmp_path)
    assert lines[1] == "component 1 on node n2: FAILED, exit code 1; worker rank 1 killed by signal 9 (SIGKILL)"
    assert lines[0].startswith("component 0 on node n1: FAILED, exit code 0, signal 15 (SIGTERM)")
    assert status.state == "FAILED" and JobStatus("8", [Component(0, "CANCELLED by 0")]).state == "CANCELLED"


def test_a_decided_job_is_waited_out_while_squeue_still_lists_it_completing(monkeypatch):
    """sacct says CANCELLED at once; the nodes may still be killing its processes (squeue: COMPLETING).
    A retry started then met the old job's rendezvous port still bound (EADDRINUSE in CI)."""
    import subprocess

    from chatpipe import slurm

    answers = iter(["COMPLETING\nCOMPLETING\n", "COMPLETING\n", ""])
    calls = []

    def fake_slurm(*cmd):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, next(answers), "")

    monkeypatch.setattr(slurm, "_slurm", fake_slurm)
    assert slurm.wait_until_gone("7", timeout_s=5, poll_s=0.01) is True
    assert len(calls) == 3 and calls[0] == ("squeue", "-j", "7", "-h", "-o", "%T")

    monkeypatch.setattr(slurm, "_slurm", lambda *cmd: subprocess.CompletedProcess(cmd, 0, "COMPLETING\n", ""))
    assert slurm.wait_until_gone("7", timeout_s=0.05, poll_s=0.01) is False


# --------------------------------------------------------------------------- sweeps


@pytest.mark.slow
def test_sweep_runs_its_points_as_slurm_jobs_two_at_a_time(slurm_cluster, prefect_server, tmp_path):
    """4 points (2 budgets x 2 depths) on the `slurm` profile, concurrency 2: every pretrain a 2-node job."""
    import mlflow
    import yaml

    project = make_project(tmp_path / "proj", {"profile": "slurm"})
    sweep = {
        "name": "slurm4",
        "profile": "slurm",
        "settings": {
            # 1 CPU and 3 GB a node per job: two 2-node jobs fit the 2-CPU, 8 GB nodes at once
            "launch": {"cpus_per_node": 1, "mem_mb": 3000},
            "pretrain": {
                "sequence_len": 64,
                "device_batch_size": 4,  # 4 rows x 64 x 2 ranks = 512 tokens a step
                "total_batch_size": 512,
                "max_steps": -1,
                "target_param_data_ratio": -1,
                "eval_every": 0,
                "eval_tokens": 1024,
                "checkpoint_every": 0,
                "sample_every": 0,
                "dtype": "float32",
            },
        },
        "grid": {"pretrain.target_flops": [1.0e10, 2.0e10], "pretrain.depth": [1, 2]},
        "stages": ["data", "tokenizer", "pretrain"],
        "concurrency": 2,
    }
    (project / "sweep.yaml").write_text(yaml.safe_dump(sweep, sort_keys=False))
    env = slurm_env(project, PREFECT_API_URL=prefect_server)
    run(project, "python", "-m", "flows.sweep", "sweep.yaml", "--runs-dir", "runs", **env)

    points = sorted(p for p in (project / "runs").glob("target_flops*") if (p / "done.json").exists())
    assert len(points) == 4
    for point in points:  # each point's pretrain ran as one 2-node job from its own directory, and completed
        jobs = [j for j in project_jobs(point) if j["name"].startswith("pretrain-")]
        assert len({j["id"].partition("+")[0] for j in jobs}) == 1, jobs
        assert sorted(j["nodes"] for j in jobs) == ["n1", "n2"] and all(j["state"] == "COMPLETED" for j in jobs), jobs
    mlflow.set_tracking_uri(f"sqlite:///{project}/mlruns/mlflow.db")
    df = mlflow.search_runs(experiment_names=["chatpipe"])
    children = df[df["tags.stage"] == "sweep-point"]
    spans = sorted(zip(children["start_time"], children["end_time"]))
    assert len(spans) == 4
    overlaps = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :] if a[0] < b[1] and b[0] < a[1]]
    assert overlaps, spans  # two points trained at the same time
    for start, _ in spans:  # and never three
        assert sum(s <= start < e for s, e in spans) <= 2


# --------------------------------------------------------------------------- asynchronous RL's two roles


@pytest.mark.slow
def test_async_rl_puts_the_trainer_and_the_rollout_role_on_two_nodes(slurm_cluster, tmp_path):
    """rl.rollout.role as a Slurm heterogeneous job: one component a node, meeting in the project's
    checkpoints dir (the launcher's choice off local_cwd); the stage finishes and trains every step."""
    from tests.test_stage_rl import setup_project

    project = setup_project(tmp_path, max_steps=4, eval_every=0, checkpoint_every=2)
    stage = ["--", "--rollout.role=true", "--rollout.max_staleness=1", "--log_every=1"]
    launch = ["--scheduler", "slurm", "--nnodes", "1", "--nproc_per_node", "1"]
    env = slurm_env(project, CHATPIPE_TRACKING__ENABLED="false")
    out = run(project, "python", "-m", "chatpipe.launch", "rl", *launch, *stage, **env)
    assert "SUCCEEDED" in out.stdout, out.stdout[-3000:]
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    assert meta["step"] == 4 and len(meta["prompt_indices"]) == 4
    nodes = {job["name"]: job["nodes"] for job in project_jobs(project)}
    assert len(nodes) == 2 and len(set(nodes.values())) == 2, nodes  # trainer and role, a node each
    assert not (project / "checkpoints" / "rl" / "exchange" / "weights.pt").exists()


# --------------------------------------------------------------------------- several rollout workers


def weight_files_seen(root: Path, done: threading.Event, seen: list[str]) -> None:
    """Every file whose name says weights that appears under ``root`` until ``done``."""
    while not done.wait(0.05):
        seen.extend(str(p) for p in root.rglob("*weight*") if str(p) not in seen)


def node_of(log: Path, pattern: str) -> str:
    """The node a process of the job said it ran on, from its log (``log``: the .out; the .err beside it too)."""
    text = log.read_text() + log.with_suffix(".err").read_text()
    found = re.findall(pattern + r" on node (\S+)", text)
    assert found, f"{log} does not say its node: {text[-2000:]}"
    return found[0]


@pytest.mark.slow
def test_two_rollout_workers_on_two_slurm_nodes_get_weights_over_torch_distributed(slurm_cluster, tiny_sft, tmp_path):
    """rl.rollout.workers: 2 as one Slurm job: the trainer and worker 0 in one component (a heterogeneous job's
    components never share a node), worker 1 in the other, on the other node;
    the weights go over torch.distributed (no weights file under the exchange dir, which is in the project's
    checkpoints, not /dev/shm), every batch within max_staleness, and RL lifts the tiny SFT model's pass@1."""
    project = rl_ready_project(tmp_path / "tiny", tiny_sft)
    stage = ["--", "--rollout.role=true", "--rollout.workers=2", "--rollout.max_staleness=1", "--log_every=1"]
    stage += ["--eval_every=0", "--test_split=none"]  # pass@1 on val before and after is what this test reads
    launch = ["--scheduler", "slurm", "--nnodes", "1", "--nproc_per_node", "1"]
    env = slurm_env(project, CHATPIPE_LAUNCH__CPUS_PER_NODE="2")  # the trainer's node: 1 core each for it and worker 0
    done, seen = threading.Event(), []
    watcher = threading.Thread(target=weight_files_seen, args=(project / "checkpoints" / "rl", done, seen))
    watcher.start()
    try:
        out = run(project, "python", "-m", "chatpipe.launch", "rl", *launch, *stage, **env)
    finally:
        done.set()
        watcher.join()
    assert "SUCCEEDED" in out.stdout, out.stdout[-3000:]
    assert not seen, f"weights went through files: {seen}"
    job = re.search(r"slurm job (\d+)", out.stdout).group(1)
    logs = project / "logs" / "slurm"
    trainer = node_of(logs / f"rl-{job}-rl-0.out", "trainer")
    workers = [node_of(logs / f"rl-{job}-rl-0.out", "rollout worker 0 of 2")]
    workers.append(node_of(logs / f"rl-{job}-rl_rollout-0.out", "rollout worker 1 of 2"))
    assert trainer == workers[0] and set(workers) == {"n1", "n2"}, (trainer, workers)  # a worker on each node
    nodes = {j["name"]: j["nodes"] for j in project_jobs(project)}
    assert nodes == {"rl-0": trainer, "rl_rollout-0": workers[1]}, nodes  # as Slurm accounted them
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    staleness = [float(v) for v in re.findall(r"async/staleness ([-0-9.e]+)", out.stdout)]
    assert len(staleness) == meta["step"] == 80 and 0 <= min(staleness) and max(staleness) <= 1, staleness
    first, final = meta["summary"]["first_eval/pass_at_1"], meta["summary"]["final_eval/pass_at_1"]
    assert final >= first + 0.03, (first, final)
