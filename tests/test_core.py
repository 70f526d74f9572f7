"""Tests for chatpipe/evals/core.py: config and data validation, prompts, scoring and the CORE mean.

Uses the 14 real CORE task files in ``<repo>/../shared/data/core`` (skipped if absent) with
scripted scorers, plus tiny torch models for the real model path.
Run: python -m pytest tests/test_core.py -q
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from chatpipe.evals.core import (
    DEFAULT_CONFIG,
    TaskConfig,
    encode_item,
    evaluate_core,
    evaluate_task,
    fewshot_indices,
    load_core_config,
    read_task_rows,
    render_prompts,
    task_file,
)

SHARED_CORE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "core"
needs_shared = pytest.mark.skipif(not SHARED_CORE.is_dir(), reason=f"{SHARED_CORE} not present")


def gold_scorer(task: TaskConfig, item: dict, prompts: list) -> int | bool:
    """Always answers correctly."""
    return True if task.type == "language_modeling" else item["gold"]


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS is 256."""

    bos_id = 256

    def encode(self, text: str, prepend: int | None = None) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([prepend] if prepend is not None else []) + ids


class TinyLM(nn.Module):
    """Random embedding + linear head: [B, T] -> [B, T, V]."""

    def __init__(self, vocab: int = 257, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx))


class CopyLM(nn.Module):
    """Predicts that the next token repeats the current one (confidently)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(idx, 257).float() * 10.0


def _task(type_: str, **kw: object) -> TaskConfig:
    base = dict(label=f"t_{type_}", file=f"{type_}.jsonl", type=type_, num_fewshot=0, random_baseline=0.0)
    return TaskConfig(**{**base, **kw})  # type: ignore[arg-type]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# --------------------------------------------------------------------------- config


def test_default_config_has_the_22_tasks_with_spec_baselines() -> None:
    tasks = load_core_config(DEFAULT_CONFIG)
    assert len(tasks) == 22
    by_label = {t.label: t for t in tasks}
    assert len(by_label) == 22
    assert by_label["hellaswag_zeroshot"].file == by_label["hellaswag"].file == "hellaswag.jsonl"
    assert (by_label["hellaswag_zeroshot"].num_fewshot, by_label["hellaswag"].num_fewshot) == (0, 10)
    expected = {
        "jeopardy": (10, 0.0),
        "arc_easy": (10, 0.25),
        "copa": (0, 0.5),
        "piqa": (10, 0.5),
        "boolq": (10, 0.62),
        "agi_eval_lsat_ar": (3, 0.25),
        "winogrande": (0, 0.5),
        "coqa": (0, 0.0),
        "openbook_qa": (0, 0.25),
    }
    for label, (shots, baseline) in expected.items():
        assert (by_label[label].num_fewshot, by_label[label].random_baseline) == (shots, baseline)
    assert by_label["winograd"].type == "schema" and by_label["lambada_openai"].type == "language_modeling"


def test_config_with_unknown_type_names_task_key_and_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tasks:\n  - {label: mytask, file: a.jsonl, type: cloze, num_fewshot: 0, random_baseline: 0}\n")
    with pytest.raises(ValueError) as e:
        load_core_config(cfg)
    msg = str(e.value)
    assert "mytask" in msg and "'type'" in msg and "cloze" in msg and "multiple_choice" in msg


def test_config_missing_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tasks:\n  - {label: mytask, file: a.jsonl, type: schema, random_baseline: 0.5}\n")
    with pytest.raises(ValueError, match="mytask.*num_fewshot"):
        load_core_config(cfg)


# --------------------------------------------------------------------------- data


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "multiple_choice.jsonl"
    path.write_text('{"query": "q", "choices": ["a", "b"], "gold": 0}\n\n{"query": oops}\n')
    with pytest.raises(ValueError, match=rf"{path}:3: bad JSON"):
        read_task_rows(tmp_path / "multiple_choice.jsonl", _task("multiple_choice"))


def test_row_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    _write_jsonl(
        tmp_path / "schema.jsonl",
        [{"context_options": ["a", "b"], "continuation": "c", "gold": 1}, {"context_options": ["a", "b"], "gold": 0}],
    )
    with pytest.raises(ValueError, match=r"schema.jsonl:2: missing field\(s\) \['continuation'\]"):
        read_task_rows(tmp_path / "schema.jsonl", _task("schema"))
    _write_jsonl(tmp_path / "multiple_choice.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 2}])
    with pytest.raises(ValueError, match=r"multiple_choice.jsonl:1: gold 2"):
        read_task_rows(tmp_path / "multiple_choice.jsonl", _task("multiple_choice"))


def test_missing_file_names_path_and_task(tmp_path: Path) -> None:
    run = {"device": "cpu", "max_seq_len": 64}
    out = evaluate_core(None, None, [_task("schema")], tmp_path, **run)
    assert out["skipped"] == {"t_schema": f"data file not found: {tmp_path / 'schema.jsonl'}"}
    with pytest.raises(FileNotFoundError, match=rf"t_schema.*{tmp_path / 'schema.jsonl'}"):
        evaluate_core(None, None, [_task("schema", required=True)], tmp_path, **run)


# --------------------------------------------------------------------------- prompts


def test_fewshot_never_includes_the_item_and_is_deterministic() -> None:
    for n in (2, 5, 11, 1000):
        for i in range(min(n, 200)):
            shots = fewshot_indices(n, i, 10)
            assert i not in shots
            assert len(shots) == len(set(shots)) == min(10, n - 1)
            assert shots == fewshot_indices(n, i, 10)
    assert fewshot_indices(50, 3, 5) != fewshot_indices(50, 4, 5)  # seeded per item


def test_rendered_prompts_use_other_rows_as_demos() -> None:
    rows = [{"query": f"Q{i}?", "choices": [f"wrong{i}", f"right{i}"], "gold": 1} for i in range(30)]
    task = _task("multiple_choice", num_fewshot=3, continuation_delimiter="\nAnswer: ")
    for i in range(30):
        prompts = render_prompts(task, rows, i)
        assert [c for _, c in prompts] == [f"wrong{i}", f"right{i}"]
        assert len({ctx for ctx, _ in prompts}) == 1  # MC: same context for every choice
        context = prompts[0][0]
        demos = context.split("\n\n")[:-1]
        assert len(demos) == 3 and context.endswith(f"Q{i}?\nAnswer: ")
        for demo in demos:
            j = int(demo.split("?")[0][1:])
            assert j != i and demo == f"Q{j}?\nAnswer: right{j}"


def test_schema_and_lm_prompt_shapes() -> None:
    schema = [{"context_options": ["A sat", "B sat"], "continuation": "down.", "gold": 0}]
    assert render_prompts(_task("schema"), schema, 0) == [("A sat ", "down."), ("B sat ", "down.")]
    lm = [{"context": "2+2=", "continuation": "4"}, {"context": "1+1=", "continuation": "2"}]
    assert render_prompts(_task("language_modeling", num_fewshot=1), lm, 0) == [("1+1= 2\n\n2+2= ", "4")]


def test_encode_item_spans_by_task_type_and_left_truncation() -> None:
    tok = ByteTokenizer()
    # multiple choice: the span starts where the options' sequences first differ
    enc = encode_item(tok, "multiple_choice", [("Q: ", "the cat"), ("Q: ", "the dog")], max_seq_len=100)
    assert [bytes(t[s:e]) for t, s, e in enc] == [b"cat", b"dog"]
    assert enc[0][0] == [256, *b"Q: the cat"]
    # schema: the span is the whole shared token suffix (here more than the continuation)
    enc = encode_item(tok, "schema", [("A sat", " down."), ("Bo sat", " down.")], max_seq_len=100)
    assert [bytes(t[s:e]) for t, s, e in enc] == [b" sat down.", b" sat down."]
    # language modelling: after the stripped prompt, so the delimiter's space is scored
    ((t, s, e),) = encode_item(tok, "language_modeling", [("2+2= ", "4")], max_seq_len=100)
    assert bytes(t[s:e]) == b" 4"
    # over-long: keep the last max_seq_len tokens, the span moves with them
    ((t, s, e),) = encode_item(tok, "language_modeling", [("abcdefgh ", "xy")], max_seq_len=5)
    assert t == list(b"gh xy") and bytes(t[s:e]) == b" xy"


# --------------------------------------------------------------------------- real task files


@needs_shared
def test_gold_scorer_gets_every_shared_task_right() -> None:
    out = evaluate_core(None, None, load_core_config(), SHARED_CORE, device="cpu", max_seq_len=2048, scorer=gold_scorer)
    assert len(out["tasks"]) == 14 and len(out["skipped"]) == 8
    assert "hellaswag" in out["skipped"] and "not found" in out["skipped"]["hellaswag"]
    files = {t.label: t.file for t in load_core_config()}
    for label, res in out["tasks"].items():
        assert res["accuracy"] == 1.0 and res["centered"] == 1.0, label
        lines = (SHARED_CORE / files[label]).read_text().splitlines()
        assert res["num_examples"] == sum(1 for line in lines if line.strip()), label
    assert out["core"] == 1.0


@needs_shared
def test_random_scorer_lands_near_the_random_baseline() -> None:
    # Uniform guessing has accuracy 1/len(choices) == the configured baseline. With n items the
    # standard error is sqrt(b(1-b)/n); 4 of them (~1 in 16,000 for a fresh seed) bounds it.
    rng = random.Random(0)

    def guess(task: TaskConfig, item: dict, prompts: list) -> int:
        return rng.randrange(len(prompts))

    config = {t.label: t for t in load_core_config()}
    for label in ("arc_easy", "arc_challenge", "commonsense_qa", "piqa", "openbook_qa", "copa", "winograd"):
        task = config[label]
        rows = read_task_rows(task_file(SHARED_CORE, task), task)
        n = min(len(rows), 1000)
        acc = evaluate_task(None, None, task, rows, device="cpu", max_seq_len=2048, max_examples=n, scorer=guess)
        b = task.random_baseline
        assert abs(acc - b) <= 4 * math.sqrt(b * (1 - b) / n), (label, acc, b)


@needs_shared
def test_real_rows_render_without_the_item_in_its_own_demos() -> None:
    task = next(t for t in load_core_config() if t.label == "arc_easy")
    rows = read_task_rows(task_file(SHARED_CORE, task), task)
    for i in range(0, len(rows), 97):
        demos = render_prompts(task, rows, i)[0][0].split("\n\n")[:-1]
        assert len(demos) == 10
        own = rows[i]["query"] + task.continuation_delimiter + rows[i]["choices"][rows[i]["gold"]]
        assert own not in demos


# --------------------------------------------------------------------------- CORE arithmetic


def test_core_mean_and_centering_match_hand_values(tmp_path: Path) -> None:
    _write_jsonl(tmp_path / "mc.jsonl", [{"query": f"q{i}", "choices": list("abcd"), "gold": 0} for i in range(4)])
    _write_jsonl(tmp_path / "lm.jsonl", [{"context": f"c{i}", "continuation": "x"} for i in range(5)])
    cfg = tmp_path / "core.yaml"
    cfg.write_text(
        "tasks:\n"
        "  - {label: mc, file: mc.jsonl, type: multiple_choice, num_fewshot: 2, random_baseline: 0.25}\n"
        "  - {label: lm, file: lm.jsonl, type: language_modeling, num_fewshot: 0, random_baseline: 0.0}\n"
        "  - {label: gone, file: gone.jsonl, type: schema, num_fewshot: 0, random_baseline: 0.5}\n"
    )

    def scripted(task: TaskConfig, item: dict, prompts: list) -> int | bool:
        i = int(item.get("query", item.get("context"))[1:])
        return i < 2 if task.type == "language_modeling" else (0 if i < 2 else 3)

    out = evaluate_core(None, None, Path(cfg), tmp_path, device="cpu", max_seq_len=64, scorer=scripted)
    mc, lm = out["tasks"]["mc"], out["tasks"]["lm"]
    assert (mc["accuracy"], mc["num_examples"]) == (0.5, 4)
    assert mc["centered"] == pytest.approx((0.5 - 0.25) / 0.75)
    assert (lm["accuracy"], lm["centered"], lm["num_examples"]) == (0.4, 0.4, 5)
    assert out["core"] == pytest.approx(((0.5 - 0.25) / 0.75 + 0.4) / 2)
    assert set(out["skipped"]) == {"gone"}
    only = evaluate_core(None, None, Path(cfg), tmp_path, device="cpu", max_seq_len=64, scorer=scripted, tasks=["lm"])
    assert list(only["tasks"]) == ["lm"] and only["core"] == pytest.approx(0.4)

    cfg.write_text(cfg.read_text().replace("random_baseline: 0.5}", "random_baseline: 0.5, required: true}"))
    with pytest.raises(FileNotFoundError, match="gone.*required"):
        evaluate_core(None, None, Path(cfg), tmp_path, device="cpu", max_seq_len=64, scorer=scripted)


def test_items_are_split_across_ranks() -> None:
    rows = [{"context": f"c{i}", "continuation": "x"} for i in range(10)]
    seen: list[list[int]] = []
    for rank in range(3):
        mine: list[int] = []
        evaluate_task(
            None,
            None,
            _task("language_modeling"),
            rows,
            device="cpu",
            max_seq_len=64,
            rank=rank,
            world_size=3,
            scorer=lambda t, item, p, mine=mine: mine.append(int(item["context"][1:])) or True,
        )
        seen.append(mine)
    assert sorted(sum(seen, [])) == list(range(10))
    assert seen[0] == [0, 3, 6, 9]


# --------------------------------------------------------------------------- model path


@needs_shared
def test_tiny_random_model_runs_every_task_type() -> None:
    torch.manual_seed(0)
    model, tok = TinyLM(), ByteTokenizer()
    config = {t.label: t for t in load_core_config()}
    for label in ("copa", "winograd", "lambada_openai", "arc_easy"):
        rows = read_task_rows(task_file(SHARED_CORE, config[label]), config[label])
        acc = evaluate_task(model, tok, config[label], rows, device="cpu", max_seq_len=256, max_examples=5)
        assert 0.0 <= acc <= 1.0
    assert model.training  # mode restored


def test_copy_model_scores_are_exact_with_padding_and_truncation() -> None:
    # CopyLM predicts "same as the current byte". For MC it prefers the choice made of repeats,
    # even when that choice is longer (so the other row is padded); for LM it reproduces a
    # continuation of spaces after the " " delimiter but nothing else.
    tok, model = ByteTokenizer(), CopyLM()
    mc_rows = [
        {"query": "pick", "choices": ["xyz", "bbbbbbbb"], "gold": 1},
        {"query": "pick", "choices": ["cccccc", "cdefgh"], "gold": 0},
        {"query": "pick", "choices": ["zz", "qrst"], "gold": 1},  # copy model picks "zz": wrong
    ]
    acc = evaluate_task(model, tok, _task("multiple_choice"), mc_rows, device="cpu", max_seq_len=12)
    assert acc == pytest.approx(2 / 3)
    lm_rows = [{"context": "aaa", "continuation": "aa"}, {"context": "abc", "continuation": "ab"}]
    lm = _task("language_modeling", continuation_delimiter="")
    assert evaluate_task(model, tok, lm, lm_rows, device="cpu", max_seq_len=5) == 0.5


def test_batched_scoring_matches_one_sequence_at_a_time() -> None:
    # Reference: score each option alone (no padding). Rows whose gold is the reference's pick
    # must then all be "correct" under the padded batch path.
    torch.manual_seed(1)
    tok, model = ByteTokenizer(), TinyLM()
    rng = random.Random(5)
    task = _task("multiple_choice")
    rows = []
    for i in range(12):
        choices = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 9))) for _ in range(4)]
        losses = []
        for tokens, start, end in encode_item(tok, "multiple_choice", [(f"question {i} ", c) for c in choices], 64):
            logits = model(torch.tensor([tokens]))[0]
            target = torch.tensor(tokens[start:end])
            losses.append(torch.nn.functional.cross_entropy(logits[start - 1 : end - 1], target).item())
        rows.append({"query": f"question {i}", "choices": choices, "gold": losses.index(min(losses))})
    assert evaluate_task(model, tok, task, rows, device="cpu", max_seq_len=64) == 1.0


def test_task_file_is_found_in_category_folders_and_ambiguity_is_named(tmp_path):

    task = _task("multiple_choice")
    assert task_file(tmp_path, task) is None
    nested = tmp_path / "eval_data" / "world" / task.file
    nested.parent.mkdir(parents=True)
    nested.write_text("{}\n")
    assert task_file(tmp_path, task) == nested
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / task.file).write_text("{}\n")
    with pytest.raises(ValueError, match=rf"2 files named '{task.file}'"):
        task_file(tmp_path, task)
    (tmp_path / task.file).write_text("{}\n")  # the configured relative path always wins
    assert task_file(tmp_path, task) == tmp_path / task.file
