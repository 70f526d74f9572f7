"""GRPO and PPO updates (chatpipe.rl.update) against hand-computed parameter values.

The "policy" is a unigram model over a 2-token vocabulary: logits = w, whatever the input, so
log p(t) = log_softmax(w)[t] and d log p(t) / dw = onehot(t) - softmax(w). With w = 0, p = (1/2, 1/2)
and every gradient below is a few fractions; SGD with lr 1 turns it into the new w.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from chatpipe.rl.losses import KLController, ValueNorm, behaviour_weights, sampler_gap
from chatpipe.rl.rollout import Rollouts
from chatpipe.rl.update import GRPOConfig, PPOConfig, critic_values, grpo_update, micro_batches, ppo_targets, ppo_update


class Unigram(torch.nn.Module):
    """Next-token logits ``w`` at every position."""

    def __init__(self, w: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w))

    def forward(self, inputs, targets=None, loss_reduction="none"):
        logits = self.w.expand(*inputs.shape, -1)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none").view(
            targets.shape
        )


class ConstantCritic(torch.nn.Module):
    """V = c at every position."""

    def __init__(self, c: float = 0.0) -> None:
        super().__init__()
        self.c = torch.nn.Parameter(torch.tensor(c))

    def forward(self, inputs):
        return self.c.expand(inputs.shape).float()


def two_rows(targets: list[list[int]], mask: list[list[float]], scores: list[float]) -> Rollouts:
    t = torch.tensor(targets)
    b = len(targets)
    return Rollouts(
        inputs=torch.zeros_like(t),
        targets=t,
        mask=torch.tensor(mask),
        scores=torch.tensor(scores),
        ended=torch.ones(b, dtype=torch.bool),
        lengths=torch.tensor(mask).sum(1).long(),
        groups=torch.zeros(b, dtype=torch.long),
    )


def sgd(model, lr=1.0):
    return [torch.optim.SGD(model.parameters(), lr=lr)]


def test_micro_batches_cover_rows_once():
    assert micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    assert micro_batches(3, 0) == [slice(0, 3)]


def test_grpo_step_by_hand():
    # row 0 sampled token 0 and scored 1, row 1 sampled token 1 and scored 0: adv = (+1/2, -1/2)
    # loss = -(1/2 log p(0) - 1/2 log p(1)) / 2 tokens = 0 at w = 0
    # grad = -(1/2 (e0 - p) - 1/2 (e1 - p)) / 2 = (-1/4, +1/4)  ->  w = (1/4, -1/4)
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    stats = grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=16))
    assert model.w.tolist() == pytest.approx([0.25, -0.25])
    assert stats["loss/policy"] == pytest.approx(0.0, abs=1e-7)
    assert stats["adv/abs_mean"] == pytest.approx(0.5)
    assert model.w.grad is None  # zeroed after the step


def test_grpo_normalizes_by_every_informative_action_token_of_the_batch():
    # row 0: two action tokens (0, 0) and a masked third; row 1: one action token (1). N = 3.
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0, 0, 1], [1, 0, 0]], [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], [1.0, 0.0])
    grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2))
    # e0 - p = (1/2, -1/2), e1 - p = (-1/2, 1/2)
    # sum adv * dlogp = 1/2 * 2 * (1/2, -1/2) - 1/2 * (-1/2, 1/2) = (3/4, -3/4); grad = -(3/4, -3/4)/3
    assert model.w.tolist() == pytest.approx([0.25, -0.25])


def test_grpo_micro_batches_accumulate_to_the_full_batch_gradient():
    batch = two_rows([[0, 1], [1, 1], [0, 0], [1, 0]], [[1, 1], [1, 0], [1, 1], [0, 1]], [1.0, 0.0, 1.0, 0.0])
    whole, split = Unigram([0.3, -0.1]), Unigram([0.3, -0.1])
    grpo_update(whole, sgd(whole), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=4))
    grpo_update(split, sgd(split), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=1))
    assert split.w.tolist() == pytest.approx(whole.w.tolist())
    assert whole.w.tolist() != pytest.approx([0.3, -0.1])


class CountingUnigram(Unigram):
    """A Unigram that records how many rows each forward pass saw."""

    def __init__(self, w: list[float]) -> None:
        super().__init__(w)
        self.rows_seen: list[int] = []

    def forward(self, inputs, targets, loss_reduction="none"):
        self.rows_seen.append(len(targets))
        return super().forward(inputs, targets, loss_reduction)


def test_grpo_leaves_solved_groups_out_of_the_passes_and_the_denominator():
    # group 0 as in the step by hand (scores 1, 0); group 1 solved (1, 1): advantage 0, no signal.
    # The step equals the step on group 0 alone, w = (1/4, -1/4), not diluted by group 1's two
    # tokens ((1/8, -1/8) when every action token counts), and group 1 is never forwarded.
    model = CountingUnigram([0.0, 0.0])
    batch = two_rows([[0], [1], [0], [0]], [[1.0], [1.0], [1.0], [1.0]], [1.0, 0.0, 1.0, 1.0])
    stats = grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=16))
    assert model.w.tolist() == pytest.approx([0.25, -0.25])
    assert model.rows_seen == [2]
    assert stats["adv/informative_frac"] == 0.5


class NoSyncUnigram(CountingUnigram):
    """Looks like DDP to grpo_update (has ``no_sync``), so every rank must run every micro-batch."""

    def no_sync(self):
        return contextlib.nullcontext()


def test_grpo_under_ddp_runs_every_row_and_takes_the_same_step():
    batch = two_rows([[0], [1], [0], [0]], [[1.0], [1.0], [1.0], [1.0]], [1.0, 0.0, 1.0, 1.0])
    plain, ddp_like = CountingUnigram([0.0, 0.0]), NoSyncUnigram([0.0, 0.0])
    grpo_update(plain, sgd(plain), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=1))
    grpo_update(ddp_like, sgd(ddp_like), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=1))
    assert ddp_like.rows_seen == [1, 1, 1, 1] and plain.rows_seen == [1, 1]
    assert ddp_like.w.tolist() == plain.w.tolist() == pytest.approx([0.25, -0.25])


def test_grpo_on_a_batch_of_solved_groups_without_replay_does_not_step():
    model = CountingUnigram([0.3, -0.1])
    momentum = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    model.w.grad = torch.tensor([1.0, 1.0])
    momentum.step()  # a momentum buffer that a step on zero gradient would still move w by
    before = model.w.tolist()
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 1.0])
    stats = grpo_update(model, [momentum], batch, batch.scores, GRPOConfig(group_size=2))
    assert model.w.tolist() == before and model.rows_seen == []
    assert stats["adv/informative_frac"] == 0.0 and stats["loss/policy"] == 0.0


def replay_token_0(coef: float):
    """A replay loss: coef x the LM loss of one row whose target is token 0, i.e. coef x -log p(0)."""
    targets = torch.tensor([[0]])
    return lambda model: coef * model(torch.zeros_like(targets), targets).mean()


def test_grpo_with_replay_steps_along_the_sum_of_both_gradients():
    # policy gradient (-1/4, +1/4) as above; replay 0.5 x -log p(0) has gradient 0.5 x -(e0 - p) = (-1/4, +1/4)
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    stats = grpo_update(
        model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=1), replay=replay_token_0(0.5)
    )
    assert model.w.tolist() == pytest.approx([0.5, -0.5])
    assert stats["loss/replay"] == pytest.approx(0.5 * math.log(2))


def test_ppo_replays_one_batch_per_optimizer_step():
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    calls = []

    def replay(m):
        calls.append(1)
        return replay_token_0(0.5)(m)

    stats = ppo_update(model, Unigram([0.0, 0.0]), None, sgd(model), [], batch, batch.scores, KLController(0.1),
                       ppo_cfg(), replay=replay)  # fmt: skip
    assert model.w.tolist() == pytest.approx([0.5, -0.5])  # as GRPO with replay: ratio 1 on the first step
    assert len(calls) == stats["ppo/updates"] == 1.0
    assert stats["loss/replay"] == pytest.approx(0.5 * math.log(2))


def test_grpo_rejects_batch_not_made_of_groups():
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1], [0]], [[1.0], [1.0], [1.0]], [1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="group_size=2"):
        grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2))


def ppo_cfg(**kw) -> PPOConfig:
    base = dict(group_size=2, epochs=1, num_minibatches=1, micro_batch=16, clip_eps=0.2, value_clip=0.2)
    base |= dict(value_coef=0.1, gamma=1.0, lam=0.95, kl_estimator="k1", whiten="none", normalize_std=False)
    base |= dict(max_ratio=0.0, max_token_ratio=0.0, temperature=1.0, bootstrap=False, grad_clip=0.0)
    return PPOConfig(**{**base, "seed": 0, **kw})


def test_ppo_config_from_settings_takes_every_knob_of_the_rl_section():
    from chatpipe.settings import RLSettings
    from chatpipe.settings.training import PPOSettings

    cfg = RLSettings.model_construct(ppo=PPOSettings(epochs=3, clip_eps=0.3), device_batch_size=5)  # the rest: defaults
    config = PPOConfig.from_settings(cfg)
    assert config.epochs == 3 and config.micro_batch == 5 and config.clip_eps == 0.3
    assert config.whiten == cfg.ppo.whiten and config.seed == cfg.seed and config.group_size == cfg.group_size


def test_ppo_without_critic_first_step_equals_policy_gradient():
    # ratio = 1 on the first minibatch, so the clipped surrogate has the policy-gradient gradient;
    # ref == policy, so KL = 0 and the group advantages are (+1/2, -1/2) as in the GRPO case.
    model = Unigram([0.0, 0.0])
    ref = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    kl = KLController(0.1)
    stats = ppo_update(model, ref, None, sgd(model), [], batch, batch.scores, kl, ppo_cfg())
    assert model.w.tolist() == pytest.approx([0.25, -0.25])
    assert stats["ppo/updates"] == 1.0
    assert stats["ppo/early_stop"] == 0.0
    assert stats["kl_sum"] == pytest.approx(0.0)


def test_ppo_stops_when_a_token_ratio_exceeds_max_token_ratio():
    # epoch 1 moves w to (1/4, -1/4); in epoch 2 p(0) = sigmoid(1/2) = 0.6225, ratio 0.6225/0.5 = 1.245 > 1.2
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    stats = ppo_update(
        model, Unigram([0.0, 0.0]), None, sgd(model), [], batch, batch.scores, KLController(0.0),
        ppo_cfg(epochs=2, max_token_ratio=1.2),
    )  # fmt: skip
    assert stats["ppo/updates"] == 1.0 and stats["ppo/early_stop"] == 1.0
    assert model.w.tolist() == pytest.approx([0.25, -0.25])  # the second epoch's gradient was dropped
    assert math.isclose(1 / (1 + math.exp(-0.5)) / 0.5, 1.2449, rel_tol=1e-4)


def test_ppo_with_critic_by_hand():
    # one action token per row, gamma = lam = 1, V = 0: advantage = return = score = (1, 0);
    # batch whitening: mean 1/2, std 1/2 -> (+1, -1)
    # policy grad = -(1 (e0 - p) - 1 (e1 - p)) / 2 = (-1/2, +1/2)  ->  w = (1/2, -1/2)
    # value loss = 1/2 mean((V - R)^2); d/dc = mean(c - R) = -1/2; value_coef 1  ->  c = 1/2
    model, critic = Unigram([0.0, 0.0]), ConstantCritic(0.0)
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    stats = ppo_update(
        model, Unigram([0.0, 0.0]), critic, sgd(model), sgd(critic), batch, batch.scores, KLController(0.0),
        ppo_cfg(whiten="batch", gamma=1.0, lam=1.0, value_coef=1.0),
    )  # fmt: skip
    assert model.w.tolist() == pytest.approx([0.5, -0.5], abs=1e-6)
    assert critic.c.item() == pytest.approx(0.5)
    assert stats["loss/value"] == pytest.approx(0.25)


def test_ppo_kl_penalty_moves_adaptive_controller():
    # policy w = (1, 0) vs reference 0: k1 KL of token 0 = log p(0) - log(1/2) = log(2 e / (1 + e))
    model, ref = Unigram([1.0, 0.0]), Unigram([0.0, 0.0])
    batch = two_rows([[0], [0]], [[1.0], [1.0]], [1.0, 1.0])
    ctl = KLController(0.1, adaptive=True, target=0.01, horizon=10)
    stats = ppo_update(model, ref, None, sgd(model), [], batch, batch.scores, ctl, ppo_cfg())
    kl0 = math.log(2 * math.e / (1 + math.e))
    assert stats["kl_sum"] == pytest.approx(2 * kl0, rel=1e-5)
    # KL far above target: error clipped to +0.2, beta *= 1 + 0.2 * 2 rows / 10
    assert ctl.value == pytest.approx(0.1 * 1.04)


def test_ppo_max_ratio_skips_a_minibatch_whose_mean_ratio_is_too_high_and_goes_on():
    # rows (0, 0 | 0, 1) scored (1, 1 | 1, 0): group 1 has advantage 0, group 2 (+1/2, -1/2); 4 action tokens
    # epoch 1 (ratio 1): grad = -(1/2 (e0 - p) - 1/2 (e1 - p)) / 4 = (-1/8, +1/8)  ->  w = (1/8, -1/8)
    # epoch 2: p(0) = sigmoid(1/4) = 0.56218, ratios 1.12436 (x3) and 0.87564: mean 1.06218
    r0 = 2 / (1 + math.exp(-0.25))
    mean_ratio = (3 * r0 + (2 - r0)) / 4
    batch = two_rows([[0], [0], [0], [1]], [[1.0]] * 4, [1.0, 1.0, 1.0, 0.0])

    def run(cap: float, token_cap: float = 0.0):
        model = Unigram([0.0, 0.0])
        stats = ppo_update(
            model, Unigram([0.0, 0.0]), None, sgd(model), [], batch, batch.scores, KLController(0.0),
            ppo_cfg(epochs=3, max_ratio=cap, max_token_ratio=token_cap),
        )  # fmt: skip
        return model, stats

    model, stats = run(1.05)  # epochs 2 and 3 see the same mean 1.062 > 1.05: both skipped, none stops the update
    assert model.w.tolist() == pytest.approx([0.125, -0.125])
    assert stats["ppo/updates"] == 1.0 and stats["ppo/skipped"] == 2.0 and stats["ppo/early_stop"] == 0.0
    # importance ratios are logged: mean per minibatch (1, 1.062, 1.062) and the largest
    assert stats["ppo/ratio_mean"] == pytest.approx((1 + 2 * mean_ratio) / 3, rel=1e-5)
    assert stats["ppo/ratio_max"] == pytest.approx(r0, rel=1e-5)
    assert stats["ppo/clip_frac"] == pytest.approx(0.0)
    model, stats = run(2.0)  # under the cap: every epoch steps
    assert stats["ppo/updates"] == 3.0 and stats["ppo/skipped"] == 0.0
    model, stats = run(0.0, token_cap=1.1)  # the old rule (one token's 1.124 > 1.1): epoch 2 ends the update
    assert stats["ppo/updates"] == 1.0 and stats["ppo/early_stop"] == 1.0


def test_ppo_rejects_rows_that_do_not_split_into_minibatches():
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1], [0]], [[1.0]] * 3, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="3 rollout rows do not split into num_minibatches=2"):
        ppo_update(model, Unigram([0.0, 0.0]), None, sgd(model), [], batch, batch.scores, KLController(0.0),
                   ppo_cfg(group_size=1, num_minibatches=2))  # fmt: skip
    assert model.w.tolist() == [0.0, 0.0]


def test_grpo_log_probs_at_the_sampling_temperature():
    # log p_T(t) = log_softmax(w / T)[t]: d/dw = (e_t - p_T) / T. At w = 0, T = 1/2 the by-hand step of
    # test_grpo_step_by_hand doubles: w = (1/2, -1/2)
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, temperature=0.5))
    assert model.w.tolist() == pytest.approx([0.5, -0.5])


def test_ppo_old_reference_and_training_log_probs_use_the_temperature():
    # policy w = (1, 0), reference w = 0, T = 0.7: every log-prob is log_softmax(w / 0.7)
    model, ref = Unigram([1.0, 0.0]), Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    cfg = ppo_cfg(temperature=0.7)
    t = ppo_targets(model, ref, None, batch, batch.scores, KLController(0.1), cfg, contextlib.nullcontext)
    logp = torch.log_softmax(torch.tensor([1.0, 0.0]) / 0.7, dim=0)
    assert t.old_logp[:, 0].tolist() == pytest.approx([logp[0].item(), logp[1].item()], rel=1e-6)
    assert t.kl[:, 0].tolist() == pytest.approx((logp - math.log(0.5)).tolist(), rel=1e-6)
    # the first minibatch's ratio is exactly 1 only if training log-probs use T too
    stats = ppo_update(model, ref, None, sgd(model, 0.0), [], batch, batch.scores, KLController(0.1), cfg)
    assert stats["ppo/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-6)


def test_grad_clip_scales_the_step_to_the_clipped_norm():
    # the by-hand grad (-1/4, +1/4) has norm sqrt(2)/4; clipped to 0.1 the step is 0.1 along it
    model = Unigram([0.0, 0.0])
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, grad_clip=0.1))
    assert model.w.tolist() == pytest.approx([0.1 / math.sqrt(2), -0.1 / math.sqrt(2)], rel=1e-4)


def test_value_norm_trains_the_critic_on_normalised_returns():
    # as test_ppo_with_critic_by_hand, returns (1, 0); their moments after one update: mean 1/2, std 1/2,
    # so the critic's targets are (+1, -1): value loss 1/2 mean(1, 1) = 1/2 and d/dc = mean(c - R) = 0
    model, critic = Unigram([0.0, 0.0]), ConstantCritic(0.0)
    batch = two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0])
    norm = ValueNorm(beta=0.9)
    stats = ppo_update(
        model, Unigram([0.0, 0.0]), critic, sgd(model), sgd(critic), batch, batch.scores, KLController(0.0),
        ppo_cfg(whiten="batch", gamma=1.0, lam=1.0, value_coef=1.0), value_norm=norm,
    )  # fmt: skip
    assert critic.c.item() == pytest.approx(0.0, abs=1e-7)
    assert stats["loss/value"] == pytest.approx(0.5)
    assert norm.moments() == pytest.approx((0.5, 0.5))


class PositionCritic(torch.nn.Module):
    """V = the column index, whatever the input (so which column a value came from shows)."""

    def forward(self, inputs):
        return torch.arange(inputs.size(1), dtype=torch.float32).expand(inputs.shape)


def test_bootstrap_reads_the_value_after_the_last_action_of_cut_rows_only():
    # row 0: actions at columns 0, 1 and cut at max_new_tokens; row 1: one action, ended
    batch = two_rows([[0, 1, 0], [1, 0, 0]], [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], [0.0, 1.0])
    batch.ended = torch.tensor([False, True])
    values, last = critic_values(PositionCritic(), batch, ppo_cfg(bootstrap=True))
    assert values.tolist() == [[0.0, 1.0, 2.0]] * 2
    assert last.tolist() == [2.0, 1.0]  # the state after each row's last action
    assert critic_values(PositionCritic(), batch, ppo_cfg())[1] is None
    # in the update: row 0 (cut, score 0) ends on V = 2; row 1 (ended) on 0. gamma = lam = 1, V = column:
    # row 0: A_1 = 0 + 2 - 1 = 1, A_0 = 0 + 1 - 0 + 1 = 2; row 1: A_0 = 1 + 0 - 0 = 1
    cfg = ppo_cfg(bootstrap=True, gamma=1.0, lam=1.0)
    t = ppo_targets(Unigram([0.0, 0.0]), Unigram([0.0, 0.0]), PositionCritic(), batch, batch.scores,
                    KLController(0.0), cfg, contextlib.nullcontext)  # fmt: skip
    assert t.adv.tolist() == [[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert t.returns.tolist() == [[2.0, 2.0, 0.0], [1.0, 0.0, 0.0]]


def test_grpo_kl_loss_pulls_every_row_towards_the_reference_by_hand():
    # both rows sampled token 0 and tied (advantage 0): only the KL loss moves w
    # policy p = (1/2, 1/2), reference p = (3/4, 1/4); x = ref_logp - logp = ln 1.5 on token 0
    # k3 = e^x - x - 1 = 0.5 - ln 1.5; d k3 / d logp = 1 - e^x = -1/2; d logp / dw = (1/2, -1/2)
    # mean over the 2 action tokens: grad = coef * (-1/2) * (1/2, -1/2) = (-1/4, 1/4) at coef 1
    model, ref = Unigram([0.0, 0.0]), Unigram([math.log(3.0), 0.0])
    batch = two_rows([[0], [0]], [[1.0], [1.0]], [1.0, 1.0])
    stats = grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, kl_loss_coef=1.0), ref=ref)
    assert model.w.tolist() == pytest.approx([0.25, -0.25])
    assert stats["kl/loss_mean"] == pytest.approx(0.5 - math.log(1.5))
    assert stats["adv/informative_frac"] == 0.0
    off = Unigram([0.0, 0.0])
    grpo_update(off, sgd(off), batch, batch.scores, GRPOConfig(group_size=2, kl_loss_coef=0.0), ref=ref)
    assert off.w.tolist() == [0.0, 0.0]  # no KL loss and no signal: no step


# --------------------------------------------------------------------------- stale rollouts (decoupled loss)


def stale(batch: Rollouts, behav_probs: list[list[float]]) -> Rollouts:
    """``batch`` as sampled by an older policy that gave its targets ``behav_probs``."""
    return dataclasses.replace(batch, behav_logp=torch.tensor(behav_probs).log())


def test_grpo_on_stale_rollouts_weighs_each_token_by_proximal_over_behaviour():
    # as test_grpo_step_by_hand, but an older policy sampled token 0 at p = 1/4 (weight 1/2 / 1/4 = 2)
    # and token 1 at 1/2 (weight 1): grad = -(2 x 1/2 (e0 - p) - 1 x 1/2 (e1 - p)) / 2 = (-3/8, +3/8)
    model = Unigram([0.0, 0.0])
    batch = stale(two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0]), [[0.25], [0.5]])
    stats = grpo_update(model, sgd(model), batch, batch.scores, GRPOConfig(group_size=2, micro_batch=1))
    assert model.w.tolist() == pytest.approx([0.375, -0.375])
    assert stats["stale/weight_mean"] == pytest.approx(1.5, abs=1e-6)
    assert stats["stale/weight_max"] == pytest.approx(2.0, abs=1e-6)
    assert stats["stale/clipped_frac"] == 0.0


def test_ppo_on_stale_rollouts_truncates_the_weight_at_its_cap():
    # one epoch, one minibatch: ratio 1 against the proximal policy, so the step is the policy gradient
    # (-1/4, +1/4) of test_ppo_without_critic_first_step_equals_policy_gradient times the weight;
    # pi_prox / pi_behav = 1/2 / (1/16) = 8 on both tokens, truncated at 5
    model = Unigram([0.0, 0.0])
    batch = stale(two_rows([[0], [1]], [[1.0], [1.0]], [1.0, 0.0]), [[1 / 16], [1 / 16]])
    stats = ppo_update(model, Unigram([0.0, 0.0]), None, sgd(model), [], batch, batch.scores, KLController(0.1),
                       ppo_cfg(), behav_weight_cap=5.0)  # fmt: skip
    assert model.w.tolist() == pytest.approx([1.25, -1.25])
    assert stats["stale/weight_max"] == pytest.approx(8.0, abs=1e-5)
    assert stats["stale/clipped_frac"] == 1.0


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rollouts_sampled_by_the_current_policy_update_exactly_as_today(algorithm):
    batch = two_rows([[0, 1], [1, 1], [0, 0], [1, 0]], [[1, 1], [1, 0], [1, 1], [0, 1]], [1.0, 0.0, 1.0, 0.0])
    w0 = [0.3, -0.1]
    behav = torch.log_softmax(torch.tensor(w0), 0)[batch.targets]  # the policy that sampled is the trainer's
    fresh, old = Unigram(w0), Unigram(w0)
    for model, b in ((fresh, batch), (old, dataclasses.replace(batch, behav_logp=behav))):
        if algorithm == "grpo":
            grpo_update(model, sgd(model), b, b.scores, GRPOConfig(group_size=2, micro_batch=1))
        else:
            ppo_update(model, Unigram(w0), None, sgd(model), [], b, b.scores, KLController(0.1),
                       ppo_cfg(epochs=2, num_minibatches=2, micro_batch=1))  # fmt: skip
    assert torch.equal(fresh.w, old.w)


# --------------------------------------------------------------------------- the sampler-trainer gap


def test_sampler_gap_by_hand():
    # trainer p = (1/2, 1/4) and sampler q = (1/4, 1/2) on two action tokens; the third is masked out.
    # |ln p - ln q| = ln 2 on both; k3 with r = p / q: r - 1 - ln r = 1 - ln 2 (r = 2), ln 2 - 1/2 (r = 1/2)
    trainer = torch.tensor([[0.5, 0.25, 0.9]]).log()
    sampler = torch.tensor([[0.25, 0.5, 0.1]]).log()
    gap = sampler_gap(trainer, sampler, torch.tensor([[1.0, 1.0, 0.0]]))
    assert gap["gap/logp_abs"] == pytest.approx(math.log(2.0))
    assert gap["gap/kl"] == pytest.approx(0.25)
    assert sampler_gap(trainer, trainer, torch.ones(1, 3)) == {"gap/logp_abs": 0.0, "gap/kl": 0.0}


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_trainers_own_sampler_is_measured_not_weighed(algorithm):
    """weigh_behaviour off (the sampler is the trainer's own numerics): a batch with the sampler's
    log-probs steps exactly as one without, and reports their gap to the trainer's; on, it is weighed."""
    batch = two_rows([[0, 1], [1, 1], [0, 0], [1, 0]], [[1, 1], [1, 0], [1, 1], [0, 1]], [1.0, 0.0, 1.0, 0.0])
    w0 = [0.3, -0.1]
    sampler = torch.log_softmax(torch.tensor(w0) / 1.3, 0)[batch.targets]  # another numerics than the trainer's
    runs = {}
    for name, b, weigh in (("none", batch, True), ("off", dataclasses.replace(batch, behav_logp=sampler), False),
                           ("on", dataclasses.replace(batch, behav_logp=sampler), True)):  # fmt: skip
        model = Unigram(w0)
        if algorithm == "grpo":
            cfg = GRPOConfig(group_size=2, micro_batch=1, weigh_behaviour=weigh)
            stats = grpo_update(model, sgd(model), b, b.scores, cfg)
        else:
            cfg = ppo_cfg(epochs=2, num_minibatches=2, micro_batch=1, weigh_behaviour=weigh)
            stats = ppo_update(model, Unigram(w0), None, sgd(model), [], b, b.scores, KLController(0.1), cfg)
        runs[name] = model.w.detach(), stats
    assert torch.equal(runs["off"][0], runs["none"][0])
    assert not torch.equal(runs["on"][0], runs["none"][0])
    trainer = torch.log_softmax(torch.tensor(w0), 0)[batch.targets]
    on = batch.mask > 0
    want = (trainer - sampler)[on].abs().mean().item()  # every row is forwarded: each group has signal
    for name in ("off", "on"):
        assert runs[name][1]["gap/logp_abs"] == pytest.approx(want, rel=1e-5)
        assert runs[name][1]["gap/kl"] > 0
    assert "gap/kl" not in runs["none"][1] and "stale/weight_mean" not in runs["off"][1]
    assert "stale/weight_mean" in runs["on"][1]


PLANTED = dict(logits=[1.0, 0.5, 0.0, -1.0], reward=[1.0, 0.0, 0.5, -1.0], sampler_temperature=1.3, n=40_000)


def planted_samples(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The trainer's policy p = softmax(logits) (T = 1), a sampler at T = 1.3 (flatter: it draws the
    likely tokens too rarely), and ``n`` single-token draws from the sampler: (p, q, tokens)."""
    w = torch.tensor(PLANTED["logits"])
    p, q = torch.softmax(w, 0), torch.softmax(w / PLANTED["sampler_temperature"], 0)
    tokens = torch.multinomial(q, PLANTED["n"], replacement=True, generator=torch.Generator().manual_seed(seed))
    return p, q, tokens


def test_truncated_weights_give_the_trainers_expectation_from_another_samplers_draws():
    """E_p[reward] from draws of q: the draws weighed by pi_trainer / pi_sampler (truncated at 2, as
    TRL and verl do; here p / q <= 1.12, so the cap costs no bias) land within 0.02 of it; unweighted,
    the draws' mean is E_q[reward], 0.066 lower."""
    p, q, x = planted_samples()
    r = torch.tensor(PLANTED["reward"])
    exact = (p * r).sum().item()
    mask = torch.ones(len(x), 1)
    weights, stats = behaviour_weights(p[x].log()[:, None], q[x].log()[:, None], mask, cap=2.0)
    tol = 0.02  # ~4 standard errors of the weighted mean at n = 40,000
    assert abs((weights[:, 0] * r[x]).mean().item() - exact) < tol
    assert abs(r[x].mean().item() - exact) > 2 * tol
    assert stats["stale/clipped_frac"] == 0.0


def test_the_update_on_another_samplers_draws_follows_the_trainers_gradient():
    """GRPO on single-token rollouts drawn at T = 1.3 from a unigram policy trained at T = 1: one SGD
    step (lr 1) is the mean of adv x weight x grad log p, which the truncated weights make the gradient
    of E_p[reward], p (r - E_p[r]), within 0.01 per logit; without them it is q (r - E_q[r]), off by 0.034."""
    p, q, x = planted_samples(seed=1)
    r = torch.tensor(PLANTED["reward"])
    exact = p * (r - (p * r).sum())
    batch = two_rows(x[:, None].tolist(), [[1.0]] * len(x), r[x].tolist())
    steps = {}
    for name, behav in (("weighed", q[x].log()[:, None]), ("plain", None)):
        model = Unigram(PLANTED["logits"])
        b = dataclasses.replace(batch, behav_logp=behav)
        grpo_update(model, sgd(model), b, b.scores, GRPOConfig(group_size=len(x), micro_batch=0, behav_weight_cap=2.0))
        steps[name] = model.w.detach() - torch.tensor(PLANTED["logits"])
    tol = 0.01
    assert (steps["weighed"] - exact).abs().max().item() < tol
    assert (steps["plain"] - exact).abs().max().item() > 2 * tol
