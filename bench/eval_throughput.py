"""CORE evaluator throughput vs bare forward passes of the same batches.

    python bench/eval_throughput.py [--model artifacts/base] [--items 60]

Evaluates the tiny-world CORE tasks (written to a temp bundle) with the trained model, records the
shape of every batch the evaluator sends through the model, then times bare forward passes of
random tokens with exactly those shapes. Prints evaluator tokens/s, bare tokens/s and their ratio
last (how much of the evaluator's time is model compute; 1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.evals.core import evaluate_core  # noqa: E402
from chatpipe.evals.core_tinyworld import write_tinyworld_bundle  # noqa: E402
from chatpipe.model.files import load_model  # noqa: E402
from chatpipe.tokenizer import Tokenizer  # noqa: E402


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(REPO / "artifacts" / "base"))
    p.add_argument("--tokenizer", default=str(REPO / "artifacts" / "tokenizer"))
    p.add_argument("--items", type=int, default=60, help="items per task")
    args = p.parse_args()
    model, _ = load_model(args.model, "cpu")
    tok = Tokenizer.load(args.tokenizer)
    shapes: list[torch.Size] = []
    hook = model.register_forward_pre_hook(lambda m, a: shapes.append(a[0].shape))
    with tempfile.TemporaryDirectory() as tmp:
        config = write_tinyworld_bundle(Path(tmp), n=args.items)
        t0 = time.perf_counter()
        result = evaluate_core(
            model, tok, config, Path(tmp), device="cpu", max_seq_len=model.config.sequence_len, max_per_task=args.items
        )
        evaluator_s = time.perf_counter() - t0
    hook.remove()
    tokens = sum(s.numel() for s in shapes)
    t0 = time.perf_counter()
    for shape in shapes:
        model(torch.randint(0, model.config.vocab_size, tuple(shape)))
    bare_s = time.perf_counter() - t0
    print(f"CORE on tiny-world tasks: {result.get('core', float('nan')):.4f}, {len(shapes)} batches, {tokens:,} tokens")
    for name, seconds in (("evaluator", evaluator_s), ("bare forward passes", bare_s)):
        print(f"{name}: {seconds:.2f} s, {tokens / seconds:,.0f} tokens/s")
    print(f"ratio evaluator/bare tokens/s: {bare_s / evaluator_s:.3f}")


if __name__ == "__main__":
    main()
