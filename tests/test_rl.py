"""RL math against hand-computed values (chatpipe/rl/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from chatpipe.rl import losses as rl

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol)


def test_group_advantages_mean_and_std():
    scores = T([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    assert close(rl.group_advantages(scores), [[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0]])
    # population std of the first group is 0.5; an all-equal group stays 0 (no division blow-up)
    assert close(rl.group_advantages(scores, normalize_std=True), [[1, -1, -1, 1], [0, 0, 0, 0]], tol=1e-4)


def test_gae_by_hand():
    rewards, values, mask = T([[0.0, 0.0, 1.0]]), T([[0.5, 0.5, 0.5]]), T([[1.0, 1.0, 1.0]])
    # gamma 1, lam 0.5: A2 = 1 - .5 = .5; A1 = (0 + .5 - .5) + .5*.5 = .25; A0 = 0 + .5*.25 = .125
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert close(adv, [[0.125, 0.25, 0.5]]) and close(ret, [[0.625, 0.75, 1.0]])
    # gamma .9, lam 1: A2 = .5; d1 = .45 - .5 = -.05, A1 = -.05 + .9*.5 = .4; A0 = -.05 + .9*.4 = .31
    adv, _ = rl.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    assert close(adv, [[0.31, 0.4, 0.5]])


def test_gae_skips_forced_and_padding_tokens():
    # the middle token is a forced tool output: its reward and value must not enter the recursion
    rewards, values = T([[0.0, 7.0, 1.0], [0.0, 1.0, 5.0]]), T([[0.5, 99.0, 0.5], [0.5, 0.5, 42.0]])
    mask = T([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    assert close(adv, [[0.25, 0.0, 0.5], [0.25, 0.5, 0.0]])
    assert close(ret, [[0.75, 0.0, 1.0], [0.75, 1.0, 0.0]])


def test_kl_penalty_lands_on_actions_and_score_on_last_action():
    # column 0 is prompt, column 3 padding; actions are columns 1 and 2
    scores = T([2.0])
    logp, ref_logp = T([[-1.0, -0.5, -1.0, 0.0]]), T([[-1.5, -1.0, -2.0, 0.0]])
    mask = T([[0.0, 1.0, 1.0, 0.0]])
    rewards, kl = rl.kl_penalized_rewards(scores, logp, ref_logp, mask, beta=0.5)
    assert close(kl, [[0.0, 0.5, 1.0, 0.0]])
    assert close(rewards, [[0.0, -0.25, 1.5, 0.0]])


def test_kl_estimators():
    logp, ref = T([0.0]), T([math.log(0.5)])  # diff = log 2
    d = math.log(2)
    assert close(rl.kl_estimate(logp, ref, "k1"), [d])
    assert close(rl.kl_estimate(logp, ref, "k2"), [0.5 * d * d])
    assert close(rl.kl_estimate(logp, ref, "k3"), [0.5 - 1 + d])
    with pytest.raises(ValueError, match="allowed"):
        rl.kl_estimate(logp, ref, "k9")


def test_clipped_surrogate_by_hand():
    ratios = T([[1.5, 0.5, 1.0, 0.5]])
    old = T([[-1.0, -1.0, -1.0, -1.0]])
    logp = old + ratios.log()
    adv = T([[1.0, 1.0, -1.0, -1.0]])
    # per token max(-A r, -A clip(r)): -1.2 (clipped), -0.5, 1.0, 0.8 (clipped)
    loss, stats = rl.clipped_surrogate(logp, old, adv, torch.ones(1, 4), clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.0 + 0.8) / 4, abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(0.5)
    assert stats["ratio_max"] == pytest.approx(1.5, abs=1e-5)
    # masked tokens do not count, and num_tokens sets the denominator
    loss, _ = rl.clipped_surrogate(logp, old, adv, T([[1.0, 1.0, 0.0, 0.0]]), clip_eps=0.2, num_tokens=4)
    assert loss.item() == pytest.approx((-1.2 - 0.5) / 4, abs=1e-5)


def test_clipped_surrogate_gradient_zero_when_clipped():
    old = T([[0.0, 0.0]])
    logp = T([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, _ = rl.clipped_surrogate(logp, old, T([[1.0, 1.0]]), torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0  # ratio 1.5 > 1.2 with A > 0: clipped, no push further
    assert logp.grad[0, 1] == pytest.approx(-1.1 / 2, abs=1e-5)  # d(-r/2)/dlogp = -r/2


def test_clipped_value_loss_by_hand():
    values, old, returns = T([[1.0, 0.0]]), T([[0.5, 0.5]]), T([[1.0, 1.0]])
    # token 0: (1-1)^2 = 0 vs clipped (0.7-1)^2 = .09 -> .09; token 1: 1 vs (0.3-1)^2 = .49 -> 1
    loss, clip_frac = rl.clipped_value_loss(values, old, returns, torch.ones(1, 2), clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 1.0) / 2, abs=1e-6)
    assert clip_frac == pytest.approx(0.5)


def test_policy_gradient_loss_normalised_by_valid_tokens():
    logp = T([[-1.0, -2.0], [-0.5, -3.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    # -(( -1 - 2) * 1 + (-0.5) * -2) / 3 = 2/3
    assert rl.policy_gradient_loss(logp, T([1.0, -2.0]), mask).item() == pytest.approx(2 / 3)


def test_behaviour_weights_truncate_and_count():
    prox, mask = T([[-1.0, -1.0, -1.0, -1.0]]), T([[1.0, 1.0, 1.0, 1.0]])
    behav = prox - T([[2.0, 0.5, 1.0, 8.0]]).log()  # pi_prox / pi_behav = 2, 0.5, 1, 8
    weights, stats = rl.behaviour_weights(prox, behav, mask, cap=4.0)
    assert close(weights, [[2.0, 0.5, 1.0, 4.0]])
    assert stats["stale/weight_mean"] == pytest.approx(11.5 / 4, abs=1e-5)
    assert stats["stale/weight_max"] == pytest.approx(8.0, abs=1e-4)
    assert stats["stale/clipped_frac"] == pytest.approx(0.25)
    weights, _ = rl.behaviour_weights(prox, behav, T([[1.0, 1.0, 0.0, 0.0]]), cap=4.0)
    assert close(weights, [[2.0, 0.5, 0.0, 0.0]])  # off the mask: 0


def test_decoupled_ppo_loss_by_hand_with_stale_behaviour_logprobs():
    # the clipped_surrogate_by_hand case, its tokens sampled by an older policy: weights 2, .5, 1, 8 -> 4
    old = T([[-1.0, -1.0, -1.0, -1.0]])  # the proximal policy: the trainer's before the update
    ratios = T([[1.5, 0.5, 1.0, 0.5]])
    logp = (old + ratios.log()).requires_grad_()
    adv, mask = T([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4)
    behav = old - T([[2.0, 0.5, 1.0, 8.0]]).log()
    weights, _ = rl.behaviour_weights(old, behav, mask, cap=4.0)
    loss, stats = rl.clipped_surrogate(logp, old, adv, mask, clip_eps=0.2, weights=weights)
    # per token -1.2, -0.5, 1.0, 0.8 (the clip is against the proximal policy), weighted 2, .5, 1, 4
    assert loss.item() == pytest.approx((2 * -1.2 + 0.5 * -0.5 + 1.0 + 4 * 0.8) / 4, abs=1e-5)
    assert stats["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert logp.grad[0, 0] == 0  # clipped: no gradient, whatever its weight
    assert logp.grad[0, 1] == pytest.approx(0.5 * -0.5 / 4, abs=1e-6)  # weight x d(-A r)/dlogp / tokens


def test_decoupled_policy_gradient_loss_by_hand():
    logp = T([[-1.0, -2.0], [-0.5, -3.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    weights = T([[2.0, 1.0], [0.5, 0.0]])
    # -((2 * -1 + 1 * -2) * 1 + 0.5 * -0.5 * -2) / 3 = 3.5 / 3
    assert rl.policy_gradient_loss(logp, T([1.0, -2.0]), mask, weights=weights).item() == pytest.approx(3.5 / 3)


def test_decoupled_losses_without_staleness_are_todays_losses_exactly():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) * 3
    logp = old + torch.randn(4, 6, generator=g) * 0.3
    adv, mask = torch.randn(4, 6, generator=g), (torch.rand(4, 6, generator=g) > 0.3).float()
    weights, stats = rl.behaviour_weights(old, old.clone(), mask, cap=5.0)  # behaviour = proximal
    assert stats["stale/weight_max"] == 1.0 and stats["stale/clipped_frac"] == 0.0
    today, _ = rl.clipped_surrogate(logp, old, adv, mask, clip_eps=0.2, num_tokens=20)
    decoupled, _ = rl.clipped_surrogate(logp, old, adv, mask, clip_eps=0.2, num_tokens=20, weights=weights)
    assert torch.equal(today, decoupled)
    seq_adv = adv[:, 0]
    assert torch.equal(
        rl.policy_gradient_loss(logp, seq_adv, mask), rl.policy_gradient_loss(logp, seq_adv, mask, weights=weights)
    )


def test_adaptive_kl_controller():
    ctl = rl.KLController(0.1, adaptive=True, target=6.0, horizon=10000)
    assert ctl.update(9.0, 256) == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))  # error clipped at +0.2
    ctl = rl.KLController(0.1, adaptive=True, target=6.0, horizon=10000)
    assert ctl.update(6.6, 256) == pytest.approx(0.1 * (1 + 0.1 * 256 / 10000))
    ctl = rl.KLController(0.1, adaptive=True, target=6.0, horizon=10000)
    assert ctl.update(3.0, 256) == pytest.approx(0.1 * (1 - 0.2 * 256 / 10000))  # clipped at -0.2
    fixed = rl.KLController(0.1)
    assert fixed.update(100.0, 256) == 0.1


def test_whiten_batch_and_group():
    x, mask = T([[1.0, 2.0, 3.0, 99.0]]), T([[1.0, 1.0, 1.0, 0.0]])
    s = math.sqrt(1.5)  # 1 / sqrt(var 2/3)
    assert close(rl.whiten(x, mask), [[-s, 0.0, s, 0.0]], tol=1e-4)
    x2 = T([[1.0, 3.0], [10.0, 30.0]])
    out = rl.whiten(x2, torch.ones(2, 2), groups=T([0, 1]))
    assert close(out, [[-1.0, 1.0], [-1.0, 1.0]], tol=1e-4)  # each group to mean 0, std 1
    assert close(rl.whiten(x, mask, shift_mean=False), [[-s + 2, 2.0, s + 2, 0.0]], tol=1e-4)


def test_reward_shaping():
    assert close(rl.shape_scores(T([1.0, -30.0]), scale=2.0, bias=0.5, clip=2.0), [2.0, -2.0])
    assert close(rl.shape_scores(T([-30.0]), clip=20.0), [-20.0])
    assert close(rl.shape_scores(T([-30.0])), [-30.0])
    scores, ended, lengths = T([1.0, 1.0, 1.0]), T([True, False, True]), T([5, 5, 1])
    assert close(rl.length_penalties(scores, ended, lengths, no_eos="keep", min_length=3), [1, 1, -1])
    assert close(rl.length_penalties(scores, ended, lengths, no_eos="zero", min_length=3), [1, 0, -1])
    assert close(rl.length_penalties(scores, ended, lengths, no_eos="penalty", penalty=-3.0), [1, -3, 1])
    with pytest.raises(ValueError, match="allowed"):
        rl.length_penalties(scores, ended, lengths, no_eos="drop")


def test_ratio_cap_ignores_masked_tokens():
    old = T([[0.0, 0.0]])
    logp = T([[math.log(6.0), 0.0]])
    assert rl.ratio_exceeds_cap(logp, old, T([[1.0, 1.0]]), cap=5.0)
    assert not rl.ratio_exceeds_cap(logp, old, T([[0.0, 1.0]]), cap=5.0)
    assert not rl.ratio_exceeds_cap(logp, old, T([[1.0, 1.0]]), cap=0.0)  # 0 = off


def test_ema_update_and_pass_at_k():
    ref, pol = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(ref.weight)
    torch.nn.init.ones_(pol.weight)
    rl.ema_update(ref, pol, 0.0)
    assert ref.weight.item() == 0.0
    rl.ema_update(ref, pol, 0.1)
    assert ref.weight.item() == pytest.approx(0.1)
    # pass@2 of 4 samples: 1 correct -> 1 - C(3,2)/C(4,2) = .5; 2 correct -> 1 - 1/6
    assert rl.mean_pass_at_k([[True, False, False, False], [True, True, False, False]], 2) == pytest.approx(
        (0.5 + 5 / 6) / 2
    )
    assert rl.mean_pass_at_k([[True, False]], 1) == pytest.approx(0.5)


def _shaping(**keys):
    """The RL settings' defaults with ``keys`` changed (what the rl stage passes to final_scores)."""
    from chatpipe.settings import RLSettings

    return RLSettings().reward.model_copy(update=keys)


def test_no_eos_zero_applies_after_scale_bias_and_clip():
    # a bias of 0.5 must not lift a cut-off response off 0; an ended one is shaped as usual
    scores, ended, lengths = T([0.0, 1.0, 1.0]), T([False, True, False]), T([4, 4, 4])
    out = rl.final_scores(scores, ended, lengths, _shaping(scale=2.0, bias=0.5, clip=2.0, no_eos="zero"))
    assert out.tolist() == [0.0, 2.0, 0.0]
    # penalty is the final score too, unscaled; min_length likewise
    out = rl.final_scores(scores, ended, lengths, _shaping(scale=2.0, bias=0.5, no_eos="penalty"))
    assert out.tolist() == [-1.0, 3.0, -1.0]
    out = rl.final_scores(scores, ended, lengths, _shaping(bias=0.5, min_response_length=5, length_penalty=-2.0))
    assert out.tolist() == [-2.0, -2.0, -2.0]


def test_value_norm_moments_by_hand():
    norm = rl.ValueNorm(beta=0.5)
    assert norm.moments() == (0.0, 1.0)  # before any update: the identity
    norm.update(T([[1.0, 3.0, 99.0]]), T([[1.0, 1.0, 0.0]]))  # masked: mean 2, mean square 5
    # m = 0.5 * 2 = 1, s = 0.5 * 5 = 2.5, d = 0.5: mean 2, var 5 - 4 = 1
    assert norm.moments() == pytest.approx((2.0, 1.0))
    norm.update(T([[5.0]]), T([[1.0]]))
    # m = 0.5 + 2.5 = 3, s = 1.25 + 12.5 = 13.75, d = 0.75: mean 4, var 13.75 / 0.75 - 16 = 7/3
    mean, std = norm.moments()
    assert (mean, std) == pytest.approx((4.0, math.sqrt(7 / 3)))
    assert norm.normalize(T([5.0])).item() == pytest.approx(1 / math.sqrt(7 / 3), rel=1e-6)
    assert norm.denormalize(norm.normalize(T([5.0]))).item() == pytest.approx(5.0)
    # what the checkpoint saves restores the same moments
    again = rl.ValueNorm(beta=0.5)
    again.load(norm.state())
    assert again.moments() == (mean, std)


def test_gae_bootstraps_cut_rows_from_the_last_value():
    # 2 actions then padding, V = 0.5 on both, no reward; the row was cut: V after it = 2. gamma = lam = 1:
    # delta_1 = 0 + 2 - 0.5 = 1.5 = A_1; delta_0 = 0 + 0.5 - 0.5 = 0, A_0 = 0 + 1.5 = 1.5; returns = A + V = 2
    rewards, values, mask = T([[0.0, 0.0, 0.0]]), T([[0.5, 0.5, 9.0]]), T([[1.0, 1.0, 0.0]])
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=1.0, last_values=T([2.0]))
    assert close(adv, [[1.5, 1.5, 0.0]]) and close(ret, [[2.0, 2.0, 0.0]])
    adv, _ = rl.gae(rewards, values, mask, gamma=1.0, lam=1.0)  # no bootstrap: the episode ended
    assert close(adv, [[-0.5, -0.5, 0.0]])


def test_group_solve_rates():
    correct, groups = T([True, False, True, True, False, False]), T([0, 0, 1, 1, 2, 2])
    assert rl.group_solve_rates(correct, groups) == {0: 0.5, 1: 1.0, 2: 0.0}
