"""GSM8K grade-school math: ``<<a*b=c>>`` annotations become calculator tool calls, graded on ``#### n``.

Sources: ``hf`` (openai/gsm8k, config ``main``), ``local`` (a directory with ``train.jsonl`` and
``test.jsonl`` of ``{"question", "answer"}``; val = a stable 10% of train, held out of train).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from chatpipe.data.synthetic import split_of
from chatpipe.data.tasks.base import NumericAnswerTask, check_split_source, checked_rows, limit_rows, load_hf

_CALL = re.compile(r"<<([^<>=]*)=([^<>]*)>>")


def answer_parts(answer: str) -> list[dict[str, str]]:
    """Split a GSM8K answer into text / python / python_output parts at each ``<<expr=result>>``."""
    parts: list[dict[str, str]] = []
    pos = 0
    for m in _CALL.finditer(answer):
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos : m.start()]})
        parts.append({"type": "python", "text": m.group(1).strip()})
        parts.append({"type": "python_output", "text": m.group(2).strip()})
        pos = m.end()
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return parts


def gsm_conversation(row: dict[str, Any]) -> dict[str, Any]:
    """``{"question", "answer"}`` -> a conversation whose answer calls the calculator."""
    question, answer = row["question"], row["answer"]
    if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
        raise ValueError("expected string 'question' and an 'answer' ending with '#### <number>'")
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer_parts(answer)}]}


def _valid_row(obj: dict[str, Any]) -> dict[str, Any]:
    gsm_conversation(obj)  # raises on a malformed row
    return obj


def _local_rows(directory: Path, split: str) -> list[dict[str, Any]]:
    path = directory / ("test.jsonl" if split == "test" else "train.jsonl")
    rows = checked_rows(path, _valid_row, "GSM8K row")
    if split == "test":
        return rows
    return [r for r in rows if (split_of(r["question"]) == "val") == (split == "val")]


class GSM8K(NumericAnswerTask):
    """GSM8K with calculator tool calls."""

    name = "gsm8k"

    def __init__(
        self, split: str = "train", source: str = "local", path: str | Path = "", limit: int | None = None
    ) -> None:
        check_split_source(split, source, self.name)
        if source == "local":
            rows = _local_rows(Path(path or "data/gsm8k"), split)
        else:
            ds = load_hf("openai/gsm8k", "main", "test" if split == "test" else "train")
            rows = [r for r in ds if split == "test" or (split_of(r["question"]) == "val") == (split == "val")]
        super().__init__(limit_rows(rows, limit), split)

    def conversation(self, row: dict[str, Any]) -> dict[str, Any]:
        return gsm_conversation(row)
