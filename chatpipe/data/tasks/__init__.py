"""Chat tasks: conversations for midtraining, SFT, RL and evals (one module per task).

    from chatpipe.data.tasks import build_task, TaskMixture
    gsm = build_task("gsm8k", "train", source="local", path="../shared/data/gsm8k", limit=500)
    mix = TaskMixture([(build_task("tinyworld_chat", "train"), 1), (gsm, 2)], seed=0)

Names (``TASK_NAMES``): tinyworld_chat, tinyworld_arith, tinyworld_gsm, tinyworld_mc, smoltalk, mmlu,
arc_easy, arc_challenge, gsm8k, identity, simplespelling, spellingbee, customjson, humaneval.
"""

from __future__ import annotations

import inspect
from typing import Any

from chatpipe.data.tasks.arc import ARC
from chatpipe.data.tasks.base import Task
from chatpipe.data.tasks.customjson import CustomJSON
from chatpipe.data.tasks.gsm8k import GSM8K
from chatpipe.data.tasks.humaneval import HumanEval
from chatpipe.data.tasks.identity import Identity
from chatpipe.data.tasks.mixture import TaskMixture, TaskSequence
from chatpipe.data.tasks.mmlu import MMLU
from chatpipe.data.tasks.smoltalk import SmolTalk
from chatpipe.data.tasks.spelling import SimpleSpelling, SpellingBee
from chatpipe.data.tasks.tinyworld import TinyArithmetic, TinyChat, TinyGSM, TinyMC

_BUILDERS: dict[str, Any] = {
    "tinyworld_chat": TinyChat,
    "tinyworld_arith": TinyArithmetic,
    "tinyworld_gsm": TinyGSM,
    "tinyworld_mc": TinyMC,
    "smoltalk": SmolTalk,
    "mmlu": MMLU,
    "arc_easy": lambda **kw: ARC(subset="easy", **kw),
    "arc_challenge": lambda **kw: ARC(subset="challenge", **kw),
    "gsm8k": GSM8K,
    "identity": Identity,
    "simplespelling": SimpleSpelling,
    "spellingbee": SpellingBee,
    "customjson": CustomJSON,
    "humaneval": HumanEval,
}
TASK_NAMES = tuple(_BUILDERS)
_ACCEPTS = {
    name: set(inspect.signature(ARC if name.startswith("arc_") else b).parameters) - {"subset"}
    for name, b in _BUILDERS.items()
}


def build_task(name: str, split: str, **kw: Any) -> Task:
    """Build task ``name`` for ``split``; keyword arguments set to None or "" are left at their defaults.

    ``model_name`` / ``model_maker`` set the identity task's name and maker. An argument the task
    does not take raises ``ValueError`` naming what it does take.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASK_NAMES)}")
    if name == "identity":
        kw["name"], kw["maker"] = kw.pop("model_name", None), kw.pop("model_maker", None)
    else:
        kw.pop("model_name", None), kw.pop("model_maker", None)
    kw = {k: v for k, v in kw.items() if v is not None and v != ""}
    unknown = set(kw) - _ACCEPTS[name]
    if unknown:
        takes = sorted(_ACCEPTS[name] - {"split"})
        raise ValueError(f"task {name!r} does not take {sorted(unknown)}; it takes {takes}")
    return _BUILDERS[name](split=split, **kw)


def build_mixture(spec, split: str, *, seed: int = 0, cap: int | None = None, **task_kw: Any) -> TaskMixture:
    """A :class:`TaskMixture` from params entries (objects or dicts with task, limit, epochs, source, path, words).

    ``cap`` bounds every task's examples and drops epochs (for val mixtures); ``task_kw`` (e.g.
    ``model_name``) go to every task that takes them.
    """
    parts = []
    for item in spec:
        item = item if isinstance(item, dict) else item.model_dump()
        limit = item.get("limit")
        if cap is not None:
            limit = cap if limit is None else min(limit, cap)
        kw = {k: item.get(k) for k in ("source", "path", "words")}
        extra = {k: v for k, v in task_kw.items() if k in _ACCEPTS[item["task"]] or k.startswith("model_")}
        task = build_task(item["task"], split, limit=limit, **kw, **extra)
        parts.append((task, 1 if cap is not None else item.get("epochs", 1)))
    return TaskMixture(parts, seed=seed)


__all__ = ["TASK_NAMES", "Task", "TaskMixture", "TaskSequence", "build_mixture", "build_task"]
