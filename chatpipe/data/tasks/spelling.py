"""Spelling tasks from a word list: SimpleSpelling (spell a word) and SpellingBee (count a letter).

Words: ``words="english"`` (the ``english-words`` package, web2 list, lower-case a-z only) or
``words="tinyworld"`` (:func:`chatpipe.data.synthetic.vocabulary`). Each word belongs to one split by a
stable hash; the tasks draw ``limit`` examples from that split's words with a fixed seed.
"""

from __future__ import annotations

import random
import re
from functools import cache
from typing import Any

from chatpipe.data import synthetic
from chatpipe.data.tasks.base import NumericAnswerTask, Task, check_split

WORD_LISTS = ("english", "tinyworld")


@cache
def word_list(words: str = "english") -> tuple[str, ...]:
    """Sorted lower-case words of a list (only letters a-z, 3-12 long for ``english``)."""
    if words == "tinyworld":
        return tuple(synthetic.vocabulary())
    if words != "english":
        raise ValueError(f"spelling: words = {words!r}; allowed: {', '.join(WORD_LISTS)}")
    from english_words import get_english_words_set

    found = get_english_words_set(["web2"], lower=True, alpha=True)
    return tuple(sorted(w for w in found if re.fullmatch(r"[a-z]{3,12}", w)))


def _split_words(words: str, split: str) -> list[str]:
    out = [w for w in word_list(words) if synthetic.split_of(w) == split]
    if not out:  # the tiny vocabulary is small: never leave a split empty
        out = list(word_list(words))
    return out


def _draw(words: str, split: str, n: int, seed: int, salt: str) -> list[str]:
    rng = random.Random(f"{salt}:{seed}:{split}")
    pool = _split_words(words, split)
    return [rng.choice(pool) for _ in range(n)]


class SimpleSpelling(Task):
    """``Spell the word: apple`` -> ``apple:a,p,p,l,e``."""

    name = "simplespelling"

    def __init__(self, split: str = "train", words: str = "english", seed: int = 0, limit: int | None = None) -> None:
        check_split(split, self.name)
        super().__init__(_draw(words, split, limit if limit is not None else 1000, seed, "simple"), split)

    def conversation(self, word: str) -> dict[str, Any]:
        return {
            "messages": [
                {"role": "user", "content": f"Spell the word: {word}"},
                {"role": "assistant", "content": f"{word}:{','.join(word)}"},
            ]
        }

    def evaluate(self, conversation, completion: str) -> bool:
        return completion.strip() == conversation["messages"][-1]["content"]


class SpellingBee(NumericAnswerTask):
    """``How many r are in strawberry?``: spell it out, count with the calculator, answer ``#### n``."""

    name = "spellingbee"

    def __init__(self, split: str = "train", words: str = "english", seed: int = 0, limit: int | None = None) -> None:
        check_split(split, self.name)
        n = limit if limit is not None else 1000
        rng = random.Random(f"bee-letter:{seed}:{split}")
        rows = []
        for word in _draw(words, split, n, seed, "bee"):
            # half the time a letter of the word, else any letter (answers of 0 matter too)
            letter = rng.choice(word) if rng.random() < 0.5 else rng.choice("abcdefghijklmnopqrstuvwxyz")
            rows.append((word, letter))
        super().__init__(rows, split)

    def conversation(self, row: tuple[str, str]) -> dict[str, Any]:
        word, letter = row
        count = word.count(letter)
        parts = [
            {"type": "text", "text": f"{word} is spelled {','.join(word)}. Let me count the {letter}'s."},
            {"type": "python", "text": f'"{word}".count("{letter}")'},
            {"type": "python_output", "text": str(count)},
            {"type": "text", "text": f"There are {count} {letter}'s in {word}.\n#### {count}"},
        ]
        return {
            "messages": [
                {"role": "user", "content": f"How many {letter} are in the word {word}?"},
                {"role": "assistant", "content": parts},
            ]
        }
