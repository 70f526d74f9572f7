"""SFT stage: supervised fine-tuning of the midtrained model on a task mixture, then a chat check.

    python -m stages.sft                                        # one process
    torchrun --nproc_per_node=2 -m stages.sft                   # DDP
    python -m chatpipe.launch sft -- --max_steps=20             # through torchx, as DVC does

Starts from ``artifacts/mid``; trains on ``sft.mixture`` exactly as midtrain does (best-fit packed
conversations, assistant-only loss, flat-then-decay LR). In-progress checkpoints go to
``checkpoints/sft/``, the final model to ``artifacts/sft/``. At the end it samples replies to
held-out tiny-world prompts (fraction that end with ``<|assistant_end|>``) and scores held-out
tool-use arithmetic for the sft model and, as a baseline, the base model; all go to MLflow and to
``summary`` in ``artifacts/sft/meta.json``.
"""

from __future__ import annotations

import logging
import time

from chatpipe import runtime, tracking
from chatpipe.data.tasks import build_task
from chatpipe.evals.chat_checks import end_token_rate, task_accuracy
from chatpipe.model.files import load_model
from chatpipe.paths import ARTIFACTS
from chatpipe.settings import SFTSettings
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.chat import train_chat

log = logging.getLogger("sft")


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(SFTSettings, train, argv, training=True)


def train(cfg: SFTSettings, rt: runtime.Runtime) -> None:
    train_chat(
        cfg,
        rt,
        stage="sft",
        init_dir=ARTIFACTS / "mid",
        out_dir=ARTIFACTS / "sft",
        finish=lambda model, tok, run: score_replies_and_arithmetic(cfg, model, tok, rt, run),
    )


def score_replies_and_arithmetic(
    cfg: SFTSettings, model, tok: Tokenizer, rt: runtime.Runtime, run: tracking.StageRun
) -> dict[str, float]:
    """End-token rate on sampled held-out prompts; tool-use arithmetic accuracy of sft vs base."""
    out: dict[str, float] = {}
    model.eval()
    t0 = time.perf_counter()
    if cfg.eval_prompts:
        # held-out (test split) prompts of every tiny-world kind, interleaved
        kinds = [
            build_task(name, "test", limit=cfg.eval_prompts)
            for name in ("tinyworld_chat", "tinyworld_arith", "tinyworld_mc")
        ]
        prompts = [kinds[i % len(kinds)][i // len(kinds)] for i in range(cfg.eval_prompts)]
        out["end_token_rate"] = end_token_rate(
            model, tok, prompts, max_tokens=cfg.eval_max_tokens, temperature=cfg.eval_temperature, seed=cfg.seed
        )
    if cfg.eval_arith:
        arith = build_task("tinyworld_arith", "test", limit=cfg.eval_arith)
        samples: list = []
        out["arith_accuracy"] = task_accuracy(model, tok, arith, max_tokens=cfg.eval_max_tokens, samples=samples)
        if cfg.eval_baseline:
            base, _ = load_model(ARTIFACTS / "base", rt.device)
            out["arith_accuracy_base"] = task_accuracy(base, tok, arith, max_tokens=cfg.eval_max_tokens)
        lines = [f"{'OK ' if ok else 'BAD'} {q!r} -> {reply!r}" for q, reply, ok in samples[:20]]
        log.info("arithmetic samples:\n  %s", "\n  ".join(lines))
        run.log_text("\n".join(lines), "samples/arithmetic.txt")
    model.train()
    log.info("chat checks (%.1f s): %s", time.perf_counter() - t0, out)
    run.log_metrics({f"eval/{k}": v for k, v in out.items()})
    return out


if __name__ == "__main__":
    main()
