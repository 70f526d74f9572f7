"""CORE scored as the reference evaluator (nanochat core_eval) scores it.

1. Rendered prompts and scored spans of real items of each task type, pinned as text.
2. An independent re-implementation of the reference algorithm, written from its description
   (issue 19), must agree item by item with chatpipe.evals.core on the shared task files.

Both use a byte-level tokenizer (the spans read as text) and a bigram model fitted on the task
text, so correctness varies from item to item and near-ties are rare. The model is position-wise
(no attention), so padded and unpadded forwards give identical logits.
Run: python -m pytest tests/test_core_reference.py -q
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from chatpipe.evals.core import encode_item, load_core_config, read_task_rows, render_prompts, score_items, task_file

SHARED_CORE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "core"
pytestmark = pytest.mark.skipif(not SHARED_CORE.is_dir(), reason=f"{SHARED_CORE} not present")
BOS = 256


class ByteTokenizer:
    bos_id = BOS

    def encode(self, text: str, prepend: int | None = None) -> list[int]:
        return ([prepend] if prepend is not None else []) + list(text.encode("utf-8"))


class Bigram(nn.Module):
    """logits[next | current] = log(count + 1) from a text sample."""

    def __init__(self, texts: list[str]) -> None:
        super().__init__()
        counts = torch.ones(257, 257)
        for text in texts:
            ids = [BOS, *text.encode("utf-8")]
            for a, b in zip(ids, ids[1:]):
                counts[a, b] += 1
        self.table = nn.Parameter(counts.log(), requires_grad=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


def config(label: str):
    return next(t for t in load_core_config() if t.label == label)


def spans(label: str, index: int) -> tuple[list[tuple[str, str]], list[str]]:
    task = config(label)
    rows = read_task_rows(task_file(SHARED_CORE, task), task)
    prompts = render_prompts(task, rows, index)
    enc = encode_item(ByteTokenizer(), task.type, prompts, 2048)
    return prompts, [bytes(t[s:e]).decode() for t, s, e in enc]


# --------------------------------------------------------------------------- pinned items


def test_multiple_choice_copa_scores_from_where_the_options_differ() -> None:
    prompts, scored = spans("copa", 0)
    assert prompts == [
        ("The man turned on the faucet, therefore ", "the toilet filled with water."),
        ("The man turned on the faucet, therefore ", "water flowed from the spout."),
    ]
    assert scored == ["the toilet filled with water.", "water flowed from the spout."]


def test_multiple_choice_arc_easy_demos_are_the_reference_draw() -> None:
    task = config("arc_easy")
    rows = read_task_rows(task_file(SHARED_CORE, task), task)
    prompts, scored = spans("arc_easy", 0)
    # random.Random(1234 + 0).sample([j for j in range(2376) if j != 0], 10)
    demos = [1806, 479, 31, 372, 144, 344, 404, 1453, 970, 72]
    expected_prefix = "".join(
        rows[j]["query"] + "\nAnswer: " + rows[j]["choices"][rows[j]["gold"]] + "\n\n" for j in demos
    )
    assert prompts[0][0] == expected_prefix + rows[0]["query"] + "\nAnswer: "
    assert rows[0]["query"].endswith(
        "Which statement best explains why photosynthesis is the foundation of most food webs?"
    )
    assert scored == [
        "Sunlight is the source of energy for nearly all ecosystems.",
        "Most ecosystems are found on land instead of in water.",
        "Carbon dioxide is more available than other gases.",
        "The producers in all ecosystems are plants.",
    ]


def test_schema_winograd_scores_the_shared_suffix() -> None:
    prompts, scored = spans("winograd", 0)
    assert prompts == [
        ("The city councilmen refused the demonstrators a permit because the city councilmen ", "feared violence."),
        ("The city councilmen refused the demonstrators a permit because the demonstrators ", "feared violence."),
    ]
    assert scored == [" feared violence.", " feared violence."]  # the delimiter is shared too


def test_language_modeling_lambada_scores_after_the_stripped_prompt() -> None:
    prompts, scored = spans("lambada_openai", 0)
    assert prompts[0][0].endswith("his mouth curved in a confident grin, I don't care about ")
    assert prompts[0][1] == "signs"
    assert scored == [" signs"]


def test_language_modeling_fewshot_operators() -> None:
    prompts, scored = spans("bigbench_operators", 3)
    context, continuation = prompts[0]
    assert context.endswith("i op j is the remainder of the integer division of i by j.\n5 op 3 = ")
    assert context.count("\n\n") == 10 and (continuation, scored) == ("2", [" 2"])


def test_long_sequences_keep_their_last_tokens() -> None:
    task = config("arc_easy")
    rows = read_task_rows(task_file(SHARED_CORE, task), task)
    enc = encode_item(ByteTokenizer(), task.type, render_prompts(task, rows, 0), max_seq_len=100)
    assert all(len(t) == 100 for t, _, _ in enc)
    assert bytes(enc[3][0][enc[3][1] : enc[3][2]]) == b"The producers in all ecosystems are plants."


# --------------------------------------------------------------------------- independent reference


def reference_item(model: nn.Module, task, rows: list[dict], i: int, max_seq_len: int) -> bool:
    """The reference algorithm, from its description only."""
    n, k, d = len(rows), task.num_fewshot, task.continuation_delimiter
    shots = random.Random(1234 + i).sample([j for j in range(n) if j != i], k) if k else []
    row = rows[i]
    if task.type == "multiple_choice":
        demos = [rows[j]["query"] + d + rows[j]["choices"][rows[j]["gold"]] for j in shots]
        head = "\n\n".join(demos) + ("\n\n" if demos else "")
        texts = [head + row["query"] + d + c for c in row["choices"]]
    elif task.type == "schema":
        demos = [rows[j]["context_options"][rows[j]["gold"]] + d + rows[j]["continuation"] for j in shots]
        head = "\n\n".join(demos) + ("\n\n" if demos else "")
        texts = [head + c + d + row["continuation"] for c in row["context_options"]]
    else:
        demos = [rows[j]["context"].strip() + d + rows[j]["continuation"] for j in shots]
        head = "\n\n".join(demos) + ("\n\n" if demos else "")
        without = (head + row["context"].strip() + d).strip()
        texts = [head + row["context"].strip() + d + row["continuation"]]
    seqs = [[BOS, *t.encode("utf-8")] for t in texts]
    if task.type == "multiple_choice":
        p = 0
        while all(len(s) > p for s in seqs) and len({s[p] for s in seqs}) == 1:
            p += 1
        bounds = [(p, len(s)) for s in seqs]
    elif task.type == "schema":
        q = 0
        while all(len(s) > q for s in seqs) and len({s[-1 - q] for s in seqs}) == 1:
            q += 1
        bounds = [(len(s) - q, len(s)) for s in seqs]
    else:
        bounds = [(len(without.encode("utf-8")) + 1, len(seqs[0]))]
    results = []
    for s, (a, b) in zip(seqs, bounds):
        if len(s) > max_seq_len:
            cut = len(s) - max_seq_len
            # the description leaves a span cut at its start open; both keep what is left of it
            s, a, b = s[cut:], max(1, a - cut), b - cut
        logits = model(torch.tensor([s]))[0]
        target = torch.tensor(s[a:b])
        if task.type == "language_modeling":
            return bool((logits[a - 1 : b - 1].argmax(-1) == target).all())
        results.append(F.cross_entropy(logits[a - 1 : b - 1], target).item())
    return results.index(min(results)) == row["gold"]


@pytest.mark.slow
def test_item_level_correctness_matches_the_reference_on_every_shared_task() -> None:
    tasks = [t for t in load_core_config() if (SHARED_CORE / t.file).is_file()]
    assert len(tasks) == 14
    model = Bigram([(SHARED_CORE / t.file).read_text()[:200_000] for t in tasks])
    total = agree_correct = 0
    for task in tasks:
        rows = read_task_rows(task_file(SHARED_CORE, task), task)
        items = random.Random(task.label).sample(range(len(rows)), min(12, len(rows)))
        for max_seq_len in (2048, 192):  # 192 crops the few-shot prompts
            ours = score_items(model, ByteTokenizer(), task, rows, items, max_seq_len=max_seq_len)
            ref = [reference_item(model, task, rows, i, max_seq_len) for i in items]
            assert ours == ref, (task.label, max_seq_len)
            total += len(items)
            agree_correct += sum(ours)
    assert 0 < agree_correct < total  # the check is not vacuous: some right, some wrong
