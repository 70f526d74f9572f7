"""RL math for the `rl` stage: advantages, KL, GAE, PPO losses, KL control, reward shaping.

Pure tensor functions, no model or I/O, so every formula is unit-tested against hand-computed
numbers (tests/test_rl.py). Shapes: one row per sampled response, one column per *target* position
(next-token prediction), and ``mask`` [B, T] is 1 on the tokens the policy sampled (the actions):
0 on the prompt, on tool outputs the engine forced in and on padding.

    adv = group_advantages(scores.view(n_prompts, group_size)).flatten()     # GRPO-lite
    rewards = kl_penalized_rewards(scores, logp, ref_logp, mask, beta=0.1)   # PPO
    adv, returns = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    loss, stats = clipped_surrogate(logp, old_logp, whiten(adv, mask), mask, clip_eps=0.2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from chatpipe.evals.metrics import pass_at_k

# --------------------------------------------------------------------------- masked reductions


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` where ``mask`` is 1."""
    x = x * mask
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (0 when there are none)."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Population variance of ``x`` over the masked positions."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


# --------------------------------------------------------------------------- advantages


def group_advantages(scores: torch.Tensor, normalize_std: bool = False, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantage per sample: score minus its group's mean (optionally / the group's std).

    ``scores`` is [num_prompts, group_size]; all samples of a row answered the same prompt.
    The std is the population std; a group whose samples all scored the same gets advantage 0.
    """
    adv = scores - scores.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (scores.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv


def whiten(
    x: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor | None = None, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``x`` to mean 0, std 1 over the masked positions of the batch (or of each group).

    ``groups`` [B] gives each row's group id (e.g. its prompt); rows of a group are whitened
    together. ``shift_mean=False`` only rescales (keeps the sign of every advantage).
    """
    if groups is None:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
        out = (x - mean) * torch.rsqrt(var + eps)
        return (out if shift_mean else out + mean) * mask
    out = torch.zeros_like(x)
    for g in groups.unique():
        rows = groups == g
        out[rows] = whiten(x[rows], mask[rows], shift_mean=shift_mean, eps=eps)
    return out


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    last_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action tokens of each row; returns (advantages, returns).

    Positions where ``mask`` is 0 are skipped: the "next state" of an action is the next action
    of the same row, so a forced tool output between two sampled tokens is not a step. After the
    last action the value is ``last_values`` [B] (default 0: the episode ended; a response cut at
    max_new_tokens may bootstrap from the critic's value of the state it was cut in).
    delta_t = r_t + gamma V_next - V_t, A_t = delta_t + gamma lam A_next, returns = A + V.
    Both are 0 off the mask.
    """
    b, t = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(b, dtype=rewards.dtype, device=rewards.device)
    if last_values is not None:
        next_value = last_values.to(rewards.dtype).clone()
    next_adv = torch.zeros_like(next_value)
    m = mask.to(rewards.dtype)
    for i in reversed(range(t)):
        delta = rewards[:, i] + gamma * next_value - values[:, i]
        a = delta + gamma * lam * next_adv
        adv[:, i] = a * m[:, i]
        # carry the running values only through action positions
        next_value = torch.where(m[:, i] > 0, values[:, i], next_value)
        next_adv = torch.where(m[:, i] > 0, a, next_adv)
    returns = (adv + values) * m
    return adv, returns


# --------------------------------------------------------------------------- KL to the reference


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL(policy || reference) estimate from log-probs of the sampled tokens.

    "k1": logp - ref_logp (unbiased, can be negative); "k2": 0.5 (logp - ref_logp)^2;
    "k3": exp(ref - logp) - (ref - logp) - 1 (unbiased and >= 0).
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff**2
    if kind == "k3":
        return torch.expm1(-diff) + diff
    raise ValueError(f"kl estimator {kind!r}; allowed: k1, k2, k3")


def last_action_index(mask: torch.Tensor) -> torch.Tensor:
    """Column of each row's last action token (0 for a row without actions)."""
    cols = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    return torch.where(mask > 0, cols, torch.zeros_like(cols)).max(dim=1).values


def kl_penalized_rewards(
    scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float, kind: str = "k1"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards: -beta KL on every action token, plus the sequence score on the *last* action token.

    Returns (rewards [B, T], kl [B, T]); both are 0 off the mask. The score lands where the
    response ended (its ``<|assistant_end|>`` or its last sampled token), not at the last column.
    """
    kl = kl_estimate(logp, ref_logp, kind) * mask
    rewards = -beta * kl
    rows = torch.arange(scores.size(0), device=scores.device)
    rewards[rows, last_action_index(mask)] += scores * (mask.sum(1) > 0)
    return rewards, kl


# --------------------------------------------------------------------------- losses


def policy_gradient_loss(
    logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    num_tokens: float | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO-lite / REINFORCE: -sum(logp * adv) over action tokens / number of action tokens.

    ``advantages`` is [B] (one per sequence, broadcast to its tokens) or [B, T]. ``num_tokens``
    overrides the denominator (e.g. the action tokens of the whole step, not just this micro-batch).
    ``weights`` [B, T] (:func:`behaviour_weights`, for stale rollouts) multiply each token's term.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    per_token = logp * advantages if weights is None else weights * logp * advantages
    return -token_mean(per_token, mask, num_tokens)


def behaviour_weights(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights of stale rollouts for the decoupled objective (AReaL's decoupled PPO).

    A rollout sampled by an older policy (the *behaviour* policy, its log-probs recorded at sampling)
    is trained on by the current one. Its terms are reweighted by pi_prox / pi_behav, where the
    *proximal* policy is the trainer's policy before this update (``prox_logp``, recomputed by the
    trainer); PPO's clip is then taken against the proximal policy, not the behaviour one. The
    weight is truncated at ``cap`` so one token sampled at a much lower probability cannot dominate
    the step. Returns (weights [B, T], detached and 0 off the mask; stats ``stale/weight_mean``,
    ``stale/weight_max`` (before truncation) and ``stale/clipped_frac``). With no staleness the
    two policies are one and every weight is exactly 1, so the losses are today's.
    """
    with torch.no_grad():
        raw = torch.exp(prox_logp.float() - behav_logp.float())
        weights = raw.clamp(max=cap) * mask
        stats = {
            "stale/weight_mean": masked_mean(raw, mask).item(),
            "stale/weight_max": (raw * mask).max().item() if mask.any() else 1.0,
            "stale/clipped_frac": masked_mean((raw > cap).float(), mask).item(),
        }
    return weights, stats


def sampler_gap(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the sampler's log-probs of its own tokens are from the trainer's, over the action tokens:
    ``gap/logp_abs``, the mean |log pi_trainer - log pi_sampler|, and ``gap/kl``, the mean k3 estimate of
    KL(pi_sampler || pi_trainer). The tokens are the sampler's draws, so k3 = r - 1 - log r with
    r = pi_trainer / pi_sampler is an unbiased, never negative estimate of that direction's KL.

    Another dtype (bf16 rollouts) or another engine (the rollout role) gives a gap the trainer would
    otherwise never see; the same numerics in float32 give one at rounding level."""
    with torch.no_grad():
        trainer, sampler = trainer_logp.float(), sampler_logp.float()
        return {
            "gap/logp_abs": masked_mean((trainer - sampler).abs(), mask).item(),
            "gap/kl": masked_mean(kl_estimate(sampler, trainer, "k3"), mask).item(),
        }


def token_mean(per_token: torch.Tensor, mask: torch.Tensor, num_tokens: float | None = None) -> torch.Tensor:
    """Sum over the masked (action) tokens divided by ``num_tokens``, by default the mask's count."""
    denom = mask.sum() if num_tokens is None else num_tokens
    return masked_sum(per_token, mask) / max(float(denom), 1.0)


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    num_tokens: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO policy loss: mean over action tokens of max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp - old).

    ``old_logp`` is the proximal policy's (the trainer's, before this update). ``weights`` [B, T]
    (:func:`behaviour_weights`) multiply each token's term: the decoupled objective of stale rollouts.
    Returns (loss, stats) with stats clip_frac, approx_kl (mean 0.5 (logp-old)^2), ratio_max.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(unclipped, clipped)
    loss = token_mean(per_token if weights is None else weights * per_token, mask, num_tokens)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
            "approx_kl": masked_mean(0.5 * (logp - old_logp) ** 2, mask).item(),
            "ratio_max": (ratio * mask).max().item() if mask.any() else 1.0,
        }
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, float]:
    """PPO value loss: 0.5 * mean max((V - R)^2, (old + clip(V - old, -c, c) - R)^2); returns (loss, clip_frac)."""
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    a, b = (values - returns) ** 2, (v_clipped - returns) ** 2
    loss = 0.5 * token_mean(torch.maximum(a, b), mask, num_tokens)
    return loss, masked_mean((b > a).float(), mask).item()


def ratio_exceeds_cap(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, cap: float) -> bool:
    """True when any action token's importance ratio exp(logp - old) is above ``cap`` (``max_token_ratio``:
    early-stop the whole update)."""
    if cap <= 0 or not mask.any():
        return False
    return bool((torch.exp(logp - old_logp)[mask > 0] > cap).any())


def ratio_sums(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum of the importance ratios, action tokens, largest ratio] over the masked tokens, for
    summing over micro-batches and ranks: ``max_ratio`` compares the minibatch's mean ratio
    (sum / tokens) with its cap, as AReaL's ``early_stop_imp_ratio`` does."""
    ratio = torch.exp(logp.detach() - old_logp) * mask
    peak = ratio.max() if mask.any() else ratio.new_zeros(())
    return torch.stack([ratio.sum(), mask.sum().to(ratio.dtype), peak]).float()


# --------------------------------------------------------------------------- KL coefficient


@dataclass
class KLController:
    """The KL penalty coefficient beta: fixed, or adaptive (Ziegler et al. 2019).

    Adaptive: e = clip(KL / target - 1, -0.2, 0.2); beta *= 1 + e * n_steps / horizon,
    so beta grows when the policy drifts past ``target`` and shrinks when it stays below.
    """

    value: float
    adaptive: bool = False
    target: float = 6.0
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move beta after a step that observed mean sequence KL ``current_kl`` over ``n_steps`` samples."""
        if self.adaptive:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


# --------------------------------------------------------------------------- reward shaping


@dataclass
class ValueNorm:
    """Running mean and std of the returns (an EMA, debiased), in which the critic predicts values.

    AReaL's default ``value_norm``: the critic's targets are normalised returns, and its outputs
    are de-normalised before GAE. Each :meth:`update` with a batch's masked returns x does
    m <- beta m + (1 - beta) mean(x), s <- beta s + (1 - beta) mean(x^2), d <- beta d + (1 - beta);
    then mean = m / d, var = max(s / d - mean^2, eps) (d removes the bias towards 0 of the first
    steps, as Adam's moment estimates do).
    """

    beta: float = 0.99
    eps: float = 1e-5
    running_mean: float = 0.0
    running_mean_sq: float = 0.0
    debias: float = 0.0

    def update(self, x: torch.Tensor, mask: torch.Tensor) -> None:
        """Fold the masked entries of ``x`` into the running moments (a no-op with no masked entry)."""
        if mask.any():
            self.update_moments(masked_mean(x, mask).item(), masked_mean(x * x, mask).item())

    def update_moments(self, mean: float, mean_sq: float) -> None:
        """Fold a batch's mean and mean square (e.g. summed over ranks) into the running moments."""
        b = self.beta
        self.running_mean = b * self.running_mean + (1 - b) * mean
        self.running_mean_sq = b * self.running_mean_sq + (1 - b) * mean_sq
        self.debias = b * self.debias + (1 - b)

    def moments(self) -> tuple[float, float]:
        """(mean, std); (0, 1) before the first update."""
        if self.debias == 0:
            return 0.0, 1.0
        mean = self.running_mean / self.debias
        var = max(self.running_mean_sq / self.debias - mean * mean, self.eps)
        return mean, math.sqrt(var)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.moments()
        return (x - mean) / std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = self.moments()
        return x * std + mean

    def state(self) -> dict[str, float]:
        """What a checkpoint saves, and :meth:`load` restores."""
        return {"running_mean": self.running_mean, "running_mean_sq": self.running_mean_sq, "debias": self.debias}

    def load(self, state: dict[str, float]) -> None:
        self.running_mean, self.running_mean_sq, self.debias = (state[k] for k in self.state())


def shape_scores(scores: torch.Tensor, *, scale: float = 1.0, bias: float = 0.0, clip: float = 0.0) -> torch.Tensor:
    """(score + bias) * scale, then clipped to [-clip, clip] (clip 0 = no clipping)."""
    out = (scores + bias) * scale
    return out.clamp(-clip, clip) if clip > 0 else out


def length_penalties(
    scores: torch.Tensor,
    ended: torch.Tensor,
    lengths: torch.Tensor,
    *,
    no_eos: str = "keep",
    penalty: float = -1.0,
    min_length: int = 0,
) -> torch.Tensor:
    """Scores after the response-shape rules.

    ``ended`` [B] bool: the response stopped with a stop token (not cut at max_new_tokens).
    ``no_eos``: "keep" leaves unfinished responses alone, "zero" sets their score to 0,
    "penalty" sets it to ``penalty``. A response with fewer than ``min_length`` action tokens
    also gets ``penalty``.
    """
    if no_eos not in ("keep", "zero", "penalty"):
        raise ValueError(f"no_eos={no_eos!r}; allowed: keep, zero, penalty")
    out = scores.clone()
    if no_eos == "zero":  # exactly 0, whatever scale, bias and clip did (final_scores runs this after them)
        out = torch.where(ended, out, torch.zeros_like(out))
    elif no_eos == "penalty":
        out = torch.where(ended, out, torch.full_like(out, penalty))
    if min_length > 0:
        out = torch.where(lengths < min_length, torch.full_like(out, penalty), out)
    return out


class ScoreShaping(Protocol):
    """The RL settings' score-shaping keys (``RLSettings.reward`` is one): what :func:`final_scores` reads."""

    scale: float
    bias: float
    clip: float
    no_eos: str
    length_penalty: float
    min_response_length: int


def final_scores(
    scores: torch.Tensor, ended: torch.Tensor, lengths: torch.Tensor, shaping: ScoreShaping
) -> torch.Tensor:
    """The scores RL trains on: :func:`shape_scores`, then :func:`length_penalties`.

    The response-shape rules run last, so ``no_eos="zero"`` gives a cut-off response exactly 0 and
    ``penalty`` exactly ``length_penalty``, whatever the scale, bias and clip (as AReaL zeroes after shaping).
    """
    shaped = shape_scores(scores, scale=shaping.scale, bias=shaping.bias, clip=shaping.clip)
    return length_penalties(
        shaped,
        ended,
        lengths,
        no_eos=shaping.no_eos,
        penalty=shaping.length_penalty,
        min_length=shaping.min_response_length,
    )


def group_solve_rates(correct: torch.Tensor, groups: torch.Tensor) -> dict[int, float]:
    """Fraction of each group's samples that are right, by group id (``filter_solved``)."""
    return {int(g): correct[groups == g].float().mean().item() for g in groups.unique()}


# --------------------------------------------------------------------------- reference EMA, pass@k


@torch.no_grad()
def ema_update(ref: torch.nn.Module, policy: torch.nn.Module, eta: float) -> None:
    """ref <- (1 - eta) ref + eta policy, parameter by parameter (eta 0: frozen reference)."""
    if eta <= 0:
        return
    for r, p in zip(ref.parameters(), policy.parameters()):
        r.lerp_(p.detach(), eta)


def mean_pass_at_k(correct: list[list[bool]], k: int) -> float:
    """Mean unbiased pass@k over problems, each with its list of per-sample correctness."""
    if not correct:
        return math.nan
    return sum(pass_at_k(len(c), sum(c), k) for c in correct) / len(correct)
