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
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from chatpipe import runtime
from chatpipe.rl import losses as rl
from chatpipe.rl.rollout import Rollouts, sampled_logprobs, token_logprobs
from chatpipe.rl.value import token_values
from chatpipe.train.step import step_optimizers

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings

Autocast = Callable[[], AbstractContextManager]
# rollouts from another policy, dtype or engine: pi_prox / pi_behav is truncated here (losses.behaviour_weights)
BEHAV_WEIGHT_CAP = 5.0
# model -> the (weighted) replay loss of one batch of chat-stage rows; see :func:`replay_backward`
Replay = Callable[[torch.nn.Module], torch.Tensor]


def micro_batches(n_rows: int, size: int) -> list[slice]:
    """Row slices of at most ``size`` rows (``size`` <= 0: one slice of all rows)."""
    size = size if size > 0 else max(n_rows, 1)
    return [slice(i, min(i + size, n_rows)) for i in range(0, n_rows, size)]


def _no_sync(model, last: bool) -> AbstractContextManager:
    """DDP syncs gradients on the backward of the last micro-batch only; plain modules always "sync"."""
    return contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()


def _step(model, optimizers: list, grad_clip: float = 0.0, critic=None, critic_opts: list = ()) -> float:
    """Step the policy's optimizers (and the critic's on its own norm): each module's gradient clipped to
    norm ``grad_clip`` (0: off), then zeroed. Returns the policy's gradient norm before clipping."""
    norm = step_optimizers(model, optimizers, grad_clip)
    if critic is not None:
        step_optimizers(critic, critic_opts, grad_clip)
    return norm.item()


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


@dataclass
class GRPOConfig:
    """The knobs of :func:`grpo_update`, named as in the ``rl`` params section but for ``micro_batch``
    (``device_batch_size``); the defaults are the plain update's (tests and benches build it by hand),
    :meth:`from_settings` builds the stage's from its settings."""

    group_size: int
    normalize_std: bool = False
    micro_batch: int = 16
    temperature: float = 1.0
    grad_clip: float = 0.0
    kl_loss_coef: float = 0.0
    behav_weight_cap: float = BEHAV_WEIGHT_CAP
    # False: the batch's sampler computes as the trainer does, so its behav_logp is only measured
    # against the trainer's (the gap/* stats), not weighed by (see sampling.sampler_is_trainer)
    weigh_behaviour: bool = True

    @classmethod
    def from_settings(cls, cfg: RLSettings, weigh_behaviour: bool = True) -> GRPOConfig:
        """The GRPO knobs of the ``rl`` section's settings."""
        own = {"micro_batch": cfg.device_batch_size, "kl_loss_coef": cfg.grpo.kl_loss_coef}
        own |= {"behav_weight_cap": cfg.rollout.behav_weight_cap, "weigh_behaviour": weigh_behaviour}
        return cls(**{f.name: own[f.name] if f.name in own else getattr(cfg, f.name) for f in fields(cls)})


def grpo_update(
    model,
    optimizers: list,
    batch: Rollouts,
    scores: torch.Tensor,
    cfg: GRPOConfig,
    *,
    autocast: Autocast = contextlib.nullcontext,
    replay: Replay | None = None,
    ref: torch.nn.Module | None = None,
) -> dict[str, float]:
    """One policy-gradient step: advantage = score - group mean, loss over the batch's informative tokens.

    Rows are consecutive groups of ``cfg.group_size`` samples of one prompt. A group whose samples all
    scored the same has advantage 0: it carries no gradient, so its rows are left out of the
    forward passes and of the loss's denominator. Dividing by the action tokens of the rows that
    do carry signal keeps the policy gradient's weight beside the replay loss the same however
    many groups are already solved (counting solved rows would shrink it as the policy improves).
    With ``replay`` the step also follows one replay batch's loss (:func:`replay_backward`).
    Log-probs are taken at the sampling ``cfg.temperature``; ``cfg.grad_clip`` > 0 clips the gradient
    norm before the step. With ``cfg.kl_loss_coef`` > 0 every row also carries that weight x the k3
    estimate of KL(policy || ``ref``), a mean over all the batch's action tokens (verl's KL loss: it
    holds a policy trained on a learned reward near the reference without touching the rewards). A
    batch that carries its sampler's log-probs (``batch.behav_logp``) gets the sampler-trainer gap
    (``gap/*``, :func:`chatpipe.rl.losses.sampler_gap`) of the rows forwarded here, and, unless
    ``cfg.weigh_behaviour`` is off (the sampler is the trainer's own numerics), weighs each token by
    pi_prox / pi_behav, truncated at ``cfg.behav_weight_cap``; the proximal policy is the policy before
    this step. Returns ``loss/policy`` (the summed loss), ``adv/abs_mean``, ``adv/informative_frac``
    and, with replay, ``loss/replay``; with the KL loss ``kl/loss_mean``; with weights their
    ``stale/*`` stats of the rows trained on.
    """
    if len(scores) % cfg.group_size:
        raise ValueError(f"{len(scores)} rollouts do not split into groups of group_size={cfg.group_size}")
    adv = rl.group_advantages(scores.view(-1, cfg.group_size), cfg.normalize_std).flatten()
    informative = adv != 0
    kl_ref = ref if cfg.kl_loss_coef > 0 else None
    # under DDP every rank runs every micro-batch (the same number of backward passes on each rank);
    # solved rows then add exact zeros. The KL loss reaches every row.
    every_row = hasattr(model, "no_sync") or kl_ref is not None
    rows_used = torch.arange(len(adv)) if every_row else informative.nonzero().flatten().cpu()
    chunks = [rows_used[s] for s in micro_batches(len(rows_used), cfg.micro_batch)]
    stats = {"adv/informative_frac": informative.float().mean().item()}
    total, stats_pg = grpo_backward(model, batch, adv, chunks, cfg, autocast, replay is None, kl_ref)
    stats |= stats_pg
    if replay is not None:
        stats["loss/replay"] = replay_backward(model, replay, autocast)
    if chunks or replay is not None:  # a batch of solved groups and no replay: nothing to step on
        stats["train/grad_norm"] = _step(model, optimizers, cfg.grad_clip)
    return {"loss/policy": total, "adv/abs_mean": adv.abs().mean().item(), **stats}


def grpo_backward(
    model, batch: Rollouts, adv: torch.Tensor, chunks: list[torch.Tensor], cfg: GRPOConfig, autocast: Autocast,
    sync_last: bool, ref: torch.nn.Module | None,
) -> tuple[float, dict[str, float]]:  # fmt: skip
    """Accumulate the policy-gradient (and KL) loss's gradients over the micro-batches ``chunks`` of
    rows. The loss of every micro-batch is divided by the informative action tokens of the *whole*
    batch, so the accumulated gradient equals one pass over the rows. ``sync_last``: DDP syncs on the
    last micro-batch's backward (no replay batch follows). Returns (summed loss, KL and stale stats)."""
    num_tokens = batch.mask[adv != 0].sum().item()
    total, kl_total, stale = 0.0, 0.0, []
    for i, rows in enumerate(chunks):
        with _no_sync(model, i == len(chunks) - 1 and sync_last), autocast():
            logp = sampled_logprobs(model, batch.inputs[rows], batch.targets[rows], cfg.temperature)
            weights = None
            if batch.behav_logp is not None:  # the policy before this step is the proximal one
                weights, s = behaviour_terms(logp.detach(), batch.behav_logp[rows], batch.mask[rows], cfg)
                stale.append((s, batch.mask[rows].sum().item()))
            loss = rl.policy_gradient_loss(logp, adv[rows], batch.mask[rows], num_tokens=num_tokens, weights=weights)
            if ref is not None:
                kl = kl_loss_term(ref, logp, batch.select(rows), cfg.temperature, batch.mask.sum().item())
                kl_total += kl.item()
                loss = loss + cfg.kl_loss_coef * kl
        loss.backward()
        total += loss.item()
    stats = {"kl/loss_mean": kl_total} if ref is not None else {}
    return total, stats | merge_token_stats(stale)


def behaviour_terms(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig | PPOConfig
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """What a batch sampled with its own log-probs brings to an update: the sampler-trainer gap's
    stats (:func:`chatpipe.rl.losses.sampler_gap`), and with ``cfg.weigh_behaviour`` each token's
    weight pi_prox / pi_behav truncated at ``cfg.behav_weight_cap`` (AReaL's decoupled loss; TRL and
    verl's truncated importance sampling is this with the trainer's own policy as the proximal one)
    with its ``stale/*`` stats. Without, the weights are None: the loss is the plain one."""
    gap = rl.sampler_gap(prox_logp, behav_logp, mask)
    if not cfg.weigh_behaviour:
        return None, gap
    weights, stale = rl.behaviour_weights(prox_logp, behav_logp, mask, cfg.behav_weight_cap)
    return weights, gap | stale


def merge_token_stats(parts: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """The ``gap/*`` and ``stale/*`` stats of micro-batches (each with its action tokens) as one
    batch's: means weighted by tokens, the largest (``*_max``) over all; none without such rollouts."""
    tokens = sum(n for _, n in parts)
    if not parts or tokens <= 0:
        return {}
    keys = parts[0][0]
    out = {k: sum(s[k] * n for s, n in parts) / tokens for k in keys if not k.endswith("_max")}
    return out | {k: max(s[k] for s, _ in parts) for k in keys if k.endswith("_max")}


def kl_loss_term(
    ref: torch.nn.Module, logp: torch.Tensor, rows: Rollouts, temperature: float, batch_tokens: float
) -> torch.Tensor:
    """These rows' share of the batch's mean k3 KL(policy || ``ref``) per action token (their sum over
    ``batch_tokens``, the action tokens of the whole batch); ``logp`` the policy's, with gradients."""
    with torch.no_grad():
        ref_logp = sampled_logprobs(ref, rows.inputs, rows.targets, temperature)
    return rl.token_mean(rl.kl_estimate(logp.float(), ref_logp.float(), "k3"), rows.mask, batch_tokens)


@dataclass
class PPOConfig:
    """The knobs of :func:`ppo_update`: the ``rl.ppo`` section's (``epochs``, ``clip_eps``, ...) and the
    ones both algorithms share (``group_size``, ``temperature``, ...; ``micro_batch`` is ``device_batch_size``).

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
    max_token_ratio: float
    temperature: float
    bootstrap: bool
    grad_clip: float
    seed: int
    behav_weight_cap: float = BEHAV_WEIGHT_CAP  # rollouts with behav_logp (GRPOConfig's)
    weigh_behaviour: bool = True  # as GRPOConfig's

    @classmethod
    def from_settings(cls, cfg: RLSettings, weigh_behaviour: bool = True) -> PPOConfig:
        """The PPO knobs of the ``rl`` section's settings: ``rl.ppo``'s, then the shared ones."""
        ppo = cfg.ppo.model_dump()
        own = {"micro_batch": cfg.device_batch_size, "weigh_behaviour": weigh_behaviour}
        own["behav_weight_cap"] = cfg.rollout.behav_weight_cap
        own |= {k: v for k, v in ppo.items() if k not in own}
        return cls(**{f.name: own[f.name] if f.name in own else getattr(cfg, f.name) for f in fields(cls)})


@dataclass
class PPOTargets:
    """What the clipped losses compare against, computed once before the epochs."""

    old_logp: torch.Tensor  # [B, T] the rollout policy's token log-probs
    old_values: torch.Tensor | None  # [B, T] the critic's values (None without a critic)
    adv: torch.Tensor  # [B, T] advantages, zero off the action tokens
    returns: torch.Tensor | None  # [B, T] value targets (None without a critic)
    kl: torch.Tensor  # [B, T] per-token KL to the reference policy
    weights: torch.Tensor | None = None  # [B, T] pi_prox / pi_behav (None: not weighed, update.behaviour_terms)
    stale: dict[str, float] = field(default_factory=dict)  # their stats and the gap's (behaviour_terms)


def ppo_targets(
    model, ref, critic, batch: Rollouts, scores: torch.Tensor, kl_ctl: rl.KLController, cfg: PPOConfig,
    autocast: Autocast, value_norm: rl.ValueNorm | None = None, behav_weight_cap: float = BEHAV_WEIGHT_CAP,
) -> PPOTargets:  # fmt: skip
    """KL-penalised token rewards turned into advantages: GAE with a critic, else group advantages.

    The log-probs computed here before the epochs are the proximal policy's. A batch with
    ``behav_logp`` (the sampler's log-probs) also gets the sampler-trainer gap's stats and, with
    ``cfg.weigh_behaviour``, each token's weight pi_prox / pi_behav, truncated at
    ``behav_weight_cap`` (:func:`behaviour_terms`).

    Log-probs are those of the sampling distribution (logits / ``cfg.temperature``). With
    ``value_norm`` the critic works in normalised units: its values are de-normalised for GAE, the
    running moments take this batch's returns (over every rank), and the value targets are the
    returns normalised by them.
    """
    mb = cfg.micro_batch
    with torch.no_grad(), autocast():
        old_logp = token_logprobs(model, batch.inputs, batch.targets, mb, cfg.temperature)
        ref_logp = token_logprobs(ref, batch.inputs, batch.targets, mb, cfg.temperature)
        old_values, last_values = critic_values(critic, batch, cfg) if critic is not None else (None, None)
    rewards, kl = rl.kl_penalized_rewards(scores, old_logp, ref_logp, batch.mask, kl_ctl.value, cfg.kl_estimator)
    if critic is not None:
        denorm = value_norm.denormalize if value_norm is not None else (lambda v: v)
        last = denorm(last_values) * ~batch.ended if last_values is not None else None
        adv, returns = rl.gae(rewards, denorm(old_values), batch.mask, cfg.gamma, cfg.lam, last)
        if value_norm is not None:
            update_value_norm(value_norm, returns, batch.mask)
            returns = value_norm.normalize(returns) * batch.mask
    else:  # no critic: the sequence's total reward minus its group's mean, on every action token
        seq_adv = rl.group_advantages(rewards.sum(1).view(-1, cfg.group_size), cfg.normalize_std).flatten()
        adv, returns = seq_adv[:, None] * batch.mask, None
    if cfg.whiten != "none":
        adv = rl.whiten(adv, batch.mask, groups=batch.groups if cfg.whiten == "group" else None)
    if batch.behav_logp is None:
        return PPOTargets(old_logp, old_values, adv, returns, kl)
    # old_logp is the proximal policy's, the clip is taken against it (decoupled PPO)
    capped = replace(cfg, behav_weight_cap=behav_weight_cap)
    weights, stats = behaviour_terms(old_logp, batch.behav_logp, batch.mask, capped)
    return PPOTargets(old_logp, old_values, adv, returns, kl, weights, stats)


def critic_values(critic, batch: Rollouts, cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values [B, T], values after each row's last action [B] or None): the second only with
    ``cfg.bootstrap``, read from one extra column (the row's final token as an input)."""
    if not cfg.bootstrap:
        return token_values(critic, batch.inputs, cfg.micro_batch), None
    full = token_values(critic, torch.cat([batch.inputs, batch.targets[:, -1:]], 1), cfg.micro_batch)
    rows = torch.arange(full.size(0), device=full.device)
    return full[:, :-1], full[rows, rl.last_action_index(batch.mask) + 1]


def update_value_norm(value_norm: rl.ValueNorm, returns: torch.Tensor, mask: torch.Tensor) -> None:
    """Fold this step's returns, over every rank, into the running moments."""
    sums = torch.stack([rl.masked_sum(returns, mask), rl.masked_sum(returns * returns, mask), mask.sum()])
    sums = runtime.all_reduce_sum(sums.double())
    if sums[2] > 0:
        value_norm.update_moments((sums[0] / sums[2]).item(), (sums[1] / sums[2]).item())


def ppo_minibatch_backward(
    model, critic, batch: Rollouts, t: PPOTargets, rows_mb: torch.Tensor, cfg: PPOConfig, autocast: Autocast,
    replay_follows: bool, stats: dict[str, float],
) -> torch.Tensor:  # fmt: skip
    """Accumulate one minibatch's gradients over its micro-batches, adding their losses to ``stats``.

    Returns [sum of importance ratios, action tokens, micro-batches with a token ratio above
    ``cfg.max_token_ratio``] (for the all-reduce) and keeps this rank's largest ratio in
    ``stats["ppo/ratio_max"]``. ``replay_follows``: a replay batch's backward ends the step, so
    DDP syncs the policy there, not here.
    """
    num_tokens = batch.mask[rows_mb].sum().item()
    chunks = micro_batches(len(rows_mb), cfg.micro_batch)
    sums = torch.zeros(3, device=batch.inputs.device)
    for i, sl in enumerate(chunks):
        rows = rows_mb[sl]
        mask = batch.mask[rows]
        last = i == len(chunks) - 1
        with contextlib.ExitStack() as stack:
            stack.enter_context(_no_sync(model, last and not replay_follows))
            if critic is not None:
                stack.enter_context(_no_sync(critic, last))
            stack.enter_context(autocast())
            logp = sampled_logprobs(model, batch.inputs[rows], batch.targets[rows], cfg.temperature)
            weights = None if t.weights is None else t.weights[rows]
            loss, s = rl.clipped_surrogate(
                logp, t.old_logp[rows], t.adv[rows], mask, cfg.clip_eps, num_tokens, weights=weights
            )
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
        ratio_sum, tokens, peak = rl.ratio_sums(logp, t.old_logp[rows], mask).tolist()
        stats["ppo/ratio_max"] = max(stats["ppo/ratio_max"], peak)
        over = rl.ratio_exceeds_cap(logp.detach(), t.old_logp[rows], mask, cfg.max_token_ratio)
        sums += torch.tensor([ratio_sum, tokens, float(over)], device=sums.device)
    return sums


def ppo_summary(
    stats: dict[str, float], stopped: bool, kl: torch.Tensor, kl_ctl: rl.KLController, n: int
) -> dict[str, float]:
    """Sums per minibatch become means; the KL controller moves by the batch's mean sequence KL."""
    seen = max(stats.pop("ppo/minibatches"), 1.0)
    per_update = ("loss/replay", "train/grad_norm")  # the policy's norm before clipping, over the steps taken
    for k in ("loss/policy", "loss/value", "ppo/clip_frac", "ppo/approx_kl", "ppo/ratio_mean", *per_update):
        if k in stats:
            stats[k] /= max(stats["ppo/updates"], 1.0) if k in per_update else seen
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
    value_norm: rl.ValueNorm | None = None,
    behav_weight_cap: float = BEHAV_WEIGHT_CAP,
) -> dict[str, float]:
    """PPO: KL-penalised token rewards, GAE (or group advantages without a critic), clipped epochs x minibatches.

    Each epoch shuffles the rows (seeded by ``cfg.seed`` and ``step``) into ``num_minibatches``
    minibatches, which must divide the rows; each minibatch is one optimizer step, accumulated over
    micro-batches (and, with ``replay``, one replay batch: :func:`replay_backward`). A minibatch
    whose mean importance ratio over its action tokens (every rank's) exceeds ``cfg.max_ratio`` is
    skipped: its gradients are dropped and the next minibatch goes on. When one action token's ratio
    exceeds ``cfg.max_token_ratio`` the update stops. The KL controller is moved by the batch's
    mean sequence KL. Returns mean losses, clip fraction, approximate KL and importance ratio per
    minibatch, the largest ratio, ``ppo/updates``, ``ppo/skipped``, ``ppo/early_stop`` and
    ``kl_sum`` (summed sequence KL of this rank's rows). A batch with ``behav_logp`` (the sampler's
    log-probs) returns the sampler-trainer gap (``gap/*``) and, with ``cfg.weigh_behaviour``, trains on
    AReaL's decoupled objective: each token's clipped term weighed by pi_prox / pi_behav, truncated
    at ``behav_weight_cap``, its ``stale/*`` stats returned too.
    """
    n = len(scores)
    if n % cfg.num_minibatches:
        raise ValueError(f"{n} rollout rows do not split into num_minibatches={cfg.num_minibatches}")
    t = ppo_targets(model, ref, critic, batch, scores, kl_ctl, cfg, autocast, value_norm, behav_weight_cap)
    rows_per_mb = n // cfg.num_minibatches
    g = torch.Generator().manual_seed(cfg.seed * 7919 + step)
    stats = dict.fromkeys(["loss/policy", "loss/value", "ppo/clip_frac", "ppo/approx_kl", "ppo/updates"], 0.0)
    stats |= dict.fromkeys(
        ["ppo/ratio_mean", "ppo/ratio_max", "ppo/skipped", "ppo/minibatches", "train/grad_norm"], 0.0
    )
    if replay is not None:
        stats["loss/replay"] = 0.0
    stopped = False
    for _ in range(cfg.epochs):
        perm = torch.randperm(n, generator=g).to(batch.inputs.device)
        for start in range(0, n, rows_per_mb):
            stopped = ppo_minibatch_step(
                model, critic, (policy_opts, critic_opts), batch, t, perm[start : start + rows_per_mb], cfg,
                autocast, replay, stats,
            )  # fmt: skip
            if stopped:
                break
        if stopped:
            break
    return ppo_summary(stats, stopped, t.kl, kl_ctl, n) | t.stale


def ppo_minibatch_step(
    model, critic, optimizers: tuple[list, list], batch: Rollouts, t: PPOTargets, rows_mb: torch.Tensor, cfg: PPOConfig,
    autocast: Autocast, replay: Replay | None, stats: dict[str, float],
) -> bool:  # fmt: skip
    """One minibatch: its gradients, then a step of (policy, critic) ``optimizers``, a skip (mean ratio
    above ``max_ratio``) or a stop (a token ratio above ``max_token_ratio``); returns True to stop the update."""
    sums = ppo_minibatch_backward(model, critic, batch, t, rows_mb, cfg, autocast, replay is not None, stats)
    # every rank must agree to step, skip or stop, or DDP's next all-reduce would hang
    ratio_sum, tokens, over = runtime.all_reduce_sum(sums).tolist()
    mean_ratio = ratio_sum / max(tokens, 1.0)
    stats["ppo/ratio_mean"] += mean_ratio
    stats["ppo/minibatches"] += 1
    if over > 0:
        _zero([model, critic])
        return True
    if cfg.max_ratio > 0 and mean_ratio > cfg.max_ratio:
        stats["ppo/skipped"] += 1
        _zero([model, critic])
        return False
    if replay is not None:
        stats["loss/replay"] += replay_backward(model, replay, autocast)
    stats["train/grad_norm"] += _step(model, optimizers[0], cfg.grad_clip, critic, optimizers[1])
    stats["ppo/updates"] += 1
    return False


# --------------------------------------------------------------------------- the algorithm, decided here


def uses_critic(cfg: RLSettings) -> bool:
    """Whether the run trains a critic: PPO, unless ``disable_value`` makes it group-advantage PPO."""
    return cfg.algorithm == "ppo" and not cfg.ppo.disable_value


def uses_critic_init(cfg: RLSettings) -> bool:
    """Whether ``ppo.critic_init_dir`` is read (and so fingerprinted for a resume): under PPO."""
    return cfg.algorithm == "ppo"


def check_minibatches(cfg: RLSettings, world_size: int) -> None:
    """Each rank's prompts per step, and its rows into PPO's minibatches, must split evenly: checked
    before any model loads."""
    if cfg.prompts_per_step % world_size:
        raise ValueError(f"rl.prompts_per_step = {cfg.prompts_per_step} must be a multiple of the {world_size} ranks")
    rows = cfg.prompts_per_step // world_size * cfg.group_size
    if cfg.algorithm == "ppo" and rows % cfg.ppo.num_minibatches:
        raise ValueError(
            f"rl: {cfg.prompts_per_step} prompts_per_step / {world_size} ranks x group_size {cfg.group_size} = "
            f"{rows} rows per rank per step do not split into ppo.num_minibatches = {cfg.ppo.num_minibatches}"
        )


def algorithm_config(cfg: RLSettings, weigh_behaviour: bool = True) -> GRPOConfig | PPOConfig:
    """The chosen algorithm's typed config (``rl.algorithm``): what :func:`policy_update` runs.
    ``weigh_behaviour``: False where the rollouts' sampler is the trainer's own numerics
    (:func:`chatpipe.rl.sampling.sampler_is_trainer`): their log-probs are then measured, not weighed by."""
    config = GRPOConfig if cfg.algorithm == "grpo" else PPOConfig
    return config.from_settings(cfg, weigh_behaviour)


@dataclass
class Learners:
    """What one update trains and reads: the (maybe DDP-wrapped) policy and critic, their optimizers,
    the reference policy, PPO's KL controller and value-norm moments."""

    policy: torch.nn.Module
    ref: torch.nn.Module
    critic: torch.nn.Module | None
    policy_opts: list
    critic_opts: list
    kl_ctl: rl.KLController
    value_norm: rl.ValueNorm | None = None


def policy_update(
    config: GRPOConfig | PPOConfig, learners: Learners, batch: Rollouts, scores: torch.Tensor, *, step: int,
    autocast: Autocast = contextlib.nullcontext, replay: Replay | None = None,
) -> dict[str, float]:  # fmt: skip
    """One update of ``config``'s algorithm (:func:`algorithm_config`) on ``batch`` with shaped ``scores``."""
    m = learners
    if isinstance(config, GRPOConfig):
        return grpo_update(m.policy, m.policy_opts, batch, scores, config, autocast=autocast, replay=replay, ref=m.ref)
    return ppo_update(
        m.policy, m.ref, m.critic, m.policy_opts, m.critic_opts, batch, scores, m.kl_ctl, config,
        step=step, autocast=autocast, replay=replay, value_norm=m.value_norm, behav_weight_cap=config.behav_weight_cap,
    )  # fmt: skip
