"""Conversations from a JSONL file of your own; every row is validated when the task is built.

Accepted row shapes (one per line):

* ``{"messages": [{"role", "content"}, ...]}``
* ``[{"role", "content"}, ...]`` (a bare list of messages)
* instruction rows: ``{"instruction", "input"?, "output"}`` or the Alpaca seed-task form
  ``{"instruction", "instances": [{"input", "output"}, ...]}`` (first instance used)

A malformed row (bad JSON, missing role, wrong alternation) raises naming the file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chatpipe.data.tasks.base import Task, conversation_rows, hash_split, limit_rows


def to_conversation(obj: Any) -> dict[str, Any]:
    """One row in any accepted shape -> ``{"messages": [...]}``."""
    if isinstance(obj, list):
        return {"messages": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"expected an object or a list of messages, got {type(obj).__name__}")
    if "messages" in obj:
        return {"messages": obj["messages"]}
    if "instruction" in obj:
        inst = obj["instances"][0] if obj.get("instances") else obj
        prompt = obj["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
        return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": inst["output"]}]}
    raise ValueError("row has neither 'messages' nor 'instruction'")


class CustomJSON(Task):
    """A JSONL conversation file; ``split="all"`` keeps every row, else a stable 80/10/10 hash split."""

    name = "customjson"

    def __init__(self, split: str = "all", path: str | Path = "", limit: int | None = None) -> None:
        if not path:
            raise ValueError("customjson: 'path' to a .jsonl file is required")
        rows = conversation_rows(path, to_conversation)
        if not rows:
            raise ValueError(f"{path}: no rows (the file is empty or blank); expected one conversation per line")
        if split != "all":
            rows = hash_split(rows, split, lambda c: str(c["messages"][0]["content"]))
        super().__init__(limit_rows(rows, limit), split)
