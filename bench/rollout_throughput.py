"""Benchmark: RL rollout tokens/s, the continuous batch beside the static batches, in one run.

Samples RL steps' rollouts (``collect_rollouts``, tool use on) on tiny-world arithmetic prompts with
the RL stage's defaults (8 prompts x 8 samples, 48 new tokens, temperature 1, top-k 50), each
step twice on the same model: with the static batches of ``Engine.generate_many`` (a batch runs
until its longest row ends) and with the continuous batch (``continuous=True``: finished rows
leave, waiting prompts join). The two alternate step by step, so load on a shared machine falls
on both alike. A third arm samples on the continuous batch with the linear layers in the RL stage's
``rl.rollout_dtype`` (``--rollout-dtype``, default ``auto``: bf16 where the CPU multiplies bf16
natively, the stage's rollouts since issue 54's round eight); it runs only where that is not float32.
Prints per arm the generated tokens (sampled + forced), seconds, tokens/s, the decode rows computed
per generated token (1.0 = no padding) and the mean score; then ``rollout tokens/s, continuous /
static: x<ratio>`` and, with the third arm, ``rollout tokens/s, continuous in <dtype> / static: x<ratio>``
(static float32 batches are the RL stage's rollouts before issue 54).

    python bench/rollout_throughput.py --model artifacts/sft --tokenizer artifacts/tokenizer [--steps 6] [--rollout-dtype auto]
    python bench/rollout_throughput.py             # a random d4 GPT, bytes tokenizer: runs anywhere
"""

from __future__ import annotations

import argparse
import time

import torch

from chatpipe import runtime
from chatpipe.inference.engine import Engine
from chatpipe.model.files import load_model
from chatpipe.model.gpt import GPT, config_from_depth
from chatpipe.rl.rollout import collect_rollouts, load_problems
from chatpipe.tokenizer import Tokenizer


def count_rows(model: torch.nn.Module) -> list[int]:
    """Wrap ``model.forward`` to add up the rows of every one-token (decode) call; returns the counter."""
    rows = [0]
    forward = model.forward

    def counted(idx, *a, **kw):
        if idx.size(1) == 1:
            rows[0] += idx.size(0)
        return forward(idx, *a, **kw)

    model.forward = counted
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model dir (e.g. artifacts/sft); default: random d4 GPT")
    p.add_argument("--tokenizer", default="", help="tokenizer dir; default: bytes + chat specials")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (rl.prompts_per_step)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (rl.group_size)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-rows", type=int, default=128, help="rows of a batch, both engines")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--rollout-dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="rl.rollout_dtype")
    args = p.parse_args()
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
    rows = count_rows(model)
    engine = Engine(model, tok)
    problems = load_problems("tinyworld_arith", "train", args.prompts * (args.steps + 1), seed=0)
    lowp = runtime.compute_dtype(args.rollout_dtype, torch.cuda.is_available(), training=True)
    arms = {"static": (False, None), "continuous": (True, None)}
    arms |= {f"continuous in {str(lowp).split('.')[-1]}": (True, lowp)} if lowp != torch.float32 else {}
    totals = {name: {"tokens": 0, "seconds": 0.0, "rows": 0, "score": 0.0} for name in arms}
    kw = dict(
        group_size=args.group, max_new_tokens=args.max_new_tokens, temperature=1.0, top_k=50, max_rows=args.max_rows
    )
    for step in range(args.steps + 1):  # step 0 warms up
        batch_problems = problems[step * args.prompts : (step + 1) * args.prompts]
        for name in list(arms) if step % 2 else list(arms)[::-1]:
            rows[0] = 0
            continuous, dtype = arms[name]
            t0 = time.perf_counter()
            batch = collect_rollouts(engine, batch_problems, seed=step, continuous=continuous, matmul_dtype=dtype, **kw)
            seconds = time.perf_counter() - t0
            if step:
                t = totals[name]
                t["tokens"] += batch.num_tokens
                t["seconds"] += seconds
                t["rows"] += rows[0]
                t["score"] += float(batch.scores.mean()) / args.steps
    cfg = model.config
    print(
        f"model d{cfg.n_layer} ({cfg.n_embd} wide), {torch.get_num_threads()} threads, {args.steps} steps of {args.prompts} x {args.group}"
    )
    for name, t in totals.items():
        print(
            f"{name}: {t['tokens']} tokens in {t['seconds']:.2f} s = {t['tokens'] / t['seconds']:.0f} tokens/s; "
            f"{t['rows'] / t['tokens']:.2f} decode rows per token; mean score {t['score']:.3f}"
        )
    static = totals["static"]["tokens"] / totals["static"]["seconds"]
    for name in list(arms)[1:]:
        print(f"rollout tokens/s, {name} / static: x{totals[name]['tokens'] / totals[name]['seconds'] / static:.2f}")


if __name__ == "__main__":
    main()
