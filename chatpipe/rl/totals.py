"""One RL step's rollout totals, summed over ranks, and the per-response means the stage logs.

    totals = RolloutTotals.of(batch, kl_sum=stats.pop("kl_sum", 0.0)).summed_over_ranks(rt.device)
    totals.means()   # {"reward/mean": ..., "response/length": ..., "response/eos_frac": ..., "kl/mean": ...}

Ranks sample different numbers of tokens, so they share sums and counts (one all-reduce) and the
means are taken over every rank's responses, not averaged per rank.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch

from chatpipe import runtime
from chatpipe.rl.rollout import Rollouts


@dataclass(frozen=True)
class RolloutTotals:
    """Sums over a step's sampled responses (this rank's, or every rank's once summed)."""

    score_sum: float  # verifier rewards, before shaping
    responses: float  # number of sampled responses
    length_sum: float  # action tokens
    ended: float  # responses that stopped with <|assistant_end|>
    tokens: float  # generated tokens, sampled + forced
    kl_sum: float  # per-response KL to the reference policy (0 for GRPO)

    @classmethod
    def of(cls, batch: Rollouts, *, kl_sum: float) -> RolloutTotals:
        return cls(
            score_sum=batch.scores.sum().item(),
            responses=float(len(batch.scores)),
            length_sum=float(batch.lengths.sum()),
            ended=batch.ended.float().sum().item(),
            tokens=float(batch.num_tokens),
            kl_sum=kl_sum,
        )

    def summed_over_ranks(self, device: torch.device) -> RolloutTotals:
        """Every rank's totals added up (in float64, one all-reduce); itself in a single process."""
        sums = torch.tensor(astuple(self), dtype=torch.float64, device=device)
        runtime.all_reduce_sum(sums)
        return RolloutTotals(*sums.tolist())

    def means(self) -> dict[str, float]:
        """Per-response means, under the metric names the rl stage logs."""
        n = self.responses
        return {
            "reward/mean": self.score_sum / n,
            "response/length": self.length_sum / n,
            "response/eos_frac": self.ended / n,
            "kl/mean": self.kl_sum / n,
        }
