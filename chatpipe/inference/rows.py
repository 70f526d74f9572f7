"""A generated row's rules, written once: stop tokens, ``max_tokens`` and the calculator tool.

Every token a row produces goes through :meth:`RowState.advance`. When a row emits
``<|python_end|>``, the text since ``<|python_start|>`` goes to
:func:`chatpipe.inference.calculator.evaluate`; a result is forced back into that row as
``<|output_start|>`` + result tokens + ``<|output_end|>``, one token per step, mask 0. A call the
calculator rejects forces nothing. A call still open after ``max_tool_tokens`` tokens (a model
looping on digits) is cut: ``<|python_end|>`` is forced and the row stops there, so no runaway
output. Both count as failed calls in ``RowRules.tool_stats``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from chatpipe.inference.calculator import evaluate


class RowRules:
    """What every row of one model and tokenizer shares: the special tokens, the calculator's limits
    and its running totals (``tool_stats``: calls, failed, cut)."""

    def __init__(self, tokenizer: Any, max_tool_tokens: int = 32) -> None:
        if max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1, got {max_tool_tokens}")
        self.tokenizer = tokenizer
        # the calculator's expressions are a few numbers and operators: 32 tokens is generous
        self.max_tool_tokens = max_tool_tokens
        self.tool_stats = {"calls": 0, "failed": 0, "cut": 0}
        special = tokenizer.encode_special
        self.bos = tokenizer.bos_id
        self.assistant_end = special("<|assistant_end|>")
        self.python_start, self.python_end = special("<|python_start|>"), special("<|python_end|>")
        self.output_start, self.output_end = special("<|output_start|>"), special("<|output_end|>")

    def stop_ids(self, stop_tokens: list[int] | None = None) -> set[int]:
        """Tokens that end a sample: ``<|assistant_end|>``, ``<|bos|>`` and any extra ``stop_tokens``."""
        return {self.assistant_end, self.bos, *(stop_tokens or [])}

    def row(self, max_tokens: int, stop_tokens: list[int] | None = None) -> RowState:
        return RowState(self, self.stop_ids(stop_tokens), max_tokens)


@dataclass(eq=False)
class RowState:
    """One sample's state: its stop tokens and budget, the calculator call it is in, the tokens to force."""

    rules: RowRules
    stops: set[int]
    max_tokens: int
    count: int = 0
    in_python: bool = False
    python_tokens: list[int] = field(default_factory=list)
    forced: deque[int] = field(default_factory=deque)
    cut: bool = False  # a tool call ran past max_tool_tokens: stop once the forced tokens are out
    reason: str | None = None  # why the row ended: "stop", "length" or "tool_cut"

    def advance(self, sampled: int) -> tuple[int, int]:
        """Apply the sampled token: returns (the row's token, mask) — a forced tool token takes the
        sample's place with mask 0. Sets ``reason`` when the row ends with this token."""
        forced = bool(self.forced)
        tok = self.forced.popleft() if forced else sampled
        self.count += 1
        if forced and self.cut and not self.forced:
            self.reason = "tool_cut"
        elif not forced and tok in self.stops:
            self.reason = "stop"
        elif not forced:
            self._tool_step(tok)
        if self.reason is None and self.count >= self.max_tokens:
            self.reason = "length"
        return tok, 0 if forced else 1

    def _tool_step(self, token: int) -> None:
        """Advance the calculator state machine by one sampled token."""
        rules, stats = self.rules, self.rules.tool_stats
        if token == rules.python_start:
            self.in_python, self.python_tokens = True, []
        elif token == rules.python_end and self.in_python:
            self.in_python = False
            stats["calls"] += 1
            result = evaluate(rules.tokenizer.decode(self.python_tokens))
            if result is not None:
                self.forced.extend([rules.output_start, *rules.tokenizer.encode(result), rules.output_end])
            else:
                stats["failed"] += 1
        elif self.in_python:
            self.python_tokens.append(token)
            if len(self.python_tokens) >= rules.max_tool_tokens:
                self.in_python, self.cut = False, True
                self.forced.append(rules.python_end)
                stats["calls"] += 1
                stats["failed"] += 1
                stats["cut"] += 1
