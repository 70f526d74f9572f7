"""CPU training step time with glibc's default malloc against the stages' setting (freed memory kept in the heap).

    python bench/cpu_allocator.py [--vocab 1024 4096 32768] [--rounds 2] [--steps 8]

Each run is a fresh process (malloc settings are process-wide): a d4 GPT, batch 16 x 256, eager
AdamW, timed per step after three warm-up steps. Default and kept runs alternate, so the
machine's drift hits both; the ratio is the median of per-round ratios, with the kernel (system)
time and the page faults per step that explain it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.runtime import MALLOC_ENV  # noqa: E402

PROBE = """
import json, resource, statistics, sys, time, torch
from chatpipe.model.gpt import GPT, config_from_depth
from chatpipe.runtime import keep_freed_memory_in_heap
mode, vocab, steps, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if mode == "kept":
    assert keep_freed_memory_in_heap()
torch.manual_seed(0)
model = GPT(config_from_depth(depth, vocab, 256, head_dim=64))
model.init_weights()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
wall, system, faults = [], [], []
for i in range(steps + 3):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    idx = torch.randint(0, vocab, (16, 257))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if i >= 3:
        wall.append(t1 - t0)
        system.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
print(json.dumps({k: statistics.median(v) for k, v in (("wall", wall), ("system", system), ("faults", faults))}))
"""


def run(mode: str, vocab: int, steps: int, depth: int = 4) -> dict:
    """One process's median step: wall seconds, kernel seconds, page faults."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    cmd = [sys.executable, "-c", PROBE, mode, str(vocab), str(steps), str(depth)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


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
