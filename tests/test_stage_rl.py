"""End-to-end `rl` stage in a throwaway project: 2 torchx workers through DVC, and kill -9 + resume.

The project gets a byte-level tokenizer and a tiny random GPT as its init model, so no upstream
stage has to run; rewards are mostly 0 there, which is fine: these tests check plumbing, not learning.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chatpipe import runtime
from chatpipe.io import sha256_file
from chatpipe.model.files import save_model_dir
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.rl.problems import Prompts, prompt_pool
from chatpipe.rl.sampling import rollout_dtype
from chatpipe.rl.step import loop_meta
from chatpipe.rl.update import check_minibatches
from chatpipe.settings import ParamsError, RLSettings, load_section
from chatpipe.testing.project import SMALL_RL, dvc, make_project, project_env, run
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.loop import LoopState

# replay on: its loader's cursor is part of what a resume must restore, and its loss the last backward DDP syncs
REPLAY = {
    "replay": [{"task": "simplespelling", "limit": 16, "words": "tinyworld"}],
    "replay_rows": 2,
    "replay_seq_len": 64,
}
RL_PARAMS = {"init_dir": "init_model", **SMALL_RL, **REPLAY}


def setup_project(tmp_path: Path, params: dict = RL_PARAMS, **rl_overrides) -> Path:
    """A project with a byte tokenizer and a random 1-layer init model; its ``rl`` section ``params``
    with ``rl_overrides``."""
    project = make_project(tmp_path / "proj", {"rl": {**params, **rl_overrides}})
    tok = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})
    tok.save(project / "artifacts" / "tokenizer")
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=64, vocab_size=tok.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32)
    model = GPT(config)
    model.init_weights()
    save_model_dir(project / "init_model", model, {"model_config": config.to_dict(), "settings": {}})
    (project / "artifacts" / "reward_model").mkdir(parents=True)  # what rl depends on in dvc.yaml: RL reads
    (project / "artifacts" / "reward_model" / "not_read.json").write_text('{"trained": false}')  # none here
    return project


@pytest.mark.slow
def test_two_workers_through_dvc_sample_disjoint_prompts(tmp_path):
    project = setup_project(tmp_path)
    # launch.nproc_per_node=2 via env: dvc -> chatpipe.launch -> torchx local_cwd -> 2 torchrun workers (gloo)
    proc = run(
        project,
        str(Path(sys.executable).parent / "dvc"),
        "repro",
        "--single-item",
        "rl",
        CHATPIPE_LAUNCH__NPROC_PER_NODE="2",
        CHATPIPE_TRACKING__ENABLED="false",
    )
    assert "SUCCEEDED" in proc.stdout
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == 4
    assert len(meta["prompt_indices"]) == 4
    for step, per_rank in enumerate(meta["prompt_indices"]):
        assert len(per_rank) == 2 and all(len(r) == 1 for r in per_rank)
        assert not set(per_rank[0]) & set(per_rank[1]), f"step {step}: ranks sampled the same prompt"
    assert "eval/pass_at_1" in " ".join(meta["summary"])
    assert meta["replay"]["row"] == 4 * 2 * 2  # steps x rows x ranks: every step replayed one batch per rank
    # DVC recorded the stage; a second repro is a no-op
    assert "rl" in (project / "dvc.lock").read_text()
    assert "didn't change" in dvc(project, "repro", "--single-item", "rl").stdout


def _stage(project: Path, *args: str) -> subprocess.Popen:
    env = project_env(project, CHATPIPE_TRACKING__ENABLED="false")
    return subprocess.Popen(
        [sys.executable, "-m", "stages.rl", *args],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_kill9_resume_matches_uninterrupted_run(tmp_path):
    project = setup_project(tmp_path, algorithm="ppo", max_steps=6, eval_every=0, checkpoint_every=2)
    # value_norm's running moments and filter_solved's pool are part of what a resume restores; best-of-n,
    # gradient clipping and a sampling temperature other than 1 run through the stage too
    args = ("--ppo.kl_ctl=adaptive", "--ppo.value_norm=true", "--ppo.bootstrap=true", "--filter_solved=0.5")
    args += ("--generation_size=6", "--grad_clip=1.0", "--temperature=0.8")

    # reference: one uninterrupted run
    ref = _stage(project, *args)
    out, _ = ref.communicate(timeout=300)
    assert ref.returncode == 0, out
    want = sha256_file(project / "artifacts" / "rl" / "model.pt")
    want_replay = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())["replay"]
    for d in ("artifacts/rl", "checkpoints/rl"):
        subprocess.run(["rm", "-rf", str(project / d)], check=True)

    # kill -9 once the first checkpoint exists, then re-run
    proc = _stage(project, *args)
    deadline = time.time() + 240
    while not list((project / "checkpoints" / "rl").glob("step_*")):
        assert proc.poll() is None and time.time() < deadline, "stage ended before its first checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (project / "artifacts" / "rl").exists()

    again = _stage(project, *args)
    out, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out
    assert "resuming from" in out
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    assert meta["step"] == 6 and len(meta["prompt_indices"]) == 6
    assert meta["replay"] == want_replay == {"row": 6 * 4 * 2}  # steps x PPO updates x replay rows
    assert meta["value_norm"]["debias"] > 0 and meta["filter"]["pool"] is not None
    # policy, critic, optimizers, KL coefficient and sampling seeds all restored: same final weights
    assert sha256_file(project / "artifacts" / "rl" / "model.pt") == want


@pytest.mark.slow
def test_replay_rows_longer_than_the_model_stop_before_anything_is_written(tmp_path):
    project = setup_project(tmp_path, replay_seq_len=128)  # the init model's sequence_len is 64
    proc = _stage(project)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "rl.replay_seq_len = 128 is longer than the model's sequence_len 64" in out, out[-2000:]
    assert not (project / "checkpoints" / "rl").exists() and not (project / "artifacts" / "rl").exists()


def test_a_ppo_key_under_grpo_is_an_error_naming_it():
    with pytest.raises(ParamsError, match=r"rl.ppo.kl_coef = 0.2.*PPO-only.*algorithm: grpo"):
        load_section(RLSettings, ["--algorithm=grpo", "--ppo.kl_coef=0.2"])
    with pytest.raises(ParamsError, match=r"rl.ppo.value_norm = True.*PPO-only"):
        load_section(RLSettings, {"algorithm": "grpo", "ppo": {"value_norm": True}})
    with pytest.raises(ParamsError, match=r"rl.grpo.kl_loss_coef = 0.1.*GRPO-only.*algorithm: ppo"):
        load_section(RLSettings, ["--algorithm=ppo", "--grpo.kl_loss_coef=0.1"])
    # at its default (as params.yaml lists every key) it is not "set"; under PPO it is read
    assert load_section(RLSettings, ["--algorithm=grpo", "--ppo.kl_coef=0.1"]).ppo.kl_coef == 0.1
    assert load_section(RLSettings, ["--algorithm=ppo", "--ppo.kl_coef=0.2"]).ppo.kl_coef == 0.2
    # the flat keys of before the nesting say where they went
    with pytest.raises(ParamsError, match=r"rl.kl_coef = '0.2'.*removed: moved to rl.ppo.kl_coef"):
        load_section(RLSettings, ["--kl_coef=0.2"])
    with pytest.raises(ParamsError, match=r"rl.ppo.kl_cof = '0.2'.*unknown key; allowed keys: critic_init_dir, "):
        load_section(RLSettings, ["--ppo.kl_cof=0.2"])


def test_indivisible_minibatches_are_an_error_naming_the_numbers():
    with pytest.raises(ParamsError, match=r"8 x 8 = 64 rows per step do not split into 3 minibatches"):
        load_section(
            RLSettings, ["--algorithm=ppo", "--prompts_per_step=8", "--group_size=8", "--ppo.num_minibatches=3"]
        )
    # per rank: 12 rows over all ranks split into 4, but 2 ranks hold 6 each
    cfg = load_section(
        RLSettings, ["--algorithm=ppo", "--prompts_per_step=4", "--group_size=3", "--ppo.num_minibatches=4"]
    )
    check_minibatches(cfg, 1)
    with pytest.raises(ValueError, match=r"6 rows per rank per step do not split into ppo.num_minibatches = 4"):
        check_minibatches(cfg, 2)


@pytest.mark.slow
def test_indivisible_minibatches_stop_the_stage_before_any_rollout(tmp_path):
    project = setup_project(tmp_path, algorithm="ppo")  # 2 prompts x 4 samples = 8 rows
    proc = _stage(project, "--ppo.num_minibatches=3")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "2 x 4 = 8 rows per step do not split into 3 minibatches" in out, out[-2000:]
    assert not (project / "checkpoints" / "rl").exists() and not (project / "artifacts" / "rl").exists()


def test_rollout_dtype_auto_is_the_dtype_the_trainer_trains_in(monkeypatch):
    """auto samples in bf16 exactly where the trainer trains in bf16 (and in the rollout role too,
    whose own runtime computes in float32); a set value wins; anything else is refused by name."""
    role_rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    for native_bf16, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(runtime, "cpu_multiplies_bf16", lambda native=native_bf16: native)
        assert rollout_dtype(load_section(RLSettings, {}), role_rt) == want
        assert rollout_dtype(load_section(RLSettings, {"dtype": "float32"}), role_rt) == torch.float32
        assert rollout_dtype(load_section(RLSettings, {"rollout": {"dtype": "float32"}}), role_rt) == torch.float32
        assert rollout_dtype(load_section(RLSettings, {"rollout": {"dtype": "bfloat16"}}), role_rt) == torch.bfloat16
    with pytest.raises(ParamsError, match="rl.rollout.dtype"):
        load_section(RLSettings, {"rollout": {"dtype": "float16"}})


def test_filter_solved_drops_solved_prompts_at_the_end_of_the_pools_epoch():
    # 6 problems, 2 prompts per step: the first pool (all 6) lasts 3 steps; prompts solved by then leave
    cfg = load_section(RLSettings, {"filter_solved": 0.75, "prompts_per_step": 2, "num_train_problems": 6})
    prompts = Prompts()
    assert prompt_pool(cfg, 6, prompts, 0) == [0, 1, 2, 3, 4, 5]
    prompts.solved = [1, 4]
    assert prompt_pool(cfg, 6, prompts, 2) == [0, 1, 2, 3, 4, 5]  # mid-epoch: unchanged
    assert prompt_pool(cfg, 6, prompts, 3) == [0, 2, 3, 5] and prompts.pool_start == 3
    prompts.solved = [0, 1, 2, 4, 5]  # the 4-prompt pool lasts 2 steps; 1 left is too few
    assert prompt_pool(cfg, 6, prompts, 5) == [0, 2, 3, 5] and prompts.pool_start == 3
    off = load_section(RLSettings, {"num_train_problems": 6})
    assert prompt_pool(off, 6, Prompts(solved=[0, 1]), 0) == list(range(6))  # filter off: every prompt


def test_a_checkpoint_from_before_the_shared_loop_resumes_with_its_totals_and_first_eval():
    # RL's own loop wrote first_eval beside carried, and train_seconds without generation
    old = {
        "step": 4,
        "first_eval": {"eval/pass_at_1": 0.25},
        "prompt_indices": [[[1]], [[2]], [[3]], [[4]]],
        "carried": {"gen_seconds": 3.0, "train_seconds": 1.0, "gen_tokens": 96, "mlflow_run_ids": ["a"]},
    }
    state = LoopState.resumed(loop_meta(old), 6)
    assert (state.step, state.run_ids, state.first_evals) == (4, ["a"], {"eval/pass_at_1": 0.25})
    assert state.totals == {"gen_seconds": 3.0, "train_seconds": 4.0, "gen_tokens": 96}  # the loop's: whole steps
    assert Prompts.resumed(old) == Prompts(log=[[[1]], [[2]], [[3]], [[4]]])  # no filter record: a fresh pool
    new = {**old, "carried": {**old["carried"], "first_evals": {}}}
    del new["first_eval"]
    assert loop_meta(new) is new  # the shared loop's meta passes as it is


def test_a_nested_key_is_read_from_the_environment_and_a_misspelt_one_named(monkeypatch):
    """``CHATPIPE_RL__PPO__KL_COEF`` sets one key of ``rl.ppo``; a key the section lacks, or one below a
    plain key, is refused naming it (and the section's keys)."""
    monkeypatch.setenv("CHATPIPE_RL__ALGORITHM", "ppo")
    monkeypatch.setenv("CHATPIPE_RL__PPO__KL_COEF", "0.25")
    monkeypatch.setenv("CHATPIPE_RL__GUARD__EVERY", "3")
    cfg = load_section(RLSettings, [])
    assert cfg.ppo.kl_coef == 0.25 and cfg.ppo.clip_eps == 0.2 and cfg.guard.every == 3
    monkeypatch.setenv("CHATPIPE_RL__PPO__KL_COFF", "0.25")
    with pytest.raises(ParamsError, match=r"unknown key rl.ppo.kl_coff; allowed keys: critic_init_dir, value_lr_frac"):
        load_section(RLSettings, [])
    monkeypatch.delenv("CHATPIPE_RL__PPO__KL_COFF")
    monkeypatch.setenv("CHATPIPE_RL__PPO__KL_COEF", "-1")
    with pytest.raises(
        ParamsError, match=r"rl.ppo.kl_coef = -1.0 \(from environment variable CHATPIPE_RL__PPO__KL_COEF\)"
    ):
        load_section(RLSettings, [])
