"""One RL update from a batch of rollouts: GRPO-lite and PPO, with micro-batching.

    stats = grpo_update(model, optimizers, batch, scores, group_size=8, micro_batch=16)
    stats = ppo_update(model, ref, critic, policy_opts, critic_opts, batch, scores, kl_ctl,
                       PPOConfig.from_settings(cfg), step=step)

The math (advantages, KL, GAE, clipped losses) lives in :mod:`chatpipe.rl.losses`; this module
runs it over a batch: which rows go into which forward pass, when gradients are synced across
DDP ranks, when the optimizers step and when PPO stops early. ``model`` is anything called as
``model(inputs, targets, loss_reduction="none") -> per-token loss [B, T]`` (a GPT, or the GPT
wrapped in DDP); ``critic(inputs) -> values [B, T]``. Unit tests: tests/test_rl_update.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from chatpipe import runtime
from chatpipe.rl import losses as rl
from chatpipe.rl.rollout import Rollouts, token_logprobs
from chatpipe.rl.value import token_values

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings

Autocast = Callable[[], AbstractContextManager]
# model -> the (weighted) replay loss of one batch of chat-stage rows; see :func:`replay_backward`
Replay = Callable[[torch.nn.Module], torch.Tensor]


def micro_batches(n_rows: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` rows (``size`` <= 0: one slice of all rows)."""
    size = size if size > 0 else max(n_rows, 1)
    return [slice(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def _no_sync(model, last: bool) -> AbstractContextManager:
    """DDP syncs gradients on the backward of the last micro-batch only; plain modules always "sync"."""
    return contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()


def _step(optimizers: list, modules: list) -> None:
    for opt in optimizers:
        opt.step()
    _zero(modules)


def _zero(modules: list) -> None:
    for m in modules:
        if m is not None:
            m.zero_grad(set_to_none=True)


def replay_backward(model, replay: Replay, autocast: Autocast = contextlib.nullcontext) -> float:
    """Add the gradient of one replay batch's loss; the last backward of an optimizer step, so DDP syncs here.

    Replay keeps skills RL does not reward: the chat-stage LM loss is trained beside the RL loss
    (InstructGPT's PPO-ptx), and the step follows the sum of both gradients.
    """
    with autocast():
        loss = replay(model)
    loss.backward()
    return loss.item()


def grpo_update(
    model,
    optimizers: list,
    batch: Rollouts,
    scores: torch.Tensor,
    *,
    group_size: int,
    normalize_std: bool = False,
    micro_batch: int = 16,
    autocast: Autocast = contextlib.nullcontext,
    replay: Replay | None = None,
) -> dict[str, float]:
    """One policy-gradient step: advantage = score - group mean, loss over the batch's informative tokens.

    Rows are consecutive groups of ``group_size`` samples of one prompt. A group whose samples all
    scored the same has advantage 0: it carries no gradient, so its rows are left out of the
    forward passes and of the loss's denominator. Dividing by the action tokens of the rows that
    do carry signal keeps the policy gradient's weight beside the replay loss the same however
    many groups are already solved (counting solved rows would shrink it as the policy improves).
    The loss of every micro-batch is divided by that count for the *whole* batch, so accumulating
    the micro-batches' gradients equals one pass over the rows. With ``replay`` the step also
    follows one replay batch's loss (:func:`replay_backward`). Returns ``loss/policy`` (the summed
    loss), ``adv/abs_mean``, ``adv/informative_frac`` and, with replay, ``loss/replay``.
    """
    if len(scores) % group_size:
        raise ValueError(f"{len(scores)} rollouts do not split into groups of group_size={group_size}")
    adv = rl.group_advantages(scores.view(-1, group_size), normalize_std).flatten()
    informative = adv != 0
    # under DDP every rank runs every micro-batch (the same number of backward passes on each rank);
    # solved rows then add exact zeros
    rows_used = torch.arange(len(adv)) if hasattr(model, "no_sync") else informative.nonzero().flatten().cpu()
    num_tokens = batch.mask[informative].sum().item()
    chunks = [rows_used[s] for s in micro_batches(len(rows_used), micro_batch)]
    total = 0.0
    stats = {"adv/informative_frac": informative.float().mean().item()}
    for i, rows in enumerate(chunks):
        with _no_sync(model, i == len(chunks) - 1 and replay is None), autocast():
            logp = -model(batch.inputs[rows], batch.targets[rows], loss_reduction="none")
            loss = rl.policy_gradient_loss(logp, adv[rows], batch.mask[rows], num_tokens=num_tokens)
        loss.backward()
        total += loss.item()
    if replay is not None:
        stats["loss/replay"] = replay_backward(model, replay, autocast)
    if chunks or replay is not None:  # a batch of solved groups and no replay: nothing to step on
        _step(optimizers, [model])
    return {"loss/policy": total, "adv/abs_mean": adv.abs().mean().item(), **stats}


@dataclass
class PPOConfig:
    """The knobs of :func:`ppo_update`, named as in the ``rl`` params section but for ``epochs``
    (``ppo_epochs``) and ``micro_batch`` (``device_batch_size``).

    No defaults here: :class:`chatpipe.settings.RLSettings` holds them (and documents and validates
    each), and :meth:`from_settings` builds the config from it.
    """

    group_size: int
    epochs: int
    num_minibatches: int
    micro_batch: int
    clip_eps: float
    value_clip: float
    value_coef: float
    gamma: float
    lam: float
    kl_estimator: str
    whiten: str  # batch | group | none
    normalize_std: bool
    max_ratio: float
    seed: int

    @classmethod
    def from_settings(cls, cfg: RLSettings) -> PPOConfig:
        """The PPO knobs of the ``rl`` section's settings."""
        renamed = {"epochs": cfg.ppo_epochs, "micro_batch": cfg.device_batch_size}
        return cls(**{f.name: renamed[f.name] if f.name in renamed else getattr(cfg, f.name) for f in fields(cls)})


@dataclass
class PPOTargets:
    """What the clipped losses compare against, computed once before the epochs."""

    old_logp: torch.Tensor  # [B, T] the rollout policy's token log-probs
    old_values: torch.Tensor | None  # [B, T] the critic's values (None without a critic)
    adv: torch.Tensor  # [B, T] advantages, zero off the action tokens
    returns: torch.Tensor | None  # [B, T] value targets (None without a critic)
    kl: torch.Tensor  # [B, T] per-token KL to the reference policy


def ppo_targets(
    model, ref, critic, batch: Rollouts, scores: torch.Tensor, kl_ctl: rl.KLController, cfg: PPOConfig,
    autocast: Autocast,
) -> PPOTargets:  # fmt: skip
    """KL-penalised token rewards turned into advantages: GAE with a critic, else group advantages."""
    mb = cfg.micro_batch
    with torch.no_grad(), autocast():
        old_logp = token_logprobs(model, batch.inputs, batch.targets, mb)
        ref_logp = token_logprobs(ref, batch.inputs, batch.targets, mb)
        old_values = token_values(critic, batch.inputs, mb) if critic is not None else None
    rewards, kl = rl.kl_penalized_rewards(scores, old_logp, ref_logp, batch.mask, kl_ctl.value, cfg.kl_estimator)
    if critic is not None:
        adv, returns = rl.gae(rewards, old_values, batch.mask, cfg.gamma, cfg.lam)
    else:  # no critic: the sequence's total reward minus its group's mean, on every action token
        seq_adv = rl.group_advantages(rewards.sum(1).view(-1, cfg.group_size), cfg.normalize_std).flatten()
        adv, returns = seq_adv[:, None] * batch.mask, None
    if cfg.whiten != "none":
        adv = rl.whiten(adv, batch.mask, groups=batch.groups if cfg.whiten == "group" else None)
    return PPOTargets(old_logp, old_values, adv, returns, kl)


def ppo_minibatch_backward(
    model, critic, batch: Rollouts, t: PPOTargets, rows_mb: torch.Tensor, cfg: PPOConfig, autocast: Autocast,
    replay_follows: bool, stats: dict[str, float],
) -> torch.Tensor:  # fmt: skip
    """Accumulate one minibatch's gradients over its micro-batches, adding their losses to ``stats``.

    Returns how many micro-batches had a token whose importance ratio exceeds ``cfg.max_ratio``
    (a one-element tensor, for the all-reduce). ``replay_follows``: a replay batch's backward ends
    the step, so DDP syncs the policy there, not here.
    """
    num_tokens = batch.mask[rows_mb].sum().item()
    chunks = micro_batches(len(rows_mb), cfg.micro_batch)
    exceeded = torch.zeros(1, device=batch.inputs.device)
    for i, sl in enumerate(chunks):
        rows = rows_mb[sl]
        mask = batch.mask[rows]
        last = i == len(chunks) - 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(_no_sync(model, last and not replay_follows))
            if critic is not None:
                stack.enter_context(_no_sync(critic, last))
            stack.enter_context(autocast())
            logp = -model(batch.inputs[rows], batch.targets[rows], loss_reduction="none")
            loss, s = rl.clipped_surrogate(logp, t.old_logp[rows], t.adv[rows], mask, cfg.clip_eps, num_tokens)
            stats["loss/policy"] += loss.item()
            if critic is not None:
                values = critic(batch.inputs[rows])
                v_loss, _ = rl.clipped_value_loss(
                    values, t.old_values[rows], t.returns[rows], mask, clip=cfg.value_clip, num_tokens=num_tokens
                )
                stats["loss/value"] += v_loss.item()
                loss = loss + cfg.value_coef * v_loss
        loss.backward()  # DDP decided in the forward (inside no_sync or not) whether this syncs
        stats["ppo/clip_frac"] += s["clip_frac"] / len(chunks)
        stats["ppo/approx_kl"] += s["approx_kl"] / len(chunks)
        if rl.ratio_exceeds_cap(logp.detach(), t.old_logp[rows], mask, cfg.max_ratio):
            exceeded += 1
    return exceeded


def ppo_summary(
    stats: dict[str, float], stopped: bool, kl: torch.Tensor, kl_ctl: rl.KLController, n: int
) -> dict[str, float]:
    """Sums per optimizer step become means; the KL controller moves by the batch's mean sequence KL."""
    updates = max(stats["ppo/updates"], 1.0)
    for k in ("loss/policy", "loss/value", "ppo/clip_frac", "ppo/approx_kl", "loss/replay"):
        if k in stats:
            stats[k] /= updates
    stats["ppo/early_stop"] = float(stopped)
    seq_kl = kl.sum(1)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    kl_ctl.update(seq_kl.mean().item(), n * world)
    stats["kl_sum"] = seq_kl.sum().item()
    return stats


def ppo_update(
    model,
    ref,
    critic,
    policy_opts: list,
    critic_opts: list,
    batch: Rollouts,
    scores: torch.Tensor,
    kl_ctl: rl.KLController,
    cfg: PPOConfig,
    *,
    step: int = 0,
    autocast: Autocast = contextlib.nullcontext,
    replay: Replay | None = None,
) -> dict[str, float]:
    """PPO: KL-penalised token rewards, GAE (or group advantages without a critic), clipped epochs x minibatches.

    Each epoch shuffles the rows (seeded by ``cfg.seed`` and ``step``) into ``num_minibatches``
    minibatches; each minibatch is one optimizer step, accumulated over micro-batches (and, with
    ``replay``, one replay batch: :func:`replay_backward`). When any
    action token's importance ratio exceeds ``cfg.max_ratio`` (on any rank) the minibatch's
    gradients are dropped and the update stops. The KL controller is moved by the batch's mean
    sequence KL. Returns mean losses, clip fraction and approximate KL per optimizer step,
    ``ppo/updates``, ``ppo/early_stop`` and ``kl_sum`` (summed sequence KL of this rank's rows).
    """
    t = ppo_targets(model, ref, critic, batch, scores, kl_ctl, cfg, autocast)
    n = len(scores)
    rows_per_mb = max(1, n // cfg.num_minibatches)
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    stats = {"loss/policy": 0.0, "loss/value": 0.0, "ppo/clip_frac": 0.0, "ppo/approx_kl": 0.0, "ppo/updates": 0.0}
    if replay is not None:
        stats["loss/replay"] = 0.0
    stopped = False
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=g).to(batch.inputs.device)
        for start in range(0, rows_per_mb * cfg.num_minibatches, rows_per_mb):
            rows_mb = perm[start : start + rows_per_mb]
            if len(rows_mb) == 0:
                continue
            exceeded = ppo_minibatch_backward(
                model, critic, batch, t, rows_mb, cfg, autocast, replay is not None, stats
            )
            # every rank must agree to step or stop, or DDP's next all-reduce would hang
            if runtime.all_reduce_sum(exceeded).item() > 0:
                stopped = True
                _zero([model, critic])
                break
            if replay is not None:
                stats["loss/replay"] += replay_backward(model, replay, autocast)
            _step(policy_opts + critic_opts, [model, critic])
            stats["ppo/updates"] += 1
        if stopped:
            break
    return ppo_summary(stats, stopped, t.kl, kl_ctl, n)
