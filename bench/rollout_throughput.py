"""Benchmark: RL rollout tokens/s of this checkout against a git revision's, in one run.

Samples RL steps' rollouts (``collect_rollouts``, tool use on) on tiny-world arithmetic prompts with
the RL stage's defaults (8 prompts x 8 samples, 48 new tokens, temperature 1, top-k 50) on the same
model with this checkout's engine and with ``--baseline``'s (its tree unpacked with ``git archive``,
run in a process of its own). The arms take turns, a step at a time, so load on a shared machine
falls on both alike. A third arm samples with this checkout's engine and the linear layers in the
RL stage's ``rl.rollout.dtype`` (``--rollout-dtype``, default ``auto``: bf16 where the CPU multiplies
bf16 natively); it runs only where that is not float32. Prints per arm the generated tokens
(sampled + forced), seconds, tokens/s and the mean score; then ``rollout tokens/s, <arm> / baseline: x<ratio>``.

    python bench/rollout_throughput.py --baseline f18dbe9 --model artifacts/sft --tokenizer artifacts/tokenizer
    python bench/rollout_throughput.py --baseline f18dbe9     # a random d4 GPT, bytes tokenizer: runs anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from revision import REPO, unpack


def worker(args: argparse.Namespace) -> None:
    """One step of rollouts (after a warm-up step) with whatever chatpipe this process imports; prints JSON."""
    import torch

    from chatpipe import runtime
    from chatpipe.inference.engine import Engine
    from chatpipe.model.files import load_model
    from chatpipe.model.gpt import GPT, config_from_depth
    from chatpipe.rl.rollout import collect_rollouts, load_problems
    from chatpipe.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = (
        Tokenizer.load(args.tokenizer) if args.tokenizer else Tokenizer.from_ranks({bytes([i]): i for i in range(256)})
    )
    if args.model:
        model, _ = load_model(args.model, torch.device("cpu"))
    else:
        torch.manual_seed(0)
        model = GPT(config_from_depth(4, tok.vocab_size, 256, head_dim=64))
        model.init_weights()
    model.eval()
    engine = Engine(model, tok)
    problems = load_problems("tinyworld_arith", "train", args.prompts * (args.steps + 1), seed=0)
    dtype = runtime.compute_dtype(args.rollout_dtype, torch.cuda.is_available(), training=True) if args.lowp else None
    kw = dict(
        group_size=args.group, max_new_tokens=args.max_new_tokens, temperature=1.0, top_k=50, max_rows=args.max_rows
    )
    collect_rollouts(engine, problems[: args.prompts], seed=0, matmul_dtype=dtype, **kw)  # warm-up
    step = args.step
    batch = problems[step * args.prompts : (step + 1) * args.prompts]
    t0 = time.perf_counter()
    out = collect_rollouts(engine, batch, seed=step, matmul_dtype=dtype, **kw)
    seconds = time.perf_counter() - t0
    print(json.dumps({"tokens": int(out.num_tokens), "seconds": seconds, "score": float(out.scores.mean())}))


def run_arm(args: argparse.Namespace, tree: Path | None, step: int, lowp: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree or REPO)}
    cmd = [sys.executable, __file__, "--worker", "--step", str(step), *args.passthrough] + (["--lowp"] if lowp else [])
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=tree or REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="", help="git revision to compare with (required unless --worker)")
    p.add_argument("--model", default="", help="model dir (e.g. artifacts/sft); default: random d4 GPT")
    p.add_argument("--tokenizer", default="", help="tokenizer dir; default: bytes + chat specials")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (rl.prompts_per_step)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (rl.group_size)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-rows", type=int, default=128, help="rows of a batch, both engines")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--rollout-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="rl.rollout.dtype")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--lowp", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.baseline:
        p.error("--baseline REV is required")
    model = [str(Path(args.model).resolve())] if args.model else []
    tok = [str(Path(args.tokenizer).resolve())] if args.tokenizer else []
    args.passthrough = [*(["--model", *model] if model else []), *(["--tokenizer", *tok] if tok else [])]
    for key in ("prompts", "group", "max_new_tokens", "max_rows", "steps", "threads", "rollout_dtype"):
        args.passthrough += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    tree = unpack(args.baseline)
    arms = {f"baseline {args.baseline}": (tree, False), "this checkout": (None, False)}
    if args.rollout_dtype != "float32":
        arms["this checkout, rollout_dtype"] = (None, True)
    totals = {name: {"tokens": 0, "seconds": 0.0, "score": 0.0} for name in arms}
    for step in range(1, args.steps + 1):
        for name in list(arms) if step % 2 else list(arms)[::-1]:
            r = run_arm(args, *arms[name][:1], step, arms[name][1])
            for key in totals[name]:
                totals[name][key] += r[key]
    print(
        f"{args.steps} steps of {args.prompts} x {args.group}, {args.max_new_tokens} new tokens; model {args.model or 'random d4'}"
    )
    for name, t in totals.items():
        print(
            f"{name}: {t['tokens']} tokens in {t['seconds']:.2f} s = {t['tokens'] / t['seconds']:.0f} tokens/s; mean score {t['score'] / args.steps:.3f}"
        )
    base = next(iter(totals.values()))
    for name in list(arms)[1:]:
        ratio = (totals[name]["tokens"] / totals[name]["seconds"]) / (base["tokens"] / base["seconds"])
        print(f"rollout tokens/s, {name} / baseline: x{ratio:.2f}")


if __name__ == "__main__":
    main()
