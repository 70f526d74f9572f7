"""Benchmark: greedy generation with the KV cache (Engine) vs full recompute every step.

Builds a small random GPT (depth 4, seq 512), generates 256 new tokens from a 32-token prompt
both ways, checks the two token streams agree, and prints tokens/s for each (best of
``--repeats`` runs per side, so a busy machine skews the ratio less). The last line is
``speedup: <x>`` (cached tokens/s over recompute tokens/s; the goal is >= 5).

Run::

    python bench/engine_speed.py [--depth 4] [--new-tokens 256] [--device cpu]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatpipe.inference.engine import Engine  # noqa: E402
from chatpipe.model.gpt import GPT, config_from_depth  # noqa: E402
from chatpipe.testing.chatmodel import ByteTokenizer  # noqa: E402  (the engine needs only bytes and specials)


@torch.inference_mode()
def recompute(model: GPT, prompt: list[int], n: int, device: torch.device) -> list[int]:
    """Greedy generation that re-runs the whole sequence each step (no cache)."""
    ids = torch.tensor([prompt], device=device)
    for _ in range(n):
        nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt) :].tolist()


def timed(fn: Callable[[], list[int]], repeats: int) -> tuple[list[int], float]:
    """Output of ``fn`` and its best wall time over ``repeats`` runs."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return out, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4, help="model depth (n_embd = 64 * depth)")
    parser.add_argument("--seq-len", type=int, default=512, help="model sequence_len")
    parser.add_argument("--vocab", type=int, default=4096, help="vocab size")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens to generate")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per side; the best counts")
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(config_from_depth(args.depth, args.vocab, args.seq_len)).to(device)
    model.init_weights()
    tok = ByteTokenizer()
    with torch.no_grad():
        for p in model.parameters():  # random non-trivial blocks (zero-init projections are identities)
            p.add_(0.05 * torch.randn_like(p))
        model.lm_head.weight[list(tok.special.values())] = 0.0  # specials never win: no early stop, no tool calls
    model.eval()
    prompt = [tok.bos_id] + torch.randint(0, 256, (args.prompt_len - 1,)).tolist()
    engine = Engine(model, tok)

    def cached() -> list[int]:
        seqs, _ = engine.generate_batch(prompt, max_tokens=args.new_tokens, temperature=0.0)
        return seqs[0][len(prompt) :]

    cached()  # warm-up (allocator, kernels) so neither side pays it
    got, t_cache = timed(cached, args.repeats)
    ref, t_full = timed(lambda: recompute(model, prompt, args.new_tokens, device), args.repeats)
    n = args.new_tokens
    print(f"model: depth {args.depth}, {model.num_params() / 1e6:.1f}M params, device {device}")
    print(f"tokens match: {got == ref} ({len(got)} generated)")
    print(f"kv cache:  {n / t_cache:8.1f} tokens/s ({t_cache:.2f} s)")
    print(f"recompute: {n / t_full:8.1f} tokens/s ({t_full:.2f} s)")
    print(f"speedup: {t_full / t_cache:.2f}")


if __name__ == "__main__":
    main()
