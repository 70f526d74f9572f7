"""SmolTalk-style general conversations (HuggingFaceTB/smoltalk), graded only by loss.

Sources: ``hf`` (config ``all``; val = ``test``) or ``local``: a directory with ``<split>.jsonl``
files of ``{"messages": [...]}`` rows, every row validated on load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatpipe.data.tasks.base import Task, check_split_source, conversation_rows, limit_rows, load_hf

HF_SPLITS = {"train": "train", "val": "test", "test": "test"}


def _messages(obj: dict[str, Any]) -> dict[str, Any]:
    return {"messages": obj["messages"]}


class SmolTalk(Task):
    """General chat conversations."""

    name = "smoltalk"

    def __init__(
        self, split: str = "train", source: str = "hf", path: str | Path = "", limit: int | None = None
    ) -> None:
        check_split_source(split, source, self.name)
        if source == "local":
            rows = conversation_rows(Path(path or "data/smoltalk") / f"{split}.jsonl", _messages)
        else:
            rows = load_hf("HuggingFaceTB/smoltalk", "all", HF_SPLITS[split])
        super().__init__(limit_rows(rows, limit), split)

    def conversation(self, row: dict[str, Any]) -> dict[str, Any]:
        return _messages(row)
