"""ARC (AI2 Reasoning Challenge), Easy and Challenge, as letter-answer multiple choice.

Sources: ``hf`` (allenai/ai2_arc), ``local`` (a CORE-bundle file such as ``arc_easy.jsonl`` with
``{"query": "Question: ...", "choices": [...], "gold": i}``; it has no splits, so train/val/test
are a stable 80/10/10 hash split of the questions).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatpipe.data.tasks.base import (
    MultipleChoiceTask,
    check_split_source,
    checked_rows,
    hash_split,
    limit_rows,
    load_hf,
    mc_conversation,
)

HF_SPLITS = {"train": "train", "val": "validation", "test": "test"}


def _local_row(obj: dict[str, Any]) -> dict[str, Any]:
    question, choices, gold = obj["query"], obj["choices"], obj["gold"]
    if not isinstance(question, str) or not isinstance(choices, list) or not isinstance(gold, int):
        raise ValueError("expected {'query': str, 'choices': [str], 'gold': int}")
    mc_conversation(question, choices, gold)  # validates the gold index
    return {"question": question.removeprefix("Question:").strip(), "choices": choices, "answer": gold}


def _hf_row(obj: dict[str, Any]) -> dict[str, Any]:
    labels = obj["choices"]["label"]
    return {"question": obj["question"], "choices": obj["choices"]["text"], "answer": labels.index(obj["answerKey"])}


class ARC(MultipleChoiceTask):
    """ARC-Easy (``subset="easy"``) or ARC-Challenge (``subset="challenge"``)."""

    def __init__(
        self,
        subset: str = "easy",
        split: str = "train",
        source: str = "local",
        path: str | Path = "",
        limit: int | None = None,
    ) -> None:
        if subset not in ("easy", "challenge"):
            raise ValueError(f"arc: subset = {subset!r}; allowed: easy, challenge")
        self.name = f"arc_{subset}"
        check_split_source(split, source, self.name)
        if source == "local":
            file = Path(path or "data/core") / f"arc_{subset}.jsonl"
            rows = checked_rows(file, _local_row, "ARC row")
            rows = hash_split(rows, split, lambda r: r["question"])
        else:
            config = "ARC-Easy" if subset == "easy" else "ARC-Challenge"
            rows = [_hf_row(r) for r in load_hf("allenai/ai2_arc", config, HF_SPLITS[split])]
        super().__init__(limit_rows(rows, limit), split)

    def conversation(self, row: dict[str, Any]) -> dict[str, Any]:
        return mc_conversation(row["question"], row["choices"], row["answer"])
