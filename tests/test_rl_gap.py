"""The sampler-trainer gap: every batch carries its sampler's log-probs, the update measures them against
the trainer's (``gap/*``) and weighs by them where the sampler is not the trainer's own numerics.

The update's side (hand-computed gap, the trainer's own sampler measured and not weighed, a planted
gap corrected): tests/test_rl_update.py. Here: what reaches the update, from the synchronous sampler
and from the rollout role, and who decides to weigh.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from chatpipe.inference.engine import Engine
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.rl import losses
from chatpipe.rl.async_role import take_rollouts
from chatpipe.rl.rollout import Problem, Rollouts, token_logprobs
from chatpipe.rl.sampling import sample_batch, sampler_is_trainer
from chatpipe.rl.update import GRPOConfig, PPOConfig, algorithm_config
from chatpipe.settings import RLSettings, load_section
from chatpipe.tokenizer import Tokenizer

TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})  # bytes only + the chat specials


def conv(question: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "#### 1"}]}


def test_the_synchronous_sampler_keeps_its_logprobs_and_bf16_rollouts_show_a_gap():
    """sample_batch records each token's log-prob without a rollout role (before: only with one). Against
    the trainer's float32 log-probs, float32 rollouts differ by rounding; bf16 linear layers (64 wide:
    chatpipe.inference.precision.MIN_WIDTH) by far more."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=64, vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=64))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # a peaked, not uniform, next-token distribution
    model.eval()
    cfg = load_section(RLSettings, {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 16, "top_k": 0})
    problems = [Problem(conv("2+2?"), lambda t: 0.0), Problem(conv("a longer question"), lambda t: 0.0)]
    gaps = {}
    for dtype in (torch.float32, torch.bfloat16):
        batch = sample_batch(cfg, Engine(model, TOK), problems, 0, 0, 1, dtype)
        assert batch.behav_logp is not None and batch.behav_logp.shape == batch.targets.shape
        with torch.no_grad():
            trainer = token_logprobs(model, batch.inputs, batch.targets, temperature=cfg.temperature)
        assert batch.mask.sum() > 50
        gaps[dtype] = losses.sampler_gap(trainer, batch.behav_logp, batch.mask)
    assert gaps[torch.float32]["gap/logp_abs"] < 1e-5
    assert gaps[torch.bfloat16]["gap/logp_abs"] > 10 * gaps[torch.float32]["gap/logp_abs"]
    assert gaps[torch.bfloat16]["gap/kl"] > 0


def test_the_update_weighs_where_the_sampler_is_another_dtype_or_engine():
    plain, role = load_section(RLSettings, {}), load_section(RLSettings, {"rollout": {"role": True}})
    f32, bf16 = torch.float32, torch.bfloat16
    assert sampler_is_trainer(plain, f32, f32)
    assert not sampler_is_trainer(plain, bf16, f32) and not sampler_is_trainer(plain, f32, bf16)
    assert not sampler_is_trainer(plain, bf16, bf16)  # autocast rounds other ops than the rollouts' bf16 linears
    assert not sampler_is_trainer(role, f32, f32)  # the rollout role: another process and engine
    for settings in ({}, {"algorithm": "ppo"}):
        cfg = load_section(RLSettings, settings)
        config = algorithm_config(cfg, weigh_behaviour=False)
        assert isinstance(config, GRPOConfig | PPOConfig) and config.weigh_behaviour is False
        assert algorithm_config(cfg).weigh_behaviour is True
        assert config.behav_weight_cap == cfg.rollout.behav_weight_cap


def test_a_batch_at_staleness_0_keeps_the_rollout_roles_logprobs():
    """Failed before: at staleness 0 take_rollouts dropped them (behav_logp=None), as if the role's
    engine computed as the trainer does; the gap then went neither measured nor corrected."""
    cfg = load_section(RLSettings, {"rollout": {"role": True}})
    behav = torch.tensor([[0.0, -0.5, -1.5], [0.0, -0.25, -2.0]])
    batch = Rollouts(
        inputs=torch.zeros(2, 3, dtype=torch.long),
        targets=torch.ones(2, 3, dtype=torch.long),
        mask=torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]]),
        scores=torch.tensor([1.0, 0.0]),
        ended=torch.ones(2, dtype=torch.bool),
        lengths=torch.tensor([2, 2]),
        groups=torch.zeros(2, dtype=torch.long),
        behav_logp=behav,
    )
    payload = {**batch.to_dict(), "version": 3, "idx": [5], "tools": {}, "gen_seconds": 1.0, "idle_seconds": 0.0}
    exchange = SimpleNamespace(take_rollouts=lambda step, timeout, alive: payload, check_alive=lambda role: None)
    run = SimpleNamespace(
        cfg=cfg, exchange=exchange, engine=SimpleNamespace(tool_stats={}), rollout_start=None, core_loan=None
    )
    got, stats = take_rollouts(run, 3, [5])
    assert stats["async/staleness"] == 0.0
    assert got.behav_logp is not None and torch.equal(got.behav_logp, behav)
