"""The rollout role's one job, shared by the trainer (synchronous RL) and the asynchronous rollout
role: a step's prompts x ``group_size`` responses, seeded so either process draws the same ones.

    dtype = rollout_dtype(cfg, rt)                              # once per process
    batch = sample_batch(cfg, engine, problems, step, rank, world_size, dtype)
    sampler_is_trainer(cfg, dtype, rt.dtype)                    # measure the gap only, or also weigh by it
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from chatpipe import runtime
from chatpipe.inference.engine import Engine
from chatpipe.rl.rollout import Problem, Rollouts, collect_rollouts

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings

log = logging.getLogger("rl")


def rollout_dtype(cfg: RLSettings, rt: runtime.Runtime) -> torch.dtype:
    """``rl.rollout.dtype``, logged; ``auto`` is the dtype the trainer trains in, in the rollout role too
    (whose own runtime, not a training one, computes in float32 on CPU). Each role resolves it once."""
    dtype = runtime.compute_dtype(
        cfg.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype, rt.device.type == "cuda", training=True
    )
    log.info("rollouts: linear layers in %s (rl.rollout.dtype: %s)", dtype, cfg.rollout.dtype)
    return dtype


def sampler_is_trainer(cfg: RLSettings, sampler: torch.dtype, trainer: torch.dtype) -> bool:
    """Whether the rollouts come from the trainer's own numerics: the trainer's process samples them
    (no ``rollout_role``, another process and engine) and both compute in float32. Then the sampler's
    log-probs differ from the trainer's by rounding only (the engine's KV cache and batch shapes: a
    mean |gap| of 3e-7 on the tiny run), and the update only measures the gap, so the float32 run stays
    bit for bit what it was. Elsewhere it also weighs each token by the truncated pi_trainer /
    pi_sampler (:func:`chatpipe.rl.update.behaviour_terms`). A bf16 trainer with bf16 rollouts is not
    the same numerics either: autocast rounds every matmul, the rollouts only the wide linear layers
    (chatpipe.inference.precision), and the tiny run's gap is then 2e-3, as with float32 training
    under bf16 rollouts (docs/async-rl.md)."""
    return not cfg.rollout.role and sampler == trainer == torch.float32


def model_ranked(cfg: RLSettings) -> bool:
    """Best-of-n ranked by a learned reward: all ``generation_size`` samples come back, and the
    ``group_size`` best are kept after scoring (the verifier ranks inside collect_rollouts)."""
    return cfg.generation_size > cfg.group_size and cfg.reward.source != "verifier"


def sample_batch(
    cfg: RLSettings,
    engine: Engine,
    problems: list[Problem],
    step: int,
    rank: int,
    world_size: int,
    matmul_dtype: torch.dtype | None = None,
) -> Rollouts:
    """``problems`` x ``group_size`` responses, seeded by (seed, step, rank), the linear layers in
    ``matmul_dtype`` (:func:`rollout_dtype`). Each token's sampling log-prob is kept (``behav_logp``):
    the update measures the sampler-trainer gap with it, and weighs by it where :func:`sampler_is_trainer`
    is false. Recording it changes no sampled token."""
    per_rank = cfg.prompts_per_step // world_size
    ranked = model_ranked(cfg)
    return collect_rollouts(
        engine,
        problems,
        group_size=cfg.generation_size if ranked else cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k or None,
        device=next(engine.model.parameters()).device,
        seed=((cfg.seed * 1_000_003 + step) * world_size + rank) * per_rank,
        generation_size=0 if ranked else cfg.generation_size,
        behaviour_logprobs=True,
        matmul_dtype=matmul_dtype,
    )
