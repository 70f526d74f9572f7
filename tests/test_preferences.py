"""Preference pairs: record formats, bad input named by file and line, the tiny pairs' construction."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from chatpipe.data import preferences as prefs
from chatpipe.data.synthetic import pretrain_documents
from chatpipe.data.tasks import build_task
from chatpipe.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(pretrain_documents(0, 100), vocab_size=400)


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = {"prompt": "Calculate 2 plus 2.", "chosen": "The answer is 4.\n#### 4", "rejected": "Five."}


def test_local_jsonl_pairs_render_user_turn_and_each_reply(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, GOOD])
    pairs = prefs.read_jsonl_pairs(path, tok, max_len=256)
    assert len(pairs) == 2 and pairs[1].where == f"{path}:2"
    want, _ = tok.render_conversation(
        {"messages": [{"role": "user", "content": GOOD["prompt"]}, {"role": "assistant", "content": GOOD["chosen"]}]}
    )
    assert pairs[0].chosen == want
    assert pairs[0].chosen[-1] == pairs[0].rejected[-1] == tok.encode_special("<|assistant_end|>")


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"prompt": "Hi", "chosen": "Hello"}, "missing field 'rejected'"),
        ({"prompt": "Hi", "chosen": "", "rejected": "x"}, "field 'chosen' is empty"),
        ({"prompt": "Hi", "chosen": "   ", "rejected": "x"}, "field 'chosen' is empty"),
        ({"prompt": "", "chosen": "a", "rejected": "b"}, "field 'prompt' is empty"),
        ({"prompt": "Hi", "chosen": 3, "rejected": "b"}, "must be a string or a list of messages"),
        ({"prompt": "Hi", "chosen": "word " * 300, "rejected": "b"}, "longer than the context of 256"),
    ],
)
def test_bad_record_fails_naming_file_and_line(tok, tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, GOOD, bad, GOOD])
    with pytest.raises(ValueError, match=message) as err:
        prefs.read_jsonl_pairs(path, tok, max_len=256)
    assert str(err.value).startswith(f"{path}:3: ")


def test_too_long_pairs_can_be_skipped(tok, tmp_path):
    long = {**GOOD, "rejected": "word " * 300}
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, long, GOOD])
    with pytest.raises(prefs.TooLong):
        prefs.read_jsonl_pairs(path, tok, max_len=256)
    assert [p.where for p in prefs.read_jsonl_pairs(path, tok, max_len=256, skip_too_long=True)] == [
        f"{path}:1",
        f"{path}:3",
    ]


def test_hub_formats_ultrafeedback_messages_and_hh_transcripts(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]
    uf = prefs.record_pair(
        {"prompt": "Hi", "chosen": msgs, "rejected": [msgs[0], {"role": "assistant", "content": "No"}]}, tok, 256, "uf"
    )
    hh = prefs.record_pair(
        {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello there", "rejected": "\n\nHuman: Hi\n\nAssistant: No"},
        tok,
        256,
        "hh",
    )
    assert uf.chosen == hh.chosen == tok.render_conversation({"messages": msgs})[0]
    assert uf.rejected == hh.rejected
    with pytest.raises(ValueError, match="hh: 'chosen' is a string but not a"):
        prefs.record_pair({"chosen": "no turns here", "rejected": "x"}, tok, 256, "hh")


def test_split_pairs_holds_out_a_seeded_disjoint_set(tok, tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{**GOOD, "prompt": f"Q{i}"} for i in range(10)])
    pairs = prefs.read_jsonl_pairs(path, tok, max_len=256)
    train, held = prefs.split_pairs(pairs, 3, seed=1)
    assert len(train) == 7 and len(held) == 3
    assert not {p.where for p in train} & {p.where for p in held}
    assert prefs.split_pairs(pairs, 3, seed=1)[1] == held
    with pytest.raises(ValueError, match="cannot hold out 10"):
        prefs.split_pairs(pairs, 10, seed=1)


def test_ranked_pairs_put_each_better_sample_over_a_worse_one():
    samples = [[1, 10], [1, 11], [1, 12], [1, 13]]
    pairs = prefs.ranked_pairs([1], samples, [0.0, 1.0, 0.0, 1.0], "p")
    # best half (1, 3) against the worst half, worst first (2, 0): every pair right over wrong
    assert [(p.chosen, p.rejected) for p in pairs] == [([1, 11], [1, 12]), ([1, 13], [1, 10])]
    assert prefs.ranked_pairs([1], samples, [1.0] * 4, "p") == []  # all tied: no preference


def test_contrasts_are_what_the_verifier_rejects(tok):
    task = build_task("tinyworld_arith", "train", limit=20)
    rng = random.Random(0)
    for i in range(20):
        conv = task[i]
        gold = conv["messages"][-1]["content"][-1]["text"]
        assert task.reward(conv, gold) == 1.0
        for bad in prefs.contrasts(conv, rng):
            text = bad["messages"][-1]["content"][-1]["text"]
            assert task.reward(conv, text) == 0.0, text
    pairs = prefs.contrast_pairs([task[i] for i in range(5)], tok, seed=0)
    assert len(pairs) == 10 and all(p.chosen != p.rejected for p in pairs)
