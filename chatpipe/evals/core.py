"""CORE (DCLM) evaluator: 22 in-context-learning tasks scored with a base model.

    from chatpipe.evals.core import DEFAULT_CONFIG, evaluate_core, load_core_config
    config = load_core_config(DEFAULT_CONFIG)          # chatpipe/evals/core_tasks.yaml
    out = evaluate_core(model, tokenizer, config, Path("eval_bundle"), device="cuda",
                        max_seq_len=2048, max_per_task=500, rank=rank, world_size=world_size)
    out["core"], out["tasks"]["arc_easy"]["centered"], out["skipped"]

Task types (rows are the llm-foundry jsonl formats):
- multiple_choice ``{query, choices, gold}``: one prompt per choice, same context; the choice
  with the lowest mean cross-entropy over its continuation tokens wins.
- schema ``{context_options, continuation, gold}``: one context per option, same continuation;
  lowest mean loss wins.
- language_modeling ``{context, continuation}``: correct only if greedy argmax reproduces every
  continuation token.

Scoring follows the reference evaluator (nanochat's ``core_eval``, which published CORE numbers
such as GPT-2's 0.2565 use), so the numbers are comparable:
- few-shot demos of item i: ``random.Random(1234 + i).sample([j for j in range(n) if j != i], k)``,
  each rendered with its gold answer, joined with blank lines before the item's own prompt;
- every sequence starts with BOS and is encoded whole; multiple choice scores each option from the
  first token where the options' sequences differ; schema scores the token suffix all options
  share; language modelling trims contexts and scores the tokens after the stripped prompt;
- sequences over ``max_seq_len`` keep their last ``max_seq_len`` tokens;
- multiple choice and schema pick the lowest mean loss over the span; language modelling is
  correct when every greedy prediction over the span matches.

The model is any causal ``nn.Module`` with ``model(idx[B, T]) -> logits[B, T, V]``; the options
of one item go through one right-padded forward pass (a causal model never looks at the pads
after a sequence). Tests and tools can pass ``scorer=`` to bypass the model entirely.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import yaml

from chatpipe.data.jsonl import iter_jsonl
from chatpipe.evals.metrics import centered
from chatpipe.progress import iterate

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
DEFAULT_CONFIG = Path(__file__).with_name("core_tasks.yaml")
FEWSHOT_SEED = 1234  # few-shot demos of item i use random.Random(FEWSHOT_SEED + i)
SUBSAMPLE_SEED = 1337  # which items are evaluated when max_examples < number of rows
FEWSHOT_SEP = "\n\n"

_REQUIRED_KEYS = ("label", "file", "type", "num_fewshot", "random_baseline")
_OPTIONAL_KEYS: dict[str, Any] = {"continuation_delimiter": " ", "required": False}
_ROW_FIELDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}

Prompt = tuple[str, str]  # (context, continuation)


@dataclass(frozen=True)
class TaskConfig:
    """One CORE task as configured in core_tasks.yaml."""

    label: str
    file: str
    type: str
    num_fewshot: int
    random_baseline: float
    continuation_delimiter: str = " "
    required: bool = False


class Tokenizer(Protocol):
    """The slice of the project tokenizer this module uses."""

    bos_id: int

    def encode(self, text: str, prepend: int | None = None) -> list[int]: ...


# A scorer replaces the model: (task, row, prompts) -> chosen option index (MC/schema) or
# whether the continuation was reproduced (language_modeling).
Scorer = Callable[[TaskConfig, dict, list[Prompt]], int | bool]


# --------------------------------------------------------------------------- config and data


def _task_from_dict(entry: Any, position: int, path: Path) -> TaskConfig:
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: task #{position} must be a mapping, got {type(entry).__name__}")
    label = entry.get("label", f"#{position}")
    for key in _REQUIRED_KEYS:
        if key not in entry:
            raise ValueError(f"{path}: task {label!r} is missing required key {key!r}")
    unknown = set(entry) - set(_REQUIRED_KEYS) - set(_OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"{path}: task {label!r} has unknown key(s) {sorted(unknown)}")
    if entry["type"] not in TASK_TYPES:
        raise ValueError(f"{path}: task {label!r} has key 'type' = {entry['type']!r}; allowed: {list(TASK_TYPES)}")
    shots, baseline = entry["num_fewshot"], entry["random_baseline"]
    if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
        raise ValueError(f"{path}: task {label!r} key 'num_fewshot' must be an int >= 0, got {shots!r}")
    if not isinstance(baseline, (int, float)) or not 0.0 <= baseline < 1.0:
        raise ValueError(f"{path}: task {label!r} key 'random_baseline' must be in [0, 1), got {baseline!r}")
    merged = {**_OPTIONAL_KEYS, **entry}
    return TaskConfig(
        label=str(label),
        file=str(merged["file"]),
        type=merged["type"],
        num_fewshot=shots,
        random_baseline=float(baseline),
        continuation_delimiter=str(merged["continuation_delimiter"]),
        required=bool(merged["required"]),
    )


def load_core_config(path: Path = DEFAULT_CONFIG) -> list[TaskConfig]:
    """Read and validate a CORE task list (a YAML mapping with a ``tasks:`` list)."""
    path = Path(path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), list):
        raise ValueError(f"{path}: expected a mapping with a 'tasks' list")
    tasks = [_task_from_dict(entry, i, path) for i, entry in enumerate(data["tasks"])]
    labels = [t.label for t in tasks]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ValueError(f"{path}: duplicate task label(s) {dupes}")
    return tasks


def _check_row(row: Any, task: TaskConfig) -> str | None:
    """Why ``row`` cannot be used for ``task``, or None if it is fine."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    missing = [f for f in _ROW_FIELDS[task.type] if f not in row]
    if missing:
        return f"missing field(s) {missing} needed by type {task.type!r}"
    options = row.get("choices", row.get("context_options"))
    if options is not None:
        if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
            return "options must be a list of at least 2 strings"
        gold = row["gold"]
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(options):
            return f"gold {gold!r} is not an index into {len(options)} options"
    return None


def task_file(bundle_dir: Path, task: TaskConfig) -> Path | None:
    """Where ``task``'s jsonl is: ``bundle_dir/<file>``, else the one file of that name below it
    (the published bundle files them in category folders); None when there is none."""
    direct = Path(bundle_dir) / task.file
    if direct.is_file():
        return direct
    found = sorted(Path(bundle_dir).rglob(Path(task.file).name))
    if len(found) > 1:
        raise ValueError(
            f"CORE task {task.label!r}: {len(found)} files named {task.file!r} under {bundle_dir}: "
            f"{', '.join(map(str, found))}; give the path relative to the bundle in the config"
        )
    return found[0] if found else None


def read_task_rows(path: Path, task: TaskConfig) -> list[dict]:
    """Read and validate the jsonl rows of ``task`` from its file ``path``."""
    rows = []
    for lineno, row in iter_jsonl(path):
        problem = _check_row(row, task)
        if problem:
            raise ValueError(f"{path}:{lineno}: {problem}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows for CORE task {task.label!r}")
    return rows


# --------------------------------------------------------------------------- prompts


def fewshot_indices(num_rows: int, item_index: int, k: int) -> list[int]:
    """Indices of the ``k`` demos for item ``item_index``: the reference evaluator's draw,
    ``random.Random(1234 + i).sample([j for j in range(n) if j != i], k)``."""
    k = min(k, num_rows - 1)
    if k <= 0:
        return []
    rng = random.Random(FEWSHOT_SEED + item_index)
    # random.sample only draws positions from the population's length, so sampling positions of
    # range(n - 1) and skipping over the item gives the same picks without building an O(n) list
    # per item (bigbench_qa_wikidata has 20k rows).
    return [j + (j >= item_index) for j in rng.sample(range(num_rows - 1), k)]


def _solved(task: TaskConfig, row: dict) -> str:
    """A row with its correct answer filled in, used as a few-shot demo."""
    d = task.continuation_delimiter
    if task.type == "multiple_choice":
        return row["query"] + d + row["choices"][row["gold"]]
    if task.type == "schema":
        return row["context_options"][row["gold"]] + d + row["continuation"]
    return row["context"].strip() + d + row["continuation"]


def render_prompts(task: TaskConfig, rows: list[dict], index: int) -> list[Prompt]:
    """The (context, continuation) pairs to score for item ``index``: one per option, or one for LM.

    Language modelling contexts (demos and item) are whitespace-trimmed; which tokens are scored
    is decided from the token sequences by :func:`encode_item`.
    """
    shots = fewshot_indices(len(rows), index, task.num_fewshot)
    prefix = "".join(_solved(task, rows[j]) + FEWSHOT_SEP for j in shots)
    row, d = rows[index], task.continuation_delimiter
    if task.type == "multiple_choice":
        return [(prefix + row["query"] + d, choice) for choice in row["choices"]]
    if task.type == "schema":
        return [(prefix + option + d, row["continuation"]) for option in row["context_options"]]
    return [(prefix + row["context"].strip() + d, row["continuation"])]


# --------------------------------------------------------------------------- model scoring


def _common_prefix_len(seqs: list[list[int]]) -> int:
    n = 0
    for column in zip(*seqs):
        if any(t != column[0] for t in column):
            break
        n += 1
    return n


def _common_suffix_len(seqs: list[list[int]]) -> int:
    return _common_prefix_len([s[::-1] for s in seqs])


def encode_item(
    tokenizer: Tokenizer, task_type: str, prompts: list[Prompt], max_seq_len: int
) -> list[tuple[list[int], int, int]]:
    """Each option's tokens (BOS first) and its scored span ``[start, end)``.

    - multiple_choice: the span starts where the options' full sequences stop sharing tokens;
    - schema: the span is the token suffix all options share (the continuation);
    - language_modeling: the span follows the tokens of the prompt without its continuation,
      whitespace-stripped.
    A sequence over ``max_seq_len`` keeps its last ``max_seq_len`` tokens, the span moving with it.
    """
    fulls = [tokenizer.encode(c + x, prepend=tokenizer.bos_id) for c, x in prompts]
    if task_type == "multiple_choice":
        common = _common_prefix_len(fulls)
        spans = [(common, len(f)) for f in fulls]
    elif task_type == "schema":
        common = _common_suffix_len(fulls)
        spans = [(len(f) - common, len(f)) for f in fulls]
    else:
        context, _ = prompts[0]
        without = tokenizer.encode(context.strip(), prepend=tokenizer.bos_id)
        spans = [(len(without), len(fulls[0]))]
    out = []
    for tokens, (start, end) in zip(fulls, spans):
        if end - start < 1:
            raise ValueError(f"nothing to score in prompt {prompts[0]!r} ({task_type})")
        drop = len(tokens) - max_seq_len
        if drop > 0:
            tokens, start, end = tokens[drop:], start - drop, end - drop
        # position 0 is never predicted (nothing before it)
        out.append((tokens, max(1, start), end))
    return out


def _score_item(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    task: TaskConfig,
    prompts: list[Prompt],
    device: torch.device | str,
    max_seq_len: int,
) -> int | bool:
    """Run the options of one item as one padded batch; return the chosen index or LM correctness."""
    encoded = encode_item(tokenizer, task.type, prompts, max_seq_len)
    width = max(len(tokens) for tokens, _, _ in encoded)
    idx = torch.full((len(encoded), width), tokenizer.bos_id, dtype=torch.long)
    for i, (tokens, _, _) in enumerate(encoded):
        idx[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    idx = idx.to(device)
    logits = model(idx)
    if task.type == "language_modeling":
        _, start, end = encoded[0]
        predicted = logits[0, start - 1 : end - 1].argmax(dim=-1)
        return bool(torch.equal(predicted, idx[0, start:end]))
    # Slice to the span before the softmax: full [B, T, V] log-probs would not fit
    # in memory for long prompts and big vocabularies.
    losses = [
        F.cross_entropy(logits[i, start - 1 : end - 1].float(), idx[i, start:end]).item()
        for i, (_, start, end) in enumerate(encoded)
    ]
    return min(range(len(losses)), key=losses.__getitem__)


def _is_correct(task: TaskConfig, row: dict, outcome: int | bool) -> bool:
    if task.type == "language_modeling":
        return bool(outcome)
    return int(outcome) == row["gold"]


def _item_indices(num_rows: int, max_examples: int | None) -> list[int]:
    if max_examples is None or max_examples >= num_rows:
        return list(range(num_rows))
    # Files are often grouped (jeopardy by category), so a prefix would be a biased sample.
    return sorted(random.Random(SUBSAMPLE_SEED).sample(range(num_rows), max_examples))


def score_items(
    model: torch.nn.Module | None,
    tokenizer: Tokenizer | None,
    task: TaskConfig,
    rows: list[dict],
    indices: list[int],
    *,
    device: torch.device | str = "cpu",
    max_seq_len: int = 2048,
    scorer: Scorer | None = None,
) -> list[bool]:
    """Whether each item of ``indices`` is answered correctly (few-shot demos come from all ``rows``)."""
    out = []
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    try:
        with torch.no_grad():
            for i in iterate(indices, f"CORE {task.label}", unit="item"):
                prompts = render_prompts(task, rows, i)
                if scorer is not None:
                    outcome = scorer(task, rows[i], prompts)
                else:
                    outcome = _score_item(model, tokenizer, task, prompts, device, max_seq_len)
                out.append(_is_correct(task, rows[i], outcome))
    finally:
        if model is not None:
            model.train(was_training)
    return out


def evaluate_task(
    model: torch.nn.Module | None,
    tokenizer: Tokenizer | None,
    task: TaskConfig,
    rows: list[dict],
    *,
    device: torch.device | str,
    max_seq_len: int,
    max_examples: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    scorer: Scorer | None = None,
) -> float:
    """Accuracy of ``model`` (or ``scorer``) on ``task``.

    Items (all rows, or a fixed random ``max_examples`` of them) are split over ranks by
    position ``% world_size``; with torch.distributed initialised the counts are all-reduced,
    so every rank returns the global accuracy.
    """
    if scorer is None and (model is None or tokenizer is None):
        raise ValueError("evaluate_task needs a model and tokenizer, or a scorer")
    items = _item_indices(len(rows), max_examples)
    mine = [i for pos, i in enumerate(items) if pos % world_size == rank]
    correct = sum(
        score_items(model, tokenizer, task, rows, mine, device=device, max_seq_len=max_seq_len, scorer=scorer)
    )
    total = len(mine)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        counts = torch.tensor([correct, total], dtype=torch.long, device=device)
        torch.distributed.all_reduce(counts)
        correct, total = (int(x) for x in counts.tolist())
    if total == 0:
        raise ValueError(f"CORE task {task.label!r}: no items evaluated")
    return correct / total


# --------------------------------------------------------------------------- CORE


def centered_accuracy(acc: float, random_baseline: float) -> float:
    """``(acc - b) / (1 - b)``: 0 at chance, 1 at perfect."""
    return centered(acc, random_baseline)


def evaluate_core(
    model: torch.nn.Module | None,
    tokenizer: Tokenizer | None,
    config: list[TaskConfig] | Path,
    bundle_dir: Path,
    *,
    device: torch.device | str,
    max_seq_len: int,
    max_per_task: int | None = None,
    tasks: list[str] | None = None,
    rank: int = 0,
    world_size: int = 1,
    scorer: Scorer | None = None,
) -> dict:
    """Evaluate every configured task found in ``bundle_dir``; CORE = mean centered accuracy.

    Returns ``{"tasks": {label: {"accuracy", "centered", "num_examples", "seconds"}},
    "core": float | None, "skipped": {label: reason}}``. A task whose file is absent is
    skipped with a reason, unless it is marked ``required: true``, which raises.
    ``tasks`` restricts the run to those labels.
    """
    if not isinstance(config, list):
        config = load_core_config(Path(config))
    if tasks is not None:
        known = {t.label for t in config}
        unknown = [label for label in tasks if label not in known]
        if unknown:
            raise ValueError(f"unknown CORE task label(s) {unknown}; known: {sorted(known)}")
        config = [t for t in config if t.label in set(tasks)]
    results: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    run_kw = {"device": device, "max_seq_len": max_seq_len, "rank": rank, "world_size": world_size, "scorer": scorer}
    for task in config:
        path = task_file(bundle_dir, task)
        if path is None:
            missing = Path(bundle_dir) / task.file
            if task.required:
                raise FileNotFoundError(f"CORE task {task.label!r} is required but {missing} is missing")
            skipped[task.label] = f"data file not found: {missing}"
            continue
        rows = read_task_rows(path, task)
        t0 = time.perf_counter()
        total = len(_item_indices(len(rows), max_per_task))  # every rank's share together
        acc = evaluate_task(model, tokenizer, task, rows, max_examples=max_per_task, **run_kw) if total else 0.0
        results[task.label] = {
            "accuracy": acc,
            "centered": centered_accuracy(acc, task.random_baseline),
            "num_examples": total,
            "seconds": time.perf_counter() - t0,
        }
    core = sum(r["centered"] for r in results.values()) / len(results) if results else None
    return {"tasks": results, "core": core, "skipped": skipped}
