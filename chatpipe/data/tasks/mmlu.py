"""MMLU as letter-answer multiple choice (train = ``auxiliary_train``, as nanochat uses for midtraining).

Sources: ``hf`` (cais/mmlu) or ``local``: a directory with ``<split>.jsonl`` files of
``{"question", "choices": [4], "answer": i, "subject"?}`` (the hub's own columns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatpipe.data.tasks.base import (
    MultipleChoiceTask,
    check_split_source,
    checked_rows,
    limit_rows,
    load_hf,
    mc_conversation,
)

HF_SPLITS = {"train": ("auxiliary_train", "train"), "val": ("all", "validation"), "test": ("all", "test")}


def _check(obj: dict[str, Any]) -> dict[str, Any]:
    mc_conversation(obj["question"], obj["choices"], obj["answer"])
    return obj


class MMLU(MultipleChoiceTask):
    """MMLU multiple choice."""

    name = "mmlu"

    def __init__(
        self, split: str = "train", source: str = "hf", path: str | Path = "", limit: int | None = None
    ) -> None:
        check_split_source(split, source, self.name)
        if source == "local":
            file = Path(path or "data/mmlu") / f"{split}.jsonl"
            rows = checked_rows(file, _check, "MMLU row")
        else:
            config, hf_split = HF_SPLITS[split]
            rows = load_hf("cais/mmlu", config, hf_split)
            if split == "train":  # auxiliary_train nests its columns under "train"
                rows = [r["train"] if "train" in r else r for r in rows]
        super().__init__(limit_rows(rows, limit), split)

    def conversation(self, row: dict[str, Any]) -> dict[str, Any]:
        extra = {"subject": row["subject"]} if row.get("subject") else {}
        return mc_conversation(row["question"], row["choices"], row["answer"], **extra)
