"""Tests for chatpipe/evals/metrics.py against hand-computed values."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from chatpipe.evals.metrics import bits_per_byte, centered, chatcore, pass_at_k


def test_pass_at_k_hand_values() -> None:
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 2, 4) == 1.0  # k >= n - c + 1: every draw holds a correct one
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6


def test_pass_at_k_matches_enumeration() -> None:
    # Brute force: fraction of k-subsets of n samples (first c correct) with a correct one.
    for n, c, k in [(6, 2, 2), (7, 3, 3), (8, 1, 5)]:
        subsets = list(combinations(range(n), k))
        expected = sum(any(i < c for i in s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_is_stable_for_large_n() -> None:
    # math.comb(2000, 1000) overflows a float; the product form must not.
    value = pass_at_k(2000, 10, 1000)
    assert 0.99 < value <= 1.0
    assert pass_at_k(2000, 10, 1) == pytest.approx(10 / 2000)


def test_pass_at_k_rejects_bad_arguments() -> None:
    for n, c, k in [(0, 0, 1), (5, 6, 1), (5, 2, 0), (5, 2, 6)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_centered_and_bits_per_byte() -> None:
    assert centered(0.25, 0.25) == 0.0
    assert centered(1.0, 0.25) == 1.0
    assert centered(0.5, 0.25) == pytest.approx(1 / 3)
    assert centered(0.1, 0.25) < 0
    with pytest.raises(ValueError):
        centered(0.5, 1.0)
    assert bits_per_byte(math.log(2) * 100, 100) == pytest.approx(1.0)
    assert bits_per_byte(10.0, 4) == pytest.approx(10.0 / (math.log(2) * 4))
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)


def test_chatcore_averages_present_tasks_only() -> None:
    # ARC-Easy 0.4 -> (0.4-0.25)/0.75 = 0.2 ; GSM8K 0.1 -> 0.1 ; mean 0.15
    assert chatcore({"ARC-Easy": 0.4, "GSM8K": 0.1}) == pytest.approx(0.15)
    full = {"ARC-Easy": 0.25, "ARC-Challenge": 1.0, "MMLU": 0.625, "GSM8K": 0.3, "HumanEval": 0.0, "SpellingBee": 0.9}
    assert chatcore(full) == pytest.approx((0 + 1 + 0.5 + 0.3 + 0 + 0.9) / 6)
    assert chatcore({"arc_challenge": 0.625}) == pytest.approx(0.5)  # name spelling is forgiving
    with pytest.raises(ValueError, match="unknown ChatCORE task"):
        chatcore({"ARC-Eeasy": 0.5})
    with pytest.raises(ValueError):
        chatcore({})


def test_wilson_interval_matches_hand_values() -> None:
    from chatpipe.evals.metrics import wilson_interval

    lo, hi = wilson_interval(0.5, 100)  # the textbook case: 0.5 +- 0.096
    assert (round(lo, 4), round(hi, 4)) == (0.4038, 0.5962)
    lo, hi = wilson_interval(0.0, 10)  # never zero-width: upper bound z^2 / (n + z^2)
    assert lo == 0.0 and hi == pytest.approx(1.96**2 / (10 + 1.96**2))
    with pytest.raises(ValueError, match="n >= 1"):
        wilson_interval(0.5, 0)


def test_within_noise() -> None:
    from chatpipe.evals.metrics import within_noise

    assert within_noise(0.375, 8, 0.25, 8)  # the "regression" is noise
    assert not within_noise(0.30, 256, 0.45, 256)  # 0.15 on 256 items each is ~3.5 standard errors
    assert within_noise(0.30, 256, 0.35, 256)
