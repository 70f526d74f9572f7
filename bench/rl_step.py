"""Benchmark: one GRPO-lite step = rollouts (engine, tool use on) + a policy-gradient update.

Times a few steps on tiny-world arithmetic prompts and prints rollout tokens/s (generated tokens,
sampled + forced, per second of generation), the share of step time spent generating vs
training, and update tokens/s. The last line is ``rollout tokens/s: <x>``.

By default the model is a random GPT of ``--depth`` with a byte-level tokenizer (runs anywhere);
``--model artifacts/sft --tokenizer artifacts/tokenizer`` benchmarks a trained one (whose
responses, and so timings, are realistic lengths).

    python bench/rl_step.py [--depth 4] [--prompts 4] [--group 8] [--max-new-tokens 64] [--steps 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from chatpipe.inference.engine import Engine
from chatpipe.model.files import load_model
from chatpipe.model.gpt import GPT, config_from_depth
from chatpipe.rl.rollout import collect_rollouts, load_problems
from chatpipe.rl.update import GRPOConfig, grpo_update
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.optim import build_optimizers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--model", default="", help="model dir (e.g. artifacts/sft); default: random GPT")
    p.add_argument("--tokenizer", default="", help="tokenizer dir; default: bytes + chat specials")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()

    device = torch.device(args.device)
    byte_tokenizer = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})
    tok = Tokenizer.load(args.tokenizer) if args.tokenizer else byte_tokenizer
    if args.model:
        model, _ = load_model(args.model, device)
    else:
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(config_from_depth(args.depth, tok.vocab_size, 512, head_dim=64))
        model.init_weights()
    model.train()
    optimizers = build_optimizers(model, matrix_lr=1e-3, embedding_lr=1e-2, unembedding_lr=2e-4)
    engine = Engine(model, tok)
    problems = load_problems("tinyworld_arith", "train", args.prompts * args.steps, seed=0)

    t_gen = t_train = 0.0
    gen_tokens = train_tokens = 0
    for step in range(args.steps):
        batch_problems = problems[step * args.prompts : (step + 1) * args.prompts]
        t0 = time.perf_counter()
        batch = collect_rollouts(
            engine,
            batch_problems,
            group_size=args.group,
            max_new_tokens=args.max_new_tokens,
            seed=step * 1000,
            device=device,
        )
        t1 = time.perf_counter()
        # the same update the rl stage runs (chatpipe.rl.update)
        grpo_update(
            model, optimizers, batch, batch.scores, GRPOConfig(group_size=args.group, micro_batch=args.micro_batch)
        )
        if device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step > 0 or args.steps == 1:  # the first step warms up allocators and kernels
            t_gen, t_train = t_gen + t1 - t0, t_train + t2 - t1
            gen_tokens += batch.num_tokens
            train_tokens += batch.inputs.numel()
        print(
            f"step {step}: {batch.num_tokens} generated tokens in {t1 - t0:.2f}s, update {t2 - t1:.2f}s, "
            f"reward {batch.scores.mean().item():.3f}",
            flush=True,
        )

    total = t_gen + t_train
    print(f"generating: {t_gen / total:.1%} of step time, training: {t_train / total:.1%}")
    print(f"update tokens/s: {train_tokens / t_train:.0f}")
    print(f"rollout tokens/s: {gen_tokens / t_gen:.0f}")


if __name__ == "__main__":
    main()
