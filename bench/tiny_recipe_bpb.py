"""Tiny profile: val bits per byte at equal CPU time, the 2025 recipe against nanochat's 2026 options.

    python bench/tiny_recipe_bpb.py --recipe old --cpu-seconds 150      # one recipe per process
    python bench/tiny_recipe_bpb.py --recipe new --cpu-seconds 150

Data as the tiny profile makes it: the synthetic tiny-world documents (seed 42, 4000 docs, the last
200 held out) and a 1024-id BPE tokenizer trained on them. Model: depth 4, seq 256, batch 16 x 256.
The budget is *process CPU time* (``time.process_time``), so the result does not depend on what
else runs on a shared machine; the LR schedule (flat, then linear warmdown over the last 65% to 5%)
follows the fraction of the budget spent. Val bpb over every full row of the held-out documents at the end.

- ``old``: tiny's model and torch AdamW + Muon (matrix 0.02, embedding 0.2, unembedding 0.004);
- ``new``: every nanochat option (SSSL quarter windows) and MuonAdamW (its speedrun lrs, wd 0.2);
- ``exportable``: the options transformers' built-in NanoChat class also has (full attention, rotary
  base 100000) with MuonAdamW and the same lrs: what a model must be to export without remote code.

``--polar-dtype bfloat16`` runs MuonAdamW's Polar Express in bfloat16 (what ``polar_express_dtype:
auto`` picks on a CPU with bfloat16 dot products); ``--seed`` varies the init and the batches.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.data import synthetic  # noqa: E402
from chatpipe.model.gpt import GPT, config_from_depth, nanochat_options  # noqa: E402
from chatpipe.tokenizer import Tokenizer  # noqa: E402
from chatpipe.train.optim import apply_schedules, build_optimizers, muon_momentum  # noqa: E402

SEQ, BATCH = 256, 16


def data() -> tuple[Tokenizer, torch.Tensor, torch.Tensor]:
    """(tokenizer, train ids, val ids) of the tiny world."""
    docs = synthetic.pretrain_documents(seed=42, num_docs=4000)
    train_docs, val_docs = docs[:-200], docs[-200:]
    tok = Tokenizer.train(train_docs, vocab_size=1024)

    def ids(ds):
        return torch.tensor([i for seq in tok.encode(ds, prepend=tok.bos_id) for i in seq], dtype=torch.long)

    return tok, ids(train_docs), ids(val_docs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=["old", "new", "exportable"], required=True)
    p.add_argument("--cpu-seconds", type=float, default=150.0)
    p.add_argument("--polar-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()
    torch.set_num_threads(1)
    tok, train, val = data()
    torch.manual_seed(args.seed)
    if args.recipe == "new":
        config = config_from_depth(4, tok.vocab_size, SEQ, head_dim=64, window_pattern="SSSL", **nanochat_options(SEQ))
    elif args.recipe == "exportable":
        config = config_from_depth(4, tok.vocab_size, SEQ, head_dim=64, rotary_base=100000.0)
    else:
        config = config_from_depth(4, tok.vocab_size, SEQ, head_dim=64)
    model = GPT(config)
    model.init_weights()
    if args.recipe in ("new", "exportable"):
        recipe = {
            "optimizer": "normuon_polar_express",
            "embedding_lr": 0.3,
            "unembedding_lr": 0.008,
            "weight_decay": 0.2,
        }
        opts = build_optimizers(model, **recipe, polar_dtype=getattr(torch, args.polar_dtype))
    else:
        opts = build_optimizers(model)
    token_bytes = tok.token_bytes()
    gen = torch.Generator().manual_seed(args.seed)
    start, step = time.process_time(), 0
    while (spent := time.process_time() - start) < args.cpu_seconds:
        frac = spent / args.cpu_seconds
        lr_mult = 1.0 if frac < 0.35 else 0.05 + 0.95 * (1.0 - frac) / 0.65
        apply_schedules(opts, lr_mult, muon_momentum(step, 300))
        starts = torch.randint(0, train.numel() - SEQ - 1, (BATCH,), generator=gen)
        rows = torch.stack([train[s : s + SEQ + 1] for s in starts.tolist()])
        model(rows[:, :-1], rows[:, 1:]).backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        step += 1
    model.eval()
    nats = nbytes = 0.0
    with torch.no_grad():
        n_rows = (val.numel() - 1) // SEQ  # every full row of the held-out documents
        for i in range(0, n_rows, BATCH):
            rows = min(BATCH, n_rows - i)
            chunk = val[i * SEQ : (i + rows) * SEQ + 1]
            x, y = chunk[:-1].view(rows, SEQ), chunk[1:].view(rows, SEQ)
            loss = model(x, y, loss_reduction="none")
            b = token_bytes[y]
            nats += (loss * (b > 0)).sum().item()
            nbytes += b.sum().item()
    bpb = nats / (math.log(2) * nbytes)
    print(
        f"recipe {args.recipe}: {step} steps in {args.cpu_seconds:.0f} CPU-s ({step * BATCH * SEQ / args.cpu_seconds:,.0f} tok/CPU-s), val bpb {bpb:.4f}"
    )


if __name__ == "__main__":
    main()
