"""The reward role: what a step's rollouts are trained on when a reward model scores them, the
reward-hacking guard that watches it, and iterated RLHF's refresh of the reward model.

    batch, stats = score_rollouts(run, batch)      # run: chatpipe.rl.step.RLRun (or anything with
                                                   # cfg, rt, guard and models)

The verifier's scores always stay in the stats, and held-out pass@k is always the verifier's, so a
policy that learns to please the reward model and not the task shows it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from chatpipe import runtime
from chatpipe.rl.guard import RewardGuard
from chatpipe.rl.reward_model import refresh_loss, rollout_rows, rollout_scores
from chatpipe.rl.rewards import combine_rewards, ensemble_rewards
from chatpipe.rl.rollout import Rollouts
from chatpipe.train.step import step_optimizers

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings


def verifier_in_reward(cfg: RLSettings) -> str:
    """How the verifier reaches the reward a model-scored policy trains on ("" when it does not, and
    for a verifier-trained run, whose reward is the verifier's): ``both`` adds its scores, and
    iterated RLHF trains the reward model on the pairs it ranks, so the model's scores carry it."""
    if cfg.reward.source == "both":
        return "rl.reward.source = both adds the verifier's scores to the reward model's"
    if cfg.reward.source == "model" and cfg.reward.model_lr_frac > 0:
        return (
            f"rl.reward.model_lr_frac = {cfg.reward.model_lr_frac} (iterated RLHF) trains the reward model "
            "during RL on pairs the verifier ranks, so the scores the policy trains on carry the verifier's "
            "verdicts: this run is not verifier-free (rl.reward.model_lr_frac: 0 keeps it so)"
        )
    return ""


def verifier_summary(cfg: RLSettings) -> dict[str, float]:
    """The summary's word on whether a model-scored run's reward carried the verifier
    (``reward_carries_verifier`` 1 or 0; nothing for a verifier-trained run, where it is the reward)."""
    return {} if cfg.reward.source == "verifier" else {"reward_carries_verifier": float(bool(verifier_in_reward(cfg)))}


def reward_guard(cfg: RLSettings, meta: dict) -> RewardGuard | None:
    """The reward-hacking guard of a run trained on the reward model's scores (None otherwise, or
    with ``guard.mode: off``), its windows where the checkpoint ``meta`` left them."""
    g = cfg.guard
    if cfg.reward.source == "verifier" or g.mode == "off":
        return None
    guard = RewardGuard(g.every, g.drop, g.mode, g.min_accuracy)
    if meta.get("guard"):
        guard.load(meta["guard"])
    return guard


def score_rollouts(run, batch: Rollouts) -> tuple[Rollouts, dict[str, float]]:
    """``batch`` with the scores ``reward.source`` trains on (the verifier's stay in the stats), and
    the mean verifier and (normalised) reward-model scores of this rank's rows; the guard counts them."""
    cfg, rm = run.cfg, run.models.reward_model
    if rm is None:
        return batch, {}
    scorers = [rm, *run.models.ensemble]
    with run.rt.autocast(), torch.no_grad():
        each = [rollout_scores(m, batch.inputs, batch.targets, batch.mask, cfg.device_batch_size) for m in scorers]
    stds = [m.score_std for m in scorers]
    normalized = ensemble_rewards(each, stds, batch.groups, win_rate=False)
    if run.guard is not None:
        run.guard.add(normalized, batch.scores, batch.groups)
    stats = {"reward/verifier_mean": batch.scores.mean().item(), "reward/model_mean": normalized.mean().item()}
    if run.models.reward_model_opts:  # the step's rewards are already read: the model learns from its replies
        stats |= refresh_reward_model(run, batch)
    # win rates from the scores read above; the guard above still reads the normalised scores
    model = ensemble_rewards(each, stds, batch.groups) if cfg.reward.model_scores == "win_rate" else normalized
    scored = combine_rewards(cfg.reward.source, batch.scores, model)
    return dataclasses.replace(batch, scores=scored, model_scores=normalized), stats


def refresh_reward_model(run, batch: Rollouts) -> dict[str, float]:
    """Iterated RLHF: one optimizer step of the reward model on this step's replies, paired by the
    verifier's scores (a right and a wrong reply to one prompt), gradients averaged over ranks. The
    policy reads the model's scores alone, but those now carry the verifier's verdicts
    (:func:`verifier_in_reward`); the model keeps up with what the policy writes instead of being
    exploited where it was never trained."""
    rm, rt = run.models.reward_model, run.rt
    ids, last = rollout_rows(batch.inputs, batch.targets, batch.mask)
    with rt.autocast():  # batch.scores are still the verifier's here
        loss, stats = refresh_loss(rm, ids, last, batch.scores, batch.groups)
    loss.backward()
    for p in rm.parameters():
        if p.grad is not None and rt.world_size > 1:
            runtime.all_reduce_sum(p.grad).div_(rt.world_size)
    step_optimizers(rm, run.models.reward_model_opts, run.cfg.grad_clip)
    return stats
