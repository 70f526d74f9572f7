"""A throwaway copy of the repo as a real git + DVC project, with small params, for end-to-end tests."""

from __future__ import annotations

import compileall
import contextlib
import csv
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import yaml

from chatpipe.io import move_into_place
from chatpipe.settings import deep_merge

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# what midtrain and SFT share in the small runs
CHAT_TRAINING = {
    "val_limit": 10,
    "max_seq_len": 128,
    "device_batch_size": 4,
    "total_batch_size": 512,
    "eval_every": 0,
    "eval_tokens": 1024,
    "log_every": 4,
    "momentum_warmup_steps": 4,
}

# Small enough for seconds per stage on 2 CPU cores, big enough that learning shows.
SMALL_PARAMS = {
    "data": {"num_docs": 600, "val_docs": 60, "docs_per_shard": 300},
    "tokenizer": {"vocab_size": 512, "max_chars": 300_000, "eval_chars": 20_000},
    "pretrain": {
        "depth": 2,
        "sequence_len": 64,
        "device_batch_size": 8,
        "total_batch_size": 1024,
        "max_steps": 24,
        "eval_every": 8,
        "eval_tokens": 2048,
        "checkpoint_every": 8,
        "sample_every": 0,
        "log_every": 4,
    },
    "midtrain": {
        "mixture": [
            {"task": "tinyworld_chat", "limit": 100},
            {"task": "tinyworld_arith", "limit": 100},
            {"task": "tinyworld_mc", "limit": 40},
            {"task": "identity", "limit": 20},
            {"task": "spellingbee", "limit": 20, "words": "tinyworld"},
        ],
        **CHAT_TRAINING,
        "max_steps": 8,
        "checkpoint_every": 4,
    },
    "sft": {
        "mixture": [
            {"task": "tinyworld_chat", "limit": 60},
            {"task": "tinyworld_arith", "limit": 100},
            {"task": "identity", "limit": 20},
        ],
        **CHAT_TRAINING,
        "max_steps": 24,
        "checkpoint_every": 2,
        "eval_prompts": 6,
        "eval_arith": 6,
        "eval_max_tokens": 32,
    },
    "reward_model": {  # the small model's context is 64 tokens
        "max_seq_len": 64,
        "tiny_prompts": 12,
        "tiny_samples": 2,
        "tiny_val_problems": 4,
        "tiny_max_new_tokens": 12,
        "val_pairs": 8,
        "device_batch_size": 4,
        "max_steps": 4,
        "eval_every": 2,
        "checkpoint_every": 2,
        "log_every": 1,
    },
}


# Small RL and eval sections for the tests that run those stages (not in SMALL_PARAMS: most tests stop earlier).
SMALL_RL = {
    "num_train_problems": 16,
    "prompts_per_step": 2,
    "group_size": 4,
    "max_new_tokens": 12,
    "max_steps": 4,
    "eval_every": 2,
    "eval_problems": 4,
    "eval_samples": 2,
    "checkpoint_every": 2,
    "device_batch_size": 8,
    "log_every": 1,
}
SMALL_EVAL = {
    "max_per_task": 6,
    "generative_max_per_task": 2,
    "max_new_tokens": 12,
    "eval_tokens": 1024,
    "device_batch_size": 4,
    "tinyworld_examples": 20,
}

PIPELINE_PARAMS = {  # SMALL_PARAMS plus small rl/eval, on the `slurm` profile
    "profile": "slurm",
    # Slurm, the flow and the math are the subject; MLflow from a Slurm job is checked by tests/test_slurm.py's grad-accum
    # test (its job runs tracked), and costs ~2 s of CPU and ~2.5 s of wall in every tracked stage process
    "tracking": {"enabled": False},
    "rl": SMALL_RL,
    "eval": {**SMALL_EVAL, "chatcore_tasks": {"MMLU": {"task": "tinyworld_mc"}, "GSM8K": {"task": "tinyworld_gsm"}}},
    "pretrain": {"dtype": "float32"},
    # a whole number of micro-batches over 2 ranks: 4 rows x 128 tokens x 2 ranks
    "midtrain": {"total_batch_size": 1024},
    "sft": {"total_batch_size": 1024},
    # the slurm profile's 12 pairs x 2 ranks per step need >= 24 train pairs (32 problems give more)
    "reward_model": {"tiny_prompts": 32},
}


def make_project(dest: Path, params: dict | None = None, small: bool = True) -> Path:
    """Copy the repo's files (tracked + untracked-not-ignored) to ``dest``, git init + commit there.

    ``params`` is merged into params.yaml over SMALL_PARAMS (or over the real params if not ``small``).
    """
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for rel in files:
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    copy_bytecode(dest)
    set_params(dest, deep_merge(SMALL_PARAMS, params or {}) if small else (params or {}))
    git = ["git", "-c", "user.email=t@chatpipe.local", "-c", "user.name=test"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-qm", "test project"], cwd=dest, check=True)
    return dest


_COMPILED = False


def copy_bytecode(dest: Path) -> None:
    """Give the copy the repo's compiled modules (``__pycache__``) of chatpipe, stages and flows.

    Every stage, launcher and flow process of a test project imports the project's own copy of the
    code. Without bytecode beside it (``PYTHONDONTWRITEBYTECODE=1`` in CI, or a fresh copy), each
    process compiles what it imports again: ~0.2-0.3 s of CPU per process, hundreds of processes a
    suite. The copies keep the sources' mtimes (``copy2``), so the bytecode stays valid.
    """
    global _COMPILED
    packages = ("chatpipe", "stages", "flows")
    if not _COMPILED:  # once per test process; py_compile replaces each file atomically
        for pkg in packages:
            compileall.compile_dir(REPO / pkg, quiet=1)
        _COMPILED = True
    for pkg in packages:
        for cache in (REPO / pkg).rglob("__pycache__"):
            target = dest / cache.relative_to(REPO)
            if target.parent.is_dir():
                shutil.copytree(cache, target, dirs_exist_ok=True)


def set_params(project: Path, overlay: dict) -> None:
    """Merge ``overlay`` into the project's params.yaml."""
    path = project / "params.yaml"
    path.write_text(yaml.safe_dump(deep_merge(yaml.safe_load(path.read_text()), overlay), sort_keys=False))


def project_env(project: Path, **extra: str) -> dict[str, str]:
    """Environment for commands run inside ``project`` (its own params, MLflow store, no stray overrides)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPIPE_")}
    env.update(
        PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        # the project first; a caller's own PYTHONPATH (e.g. an overlay of a pinned package) after it
        PYTHONPATH=os.pathsep.join([str(project), *filter(None, [os.environ.get("PYTHONPATH")])]),
        OMP_NUM_THREADS="1",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    env.update(extra)  # the caller's values win, these defaults included
    return env


def run(project: Path, *cmd: str, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run a command in the project; on failure the assertion shows its output."""
    proc = subprocess.run(list(cmd), cwd=project, env=project_env(project, **env), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


TINY_SFT_STAGES = ("data", "tokenizer", "pretrain", "midtrain", "sft")


def tiny_sft_project(shared: Path) -> Path:
    """A project of the tiny profile trained data -> sft, under ``shared`` (a dir every test process of
    a session sees): the first caller trains it, under a file lock, while the others wait for it, so
    the slow tests that start from the tiny SFT model (the README's RL answers, RL on Slurm) train it
    once between them, not once each. Callers copy what they run from (``artifacts/``); it is never
    written to after it is complete. ``CHATPIPE_TRAINED_PROJECT`` (such a project, made earlier) skips
    the training."""
    given = os.environ.get("CHATPIPE_TRAINED_PROJECT")
    if given:
        if not (Path(given) / "artifacts" / "sft" / "model.pt").is_file():
            raise FileNotFoundError(f"CHATPIPE_TRAINED_PROJECT={given}: no artifacts/sft/model.pt there")
        return Path(given)
    done = shared / "tiny-sft"
    shared.mkdir(parents=True, exist_ok=True)
    with open(shared / "tiny-sft.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not done.is_dir():
            partial = shared / "tiny-sft.partial"
            shutil.rmtree(partial, ignore_errors=True)  # a caller that died half-way
            project = make_project(partial, {"tracking": {"enabled": False}}, small=False)
            for stage in TINY_SFT_STAGES:
                run(project, "python", "-m", f"stages.{stage}", CHATPIPE_TRACKING__ENABLED="false")
            move_into_place(partial, done)
    return done


def rl_ready_project(path: Path, tiny_sft: Path) -> Path:
    """A tiny-profile project at ``path`` (tracking off) holding copies of what the RL stage reads of
    a :func:`tiny_sft_project` run: its tokenizer and SFT model."""
    project = make_project(path, {"tracking": {"enabled": False}}, small=False)
    for name in ("tokenizer", "sft"):
        shutil.copytree(tiny_sft / "artifacts" / name, project / "artifacts" / name, dirs_exist_ok=True)
    return project


def dvc(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the venv's dvc in the project."""
    return run(project, str(BIN / "dvc"), *args, check=check)


def processes_in(project: Path) -> list[tuple[psutil.Process, str]]:
    """Live (not zombie) processes whose working directory is ``project``, with their command lines;
    this process is left out.

    A process that exits while it is read is skipped: psutil then raises, or (seen in CI) lets
    ``FileNotFoundError`` for ``/proc/<pid>/cwd`` through.
    """
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.cwd() == str(project) and proc.status() != psutil.STATUS_ZOMBIE:
                found.append((proc, " ".join(proc.cmdline())))
        except (psutil.Error, OSError):
            continue
    return found


def mlflow_client(project: Path):
    """A client of the project's MLflow store, in this process.

    The store is a sqlite file the project's stage processes write; every query reads it afresh. In
    process, not through a ``python -c`` child: a child pays MLflow's ~3-5 s import every query.
    """
    import mlflow

    return mlflow.MlflowClient(tracking_uri=f"sqlite:///{project}/mlruns/mlflow.db")


def newest_pretrain_run(project: Path):
    """The newest pretrain run in the project's MLflow store."""
    client = mlflow_client(project)
    exp = client.get_experiment_by_name("chatpipe")
    return client.search_runs([exp.experiment_id], "tags.stage = 'pretrain'", order_by=["start_time DESC"])[0]


def loss_curve(project: Path) -> list[float]:
    """train/loss per step of the newest pretrain run in the project's MLflow store."""
    run_id = newest_pretrain_run(project).info.run_id
    history = mlflow_client(project).get_metric_history(run_id, "train/loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def plotted_curve(project: Path, stage: str = "pretrain", series: str = "train_loss") -> list[float]:
    """The values of ``plots/<stage>/<series>.csv`` (the stage's DVC plot), in step order; read
    without MLflow, so it holds for projects with tracking off."""
    with (project / "plots" / stage / f"{series}.csv").open() as f:
        rows = sorted((int(r["step"]), float(r[series])) for r in csv.DictReader(f))
    return [value for _, value in rows]


def prefect_task_runs(name: str, flow_run_id=None) -> list:
    """The task runs named ``name`` on the Prefect server this process talks to (of one flow run, when
    ``flow_run_id`` is given: a server shared by several tests holds theirs too), newest first."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import TaskRunSort

    async def read() -> list:
        async with get_client() as client:
            runs = await client.read_task_runs(limit=200, sort=TaskRunSort.ID_DESC)
            return [r for r in runs if r.name == name and flow_run_id in (None, r.flow_run_id)]

    return asyncio.run(read())


def final_weights(project: Path) -> dict:
    """The state dict the project's pretrain saved in artifacts/base."""
    import torch

    return torch.load(project / "artifacts" / "base" / "model.pt", map_location="cpu", weights_only=True)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    """Two state dicts hold the same tensors, bit for bit."""
    import torch

    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ: {different[:5]}"


def wait_until(cond, timeout: float = 10.0, poll: float = 0.02) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


@contextlib.contextmanager
def running_server(cmd: list[str], cwd: Path, env: dict, port: int, timeout: float, what: str):
    """Start the server ``cmd`` (listening on ``port``), yield its base URL once it answers ``/health``,
    and stop it (its own pid: terminate, then kill) afterwards; its output is in the error if it exits first."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited {proc.returncode}: {proc.stdout.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer /health within {timeout:.0f} s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
