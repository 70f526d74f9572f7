"""The isoFLOP fit on synthetic sweeps whose exponents are known (no training)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from chatpipe.sweep import fit as fitting

BUDGETS = [1e15, 1e16, 1e17, 1e18]
SIZES = np.geomspace(1e6, 1e9, 9)


def parabola_rows(a: float, k: float, curvature: float = 0.3) -> list[dict]:
    """Loss exactly quadratic in log10 N around N_opt = k C^a; D = C / (6 N), N_total = 1.25 N."""
    rows = []
    for c in BUDGETS:
        n_opt = k * c**a
        for n in SIZES:
            loss = 2.0 + curvature * (math.log10(n) - math.log10(n_opt)) ** 2
            rows.append({"C": c, "N": n, "N_total": 1.25 * n, "D": c / (6 * n), "loss": loss, "point": f"{c:g}-{n:g}"})
    return rows


@pytest.mark.parametrize("a", [0.5, 0.54, 0.7])
def test_exact_parabolas_give_back_their_exponents(a):
    k = 2e-3 if a < 0.6 else 2e-6  # keeps every N_opt inside the sizes tried
    result = fitting.fit(parabola_rows(a, k))
    assert result["budgets_used"] == len(BUDGETS)
    assert result["a"] == pytest.approx(a, abs=1e-6)
    assert result["b"] == pytest.approx(1 - a, abs=1e-6)  # D = C / 6N
    for c in BUDGETS:
        budget = result["budgets"][f"{c:.4g}"]
        assert budget["N_opt"] == pytest.approx(k * c**a, rel=1e-6)
        assert budget["ratio"] == pytest.approx(c / (6 * (k * c**a) ** 2), rel=1e-5)
        assert budget["ratio_total"] == pytest.approx(budget["ratio"] / 1.25, rel=1e-5)


def test_chinchilla_shaped_loss_gives_its_exponents_approximately():
    # L = E + A/N^alpha + B/D^beta with D = C/6N: N_opt ∝ C^(beta/(alpha+beta)), D_opt ∝ C^(alpha/(alpha+beta))
    # sampled as a sweep would be: sizes within 4x either side of the true optimum (depths 10-20 span ~8x)
    alpha, beta, a_, b_ = 0.34, 0.28, 400.0, 400.0
    g = (alpha * a_ / (beta * b_)) ** (1 / (alpha + beta))
    rows = []
    for c in BUDGETS:
        n_opt = g * (c / 6) ** (beta / (alpha + beta))
        for n in n_opt * np.geomspace(0.25, 4, 7):
            d = c / (6 * n)
            rows.append({"C": c, "N": n, "N_total": n, "D": d, "loss": 1.7 + a_ / n**alpha + b_ / d**beta, "point": ""})
    result = fitting.fit(rows)
    assert result["a"] == pytest.approx(beta / (alpha + beta), abs=0.03)
    assert result["b"] == pytest.approx(alpha / (alpha + beta), abs=0.03)


def test_budgets_without_a_minimum_are_left_out_and_named():
    rows = parabola_rows(0.5, 2e-3)
    few = [r for r in rows if r["C"] == BUDGETS[0]][:2]  # 2 points: no quadratic
    concave = [{**r, "loss": 5 - (r["loss"] - 2)} for r in rows if r["C"] == BUDGETS[1]]  # a maximum, not a minimum
    rest = [r for r in rows if r["C"] in BUDGETS[2:]]
    result = fitting.fit(few + concave + rest)
    assert result["budgets_used"] == 2
    assert "needs 3" in result["budgets"][f"{BUDGETS[0]:.4g}"]["why"]
    assert "no minimum" in result["budgets"][f"{BUDGETS[1]:.4g}"]["why"]
    assert result["budgets"][f"{BUDGETS[2]:.4g}"]["points"] == [r["point"] for r in rest[: len(SIZES)]]
    assert result["a"] == pytest.approx(0.5, abs=1e-6)


def test_plots_are_written(tmp_path):
    result = fitting.fit_and_plot(parabola_rows(0.5, 2e-3), tmp_path)
    for name in ("isoflop.png", "scaling.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["budgets_used"] == len(BUDGETS)
