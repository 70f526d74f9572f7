"""torchx users and the Kubernetes path: the component entry point and .torchxconfig, the Volcano job's
volumes for artifacts/, checkpoints/ and the MLflow store, and the Dockerfile that builds its image."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from chatpipe.launch import PERSISTENT_DIRS, build_app, main
from chatpipe.settings import LaunchSettings, load_section
from chatpipe.testing.project import make_project, run

REPO = Path(__file__).resolve().parents[1]
TORCHX = str(Path(sys.executable).parent / "torchx")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPIPE_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


# --------------------------------------------------------------------------- torchx component


def test_component_passes_the_torchx_linter():
    # before: the only entry point was build_app, whose `X | None` hint crashed the linter
    from torchx.specs.file_linter import validate

    assert validate(str(REPO / "chatpipe/components.py"), "app") == []


def test_torchx_run_uses_the_repo_config_and_the_component(tmp_path):
    # `torchx run` with no component: .torchxconfig names chatpipe/components.py:app and local_cwd
    cmd = [TORCHX, "run", "--dryrun", "--", "--stage", "pretrain", "--nproc_per_node", "2", "--", "--max_steps=20"]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "--nproc_per_node 2" in out and "stages.pretrain --max_steps=20" in out
    assert "'log_dir': 'logs/" in out  # the [local_cwd] section of .torchxconfig
    # Kubernetes through torchx's CLI: no Docker daemon needed (no workspace), the job gets the volumes
    cmd = [TORCHX, "run", "-s", "kubernetes", "--dryrun", "--", "--stage", "sft", "--scheduler", "kubernetes"]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "claimName: chatpipe-mlruns" in proc.stdout and "image: chatpipe:latest" in proc.stdout


def test_component_rejects_a_bad_param_before_launching(tmp_path, params_file):
    from chatpipe.components import app
    from chatpipe.settings import ParamsError

    with pytest.raises(ParamsError, match="allowed: data"):
        app(stage="pretrian")
    command = app("--max_steps=3", stage="sft", nproc_per_node=2).roles[0].args[-1]
    assert command.endswith("-m stages.sft --max_steps=3") and "--nproc_per_node 2" in command


@pytest.mark.slow
def test_torchx_run_runs_a_stage_in_a_project(tmp_path):
    project = make_project(tmp_path / "p")
    proc = run(project, TORCHX, "run", "--", "--stage", "data")
    assert "SUCCEEDED" in proc.stdout + proc.stderr or (project / "artifacts/data").is_dir()
    assert any((project / "artifacts/data").iterdir())


# --------------------------------------------------------------------------- Kubernetes


def volcano_tasks(out: str) -> list[dict]:
    """The Volcano job's tasks from ``chatpipe.launch --dryrun -s kubernetes`` output."""
    doc = yaml.safe_load(out[out.index("apiVersion") :])
    return doc["spec"]["tasks"]


def mounts_of(task: dict) -> tuple[dict[str, str], dict[str, dict]]:
    pod = task["template"]["spec"]
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    return mounts, volumes


def test_volcano_job_mounts_a_pvc_per_persistent_dir(params_file, monkeypatch, capsys):
    # before: no volume but /dev/shm, so every output died with its pod
    monkeypatch.setenv("CHATPIPE_PROFILE", "speedrun")
    assert main(["pretrain", "--scheduler", "kubernetes", "--nnodes", "2", "--dryrun"]) == 0
    tasks = volcano_tasks(capsys.readouterr().out)
    assert len(tasks) == 2
    for task in tasks:  # every node's pod mounts all three
        mounts, volumes = mounts_of(task)
        for d in ("artifacts", "checkpoints", "mlruns"):
            volume = volumes[mounts[f"/workspace/{d}"]]
            assert volume["persistentVolumeClaim"]["claimName"] == f"chatpipe-{d}"
        assert task["template"]["spec"]["containers"][0]["image"] == "chatpipe:latest"


def test_volcano_job_with_a_host_path(params_file, monkeypatch, capsys):
    monkeypatch.setenv("CHATPIPE_LAUNCH__VOLUME", "/srv/chatpipe")
    monkeypatch.setenv("CHATPIPE_LAUNCH__WORKDIR", "/repo")
    assert main(["report", "--scheduler", "kubernetes", "--dryrun"]) == 0
    (task,) = volcano_tasks(capsys.readouterr().out)
    mounts, volumes = mounts_of(task)
    assert {volumes[mounts[f"/repo/{d}"]]["hostPath"]["path"] for d in PERSISTENT_DIRS} == {
        "/srv/chatpipe/artifacts",
        "/srv/chatpipe/checkpoints",
        "/srv/chatpipe/mlruns",
    }


def test_no_volumes_off_kubernetes_or_when_switched_off(params_file):
    local = load_section(LaunchSettings, {"scheduler": "local_cwd"})
    assert build_app("pretrain", local, []).roles[0].mounts == []
    off = load_section(LaunchSettings, {"scheduler": "kubernetes", "volume": ""})
    assert build_app("pretrain", off, []).roles[0].mounts == []


def test_dockerfile_builds_the_image_the_job_runs():
    # no container runtime here: check the Dockerfile agrees with what the job expects
    text = (REPO / "Dockerfile").read_text()
    instructions = [line.split(None, 1) for line in text.splitlines() if line and not line.startswith(("#", " "))]
    workdir = [arg.strip() for op, arg in instructions if op == "WORKDIR"]
    params = yaml.safe_load((REPO / "params.yaml").read_text())["launch"]
    assert workdir == [params["workdir"]] == [LaunchSettings.model_fields["workdir"].default]
    assert f"docker build -t {params['image']} ." in text
    assert "download.pytorch.org/whl/cpu" in text and '"torch==2.13.0"' in text  # CPU torch, the pinned version
    assert "pip install --no-deps -e ." in text  # the repo installed (code + console script)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"artifacts", "checkpoints", "mlruns", ".venv"} <= set(ignored)
