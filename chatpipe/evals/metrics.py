"""Small evaluation metrics shared by the eval stages.

    from chatpipe.evals.metrics import pass_at_k, centered, bits_per_byte, chatcore
    pass_at_k(n=10, c=3, k=1)                      # 0.3
    chatcore({"ARC-Easy": 0.4, "GSM8K": 0.05})     # mean centered accuracy of the tasks given
    chatcore_label("GSM8K", "tinyworld_gsm")        # "tinyworld_gsm": a stand-in keeps its own name

Pure Python, no torch: callers reduce their counts across ranks first.
"""

from __future__ import annotations

import math

# ChatCORE tasks and their random baselines. Generative tasks have baseline 0.
CHATCORE_BASELINES: dict[str, float] = {
    "ARC-Easy": 0.25,
    "ARC-Challenge": 0.25,
    "MMLU": 0.25,
    "GSM8K": 0.0,
    "HumanEval": 0.0,
    "SpellingBee": 0.0,
}
# ChatCORE task -> the chatpipe.data.tasks task that is that benchmark. Any other task run in its
# place (the tiny profile's tinyworld_gsm for GSM8K) is a stand-in and reports under its own name.
BENCHMARK_TASKS: dict[str, str] = {
    "ARC-Easy": "arc_easy",
    "ARC-Challenge": "arc_challenge",
    "MMLU": "mmlu",
    "GSM8K": "gsm8k",
    "HumanEval": "humaneval",
    "SpellingBee": "spellingbee",
}


def chatcore_label(slot: str, task_name: str) -> str:
    """The name a ChatCORE result goes under: the benchmark's (``GSM8K``) only when its own task ran
    there, else the name of the task that did (``tinyworld_gsm``), so a stand-in never claims it."""
    return slot if BENCHMARK_TASKS.get(slot) == task_name else task_name


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k: chance that at least one of k samples (drawn from n, c correct) passes.

    Computes ``1 - C(n-c, k) / C(n, k)`` as a running product, which stays exact-ish for large n
    where the binomials themselves would overflow a float.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset must contain a correct sample
        return 1.0
    # C(n-c,k)/C(n,k) = prod_{i=n-c+1}^{n} (1 - k/i)
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def centered(acc: float, baseline: float) -> float:
    """Accuracy rescaled so the random baseline maps to 0 and perfect to 1."""
    if not 0.0 <= baseline < 1.0:
        raise ValueError(f"random baseline must be in [0, 1), got {baseline}")
    return (acc - baseline) / (1.0 - baseline)


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    """Tokenizer-independent loss: summed token losses (nats) per UTF-8 byte, in bits."""
    if total_bytes <= 0:
        raise ValueError(f"bits_per_byte needs total_bytes > 0, got {total_bytes}")
    return total_nats / (math.log(2) * total_bytes)


def _norm(name: str) -> str:
    # "ARC-Easy", "arc_easy" and "arceasy" all name the same task.
    return "".join(ch for ch in name.lower() if ch.isalnum())


def chatcore(results: dict[str, float]) -> float:
    """Mean centered accuracy over the ChatCORE tasks present in ``results`` (task -> accuracy).

    Task names match :data:`CHATCORE_BASELINES` ignoring case, ``-`` and ``_``; an unknown name
    raises rather than being silently dropped (a typo would otherwise change the score).
    """
    baselines = {_norm(name): b for name, b in CHATCORE_BASELINES.items()}
    if not results:
        raise ValueError("chatcore needs at least one task result")
    scores = []
    for name, acc in results.items():
        key = _norm(name)
        if key not in baselines:
            raise ValueError(f"unknown ChatCORE task {name!r}; known: {sorted(CHATCORE_BASELINES)}")
        scores.append(centered(acc, baselines[key]))
    return sum(scores) / len(scores)


def wilson_interval(accuracy: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval (95% for z = 1.96) of a proportion measured on ``n`` items.

    Unlike the normal approximation it stays inside [0, 1] and is not zero-width at 0 or 1,
    which matters for the small held-out sets of the tiny profile.
    """
    if n < 1:
        raise ValueError(f"wilson_interval needs n >= 1, got {n}")
    p = min(max(accuracy, 0.0), 1.0)
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def within_noise(acc_a: float, n_a: int, acc_b: float, n_b: int, z: float = 1.96) -> bool:
    """True when two accuracies on independent samples differ by less than z standard errors of the difference.

    The standard error uses each side's Wilson-adjusted proportion (p + z^2/2n) / (1 + z^2/n), so a
    0/n or n/n side still has a non-zero variance.
    """

    def adj(p: float, n: int) -> float:
        return (p * n + z * z / 2) / (n + z * z)

    pa, pb = adj(acc_a, n_a), adj(acc_b, n_b)
    se = math.sqrt(pa * (1 - pa) / (n_a + z * z) + pb * (1 - pb) / (n_b + z * z))
    return abs(acc_a - acc_b) <= z * se
