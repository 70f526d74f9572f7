"""The Task interface every chat task implements, plus shared helpers for loading and scoring.

A task is a sized, indexable collection of conversations ``{"messages": [...]}`` whose last
message is the assistant's gold answer. ``evaluate`` says whether a model's completion is right;
``reward`` is the same as a float (RL may override it). Categorical (multiple-choice) tasks also
put ``"letters"`` in each conversation so an evaluator can restrict the answer to those tokens.

    task = build_task("gsm8k", "train", source="local", path="../shared/data/gsm8k")
    conv = task[0]
    task.evaluate(conv, "... #### 72")   # True
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from chatpipe.data.jsonl import iter_jsonl
from chatpipe.data.synthetic import split_of
from chatpipe.tokenizer import normalize_messages

SOURCES = ("synthetic", "local", "hf")
LETTERS = "ABCDEFGHIJ"


class Task:
    """A collection of conversations. Subclasses set ``rows`` and implement ``conversation``."""

    name: str = "task"
    eval_type: str = "generative"  # "generative" | "categorical"

    def __init__(self, rows: Sequence[Any], split: str) -> None:
        self.rows, self.split = rows, split

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"{self.name}: index {i} out of range (len {len(self)})")
        return self.conversation(self.rows[i])

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def conversation(self, row: Any) -> dict[str, Any]:
        """Turn one stored row into a conversation (identity by default)."""
        return row

    def evaluate(self, conversation: dict[str, Any], completion: str) -> bool:
        """Is ``completion`` (the assistant's text) the right answer to ``conversation``?"""
        raise NotImplementedError(f"{self.name} has no evaluator")

    def reward(self, conversation: dict[str, Any], completion: str) -> float:
        """RL reward: 1.0 for a right answer, else 0.0."""
        return float(self.evaluate(conversation, completion))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(split={self.split!r}, n={len(self)})"


# ---------------------------------------------------------------------- loading


def check_source(source: str, allowed: Sequence[str], task: str) -> None:
    """Raise a clear error when a task does not support ``source``."""
    if source not in allowed:
        raise ValueError(f"{task}: source = {source!r} is not supported; allowed: {', '.join(allowed)}")


def check_split(split: str, task: str, allowed: Sequence[str] = ("train", "val", "test")) -> None:
    """Raise a clear error for an unknown split name."""
    if split not in allowed:
        raise ValueError(f"{task}: split = {split!r}; allowed: {', '.join(allowed)}")


def check_split_source(split: str, source: str, task: str, sources: Sequence[str] = ("local", "hf")) -> None:
    """Both checks a task with a hub dataset makes before reading: a known split, a supported source."""
    check_split(split, task)
    check_source(source, sources, task)


def checked_rows(path: Path | str, convert: Callable[[Any], dict[str, Any]], what: str = "row") -> list[dict[str, Any]]:
    """Read a JSONL file and convert + validate every row now, so a bad row stops a stage before training.

    ``convert`` raises ValueError/KeyError/TypeError on a bad row; the error names ``path:line``.
    """
    rows = []
    for lineno, obj in iter_jsonl(path):
        try:
            rows.append(convert(obj))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}:{lineno}: malformed {what}: {e}") from None
    return rows


def conversation_rows(path: Path | str, convert: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`checked_rows` for conversations: each converted row must also be a valid chat."""

    def checked(obj: Any) -> dict[str, Any]:
        conversation = convert(obj)
        offset = int(conversation["messages"][0].get("role") == "system")  # merged into the first user turn
        for i, message in enumerate(normalize_messages(conversation), start=offset):
            if not message_text(message["content"]).strip():
                raise ValueError(f"message {i} ({message['role']}): empty text; expected a non-empty 'content'")
        return conversation

    return checked_rows(path, checked, "conversation row")


def message_text(content: str | list[dict[str, Any]]) -> str:
    """A message's text: the string, or its parts' texts joined (tool calls and outputs included)."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def hash_split(rows: Sequence[Any], split: str, key: Callable[[Any], str]) -> list[Any]:
    """Rows of a file that has no splits of its own: 80/10/10 by a stable hash of ``key(row)``."""
    return [r for r in rows if split_of(key(r)) == split]


def limit_rows(rows: Sequence[Any], limit: int | None) -> Sequence[Any]:
    """The first ``limit`` rows (all when ``limit`` is None)."""
    return rows if limit is None else rows[:limit]


def load_hf(repo: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """Rows of one split of a Hugging Face dataset config (hub or ``HF_ENDPOINT`` mirror), as dicts.

    The parquet files are fetched once into the hub cache (``chatpipe.data.hub``: retried, checksum
    verified, huggingface_hub's own layout) and read with pyarrow; later calls make no request.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from chatpipe.data import hub

    paths = hub.dataset_split_files(repo, config, split, cache_dir=hub.default_cache_dir())
    bad = [p for p in paths if p.suffix != ".parquet"]
    if bad:
        raise ValueError(f"{repo} ({config}/{split}): only parquet data files are supported, got {bad[0].name}")
    return pa.concat_tables([pq.read_table(p) for p in paths]).to_pylist()


# ---------------------------------------------------------------------- multiple choice


def render_mc(question: str, choices: Sequence[str]) -> tuple[str, list[str]]:
    """The user prompt of a multiple-choice question and the answer letters."""
    letters = list(LETTERS[: len(choices)])
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(letters, choices)]
    lines.append("\nRespond only with the letter of the correct answer.")
    return "\n".join(lines), letters


def mc_conversation(question: str, choices: Sequence[str], answer: int, **extra: Any) -> dict[str, Any]:
    """A multiple-choice conversation whose gold assistant answer is one letter."""
    if not 0 <= answer < len(choices):
        raise ValueError(f"answer index {answer} out of range for {len(choices)} choices")
    prompt, letters = render_mc(question, choices)
    return {
        "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": letters[answer]}],
        "letters": letters,
        **extra,
    }


class MultipleChoiceTask(Task):
    """Categorical task: the completion must be the gold letter."""

    eval_type = "categorical"

    def evaluate(self, conversation: dict[str, Any], completion: str) -> bool:
        return completion.strip().rstrip(".").upper() == conversation["messages"][-1]["content"]


# ---------------------------------------------------------------------- numeric answers

_ANSWER = re.compile(r"####\s*(-?[\d,]*\.?\d+)")


def final_answer(text: str) -> str | None:
    """The number after the last ``####`` marker, commas removed (``"#### 1,234"`` -> ``"1234"``)."""
    found = _ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def gold_text(conversation: dict[str, Any]) -> str:
    """Plain text of the gold assistant message (tool calls and outputs included)."""
    return message_text(conversation["messages"][-1]["content"])


class NumericAnswerTask(Task):
    """Generative task graded by the number after ``####``."""

    def evaluate(self, conversation: dict[str, Any], completion: str) -> bool:
        want, got = final_answer(gold_text(conversation)), final_answer(completion)
        if want is None or got is None:
            return False
        try:
            return float(want) == float(got)
        except ValueError:
            return False
