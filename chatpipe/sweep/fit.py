"""The isoFLOP fit nanochat does by hand in a notebook, as a function of the sweep's results.

Per FLOP budget C: a quadratic in x = log10 N through the points' final val bpb; its vertex is
N_opt. D_opt is read off the same budget's points (log D is linear in log N along an isoFLOP line:
D = C / flops_per_token(N)), which counts the attention FLOPs that ``D = C / 6N`` leaves out; the total
parameter count at the optimum is interpolated the same way. Across budgets: least squares lines in
log-log space give N_opt ∝ C^a and D_opt ∝ C^b, and the optimal tokens:params ratio D_opt / N_opt is
reported under both counts (N = transformer matrices + lm_head, nanochat's; and all parameters).
A budget with fewer than 3 points, or whose parabola opens downwards (no minimum), is left out and named.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

BUDGET_KEY = "pretrain.target_flops"
LOSS_KEY = "pretrain.val_bpb"


def rows_for_fit(rows: list[dict[str, Any]], sweep) -> list[dict[str, float]]:
    """Finished sweep rows as (C, N, N_total, D, loss, point); empty when the grid has no FLOP budgets."""
    if BUDGET_KEY not in sweep.grid:
        return []
    out = []
    for r in rows:
        loss = r["metrics"].get(LOSS_KEY)
        if loss is None or not math.isfinite(loss):
            continue
        out.append(
            {
                "C": float(r["values"][BUDGET_KEY]),
                "N": float(r["scaling_params"]),
                "N_total": float(r["total_params"]),
                "D": float(r["metrics"].get("pretrain.tokens", r["tokens"])),
                "loss": float(loss),
                "point": r["point"],
            }
        )
    return out


def fit_budget(points: list[dict[str, float]]) -> dict[str, Any]:
    """One budget's quadratic in log10 N; ``ok`` False (with the reason) when it has no interior minimum."""
    x = np.log10([p["N"] for p in points])
    y = np.array([p["loss"] for p in points])
    used = [p["point"] for p in points]
    if len(points) < 3:
        return {"ok": False, "why": f"{len(points)} point(s); a quadratic needs 3", "points": used}
    a2, a1, a0 = np.polyfit(x, y, 2)
    if a2 <= 0:
        return {"ok": False, "why": "the parabola opens downwards (no minimum)", "points": used}
    x_opt = -a1 / (2 * a2)
    # log D and log N_total are (near) linear in log N along an isoFLOP line: interpolate them at the vertex
    log_d = np.polyval(np.polyfit(x, np.log10([p["D"] for p in points]), 1), x_opt)
    log_total = np.polyval(np.polyfit(x, np.log10([p["N_total"] for p in points]), 1), x_opt)
    n_opt, d_opt, total_opt = 10**x_opt, 10**log_d, 10**log_total
    inside = bool(x.min() <= x_opt <= x.max())
    return {
        "ok": True,
        "N_opt": float(n_opt),
        "N_total_opt": float(total_opt),
        "D_opt": float(d_opt),
        "loss_opt": float(np.polyval([a2, a1, a0], x_opt)),
        "coef": [float(a2), float(a1), float(a0)],
        "ratio": float(d_opt / n_opt),
        "ratio_total": float(d_opt / total_opt),
        "inside_grid": inside,  # a vertex outside the depths tried is an extrapolation
        "points": used,
    }


def power_law(c: list[float], y: list[float]) -> tuple[float, float]:
    """Exponent and prefactor of y = k C^e (least squares in log-log)."""
    e, log_k = np.polyfit(np.log10(c), np.log10(y), 1)
    return float(e), float(10**log_k)


def fit(rows: list[dict[str, float]]) -> dict[str, Any]:
    """The whole fit: per-budget optima, the power laws (two budgets or more), the optimal ratios."""
    budgets: dict[float, list[dict[str, float]]] = {}
    for r in rows:
        budgets.setdefault(r["C"], []).append(r)
    per = {c: fit_budget(sorted(ps, key=lambda p: p["N"])) for c, ps in sorted(budgets.items())}
    good = {c: b for c, b in per.items() if b["ok"]}
    out: dict[str, Any] = {"budgets": {f"{c:.4g}": b for c, b in per.items()}, "budgets_used": len(good)}
    if good:
        cs = list(good)
        out["ratio"] = float(np.exp(np.mean([math.log(good[c]["ratio"]) for c in cs])))
        out["ratio_total"] = float(np.exp(np.mean([math.log(good[c]["ratio_total"]) for c in cs])))
    if len(good) >= 2:
        cs = list(good)
        out["a"], out["N_coef"] = power_law(cs, [good[c]["N_opt"] for c in cs])
        out["b"], out["D_coef"] = power_law(cs, [good[c]["D_opt"] for c in cs])
    return out


def fit_and_plot(rows: list[dict[str, float]], out_dir: Path) -> dict[str, Any]:
    """Fit ``rows`` and write ``fit.json``-ready results plus ``isoflop.png`` and ``scaling.png`` into ``out_dir``."""
    if not rows:
        return {"fit": "none: the grid has no pretrain.target_flops budgets, or no point finished"}
    result = fit(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_isoflops(rows, result, out_dir / "isoflop.png")
    if "a" in result:
        plot_scaling(result, out_dir / "scaling.png")
    return result


def plot_isoflops(rows: list[dict[str, float]], result: dict[str, Any], path: Path) -> None:
    """Val bpb against N per budget, with each fitted parabola and its minimum."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, b) in enumerate(result["budgets"].items()):
        color = f"C{i}"
        ps = [r for r in rows if f"{r['C']:.4g}" == label]
        ax.scatter([p["N"] for p in ps], [p["loss"] for p in ps], color=color, label=f"C = {label}")
        if b["ok"]:
            xs = np.linspace(math.log10(min(p["N"] for p in ps)), math.log10(max(p["N"] for p in ps)), 50)
            ax.plot(10**xs, np.polyval(b["coef"], xs), color=color)
            ax.scatter([b["N_opt"]], [b["loss_opt"]], color=color, marker="*", s=160, edgecolor="k")
    ax.set_xscale("log")
    ax.set_xlabel("N (transformer matrices + lm_head)")
    ax.set_ylabel("final val bpb")
    ax.set_title("isoFLOP curves (stars: fitted minima)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_scaling(result: dict[str, Any], path: Path) -> None:
    """N_opt and D_opt against C, with the fitted power laws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    good = [(float(c), b) for c, b in result["budgets"].items() if b["ok"]]
    cs = np.array([c for c, _ in good])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, coef, exp_, color in (("N_opt", "N_coef", "a", "C0"), ("D_opt", "D_coef", "b", "C1")):
        ax.scatter(cs, [b[key] for _, b in good], color=color)
        grid = np.geomspace(cs.min(), cs.max(), 20)
        ax.plot(grid, result[coef] * grid ** result[exp_], color=color, label=f"{key} ∝ C^{result[exp_]:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("C (training FLOPs)")
    ax.set_title(f"compute-optimal N and D (D/N = {result['ratio']:.1f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
