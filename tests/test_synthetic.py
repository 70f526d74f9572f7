"""Synthetic tiny world: determinism, disjoint splits, consistent facts, GSM8K format."""

from __future__ import annotations

import random
import re

import pytest

from chatpipe.data import synthetic as S

SPLIT_GENERATORS = [S.chat_conversations, S.arithmetic_problems, S.tool_conversations, S.mc_questions]


def questions(rows: list[dict]) -> set[str]:
    """Every user question text in a list of rows (GSM8K/MC rows or conversations)."""
    out = set()
    for row in rows:
        if "question" in row:
            out.add(row["question"])
        else:
            out |= {m["content"] for m in row["messages"] if m["role"] == "user"}
    return out


@pytest.mark.parametrize("gen", SPLIT_GENERATORS)
def test_deterministic_by_seed(gen) -> None:
    assert gen(7, 40, "train") == gen(7, 40, "train")
    assert gen(7, 40, "train") != gen(8, 40, "train")


def test_other_generators_deterministic() -> None:
    assert S.pretrain_documents(3, 20) == S.pretrain_documents(3, 20)
    assert S.pretrain_documents(3, 20) != S.pretrain_documents(4, 20)
    assert S.identity_conversations(1, 10) == S.identity_conversations(1, 10)
    assert S.spelling_words(1, 10) == S.spelling_words(1, 10) != S.spelling_words(2, 10)


def test_splits_disjoint_across_all_generators() -> None:
    by_split = {split: set().union(*(questions(g(0, 150, split)) for g in SPLIT_GENERATORS)) for split in S.SPLITS}
    for a, b in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert not by_split[a] & by_split[b], f"{a}/{b} share questions"
    assert all(len(qs) > 50 for qs in by_split.values())


def test_bad_split_raises() -> None:
    with pytest.raises(ValueError, match="split"):
        S.chat_conversations(0, 5, "dev")


def test_gsm8k_format_and_annotations() -> None:
    rows = S.arithmetic_problems(0, 200, "test")
    assert len({r["question"] for r in rows}) == 200  # distinct within a split
    ops = set()
    for row in rows:
        body, final = row["answer"].rsplit("\n#### ", 1)
        value = int(final)
        annotations = re.findall(r"<<(\d+)([-+*/])(\d+)=(\d+)>>(\d+)", body)
        assert 1 <= len(annotations) <= 2, row
        for a, op, b, c, shown in annotations:
            a, b, c = int(a), int(b), int(c)
            expected = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
            assert c == expected and shown == str(c), row  # division is always exact
            ops.add(op)
        assert int(annotations[-1][3]) == value
    assert ops == {"+", "-", "*", "/"}


def test_tool_conversations_compute_correctly() -> None:
    for conv in S.tool_conversations(0, 100, "train"):
        user, assistant = conv["messages"]
        parts = assistant["content"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        calls = [p for p in parts if p["type"] == "python"]
        outputs = [p for p in parts if p["type"] == "python_output"]
        assert calls and len(calls) == len(outputs)
        for call, out in zip(calls, outputs):
            assert re.fullmatch(r"\d+(\+|-|\*|//)\d+", call["text"])
            assert str(eval(call["text"])) == out["text"]  # what a python calculator prints
        assert parts[-1]["text"].endswith(f"#### {outputs[-1]['text']}")


def test_mc_questions_well_formed() -> None:
    rows = S.mc_questions(0, 100, "val")
    for row in rows:
        assert len(row["choices"]) == 4 == len(set(row["choices"]))
        assert 0 <= row["answer"] < 4
    # Answers are spread over positions so a constant guess stays at chance.
    assert len({r["answer"] for r in rows}) == 4


def test_chat_answers_agree_with_world() -> None:
    ages = {p.name: p.age for p in S.WORLD.people}
    seen = 0
    for conv in S.chat_conversations(0, 300, "train"):
        msgs = [m for m in conv["messages"] if m["role"] != "system"]
        for q, a in zip(msgs[::2], msgs[1::2]):
            m = re.fullmatch(r"How old is (\w+)\?", q["content"])
            if m:
                assert a["content"] == f"{m[1]} is {ages[m[1]]} years old."
                seen += 1
    assert seen > 0


def test_pretrain_documents_state_world_facts() -> None:
    docs = S.pretrain_documents(0, 400)
    assert all(150 <= len(d) <= 1600 for d in docs)
    text = "\n".join(docs)
    p = S.WORLD.people[0]
    assert f"{p.name} is {p.age} years old." in text or f"{p.name}'s age is {p.age}." in text
    assert re.search(r"\d+ plus \d+ is \d+\.", text)
    for a, b, c in re.findall(r"(\d+) plus (\d+) is (\d+)\.", text):
        assert int(a) + int(b) == int(c)
    for word, spelled, k, letter in re.findall(r"The word (\w+) is spelled ([\w-]+)\. It has (\d+) (\w)", text):
        assert spelled == "-".join(word) and word.count(letter) == int(k)


def test_identity_uses_name_and_maker() -> None:
    convs = S.identity_conversations(0, 50, name="tinybot", maker="ACME")
    text = " ".join(m["content"] for c in convs for m in c["messages"])
    assert "tinybot" in text and "ACME" in text and "chatpipe" not in text


def test_spelling_words_from_world() -> None:
    words = S.spelling_words(0, 30)
    assert len(words) == len(set(words)) == 30
    assert set(words) <= set(S.vocabulary())


def test_direct_questions_cover_readme_phrasings_and_map_to_one_call_form() -> None:
    # The README asks "What is 12 + 7?" and "What is 6 times 8?": the training data must hold
    # both styles (symbols and words), one-digit numbers, and always call "a+b" / "a-b" / "a*b".
    rng = random.Random(0)
    seen: set[str] = set()
    for _ in range(3000):
        q, steps, value = S._direct_problem(rng)
        ((_, a, op, b),) = steps
        assert value == {"+": a + b, "-": a - b, "*": a * b}[op] and value >= 0
        m = re.fullmatch(r"What is (\d+) (\+|-|\*|x|plus|minus|times) (\d+)\?", q)
        if m:
            seen.add({"+": "sym", "-": "sym", "*": "sym", "x": "sym"}.get(m.group(2), "word"))
            seen.add("one-digit" if min(int(m.group(1)), int(m.group(3))) < 10 else "two-digit")
    assert seen == {"sym", "word", "one-digit", "two-digit"}
    for conv in S.tool_conversations(0, 200, "train"):
        calls = [p["text"] for p in conv["messages"][1]["content"] if p["type"] == "python"]
        assert all(re.fullmatch(r"\d+(\+|-|\*|//)\d+", c) for c in calls)
