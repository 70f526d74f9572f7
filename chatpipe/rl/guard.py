"""The reward-hacking guard: is the reward model still ranking the policy's own samples?

RL trained on a learned reward model can raise the model's score while the answers get worse (the
policy finds what the reward model mis-scores). The guard watches the rollouts themselves, fresh
samples of the current policy, which RL scores with the reward model and, where the task has one,
with the verifier anyway. Every ``every`` steps it closes a window and compares it with the first:

    guard = RewardGuard(every=10, drop=0.1, action="warn")
    guard.add(model_scores, verifier_scores, groups)      # each step's rollouts
    metrics = guard.close_if_due(step)                    # guard/... metrics at a window's end, else {}

A window trips the guard when the reward model's mean score rose since the first window while the
verifier's mean fell by ``drop`` or more, or (``min_accuracy`` > 0) when the reward model ranks
fewer than that share of the window's verifier-ranked pairs right: within each prompt's group,
every right response against every wrong one. ``action`` "warn" logs and goes on; "stop" raises
:class:`RewardHacking`, whose message names the numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from chatpipe.rl.reward_model import verifier_pairs

log = logging.getLogger("rl")


class RewardHacking(RuntimeError):
    """The guard tripped with ``guard.mode: stop``."""


def ranked_pair_accuracy(model: torch.Tensor, verifier: torch.Tensor, groups: torch.Tensor) -> tuple[float, int]:
    """(share ranked right, number of pairs) over every (better, worse) pair of responses to the same
    prompt by the verifier's score: right when the model scores the better one strictly higher."""
    better, worse = verifier_pairs(verifier, groups)
    pairs = better.numel()
    right = int((model[better] > model[worse]).sum()) if pairs else 0
    return (right / pairs if pairs else float("nan")), pairs


@dataclass
class Window:
    """One window's sums: reward-model and verifier scores, and the ranked pairs."""

    model_sum: float = 0.0
    verifier_sum: float = 0.0
    rows: int = 0
    right: float = 0.0
    pairs: int = 0

    def means(self) -> dict[str, float]:
        rows = max(self.rows, 1)
        accuracy = self.right / self.pairs if self.pairs else float("nan")
        return {"model_mean": self.model_sum / rows, "verifier_mean": self.verifier_sum / rows, "accuracy": accuracy}


@dataclass
class RewardGuard:
    """Windows of ``every`` steps compared with the first; ``state``/``load`` carry it over a resume."""

    every: int
    drop: float
    action: str = "warn"  # off | warn | stop
    min_accuracy: float = 0.0
    first: dict[str, float] | None = None
    last: dict[str, float] | None = None
    window: Window = field(default_factory=Window)
    tripped_at: list[int] = field(default_factory=list)

    def add(self, model: torch.Tensor, verifier: torch.Tensor, groups: torch.Tensor) -> None:
        """Count one step's rollouts (this rank's; the stage sums windows over ranks when it closes them)."""
        model, verifier = model.detach().float().cpu(), verifier.detach().float().cpu()
        accuracy, pairs = ranked_pair_accuracy(model, verifier, groups.cpu())
        w = self.window
        w.model_sum += model.sum().item()
        w.verifier_sum += verifier.sum().item()
        w.rows += model.numel()
        w.right += accuracy * pairs if pairs else 0.0
        w.pairs += pairs

    def close_if_due(self, step: int, reduce=None) -> dict[str, float]:
        """At the end of a window (``step`` a multiple of ``every``): its ``guard/...`` metrics, the
        verdict, and the warning or :class:`RewardHacking` when it trips; ``{}`` between windows.
        ``reduce`` sums a window's five numbers over ranks (None: one rank)."""
        if self.action == "off" or step % self.every or not self.window.rows:
            return {}
        w = self.window
        sums = [w.model_sum, w.verifier_sum, w.rows, w.right, w.pairs]
        if reduce is not None:
            sums = reduce(sums)
        now = Window(*sums[:3], sums[3], int(sums[4])).means()
        self.window = Window()
        self.first, self.last = self.first or now, now
        reasons = self.reasons(now)
        out = {f"guard/{k}": v for k, v in now.items()}
        out |= {"guard/model_change": now["model_mean"] - self.first["model_mean"]}
        out |= {"guard/verifier_change": now["verifier_mean"] - self.first["verifier_mean"]}
        out["guard/tripped"] = float(bool(reasons))
        if reasons:
            self.tripped_at.append(step)
            message = f"reward-hacking guard at step {step}: " + "; ".join(reasons)
            if self.action == "stop":
                raise RewardHacking(message + " (rl.guard.mode: stop; set rl.guard.mode: warn to go on)")
            log.warning("%s (rl.guard.mode: warn, going on)", message)
        return out

    def reasons(self, now: dict[str, float]) -> list[str]:
        """Why the window ``now`` trips the guard (empty: it does not)."""
        first, out = self.first or now, []
        rose = now["model_mean"] - first["model_mean"]
        fell = first["verifier_mean"] - now["verifier_mean"]
        if rose > 0 and fell >= self.drop:
            out.append(
                f"the reward model's mean score rose by {rose:.3f} ({first['model_mean']:.3f} -> "
                f"{now['model_mean']:.3f}) while the verifier's fell by {fell:.3f} ({first['verifier_mean']:.3f} -> "
                f"{now['verifier_mean']:.3f}), at least rl.guard.drop = {self.drop}"
            )
        if self.min_accuracy and now["accuracy"] == now["accuracy"] and now["accuracy"] < self.min_accuracy:
            out.append(
                f"the reward model ranks {now['accuracy']:.3f} of the window's verifier-ranked pairs right, "
                f"below rl.guard.min_accuracy = {self.min_accuracy}"
            )
        return out

    def summary(self) -> dict[str, float]:
        """For the run's summary: how often it tripped, and the first and the newest window's means."""
        out = {"guard_trips": float(len(self.tripped_at))}
        for name, window in (("first", self.first), ("last", self.last)):
            out |= {f"guard_{name}_{k}": v for k, v in (window or {}).items()}
        return out

    def state(self) -> dict[str, Any]:
        """What a checkpoint carries: the first window, the open window's sums, the steps it tripped at."""
        w = self.window
        return {
            "first": self.first,
            "last": self.last,
            "window": [w.model_sum, w.verifier_sum, w.rows, w.right, w.pairs],
            "tripped_at": self.tripped_at,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.first, self.last = state["first"], state.get("last")
        self.window = Window(*state["window"])
        self.tripped_at = list(state["tripped_at"])
