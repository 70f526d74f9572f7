"""Identity conversations: the assistant says its name and maker (both from params)."""

from __future__ import annotations

from chatpipe.data import synthetic
from chatpipe.data.tasks.base import Task, check_split

SPLIT_SEEDS = {"train": 0, "val": 1, "test": 2}


class Identity(Task):
    """Generated "who are you / who made you" chats; graded by exact match of the reply."""

    name = "identity"

    def __init__(
        self,
        split: str = "train",
        name: str = "chatpipe",
        maker: str = "the chatpipe authors",
        seed: int = 0,
        limit: int | None = None,
    ) -> None:
        check_split(split, self.name)
        n = limit if limit is not None else 1000
        super().__init__(synthetic.identity_conversations(seed * 10 + SPLIT_SEEDS[split], n, name, maker), split)

    def evaluate(self, conversation, completion: str) -> bool:
        return completion.strip() == conversation["messages"][-1]["content"]
