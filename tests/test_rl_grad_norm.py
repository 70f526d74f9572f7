"""RL's updates report the policy's gradient norm before clipping as ``train/grad_norm``, the metric
every training stage logs to MLflow (hand-computed on the one-token Unigram of tests/test_rl_update.py)."""

from __future__ import annotations

import math

import pytest

from chatpipe.rl.losses import KLController
from chatpipe.rl.update import GRPOConfig, grpo_update, ppo_update
from tests.test_rl_update import ConstantCritic, Unigram, ppo_cfg, sgd, two_rows

# the by-hand policy gradient of test_grpo_step_by_hand, (-1/4, +1/4)
BY_HAND_NORM = math.sqrt(2) / 4


@pytest.mark.parametrize("grad_clip", [0.0, 0.1])
def test_grpo_reports_the_norm_before_clipping(grad_clip):
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    stats = grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, grad_clip=grad_clip))
    assert stats["train/grad_norm"] == pytest.approx(BY_HAND_NORM, rel=1e-5)
    step = math.hypot(*model.w.tolist())  # SGD at lr 1: the step is the (clipped) gradient
    assert step == pytest.approx(min(BY_HAND_NORM, grad_clip or math.inf), rel=1e-4)


def test_ppo_reports_the_policys_norm_with_a_critic_stepping_beside_it():
    # no critic, ratio 1 and KL 0: group advantages (+1/2, -1/2), the GRPO gradient again
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    stats = ppo_update(
        model, Unigram([0.0, 0.0]), None, sgd(model), [], batch, batch.scores, KLController(0.0), ppo_cfg(grad_clip=0.1)
    )
    assert stats["train/grad_norm"] == pytest.approx(BY_HAND_NORM, rel=1e-5)
    # with a critic the policy's norm is still the one reported, and the critic steps on its own
    policy, critic = Unigram([0.0, 0.0]), ConstantCritic(0.0)
    stats = ppo_update(
        policy, Unigram([0.0, 0.0]), critic, sgd(policy), sgd(critic), batch, batch.scores,
        KLController(0.0), ppo_cfg(value_coef=1.0),
    )  # fmt: skip
    assert stats["train/grad_norm"] == pytest.approx(math.hypot(*policy.w.tolist()), rel=1e-5)  # SGD at lr 1
    assert critic.c.item() != 0.0
