"""CPU training step time with glibc's default malloc against the stages' setting (freed memory kept in the heap).

    python bench/cpu_allocator.py [--vocab 1024 4096 32768] [--rounds 2] [--steps 8]

Each run is a fresh process (malloc settings are process-wide): a d4 GPT, batch 16 x 256, eager
AdamW, timed per step after three warm-up steps. Default and kept runs alternate, so the
machine's drift hits both; the ratio is the median of per-round ratios, with the kernel (system)
time and the page faults per step that explain it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


from chatpipe.testing.cpu_allocator import run  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[1024, 4096, 32768])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    args = p.parse_args()
    for vocab in args.vocab:
        rows = [{mode: run(mode, vocab, args.steps) for mode in ("default", "kept")} for _ in range(args.rounds)]
        for mode in ("default", "kept"):
            wall = statistics.median(r[mode]["wall"] for r in rows)
            system = statistics.median(r[mode]["system"] for r in rows)
            faults = statistics.median(r[mode]["faults"] for r in rows)
            print(f"vocab {vocab:>6} {mode:>7}: {wall:.3f} s/step, kernel {system:.3f} s, {faults:,.0f} page faults")
        ratio = statistics.median(r["default"]["wall"] / r["kept"]["wall"] for r in rows)
        print(f"vocab {vocab:>6} default / kept step time: {ratio:.2f} (median of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
