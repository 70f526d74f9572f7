"""Tokenizer stage: train byte-level BPE on the pretraining text, save it, report compression.

    python -m stages.tokenizer             # or: python -m chatpipe.launch tokenizer
    python -m stages.tokenizer --vocab_size=4096

Reads ``artifacts/data`` (train split, first ``max_chars`` characters), writes
``artifacts/tokenizer/`` (tokenizer files, ``token_bytes.pt`` for bits-per-byte, and
``report.json`` with bytes/token on held-out val text), atomically.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from chatpipe import runtime, tracking
from chatpipe.data.sources import corpus_name, iter_documents
from chatpipe.io import atomic_dir, write_json_atomic
from chatpipe.paths import ARTIFACTS
from chatpipe.settings import TokenizerSettings, snapshot
from chatpipe.stage_metrics import write_metrics
from chatpipe.tokenizer import Tokenizer, check_corpus, compression_report


def take_chars(docs: Iterator[str], max_chars: int) -> Iterator[str]:
    """Documents until ``max_chars`` characters have been yielded (the last one cropped)."""
    left = max_chars
    for doc in docs:
        if left <= 0:
            return
        yield doc[:left]
        left -= len(doc)


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(TokenizerSettings, train_tokenizer, argv, distributed=False)


def train_tokenizer(cfg: TokenizerSettings) -> None:
    data_dir, out_dir = ARTIFACTS / "data", ARTIFACTS / "tokenizer"
    with tracking.tracked_run("tokenizer", {"tokenizer": snapshot(cfg)}) as run:
        # --- train
        t0 = time.time()
        texts = list(take_chars(iter_documents(data_dir, "train"), cfg.max_chars))
        n_chars = sum(len(t) for t in texts)
        tok = Tokenizer.train(texts, cfg.vocab_size)
        train_s = time.time() - t0
        roundtrip = check_corpus(tok, cfg.vocab_size, texts[: cfg.roundtrip_docs], corpus_name(data_dir), n_chars)

        # --- eval: compression on held-out text
        val_text = "".join(take_chars(iter_documents(data_dir, "val"), cfg.eval_chars))
        report = compression_report(tok, val_text)
        report.update(
            train_chars=n_chars,
            train_seconds=round(train_s, 3),
            chars_per_second=round(n_chars / max(train_s, 1e-9)),
            vocab_size=tok.vocab_size,
            roundtrip=roundtrip,
        )

        # --- save atomically: build in a temp dir, then swap it in
        with atomic_dir(out_dir) as tmp:
            tok.save(tmp)  # tokenizer.json, ranks and token_bytes.pt, with the checksums load verifies
            write_json_atomic(tmp / "report.json", report)
        write_metrics(
            "tokenizer",
            {
                "bytes_per_token": report["ours"]["bytes_per_token"],
                "train_seconds": train_s,
                "vocab_size": tok.vocab_size,
                "roundtrip_docs": roundtrip["docs"],
                "roundtrip_failures": roundtrip["failures"],
            },
        )

        run.log_metrics(tracking.numeric_leaves(report))
        run.log_artifact(out_dir / "report.json")
    print(f"tokenizer: vocab {tok.vocab_size}, trained on {n_chars:,} chars in {train_s:.1f}s; {report}")


if __name__ == "__main__":
    main()
