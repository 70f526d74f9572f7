"""Pretraining tokens/s: chatpipe eager and compiled against nanochat's ``base_train`` on this machine.

    python bench/pretrain_vs_nanochat.py [--steps 12] [--recipe tiny|nanochat] [--nanochat DIR]

The config is the issue's: depth 4 (n_embd 256), sequence 256, batch 16 x 256 = 4096 tokens per
step, vocab 1024, fp32, CPU. Random tokens; model and optimizers only (the loop every stage runs).

1. chatpipe eager: ``--steps`` optimizer steps after one warm-up step;
2. chatpipe compiled (``torch.compile`` of the model): the compile time (first step) is reported
   apart, then ``--steps`` steady steps; the break-even step count (when compiling pays for itself)
   is ``compile_s / (eager_step_s - compiled_step_s)``;
3. with ``--nanochat DIR`` (a checkout of karpathy/nanochat), its ``scripts.base_train`` at the same
   config, tokens/s parsed from its log (median of its steps after the first); otherwise skipped
   with the reason.

``--recipe nanochat`` runs our model with every nanochat option and MuonAdamW; ``tiny`` is the
tiny profile's model and optimizer. Keep --steps small: the machine's cores are shared.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.model.gpt import GPT, config_from_depth, nanochat_options  # noqa: E402
from chatpipe.train.optim import build_optimizers  # noqa: E402

DEPTH, SEQ, BATCH, VOCAB = 4, 256, 16, 1024


def make(recipe: str) -> tuple[torch.nn.Module, list[torch.optim.Optimizer]]:
    """The model and optimizers of ``recipe`` at the benchmark config (seeded)."""
    torch.manual_seed(0)
    if recipe == "nanochat":
        config = config_from_depth(DEPTH, VOCAB, SEQ, head_dim=64, window_pattern="SSSL", **nanochat_options(SEQ))
        optimizer = "muon_adamw"
    else:
        config = config_from_depth(DEPTH, VOCAB, SEQ, head_dim=64)
        optimizer = "muon"
    model = GPT(config)
    model.init_weights()
    return model, build_optimizers(model, optimizer=optimizer)


def run(recipe: str, steps: int, compiled: bool) -> tuple[float, list[float]]:
    """(seconds of the first step, seconds of each of the next ``steps`` steps)."""
    model, opts = make(recipe)
    step_model = torch.compile(model) if compiled else model
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, dims=1)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        step_model(x, y).backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


def nanochat_tokens_per_s(checkout: Path, steps: int) -> float:
    """nanochat's base_train at the benchmark config; median tok/sec of its logged steps after the first."""
    cmd = [
        sys.executable,
        "-m",
        "scripts.base_train",
        f"--depth={DEPTH}",
        f"--max-seq-len={SEQ}",
        f"--device-batch-size={BATCH}",
        f"--total-batch-size={BATCH * SEQ}",
        f"--num-iterations={steps + 1}",
        "--eval-every=-1",
        "--core-metric-every=-1",
        "--sample-every=-1",
    ]
    r = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"nanochat base_train failed ({' '.join(cmd)}):\n{r.stderr[-2000:]}")
    rates = [float(m.replace(",", "")) for m in re.findall(r"tok/sec:\s*([\d,\.]+)", r.stdout + r.stderr)]
    if len(rates) < 2:
        raise RuntimeError("no 'tok/sec:' lines in nanochat's output; its log format changed")
    return statistics.median(rates[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--recipe", choices=["tiny", "nanochat"], default="tiny")
    p.add_argument("--nanochat", type=Path, help="a karpathy/nanochat checkout to run base_train from")
    args = p.parse_args()
    tokens = BATCH * SEQ
    print(
        f"d{DEPTH} seq {SEQ} batch {BATCH} vocab {VOCAB} fp32, recipe {args.recipe}, {torch.get_num_threads()} threads"
    )
    _, eager = run(args.recipe, args.steps, compiled=False)
    eager_s = statistics.median(eager)
    print(f"chatpipe eager:     {tokens / eager_s:,.0f} tok/s (median of {len(eager)} steps)")
    compile_s, comp = run(args.recipe, args.steps, compiled=True)
    comp_s = statistics.median(comp)
    print(f"chatpipe compiled:  {tokens / comp_s:,.0f} tok/s steady; first step (compiling) {compile_s:.1f} s")
    if comp_s < eager_s:
        print(f"compiling pays after ~{(compile_s - comp_s) / (eager_s - comp_s):.0f} steps")
    else:
        print("compiling does not pay at this config")
    if args.nanochat is None:
        print("nanochat: skipped (no --nanochat DIR: no checkout of karpathy/nanochat given)")
    else:
        rate = nanochat_tokens_per_s(args.nanochat, args.steps)
        print(f"nanochat base_train: {rate:,.0f} tok/s; ours compiled / nanochat = {tokens / comp_s / rate:.2f}")


if __name__ == "__main__":
    main()
