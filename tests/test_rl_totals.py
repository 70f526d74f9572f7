"""The rl stage's per-step rollout metrics: named totals, summed over ranks, averaged per response."""

from __future__ import annotations

import torch

from chatpipe.rl.rollout import Rollouts
from chatpipe.rl.totals import RolloutTotals


def batch(scores: list[float], ended: list[bool], lengths: list[int]) -> Rollouts:
    rows, width = len(scores), 4
    ids = torch.zeros(rows, width, dtype=torch.long)
    return Rollouts(
        inputs=ids,
        targets=ids,
        mask=torch.ones(rows, width),
        scores=torch.tensor(scores),
        ended=torch.tensor(ended),
        lengths=torch.tensor(lengths),
        groups=torch.zeros(rows, dtype=torch.long),
    )


def test_totals_count_a_batch_by_name():
    totals = RolloutTotals.of(batch([1.0, 0.0, 0.5], [True, False, True], [3, 7, 2]), kl_sum=0.6)
    assert totals == RolloutTotals(score_sum=1.5, responses=3.0, length_sum=12.0, ended=2.0, tokens=12.0, kl_sum=0.6)


def test_means_are_per_response_under_the_logged_metric_names():
    totals = RolloutTotals(score_sum=3.0, responses=4.0, length_sum=10.0, ended=1.0, tokens=12.0, kl_sum=0.2)
    assert totals.means() == {"reward/mean": 0.75, "response/length": 2.5, "response/eos_frac": 0.25, "kl/mean": 0.05}


def test_ranks_pool_their_responses_before_averaging():
    # two ranks with different batch sizes: the mean is over all 4 responses, not the mean of the rank means
    rank0 = RolloutTotals.of(batch([1.0], [True], [4]), kl_sum=0.0)
    rank1 = RolloutTotals.of(batch([0.0, 0.0, 1.0], [False, False, True], [2, 2, 2]), kl_sum=0.0)
    pooled = RolloutTotals(*(a + b for a, b in zip(vars(rank0).values(), vars(rank1).values(), strict=True)))
    assert pooled.means()["reward/mean"] == 0.5 and pooled.means()["response/length"] == 2.5


def test_one_process_sums_to_itself_as_plain_floats():
    totals = RolloutTotals.of(batch([1.0, 0.25], [True, True], [5, 3]), kl_sum=0.125)
    summed = totals.summed_over_ranks(torch.device("cpu"))
    assert summed == totals
    assert all(type(v) is float for v in vars(summed).values())
