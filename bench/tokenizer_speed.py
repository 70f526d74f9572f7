"""Tokenizer training speed: chatpipe's trainer (rustbpe) vs a plain-Python reference BPE trainer.

    python bench/tokenizer_speed.py [--chars 300000] [--vocab 1024]

Both learn byte-level BPE merges on the same pretraining text (artifacts/data, or freshly generated
tiny-world text) with the same split pattern. The reference is the textbook algorithm: count
regex chunks once, then repeatedly merge the most frequent adjacent pair. Prints chars/s of each
and the ratio ours/reference last.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import regex

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.data.synthetic import pretrain_documents  # noqa: E402
from chatpipe.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer  # noqa: E402


def reference_bpe(text: str, num_merges: int) -> list[tuple[bytes, bytes]]:
    """Textbook byte-level BPE over chunk counts; returns the merges in order."""
    chunks = collections.Counter(regex.findall(SPLIT_PATTERN, text))
    words = {tuple(bytes([b]) for b in chunk.encode()): n for chunk, n in chunks.items()}
    merges = []
    for _ in range(num_merges):
        pairs: collections.Counter = collections.Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += n
        if not pairs:
            break
        best = max(pairs, key=pairs.__getitem__)
        merges.append(best)
        merged = {}
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return merges


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chars", type=int, default=300_000)
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args()
    text = "".join(pretrain_documents(seed=0, num_docs=2000))[: args.chars]
    t0 = time.perf_counter()
    ours = Tokenizer.train([text], args.vocab)
    ours_s = time.perf_counter() - t0
    merges = ours.vocab_size - 256 - len(SPECIAL_TOKENS)
    t0 = time.perf_counter()
    ref = reference_bpe(text, merges)
    ref_s = time.perf_counter() - t0
    print(f"text: {len(text):,} chars; merges: ours {merges}, reference {len(ref)}")
    print(f"chatpipe (rustbpe): {ours_s:.3f} s, {len(text) / ours_s:,.0f} chars/s")
    print(f"reference (Python): {ref_s:.3f} s, {len(text) / ref_s:,.0f} chars/s")
    print(f"ratio ours/reference chars/s: {ref_s / ours_s:.1f}")


if __name__ == "__main__":
    main()
