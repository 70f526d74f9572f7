"""ChatCORE: how well a chat model answers ARC, MMLU, GSM8K, HumanEval and SpellingBee.

    from chatpipe.evals.chatcore import evaluate_chatcore
    from chatpipe.settings import EvalSettings, load_section
    from chatpipe.data.tasks import build_task
    tasks = {"ARC-Easy": build_task("arc_easy", "test"), "GSM8K": build_task("tinyworld_gsm", "test")}
    out = evaluate_chatcore(model, tokenizer, tasks, load_section(EvalSettings), device="cpu")
    out["chatcore"], out["tasks"]["tinyworld_gsm"]["accuracy"]   # a stand-in keeps its own name

Two ways to score a task (``task.eval_type``):
- categorical: one forward pass over the prompt (rendered up to ``<|assistant_start|>``); the
  answer is the letter among ``conversation["letters"]`` whose token has the highest logit at
  the last position. Only the letters are compared, so a model that has not learned to stop
  after one token still gets a fair score.
- generative: ``num_samples`` completions from :class:`chatpipe.inference.engine.Engine` (tool calls run),
  each checked by ``task.evaluate``; the per-item score is the unbiased pass@k over them.

ChatCORE = mean over the tasks given of the centered accuracy (baselines in
:data:`chatpipe.evals.metrics.CHATCORE_BASELINES`). A result is named after its benchmark only when
that benchmark's own task ran (:func:`chatpipe.evals.metrics.chatcore_label`). Items are split over ranks (position % world);
with torch.distributed initialised the sums are all-reduced, so every rank sees the totals.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from chatpipe.evals.metrics import CHATCORE_BASELINES, centered, chatcore, chatcore_label, pass_at_k
from chatpipe.inference.engine import Engine
from chatpipe.progress import iterate


class Task(Protocol):
    """The slice of ``chatpipe.data.tasks.base.Task`` this module uses."""

    name: str  # the chatpipe.data.tasks name: says whether the benchmark itself or a stand-in ran
    eval_type: str

    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> dict: ...
    def evaluate(self, conversation: dict, completion: str) -> bool: ...


class ChatcoreSettings(Protocol):
    """What ChatCORE reads of its settings: the eval stage passes its ``eval`` section
    (chatpipe.settings.EvalSettings) whole; any object with these attributes will do."""

    max_per_task: int  # items per task (0: all)
    generative_max_per_task: int  # items per generative task (0: max_per_task): sampling costs more
    num_samples: int  # generative tasks: completions per item
    pass_k: int  # an item's score: pass@k over its completions
    max_new_tokens: int
    temperature: float
    top_k: int  # 0: no top-k filtering
    seed: int


def letter_token_ids(tokenizer: Any, letters: list[str]) -> list[int]:
    """The single token id of each answer letter; raises if a letter is not one token."""
    ids = []
    for letter in letters:
        tokens = tokenizer.encode(letter)
        if len(tokens) != 1:
            raise ValueError(
                f"answer letter {letter!r} encodes to {len(tokens)} tokens {tokens}; "
                "categorical scoring needs one token per letter"
            )
        ids.append(tokens[0])
    return ids


def _fit(prompt: list[int], model: torch.nn.Module, room: int = 0) -> list[int]:
    """Keep the last tokens of ``prompt`` that fit the model's positions, leaving ``room`` to generate.

    The question and answer format sit at the end of a prompt, so dropping from the left loses least.
    """
    table = getattr(model, "cos", None)  # GPT's rotary table bounds the positions it can take
    limit = table.size(2) - room if isinstance(table, torch.Tensor) else None
    return prompt if limit is None or len(prompt) <= limit else prompt[-limit:]


@torch.no_grad()
def choose_letters(
    model: torch.nn.Module, tokenizer: Any, conversations: list[dict], device: torch.device | str
) -> list[str]:
    """For each conversation, the answer letter with the highest next-token logit after the prompt."""
    prompts = [_fit(tokenizer.render_for_completion(conv), model) for conv in conversations]
    width = max(len(p) for p in prompts)
    idx = torch.full((len(prompts), width), tokenizer.bos_id, dtype=torch.long)
    for i, p in enumerate(prompts):  # right padding: a causal model never looks past position len-1
        idx[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    logits = model(idx.to(device))
    out = []
    for i, (conv, p) in enumerate(zip(conversations, prompts)):
        letters = conv["letters"]
        ids = torch.tensor(letter_token_ids(tokenizer, letters), device=logits.device)
        out.append(letters[int(logits[i, len(p) - 1, ids].argmax())])
    return out


def generate_completions(
    engine: Engine, tokenizer: Any, conversations: list[dict], sampling: ChatcoreSettings, *, seed: int
) -> list[list[str]]:
    """``sampling.num_samples`` assistant completions per conversation (text after the prompt, stop
    token removed), sampled as ``sampling`` says from ``seed``."""
    room = sampling.max_new_tokens
    prompts = [_fit(tokenizer.render_for_completion(c), engine.model, room=room) for c in conversations]
    generated = engine.generate_many(
        prompts,
        num_samples=sampling.num_samples,
        max_tokens=room,
        temperature=sampling.temperature,
        top_k=sampling.top_k,  # the engine reads 0 as no top-k
        seed=seed,
    )
    stops = engine.stop_ids()
    out = []
    for prompt, (seqs, _) in zip(prompts, generated):
        completions = []
        for seq in seqs:
            new = seq[len(prompt) :]
            if new and new[-1] in stops:
                new = new[:-1]
            completions.append(tokenizer.decode(new))
        out.append(completions)
    return out


def _item_indices(n: int, max_examples: int | None) -> list[int]:
    # Evenly spaced rather than a prefix: task files are often sorted by subject or difficulty.
    if not max_examples or max_examples >= n:
        return list(range(n))
    return sorted({round(i * n / max_examples) for i in range(max_examples)})


def _all_reduce(values: list[float], device: torch.device | str) -> list[float]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor(values, dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        return t.tolist()
    return values


def evaluate_task(
    model: torch.nn.Module,
    tokenizer: Any,
    task: Task,
    *,
    device: torch.device | str,
    max_examples: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int = 8,
    sampling: ChatcoreSettings | None = None,
) -> dict[str, float]:
    """Accuracy (categorical) or mean pass@k (generative: sampled as ``sampling`` says, which only a
    generative task needs) of ``model`` on ``task``.

    Returns ``{"accuracy", "num_examples", "seconds"}`` with totals over all ranks.
    """
    if task.eval_type not in ("categorical", "generative"):
        raise ValueError(f"task eval_type = {task.eval_type!r}; allowed: 'categorical', 'generative'")
    if task.eval_type == "generative" and sampling is None:
        raise ValueError(f"generative task {task.name!r} needs sampling settings (eval: num_samples, pass_k, ...)")
    n, k = (sampling.num_samples, sampling.pass_k) if sampling else (1, 1)
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= pass_k <= num_samples, got pass_k={k}, num_samples={n}")
    t0 = time.perf_counter()
    items = _item_indices(len(task), max_examples)
    mine = [i for pos, i in enumerate(items) if pos % world_size == rank]
    was_training = model.training
    model.eval()
    score = 0.0
    try:
        if task.eval_type == "categorical":
            for start in range(0, len(mine), batch_size):
                convs = [task[i] for i in mine[start : start + batch_size]]
                for conv, letter in zip(convs, choose_letters(model, tokenizer, convs, device)):
                    score += bool(task.evaluate(conv, letter))
        else:
            convs = [task[i] for i in mine]
            seed = sampling.seed + 1_000_003 * rank
            per_item = generate_completions(Engine(model, tokenizer), tokenizer, convs, sampling, seed=seed)
            for conv, completions in zip(convs, per_item):
                correct = sum(bool(task.evaluate(conv, c)) for c in completions)
                score += pass_at_k(n, correct, k)
    finally:
        model.train(was_training)
    score, total = _all_reduce([score, float(len(mine))], device)
    if total == 0:
        raise ValueError("ChatCORE task has no items to evaluate")
    return {"accuracy": score / total, "num_examples": int(total), "seconds": time.perf_counter() - t0}


def evaluate_chatcore(
    model: torch.nn.Module,
    tokenizer: Any,
    tasks: dict[str, Task],
    cfg: ChatcoreSettings,
    *,
    device: torch.device | str,
    rank: int = 0,
    world_size: int = 1,
) -> dict:
    """Evaluate every task (ChatCORE task name -> Task run in its place); ChatCORE = mean centered accuracy.

    ``cfg`` (the ``eval`` settings) caps the items per task, generative tasks separately (sampling
    costs far more than one forward pass), and says how they sample.
    Returns ``{"tasks": {label: {"accuracy", "centered", "num_examples", "seconds"}}, "chatcore"}``,
    labelled by :func:`chatcore_label`: a stand-in (``tinyworld_gsm`` for ``GSM8K``) goes under its own
    name and records ``"stands_in_for"``; a task that runs model-written code (HumanEval) also gets
    ``"sandbox"``, the sandbox's mode.
    Items are split over ``world_size`` ranks (:func:`evaluate_task`).
    """
    unknown = [name for name in tasks if name not in CHATCORE_BASELINES]
    if unknown:
        raise ValueError(f"unknown ChatCORE task(s) {unknown}; known: {sorted(CHATCORE_BASELINES)}")
    labels = {name: chatcore_label(name, task.name) for name, task in tasks.items()}
    if len(set(labels.values())) < len(labels):  # one task standing in twice would overwrite its own result
        raise ValueError(f"two ChatCORE tasks would report under one name: {labels}")
    results, accuracies = {}, {}
    where = {"device": device, "rank": rank, "world_size": world_size}
    for name, task in iterate(tasks.items(), "chatcore", total=len(tasks), unit="task"):  # a line every 30 s
        limit = (task.eval_type == "generative" and cfg.generative_max_per_task) or cfg.max_per_task
        r = evaluate_task(model, tokenizer, task, **where, max_examples=limit, sampling=cfg)
        r["centered"] = centered(r["accuracy"], CHATCORE_BASELINES[name])
        if hasattr(task, "sandbox"):  # a task running model-written code: say in which sandbox it ran
            r["sandbox"] = task.sandbox
        if labels[name] != name:
            r["stands_in_for"] = name
        results[labels[name]], accuracies[name] = r, r["accuracy"]
    score = chatcore(accuracies) if results else None
    return {"tasks": results, "chatcore": score}
