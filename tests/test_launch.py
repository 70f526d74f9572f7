"""The torchx launcher: AppDefs and scheduler requests from params, and real multi-worker runs."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from chatpipe.launch import build_app, main, scheduler_cfg
from chatpipe.settings import LaunchSettings, load_section
from chatpipe.testing.project import dvc, make_project, plotted_curve, processes_in, run

LAUNCH = ("python", "-m", "chatpipe.launch")


def _launch(**overrides) -> LaunchSettings:
    return LaunchSettings(**{"scheduler": "local_cwd", **overrides})


def _command(app) -> list[str]:
    role = app.roles[0]
    return [role.entrypoint, *role.args]


def test_app_runs_the_stage_module_with_torchrun_topology(params_file):
    app = build_app("pretrain", _launch(nnodes=2, nproc_per_node=8, gpus_per_node=8), ["--max_steps=5"])
    role = app.roles[0]
    args = " ".join(_command(app))
    assert role.num_replicas == 2
    assert role.resource.gpu == 8
    assert "--nnodes 2" in args and "--nproc_per_node 8" in args
    assert "-m stages.pretrain" in args and args.endswith("--max_steps=5")


def test_single_process_stages_ignore_topology(params_file):
    app = build_app("tokenizer", _launch(nnodes=4, nproc_per_node=8, gpus_per_node=8), [])
    assert app.roles[0].num_replicas == 1 and app.roles[0].resource.gpu == 0
    assert _command(app) == ["python", "-m", "stages.tokenizer"]  # one process: no torchrun


def test_one_process_runs_python_without_torchrun(params_file):
    app = build_app(
        "pretrain", _launch(nnodes=1, nproc_per_node=1, max_retries=2), ["--max_steps=5"], env={"CHATPIPE_X": "1"}
    )
    role = app.roles[0]
    assert [role.entrypoint, *role.args] == ["python", "-m", "stages.pretrain", "--max_steps=5"]
    assert role.max_retries == 2 and role.env["CHATPIPE_X"] == "1" and "PATH" in role.env
    two = build_app("pretrain", _launch(nnodes=1, nproc_per_node=2), [])
    assert "torchrun" in " ".join(_command(two)) and "--nproc_per_node 2" in " ".join(_command(two))


def test_unknown_stage_is_a_clear_error(params_file):
    from chatpipe.settings import ParamsError

    with pytest.raises(ParamsError, match="unknown stage 'pretrian'"):
        build_app("pretrian", _launch(), [])


@pytest.mark.parametrize("nnodes", [1, 2])
def test_slurm_dryrun_for_speedrun(params_file, monkeypatch, capsys, nnodes):
    monkeypatch.setenv("CHATPIPE_PROFILE", "speedrun")
    assert main(["pretrain", "--scheduler", "slurm", "--nnodes", str(nnodes), "--dryrun"]) == 0
    out = capsys.readouterr().out
    assert "sbatch" in out
    assert f"--nnodes {nnodes}" in out and "--nproc_per_node 8" in out
    assert out.count("--gpus-per-task=8") == nnodes  # one het-job component per node, 8 GPUs each
    assert "PATH=" not in out  # the cluster node keeps its own PATH
    assert "stages.pretrain" in out


def test_kubernetes_dryrun_for_speedrun(params_file, monkeypatch, capsys):
    monkeypatch.setenv("CHATPIPE_PROFILE", "speedrun")
    assert main(["pretrain", "--scheduler", "kubernetes", "--nnodes", "2", "--dryrun"]) == 0
    out = capsys.readouterr().out
    assert "    name: pretrain-0" in out and "    name: pretrain-1" in out  # one Volcano task (pod) per node
    assert "name: pretrain-2" not in out
    assert out.count("nvidia.com/gpu: '8'") == 4  # limits + requests of each pod
    assert "queue: default" in out and "image: chatpipe:latest" in out
    assert "--nnodes 2" in out and "--nproc_per_node 8" in out


def test_bad_launch_param_stops_before_launch(params_file, monkeypatch, capsys):
    monkeypatch.setenv("CHATPIPE_LAUNCH__NPROC_PER_NODE", "0")
    assert main(["pretrain", "--dryrun"]) == 2
    err = capsys.readouterr().err
    assert "launch.nproc_per_node" in err and "greater than or equal to 1" in err


def test_local_cwd_logs_go_to_log_dir(params_file):
    cfg = scheduler_cfg(load_section(LaunchSettings, {"log_dir": "somewhere"}))
    assert Path(cfg["log_dir"]).is_absolute() and cfg["log_dir"].endswith("somewhere")


@pytest.mark.slow
def test_two_workers_match_one_worker_with_grad_accum(tmp_path):
    """2 gloo workers through torchx == 1 worker accumulating 2 micro-batches (fp32)."""
    # the workers' math and teardown are the subject; MLflow (tests/test_tracking_lifecycle.py) stays off
    project = make_project(
        tmp_path,
        {
            "pretrain": {"max_steps": 8, "eval_every": 0, "checkpoint_every": 0, "log_every": 1, "dtype": "float32"},
            "tracking": {"enabled": False},
        },
    )
    dvc(project, "repro", "tokenizer")
    curves = {}
    cores = len(os.sched_getaffinity(0))
    # a stage alone takes every core (read from its log); data is light, so a busy machine cannot
    # turn its 2 threads into a slow test
    assert f"intra-op threads: {cores} (OMP_NUM_THREADS)" in run(project, *LAUNCH, "data", OMP_NUM_THREADS="").stdout
    for nproc in (2, 1):
        shutil.rmtree(project / "checkpoints", ignore_errors=True)
        # 2 workers without OMP_NUM_THREADS split the cores (1 thread each on 2); 1 worker keeps the test's 1
        threads = {"OMP_NUM_THREADS": ""} if nproc == 2 else {}
        out = run(project, *LAUNCH, "pretrain", "--nproc_per_node", str(nproc), **threads)
        assert f"world {nproc}" in out.stdout and "SUCCEEDED" in out.stdout
        if nproc == 2:  # rank 0's count, read from torch
            assert f"intra-op threads: {max(1, cores // 2)} (OMP_NUM_THREADS)" in out.stdout
        curves[nproc] = plotted_curve(project)
    assert len(curves[1]) == len(curves[2]) == 8
    for a, b in zip(curves[1], curves[2]):
        assert abs(a - b) <= 1e-4 * abs(a), (curves[1], curves[2])
    assert curves[1][-1] < curves[1][0]  # and it learns
    # SIGTERM to the launcher (what DVC or Prefect cancellation sends) stops the workers too,
    # although torchx runs them in a session of their own.
    import signal
    import subprocess
    import time

    import psutil

    from chatpipe.testing.project import project_env

    proc = subprocess.Popen(
        ["python", "-m", "chatpipe.launch", "pretrain", "--", "--max_steps=100000"],
        cwd=project,
        env=project_env(project),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def workers() -> list[psutil.Process]:
        return [p for p, cmd in processes_in(project) if "stages.pretrain" in cmd]

    for line in proc.stdout:
        if "step 1/" in line or "step 10/" in line:
            break
    assert workers(), "the stage never started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    deadline = time.monotonic() + 30
    while workers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not workers(), "workers survived the launcher's SIGTERM"


def _stage_procs(project: Path, stage: str) -> list:
    """Live launcher and worker processes of ``stage`` running in ``project`` (ours: a temp copy)."""
    return [p for p, cmd in processes_in(project) if stage in cmd]


def _wait_gone(project: Path, stage: str, timeout: float) -> list:
    import time

    deadline = time.monotonic() + timeout
    while (left := _stage_procs(project, stage)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
def test_stopping_dvc_or_killing_the_launcher_takes_the_workers_down(tmp_path):
    """issue 15 item 2: `kill -TERM` of `dvc repro` and `kill -9` of the launcher leave no worker running."""
    import signal
    import subprocess
    import time

    from chatpipe.testing.project import project_env

    project = make_project(tmp_path, {"pretrain": {"max_steps": 100000, "checkpoint_every": 0, "eval_every": 0}})
    dvc(project, "repro", "tokenizer")

    def start(*cmd: str) -> subprocess.Popen:
        return subprocess.Popen(
            list(cmd), cwd=project, env=project_env(project), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )

    def wait_for_worker() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if any("stages.pretrain" in " ".join(p.cmdline()) for p in _stage_procs(project, "stages.pretrain")):
                time.sleep(3)  # past interpreter start: the worker is importing torch or training
                return
            time.sleep(0.2)
        raise AssertionError("the pretrain worker never started")

    try:
        # 1. SIGTERM to `dvc repro` (Prefect cancel, CI timeout, job control)
        proc = start(str(Path(sys.executable).parent / "dvc"), "repro", "pretrain")
        wait_for_worker()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert not _wait_gone(project, "pretrain", 30), "launcher or worker outlived `dvc repro`"
        # 2. kill -9 of the launcher
        proc = start(sys.executable, "-m", "chatpipe.launch", "pretrain")
        wait_for_worker()
        proc.kill()
        proc.wait(timeout=10)
        assert not _wait_gone(project, "stages.pretrain", 5), "worker outlived a kill -9 of its launcher"
        # 3. Ctrl-C or SIGTERM to the flow's whole process group (a terminal's job control, `kill -- -PGID`):
        # every process of the group gets it at once, the flow's temporary Prefect server included
        for sig in (signal.SIGINT, signal.SIGTERM):
            proc = subprocess.Popen(
                [sys.executable, "-m", "flows.pipeline", "--stages", "pretrain"],
                cwd=project,
                env=project_env(project),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            wait_for_worker()
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the flow hung for 60 s after {sig.name} to its process group") from None
            assert not _wait_gone(project, "", 30), f"processes outlived {sig.name} to the flow's group"
    finally:
        for p in _stage_procs(project, ""):  # anything still running in the project: a hung flow too
            p.kill()


def test_only_the_first_stop_signal_interrupts_the_launcher(monkeypatch):
    """A stop sends the launcher several signals at once (the flow's SIGTERM to the group, then DVC's death
    signal): a second KeyboardInterrupt while the first is handled would end it before it cancels."""
    import signal

    from chatpipe import launch

    monkeypatch.setattr(launch._interrupt, "fired", False, raising=False)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        with pytest.raises(KeyboardInterrupt):
            launch._interrupt(signal.SIGTERM, None)
        for later in (signal.SIGTERM, signal.SIGHUP):
            try:
                launch._interrupt(later, None)
            except KeyboardInterrupt:
                pytest.fail(f"a later signal {later!r} interrupted the launcher again")
        assert set(launch.STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, [])  # held from now on
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
