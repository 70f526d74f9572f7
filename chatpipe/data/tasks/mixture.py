"""Combine tasks: a shuffled mixture (per-task epochs) and an in-order sequence."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from chatpipe.data.tasks.base import Task


class TaskMixture(Task):
    """Every example of every task (``epochs`` times each), shuffled deterministically by ``seed``.

    ``tasks`` is a list of tasks or ``(task, epochs)`` pairs. ``locate(i)`` says which task and item
    index example ``i`` came from (evaluation needs the task's own ``evaluate``).
    """

    name = "mixture"

    def __init__(self, tasks: Sequence[Task | tuple[Task, int]], seed: int = 0) -> None:
        pairs = [t if isinstance(t, tuple) else (t, 1) for t in tasks]
        self.tasks = [t for t, _ in pairs]
        index = [(k, i) for k, (task, epochs) in enumerate(pairs) for _ in range(epochs) for i in range(len(task))]
        random.Random(seed).shuffle(index)
        super().__init__(index, split=self.tasks[0].split if self.tasks else "train")

    def locate(self, i: int) -> tuple[Task, int]:
        """(task, index in that task) of mixture example ``i``."""
        k, j = self.rows[i]
        return self.tasks[k], j

    def conversation(self, row: tuple[int, int]) -> dict[str, Any]:
        k, j = row
        return self.tasks[k][j]

    def evaluate(self, conversation: dict[str, Any], completion: str) -> bool:
        raise TypeError("evaluate through the example's own task: mixture.locate(i)")


class TaskSequence(TaskMixture):
    """Tasks one after another, in order, without shuffling (a curriculum)."""

    name = "sequence"

    def __init__(self, tasks: Sequence[Task]) -> None:
        Task.__init__(
            self,
            [(k, i) for k, t in enumerate(tasks) for i in range(len(t))],
            split=tasks[0].split if tasks else "train",
        )
        self.tasks = list(tasks)
