"""Asynchronous RL end to end (rl.rollout.role): the rollout role as the RL stage's second torchx
role, sampling ahead of the trainer by up to max_staleness weight versions, in a throwaway project
with a tiny random init model (tests/test_stage_rl.py's), launched as DVC launches it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from chatpipe.launch import build_app
from chatpipe.paths import WORK
from chatpipe.rl.exchange import launch_dir
from chatpipe.settings import LaunchSettings, ParamsError, RLSettings, deep_merge, load_section
from chatpipe.testing.project import SMALL_PARAMS, processes_in, project_env, run, set_params
from tests.conftest import REPO
from tests.test_stage_rl import RL_PARAMS, setup_project

ONE_THREAD = {"CHATPIPE_LAUNCH__THREADS": "1", "CHATPIPE_TRACKING__ENABLED": "false"}
BEFORE_THE_ROLE = "81073b0"  # main just before the rollout role and max_staleness were added


def launch_rl(project: Path, *stage_args: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """Run the RL stage through chatpipe.launch; its meta.json, final weights and log. The run's
    outputs are moved aside, so the next run starts fresh."""
    proc = run(project, sys.executable, "-m", "chatpipe.launch", "rl", "--", *stage_args, **ONE_THREAD)
    out = project / "artifacts" / "rl"
    meta = json.loads((out / "meta.json").read_text())
    weights = torch.load(out / "model.pt", weights_only=True)
    for d in (out, project / "checkpoints" / "rl"):
        shutil.rmtree(d)
    return meta, weights, proc.stdout + proc.stderr


def logged(log: str, key: str) -> list[float]:
    return [float(v) for v in re.findall(rf"{re.escape(key)} ([-0-9.e]+)", log)]


@pytest.mark.slow
def test_rollout_role_at_staleness_0_is_synchronous_rl_and_1_runs_ahead(tmp_path):
    project = setup_project(tmp_path, max_steps=6, eval_every=0, checkpoint_every=3)
    sync_meta, sync_w, _ = launch_rl(project)

    # max_staleness 0: the role samples each step with the weights that step updates, so the batches,
    # and so the updates, are the synchronous run's. Both processes compute with 1 thread, as the
    # synchronous trainer did (the role's core is not lent: 2 threads could pick other kernels), so
    # the weights agree to float32 rounding (1e-6).
    meta, w, log = launch_rl(project, "--rollout.role=true", "--rollout.lend_cores=false")
    assert meta["prompt_indices"] == sync_meta["prompt_indices"]
    assert logged(log, "async/staleness") == [0.0] * 6
    for name, want in sync_w.items():
        torch.testing.assert_close(w[name], want, rtol=0, atol=1e-6, msg=f"{name} differs from synchronous RL")
    assert meta["summary"]["steps"] == 6
    assert meta["summary"]["rollout_tokens"] == sync_meta["summary"]["rollout_tokens"] > 0  # the same batches

    # max_staleness 1: the role samples step s + 1 while the trainer updates step s; the same prompts
    # are trained on, each once, and no batch is older than the bound. (PPO: its update weighs every
    # row, where GRPO skips the groups that all scored 0, all of them with this random model.)
    meta, _, log = launch_rl(project, "--rollout.role=true", "--rollout.max_staleness=1", "--algorithm=ppo")
    assert meta["prompt_indices"] == sync_meta["prompt_indices"]
    staleness = logged(log, "async/staleness")
    assert len(staleness) == 6 and max(staleness) == 1.0 and min(staleness) >= 0.0
    assert logged(log, "stale/weight_mean"), "stale batches train on the decoupled loss"
    # the role waits for weights most of each step here (a tiny random policy samples fast): the trainer
    # computed on its core meanwhile (the seconds of each update are logged with the next step)
    assert sum(logged(log, "async/lent_seconds")) > 0
    assert not processes_in(project), "both roles are gone"


def code_at(commit: str, dest: Path) -> Path:
    """The repo's files at ``commit``, unpacked into ``dest`` (skips in a clone without that history)."""
    if subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True).returncode:
        pytest.skip(f"commit {commit} is not in this clone (a shallow clone?): nothing to compare with")
    archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


TIMING = ("seconds", "per_s", "time/")  # wall-clock figures, which differ from run to run


def step_rows(log: str) -> list[dict[str, str]]:
    """The stage's logged step lines (``rl: step 3/3 | key value | ...``), timing figures left out."""
    rows = []
    for fields in re.findall(r"rl: step \d+/\d+ \| (.*)", log):
        pairs = (part.strip().split(" ", 1) for part in fields.split("|"))
        rows.append({k: v for k, v in pairs if not any(t in k for t in TIMING)})
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_without_the_role_rl_is_bitwise_the_code_before_it(tmp_path, algorithm):
    """max_staleness 0 without a rollout role is the RL stage as it was before either existed: on this
    machine, at one thread, the same step metrics and the same final weights, bit for bit. (The random
    model never scores, so GRPO's weights move by the replay alone; PPO's move with every sampled token:
    a changed top_k fails this test.)"""
    # float32 training and rollouts: the sampler is the trainer's own numerics, so the update only
    # measures the gap (gap/*) and is the one of then (rl.rollout.dtype came later; auto is bf16 where
    # the CPU multiplies it, and a bf16 trainer under float32 rollouts now weighs by the gap)
    rl = {"max_steps": 3, "eval_every": 0, "algorithm": algorithm, "dtype": "float32"}
    now = setup_project(tmp_path / "now", **rl, rollout={"dtype": "float32"})
    before = code_at(BEFORE_THE_ROLE, tmp_path / "before")
    set_params(before, deep_merge(SMALL_PARAMS, {"rl": {**RL_PARAMS, **rl}}))  # its own params.yaml, the same overrides
    for inputs in ("artifacts", "init_model"):  # the same tokenizer and init model
        shutil.copytree(now / inputs, before / inputs)
    out = {}
    for name, project in (("before", before), ("now", now)):
        proc = run(project, sys.executable, "-m", "stages.rl", CHATPIPE_TRACKING__ENABLED="false")
        meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
        weights = torch.load(project / "artifacts" / "rl" / "model.pt", weights_only=True)
        out[name] = meta, weights, step_rows(proc.stdout + proc.stderr)
    (meta_before, w_before, rows_before), (meta_now, w_now, rows_now) = out["before"], out["now"]
    # every step's metrics (the rollouts' lengths, rewards and tool calls; the update's losses), as logged
    assert (
        len(rows_before) == 3 and [{k: row[k] for k in want} for row, want in zip(rows_now, rows_before)] == rows_before
    )
    summary = {k: v for k, v in meta_before["summary"].items() if not any(t in k for t in TIMING)}
    assert summary and {k: meta_now["summary"][k] for k in summary} == summary
    assert meta_now["prompt_indices"] == meta_before["prompt_indices"]
    assert w_now.keys() == w_before.keys()
    for name, want in w_before.items():
        assert torch.equal(w_now[name], want), f"{name} differs from the code before the rollout role"


def test_the_launch_gives_the_rollout_role_its_own_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # a user's count would win over the split
    monkeypatch.setenv("CHATPIPE_CORES", "4")
    app = build_app("rl", load_section(LaunchSettings), ["--rollout.role=true", "--rollout.threads=1"])
    trainer, role = app.roles
    assert trainer.env["OMP_NUM_THREADS"] == "3" and role.env["OMP_NUM_THREADS"] == "1"
    assert role.env["CHATPIPE_RL_ROLE"] == "rollout" and "CHATPIPE_RL_ROLE" not in trainer.env
    assert trainer.env["CHATPIPE_RL_THREADS_AFTER_ROLE"] == "4"  # the final eval gets the role's core back
    # one dir of this launch's own, chosen once by the launcher (chatpipe.rl.exchange.launch_dir)
    shared = trainer.env["CHATPIPE_RL_LAUNCH_DIR"]
    assert shared == role.env["CHATPIPE_RL_LAUNCH_DIR"] and re.fullmatch(r"[0-9a-f]{12}", Path(shared).name)
    again = build_app("rl", load_section(LaunchSettings), ["--rollout.role=true", "--rollout.threads=1"])
    assert again.roles[0].env["CHATPIPE_RL_LAUNCH_DIR"] != shared  # the next launch's is another
    assert role.args[-2:] == trainer.args[-2:]  # the same stage settings
    assert len(build_app("rl", load_section(LaunchSettings), []).roles) == 1


def test_bad_async_settings_fail_before_any_work_naming_the_setting(monkeypatch):
    with pytest.raises(ParamsError, match=r"rl.rollout.max_staleness"):
        load_section(RLSettings, {"rollout": {"role": True, "max_staleness": -1}})
    with pytest.raises(ParamsError, match=r"rl.rollout.threads"):
        load_section(RLSettings, {"rollout": {"role": True, "threads": 0}})
    with pytest.raises(ParamsError, match=r"rl.rollout.max_staleness = 2 .*needs rollout.role: true"):
        load_section(RLSettings, {"rollout": {"max_staleness": 2}})
    with pytest.raises(ParamsError, match=r"filter_solved"):
        load_section(RLSettings, {"filter_solved": 0.5, "rollout": {"role": True}})
    with pytest.raises(ParamsError, match=r"rl.rollout_role = True .*moved to rl.rollout.role"):
        load_section(RLSettings, {"rollout_role": True})  # the flat key of before the rollout section
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("CHATPIPE_CORES", "2")
    with pytest.raises(ParamsError, match=r"rl.rollout.threads = 2 leaves the trainer none of this node's 2 cores"):
        build_app("rl", load_section(LaunchSettings), ["--rollout.role=true", "--rollout.threads=2"])


def role_processes(project: Path) -> dict[str, psutil.Process]:
    """The project's RL processes by role (the rollout role's environment says it is one)."""
    found = {}
    for proc, cmd in processes_in(project):
        if "stages.rl" in cmd:
            with contextlib.suppress(psutil.Error):
                found["rollout" if proc.environ().get("CHATPIPE_RL_ROLE") == "rollout" else "trainer"] = proc
    return found


def start_async_launch(project: Path, *args: str) -> subprocess.Popen:
    """``python -m chatpipe.launch rl`` with the rollout role, returned once the first checkpoint exists."""
    cmd = [sys.executable, "-m", "chatpipe.launch", "rl", "--", "--rollout.role=true", *args]
    launch = subprocess.Popen(cmd, cwd=project, env=project_env(project, **ONE_THREAD), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.time() + 120
    while not list((project / "checkpoints" / "rl").glob("step_*")):
        assert launch.poll() is None and time.time() < deadline, "the stage ended before its first checkpoint"
        time.sleep(0.02)
    return launch


@pytest.mark.slow
def test_sigterm_stops_both_roles(tmp_path):
    project = setup_project(tmp_path, max_steps=200, eval_every=0, checkpoint_every=2)
    launch = start_async_launch(project, "--rollout.max_staleness=1")
    assert set(role_processes(project)) == {"trainer", "rollout"}
    launch.send_signal(signal.SIGTERM)  # what DVC or Prefect cancellation sends
    out, _ = launch.communicate(timeout=60)
    assert launch.returncode == 130, out[-2000:]
    deadline = time.time() + 30
    while processes_in(project) and time.time() < deadline:
        time.sleep(0.1)
    assert not processes_in(project), "a role survived the launcher's SIGTERM"


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["rollout", "trainer"])
def test_kill9_of_either_role_resumes_with_every_prompt_trained_once(tmp_path, victim):
    project = setup_project(tmp_path, max_steps=24, eval_every=0, checkpoint_every=4)
    args = ("--rollout.role=true", "--rollout.max_staleness=1", "--rollout.heartbeat_timeout_s=5")
    want = launch_rl(project)[0]["prompt_indices"]  # an uninterrupted synchronous run's

    launch = start_async_launch(project, *args[1:])
    role_processes(project)[victim].kill()  # kill -9, mid-run
    out, _ = launch.communicate(timeout=120)
    assert launch.returncode != 0, out[-2000:]
    if victim == "trainer":  # the role's own reason reaches the launch's output
        assert "[rl_rollout]" in out and "the trainer role has given no sign of life" in out, out[-3000:]
    assert not processes_in(project), "the other role was stopped with the launch"
    assert not (project / "artifacts" / "rl").exists()

    meta, _, log = launch_rl(project, *args)
    assert "resuming from" in log
    assert meta["step"] == 24 and meta["prompt_indices"] == want  # none trained twice, none skipped
    assert not processes_in(project)


# --------------------------------------------------------------------------- several rollout workers


def test_the_launch_starts_rollout_workers_as_replicas_that_find_the_trainers_store(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("CHATPIPE_CORES", "4")
    app = build_app("rl", load_section(LaunchSettings), ["--rollout.role=true", "--rollout.workers=2"])
    trainer, role = app.roles
    assert role.num_replicas == 2 and role.env["CHATPIPE_RL_WORKER"] == "${replica_id}"
    assert trainer.env["OMP_NUM_THREADS"] == "2" and role.env["OMP_NUM_THREADS"] == "1"  # 4 cores: 2 + 1 + 1
    assert trainer.env["CHATPIPE_RL_THREADS_AFTER_ROLE"] == "4"
    assert re.fullmatch(r"\$\{rank0_env\}:\d+", trainer.env["CHATPIPE_RL_STORE"])  # torchx names the trainer's host
    assert role.env["CHATPIPE_RL_STORE"] == trainer.env["CHATPIPE_RL_STORE"]
    assert trainer.entrypoint != "bash"  # locally every worker is a replica of the role
    with pytest.raises(ParamsError, match=r"rl.rollout.workers = 4 x rl.rollout.threads = 1 leaves the trainer none"):
        build_app("rl", load_section(LaunchSettings), ["--rollout.role=true", "--rollout.workers=4"])
    with pytest.raises(ParamsError, match=r"rl.rollout.workers = 2 .*needs rollout.role: true"):
        load_section(RLSettings, {"rollout": {"workers": 2}})
    one = build_app("rl", load_section(LaunchSettings), ["--rollout.role=true"])
    assert one.roles[1].num_replicas == 1 and "CHATPIPE_RL_STORE" not in one.roles[0].env  # as before


def test_on_slurm_worker_0_runs_in_the_trainers_component_and_the_others_a_node_each(monkeypatch):
    """A heterogeneous job's components never share a node, so worker 0 starts beside the trainer."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    launch = load_section(LaunchSettings, {"scheduler": "slurm", "cpus_per_node": 2})
    app = build_app("rl", launch, ["--rollout.role=true", "--rollout.workers=3"])
    trainer, role = app.roles
    assert role.num_replicas == 2 and role.env["CHATPIPE_RL_WORKER_OFFSET"] == "1"  # workers 1 and 2
    assert trainer.entrypoint == "bash" and trainer.env["OMP_NUM_THREADS"] == "1"  # 2 cores: 1 + worker 0's 1
    script = trainer.args[1]
    assert script.startswith("{ CHATPIPE_RL_ROLE=rollout CHATPIPE_RL_WORKER=0 OMP_NUM_THREADS=1 python -m stages.rl")
    assert script.count("python -m stages.rl --rollout.role=true --rollout.workers=3") == 2
    assert trainer.env["CHATPIPE_RL_THREADS_AFTER_ROLE"] == "2"  # worker 0's core back for the final eval
    exchange = Path(trainer.env["CHATPIPE_RL_LAUNCH_DIR"])  # not /dev/shm: two nodes; this launch's own dir
    assert exchange.parent == WORK / "rl" / "exchange" and role.env["CHATPIPE_RL_LAUNCH_DIR"] == str(exchange)
    # the component fails with whichever of the two fails first, and a failed trainer stops its worker
    for trainer_rc, worker_rc, want in ((0, 0, 0), (1, 0, 1), (0, 9, 9)):
        fake = script.replace(
            "CHATPIPE_RL_ROLE=rollout CHATPIPE_RL_WORKER=0 OMP_NUM_THREADS=1 python -m stages.rl",
            f"sh -c 'exit {worker_rc}'",
            1,
        )
        fake = fake.replace(
            "python -m stages.rl --rollout.role=true --rollout.workers=3", f"sh -c 'exit {trainer_rc}'", 1
        )
        assert subprocess.run(["bash", "-c", fake]).returncode == want, fake


def worker_processes(project: Path) -> dict[int, psutil.Process]:
    """The project's rollout workers by replica id."""
    found = {}
    for proc, cmd in processes_in(project):
        if "stages.rl" in cmd:
            with contextlib.suppress(psutil.Error):
                env = proc.environ()
                if env.get("CHATPIPE_RL_ROLE") == "rollout":
                    found[int(env["CHATPIPE_RL_WORKER"])] = proc
    return found


@pytest.mark.slow
def test_two_rollout_workers_at_staleness_0_are_synchronous_rl(tmp_path):
    project = setup_project(tmp_path, max_steps=6, eval_every=0, checkpoint_every=3)
    sync_meta, sync_w, _ = launch_rl(project)
    # each worker samples every other step whole, with the weights that step updates: the synchronous batches
    meta, w, log = launch_rl(project, "--rollout.role=true", "--rollout.workers=2")
    assert meta["prompt_indices"] == sync_meta["prompt_indices"]
    assert logged(log, "async/staleness") == [0.0] * 6
    for name, want in sync_w.items():
        torch.testing.assert_close(w[name], want, rtol=0, atol=1e-6, msg=f"{name} differs from synchronous RL")
    assert "weights over torch.distributed" in log
    assert not processes_in(project), "the trainer and both workers are gone"


@pytest.mark.slow
def test_kill9_of_one_of_two_workers_ends_the_run_within_60s_naming_it(tmp_path):
    project = setup_project(tmp_path, max_steps=400, eval_every=0, checkpoint_every=2)
    launch = start_async_launch(project, "--rollout.max_staleness=1", "--rollout.workers=2")
    with contextlib.chdir(project):  # where this project's launches meet (/dev/shm here)
        exchanges = launch_dir("", "any").parent.resolve()
    deadline = time.time() + 60  # mid-run: once worker 1 says where it runs (killed before, it could not)
    while not list(exchanges.glob("*/rollout-1.beat")):
        assert launch.poll() is None and time.time() < deadline, "worker 1 never started its heartbeat"
        time.sleep(0.02)
    victim = worker_processes(project)[1]
    pid, killed = victim.pid, time.monotonic()
    victim.kill()  # kill -9, mid-run
    out, _ = launch.communicate(timeout=90)
    assert time.monotonic() - killed < 60, "the run outlived its dead worker by a minute"
    assert launch.returncode != 0, out[-2000:]
    assert re.search(rf"rollout worker 1 \(replica 1, node \S+, pid {pid}\)", out), out[-3000:]
    deadline = time.time() + 30
    while processes_in(project) and time.time() < deadline:
        time.sleep(0.1)
    assert not processes_in(project), "the trainer and the other worker end with the run"
