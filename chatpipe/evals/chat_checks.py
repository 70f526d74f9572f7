"""Evaluation helpers for the chat stages: sampled answers, end-token rate, task accuracy.

rate = end_token_rate(model, tok, prompts, max_tokens=64, temperature=0.7)
acc = task_accuracy(model, tok, build_task("tinyworld_arith", "test"), n=100)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from chatpipe.inference.engine import Engine
from chatpipe.tokenizer import reply_text

log = logging.getLogger(__name__)


def complete(
    engine: Engine, conversations: Sequence[dict[str, Any]], *, max_tokens: int, temperature: float = 0.0, seed: int = 0
) -> list[tuple[str, bool]]:
    """The assistant's reply to each conversation (its gold answer dropped) and whether it ended its turn."""
    tok = engine.tokenizer
    prompts = [tok.render_for_completion(c) for c in conversations]
    out = []
    generated = engine.generate_many(prompts, num_samples=1, max_tokens=max_tokens, temperature=temperature, seed=seed)
    for prompt, (seqs, masks) in zip(prompts, generated):
        out.append(reply_text(tok, seqs[0][len(prompt) :], masks[0][len(prompt) :]))
    return out


def end_token_rate(
    model: torch.nn.Module,
    tokenizer,
    conversations: Sequence[dict[str, Any]],
    *,
    max_tokens: int = 64,
    temperature: float = 0.7,
    seed: int = 0,
) -> float:
    """Fraction of sampled replies that end with ``<|assistant_end|>`` within ``max_tokens``."""
    replies = complete(
        Engine(model, tokenizer), conversations, max_tokens=max_tokens, temperature=temperature, seed=seed
    )
    return sum(ended for _, ended in replies) / max(1, len(replies))


def task_accuracy(
    model: torch.nn.Module, tokenizer, task, n: int | None = None, *, max_tokens: int = 64, samples: list | None = None
) -> float:
    """Exact-match accuracy of greedy replies on the first ``n`` examples of ``task`` (its own ``evaluate``).

    ``samples``, when given, receives ``(prompt text, reply, correct)`` for inspection.
    """
    n = len(task) if n is None else min(n, len(task))
    convs = [task[i] for i in range(n)]
    replies = complete(Engine(model, tokenizer), convs, max_tokens=max_tokens, temperature=0.0)
    correct = 0
    for conv, (reply, _) in zip(convs, replies):
        ok = task.evaluate(conv, reply)
        correct += ok
        if samples is not None:
            samples.append((conv["messages"][-2]["content"], reply, ok))
    return correct / max(1, n)
