"""Conversations from a JSONL file of your own; every row is validated when the task is built.

Accepted row shapes (one per line):

* ``{"messages": [{"role", "content"}, ...]}``
* ``[{"role", "content"}, ...]`` (a bare list of messages)
* instruction rows: ``{"instruction", "input"?, "output"}`` or the Alpaca seed-task form
  ``{"instruction", "instances": [{"input", "output"}, ...]}`` (first instance used)
* problem rows, for RL: ``{"prompt", "answer", ...}`` (one user turn, the answer as the gold reply;
  any other fields are kept for your verifier, ``rl.reward.verifier_file``)

A malformed row (bad JSON, missing role, wrong alternation, empty text) raises naming the file and
line. Each conversation keeps its row as written under ``"problem"`` and its position among the
file's rows under ``"index"`` (what a verifier is given, and what its errors name).
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
    if "prompt" in obj and "answer" in obj:
        answer = obj["answer"]
        if not isinstance(answer, str):  # a number is fine: its text is the gold reply
            answer = str(answer)
        return {"messages": [{"role": "user", "content": obj["prompt"]}, {"role": "assistant", "content": answer}]}
    raise ValueError("row has neither 'messages', 'instruction' nor 'prompt' and 'answer'")


class CustomJSON(Task):
    """A JSONL conversation file; ``split="all"`` keeps every row, else a stable 80/10/10 hash split."""

    name = "customjson"

    def __init__(self, split: str = "all", path: str | Path = "", limit: int | None = None) -> None:
        if not path:
            raise ValueError("customjson: 'path' to a .jsonl file is required")
        rows = conversation_rows(path, lambda obj: {**to_conversation(obj), "problem": obj})
        if not rows:
            raise ValueError(f"{path}: no rows (the file is empty or blank); expected one conversation per line")
        rows = [{**row, "index": i} for i, row in enumerate(rows)]
        if split != "all":
            rows = hash_split(rows, split, lambda c: str(c["messages"][0]["content"]))
        super().__init__(limit_rows(rows, limit), split)
