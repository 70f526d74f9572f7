"""The reward-hacking guard (chatpipe.rl.guard): windows, its trip rules, warn and stop, resume."""

from __future__ import annotations

import logging

import pytest
import torch

from chatpipe.rl.guard import RewardGuard, RewardHacking, ranked_pair_accuracy


def test_ranked_pair_accuracy_counts_every_right_wrong_pair_within_a_prompt():
    # prompt 0: rows 0, 1 right, row 2 wrong -> pairs (0>2), (1>2); the model ranks (0>2) right only
    # prompt 1: rows 3 right, 4 wrong -> (3>4), ranked right; prompt 2 all right: no pair
    verifier = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    model = torch.tensor([2.0, -1.0, 0.0, 5.0, 4.0, 0.0, 3.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    assert ranked_pair_accuracy(model, verifier, groups) == (pytest.approx(2 / 3), 3)
    assert ranked_pair_accuracy(model, torch.ones(7), groups)[1] == 0  # ties are no pair


def feed(guard: RewardGuard, model: float, verifier: float, steps: range) -> list[dict]:
    """Steps of 4 rows (one prompt) with these mean scores; the metrics of each closed window."""
    out = []
    for step in steps:
        guard.add(torch.full((4,), model), torch.full((4,), verifier), torch.zeros(4, dtype=torch.long))
        if found := guard.close_if_due(step + 1):
            out.append(found)
    return out


def test_a_reward_model_gamed_trips_the_guard_at_the_end_of_its_window(caplog):
    guard = RewardGuard(every=5, drop=0.1, action="warn")
    (first,) = feed(guard, model=0.0, verifier=0.8, steps=range(5))
    assert first["guard/tripped"] == 0 and first["guard/verifier_mean"] == pytest.approx(0.8)
    (same,) = feed(guard, model=1.0, verifier=0.75, steps=range(5, 10))  # fell 0.05 < drop: fine
    assert same["guard/tripped"] == 0 and same["guard/model_change"] == pytest.approx(1.0)
    assert feed(guard, model=0.5, verifier=0.5, steps=range(10, 14)) == []  # the window is not over
    with caplog.at_level(logging.WARNING, logger="rl"):
        (tripped,) = feed(guard, model=0.5, verifier=0.5, steps=range(14, 15))
    assert tripped["guard/tripped"] == 1 and tripped["guard/verifier_change"] == pytest.approx(-0.3)
    assert guard.tripped_at == [15]
    assert "rose by 0.500" in caplog.text and "fell by 0.300" in caplog.text and "going on" in caplog.text


def test_the_verifier_falling_while_the_model_falls_too_is_not_hacking():
    guard = RewardGuard(every=2, drop=0.1, action="stop")
    feed(guard, model=0.0, verifier=0.8, steps=range(2))
    (window,) = feed(guard, model=-1.0, verifier=0.2, steps=range(2, 4))  # PPO not learning, not gaming
    assert window["guard/tripped"] == 0


def test_stop_raises_naming_the_numbers_and_the_setting():
    guard = RewardGuard(every=2, drop=0.1, action="stop")
    feed(guard, model=0.0, verifier=0.9, steps=range(2))
    with pytest.raises(RewardHacking, match=r"step 4: .*rose by 2\.000 .* fell by 0\.400.* rl\.guard\.drop = 0\.1"):
        feed(guard, model=2.0, verifier=0.5, steps=range(2, 4))


def test_a_reward_model_preferring_shorter_answers_trips_on_accuracy_in_its_first_window():
    """Within each prompt the right answers are the long ones; a reward model that scores shorter
    answers higher ranks every verifier-ranked pair wrong, and min_accuracy stops the run at once."""
    guard = RewardGuard(every=3, drop=0.1, action="stop", min_accuracy=0.6)
    lengths = torch.tensor([30.0, 28.0, 12.0, 9.0])  # two right (long), two wrong (short)
    verifier = torch.tensor([1.0, 1.0, 0.0, 0.0])
    for step in range(2):
        guard.add(-lengths, verifier, torch.zeros(4, dtype=torch.long))
        assert guard.close_if_due(step + 1) == {}
    guard.add(-lengths, verifier, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RewardHacking, match=r"ranks 0\.000 of the window's verifier-ranked pairs right"):
        guard.close_if_due(3)


def test_off_never_closes_a_window_and_state_resumes_mid_window():
    off = RewardGuard(every=1, drop=0.1, action="off")
    assert feed(off, model=9.0, verifier=0.0, steps=range(3)) == []
    guard = RewardGuard(every=4, drop=0.1)
    feed(guard, model=0.0, verifier=1.0, steps=range(6))  # one window closed, two steps into the next
    resumed = RewardGuard(every=4, drop=0.1)
    resumed.load(guard.state())
    (window,) = feed(resumed, model=1.0, verifier=0.0, steps=range(6, 8))
    assert str(window) == str(feed(guard, 1.0, 0.0, range(6, 8))[0])  # str: no ranked pairs is NaN accuracy
    assert window["guard/verifier_mean"] == 0.5 and resumed.tripped_at == [8]
