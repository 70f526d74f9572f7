"""Benchmark: one decode step's attention on the row cache, this checkout against a git revision's.

``RowKVCache.attend`` is a third of an RL rollout's time on CPU (py-spy, bench/README.md), and at
this size its cost is its kernel count, not its arithmetic. This times one layer's call, the new
keys written and the attention over shared prompts, for a few batch shapes (prompt slots x rows per
slot, a 30-token prompt, 20 tokens into the replies, the tiny model's 4 heads of 64), with the
revision's ``chatpipe/model/row_cache.py`` loaded beside this checkout's. The two alternate, so a
loaded machine slows both alike. Prints per shape both medians, their ratio and the largest
difference of the outputs (the same inputs and cache contents):

    python bench/row_attention.py --baseline 6a70f47 [--threads 1]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[1]
LAYERS, HEADS, HEAD_DIM, CONTEXT = 4, 4, 64, 256


def module_at(revision: str) -> ModuleType:
    """``chatpipe/model/row_cache.py`` as it was at ``revision``, imported under another name."""
    source = subprocess.run(
        ["git", "show", f"{revision}:chatpipe/model/row_cache.py"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "row_cache_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("row_cache_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


class _Prefilled:
    """A prompt's keys/values as a prefilled KVCache of batch 1 holds them."""

    def __init__(self, length: int, gen: torch.Generator) -> None:
        self.k = torch.randn(LAYERS, 1, HEADS, length, HEAD_DIM, generator=gen)
        self.v = torch.randn(LAYERS, 1, HEADS, length, HEAD_DIM, generator=gen)
        self.key_mask, self.prev_embed, self.pos = None, None, length


def filled_cache(cls: type, slots: int, per_slot: int, prompt: int, reply: int):
    """A cache of ``slots`` shared prompts with ``per_slot`` rows each, ``reply`` tokens into their replies."""
    gen = torch.Generator().manual_seed(0)
    rows = slots * per_slot
    cache = cls(2 * rows, LAYERS, HEADS, HEAD_DIM, CONTEXT, HEADS * HEAD_DIM)
    for s in range(slots):
        source = _Prefilled(prompt, gen)
        slot = cache.add_prompt(source)
        for j in range(per_slot):
            cache.join(s * per_slot + j, slot, source)
    cache.n = rows
    cache._allocate(torch.float32, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    for r in range(rows):
        cache.lengths[r] += reply
    return cache


def time_calls(cache, inputs: tuple, plan, calls: int = 20) -> float:
    """Microseconds per ``attend`` call over ``calls`` calls (the same position rewritten each time)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        cache.attend(0, *inputs, plan)
    return (time.perf_counter() - t0) / calls * 1e6


def compare(classes: dict[str, type], slots: int, per_slot: int, rounds: int) -> str:
    caches = {name: filled_cache(cls, slots, per_slot, prompt=30, reply=20) for name, cls in classes.items()}
    n = slots * per_slot
    gen = torch.Generator().manual_seed(1)
    inputs = tuple(torch.randn(n, HEADS, 1, HEAD_DIM, generator=gen) for _ in range(3))  # q, k, v
    plans = {name: c.plan(None, c.positions(torch.device("cpu"))) for name, c in caches.items()}
    outs = {name: c.attend(0, *inputs, plans[name]) for name, c in caches.items()}
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(rounds):
        for name, c in caches.items():
            times[name].append(time_calls(c, inputs, plans[name]))
    base, new = (statistics.median(times[name]) for name in ("baseline", "this checkout"))
    diff = (outs["baseline"] - outs["this checkout"]).abs().max().item()
    return f"| {slots} x {per_slot} | {base:.0f} | {new:.0f} | {new / base:.2f} | {diff:.1e} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", required=True, help="git revision whose row_cache.py to time against")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--rounds", type=int, default=30, help="alternating rounds of 20 calls per shape")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO))
    from chatpipe.model.row_cache import RowKVCache

    classes = {"baseline": module_at(args.baseline).RowKVCache, "this checkout": RowKVCache}
    print(f"{torch.get_num_threads()} threads; one layer's attend, us per call (median of {args.rounds} rounds)")
    print("| prompt slots x rows each | baseline | this checkout | ratio | max abs diff |\n|---|---|---|---|---|")
    with torch.inference_mode():
        for slots, per_slot in ((8, 8), (8, 6), (4, 2), (16, 8)):
            print(compare(classes, slots, per_slot, args.rounds))


if __name__ == "__main__":
    main()
