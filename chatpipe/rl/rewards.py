"""Verifiable rewards for RL: answer extraction and pluggable reward functions.

GSM8K and the tiny-world arithmetic both end an answer with ``#### <number>``; the reward is 1.0
when the completion's extracted number equals the gold one.

    from chatpipe.rl.rewards import extract_answer, get_reward
    extract_answer("5 + 7 = 12.\\n#### 12")            # "12"
    reward = get_reward("exact")
    reward("The answer is 12.\\n#### 12", "12")        # 1.0

A reward function is ``f(completion: str, gold: str) -> float``; register more with :func:`register`.
These are the *verifier*: RL can also train on a learned reward model's scores (``rl.reward.source``,
:func:`combine_rewards`); held-out pass@k always uses the verifier.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

RewardFn = Callable[[str, str], float]

_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def normalize_number(text: str) -> str:
    """Canonical form of a number: no thousands commas, no trailing ``.0`` / zeros after a dot."""
    s = text.replace(",", "").strip()
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def extract_answer(text: str, fallback_last_number: bool = False) -> str | None:
    """The number after the first ``####`` in ``text`` (normalised), or None.

    With ``fallback_last_number`` a completion without ``####`` yields its last number instead
    (lenient grading; off by default because it rewards answers the format did not commit to).
    """
    m = _ANSWER.search(text)
    if m:
        return normalize_number(m.group(1))
    if fallback_last_number:
        numbers = _NUMBER.findall(text)
        if numbers:
            return normalize_number(numbers[-1])
    return None


def exact_answer(completion: str, gold: str) -> float:
    """1.0 when the ``####`` answer of ``completion`` equals ``gold`` (a number or a gold text with ``####``)."""
    want = extract_answer(gold) or normalize_number(gold)
    got = extract_answer(completion)
    return float(got is not None and got == want)


def exact_or_format(completion: str, gold: str) -> float:
    """Like :func:`exact_answer`, plus 0.1 for a wrong answer that at least used the ``####`` format."""
    score = exact_answer(completion, gold)
    return score if score > 0 else (0.1 if extract_answer(completion) is not None else 0.0)


REWARDS: dict[str, RewardFn] = {"exact": exact_answer, "exact_or_format": exact_or_format}


def register(name: str, fn: RewardFn) -> None:
    """Add a reward function under ``name`` (e.g. a task's own verifier or a reward model wrapper)."""
    REWARDS[name] = fn


def get_reward(name: str) -> RewardFn:
    """The reward function called ``name``; a clear error lists the known ones."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; allowed: {', '.join(sorted(REWARDS))}") from None


REWARD_SOURCES = ("verifier", "model", "both")


def combine_rewards(source: str, verifier: torch.Tensor, model: torch.Tensor | None) -> torch.Tensor:
    """The scores that train the policy under ``rl.reward.source``: the verifier's, the reward
    model's, or their sum (``both``)."""
    if source not in REWARD_SOURCES:
        raise ValueError(f"unknown reward.source {source!r}; allowed: {', '.join(REWARD_SOURCES)}")
    if source == "verifier":
        return verifier
    if model is None:
        raise ValueError(f"reward.source {source!r} needs reward-model scores")
    return model if source == "model" else verifier + model


REWARD_MODEL_SCORES = ("normalized", "win_rate")


def group_win_rates(scores: torch.Tensor, groups: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Each row's mean win probability against the other rows of its group, under the
    Bradley-Terry model a reward model is trained as: mean over j of sigmoid(scale * (s_i - s_j)).

    ``scale`` turns ``scores`` back into the model's raw logits (its ``score_std`` for normalised
    scores). The result lies in [0, 1] like a verifier's verdict; it keeps the model's ranking inside a
    prompt's group and drops the offsets between prompts, which a reward model does not learn (its
    pairs never compare two prompts). Replies the model cannot tell apart all get 0.5, so a group of
    near-ties teaches nothing, where a std-normalised advantage would blow their noise up to +-1.
    A row alone in its group gets 0.5."""
    same = groups[:, None] == groups[None, :]
    same.fill_diagonal_(False)
    wins = torch.sigmoid(scale * (scores[:, None] - scores[None, :])).masked_fill(~same, 0.0)
    rivals = same.sum(dim=1)
    return torch.where(rivals > 0, wins.sum(dim=1) / rivals.clamp(min=1), torch.full_like(scores, 0.5))


def ensemble_rewards(
    scores: list[torch.Tensor], stds: list[float], groups: torch.Tensor, win_rate: bool = True
) -> torch.Tensor:
    """Rewards [B] from several reward models' normalised scores of the same rows: the mean of their
    :func:`group_win_rates` (each at its own model's ``score_std``), or with ``win_rate`` False the mean
    of the scores. One model is returned as it would be alone, bit for bit."""
    if win_rate:
        scores = [group_win_rates(s, groups, scale=std) for s, std in zip(scores, stds)]
    return torch.stack(scores).mean(0)
