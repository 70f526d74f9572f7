"""Preference pairs: record formats, bad input named by file and line, the tiny pairs' construction."""

from __future__ import annotations

import json
import os
import random
import re
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


def _reply(conv: dict) -> list[dict]:
    return conv["messages"][-1]["content"]


def test_contrasts_are_what_the_verifier_rejects(tok):
    task = build_task("tinyworld_arith", "train", limit=40)
    rng = random.Random(0)
    for i in range(40):
        conv = task[i]
        gold = _reply(conv)
        assert task.reward(conv, gold[-1]["text"]) == 1.0
        bad = prefs.contrasts(conv, rng)
        assert len(bad) == 4, gold  # every tiny problem gets all four kinds
        assert list(bad) == list(prefs.CONTRASTS)
        for contrast in bad.values():
            assert contrast["messages"][0] == conv["messages"][0]  # same question
            assert task.reward(conv, _reply(contrast)[-1]["text"]) == 0.0, _reply(contrast)
    pairs = prefs.contrast_pairs([task[i] for i in range(5)], tok, seed=0)
    assert len(pairs) == 20 and all(p.chosen != p.rejected for p in pairs)
    assert [p.mistake for p in pairs] == list(prefs.CONTRASTS) * 5  # each pair names its contrast's mistake


def _calls(parts: list[dict]) -> list[tuple[str, str]]:
    return [(p["text"], q["text"]) for p, q in zip(parts, parts[1:]) if p["type"] == "python"]


def _operands(call: str) -> tuple[int, str, int]:
    a, op, b = re.fullmatch(r"(\d+)(\+|-|\*|//)(\d+)", call).groups()
    return int(a), op, int(b)


def test_each_contrast_is_the_mistake_the_docs_name():
    """Miscopied: calls and outputs kept, the answer differs from the last output. Unformatted: the
    gold text without its #### line. Wrong call: one operand of the last call off by 1-3, its output
    recomputed and carried into both answer lines, so only the question shows the mistake. Wrong op:
    the last call's operands kept and its operation changed, carried through the same way."""
    task = build_task("tinyworld_arith", "val", limit=60)
    rng = random.Random(3)
    for i in range(60):
        gold = _reply(task[i])
        miscopied, unformatted, wrong, wrong_op = (_reply(c) for c in prefs.contrasts(task[i], rng).values())
        (a, op, b), (x, op2, y) = _operands(_calls(gold)[-1][0]), _operands(_calls(wrong_op)[-1][0])
        assert (x, y) == (a, b) and op2 != op and _calls(wrong_op)[:-1] == _calls(gold)[:-1]
        out = _calls(wrong_op)[-1][1]
        assert out == str(eval(f"{x}{op2}{y}")) and wrong_op[-1]["text"] == f"The answer is {out}.\n#### {out}"
        assert abs(len(wrong_op[-1]["text"]) - len(gold[-1]["text"])) <= 4  # no length shortcut
        last_output = _calls(gold)[-1][1]
        assert _calls(miscopied) == _calls(gold) and miscopied[-1]["text"].split("#### ")[1] != last_output
        assert unformatted[:-1] == gold[:-1] and unformatted[-1]["text"] == gold[-1]["text"].split("\n####")[0]
        assert _calls(wrong)[:-1] == _calls(gold)[:-1]
        call, output = _calls(wrong)[-1]
        (a, op, b), (x, op2, y) = _operands(_calls(gold)[-1][0]), _operands(call)
        assert op2 == op and [x - a, y - b].count(0) == 1 and 1 <= abs(x - a + y - b) <= 3
        assert output == str(eval(call)) and wrong[-1]["text"] == f"The answer is {output}.\n#### {output}"


# --------------------------------------------------------------------------- hub format, through the local mirror

UF_REPO = "HuggingFaceH4/ultrafeedback_binarized"
# Read in a child process: huggingface_hub reads HF_ENDPOINT when it is first imported
READ_HUB = """
import sys
from chatpipe.data.preferences import read_hub_pairs
from chatpipe.data.synthetic import pretrain_documents
from chatpipe.tokenizer import Tokenizer
tok = Tokenizer.train(pretrain_documents(0, 100), vocab_size=400)
try:
    pairs = read_hub_pairs(sys.argv[1], None, sys.argv[2], tok, max_len=256)
except ValueError as e:
    print("ERROR", e)
else:
    print("PAIRS", len(pairs), pairs[0].where, tok.decode(pairs[0].chosen[-8:]))
"""


def build_preference_repos(root: Path, bad_row: bool) -> None:
    """The mirror's repos: ultrafeedback_binarized's layout (prompt, chosen/rejected message lists, a
    dataset card with its train_prefs/test_prefs splits) and the pretraining repo the mirror's probe reads."""
    import pyarrow as pa

    from chatpipe.testing.hub_mirror import PRETRAIN_REPO, _card, _git, _parquet

    def conv(prompt: str, reply: str) -> list[dict[str, str]]:
        return [{"content": prompt, "role": "user"}, {"content": reply, "role": "assistant"}]

    repo = root / "datasets" / UF_REPO
    for split, n in (("train_prefs", 6), ("test_prefs", 3)):
        rows = [
            {
                "prompt": f"What is {i} plus {i}?",
                "chosen": conv(f"What is {i} plus {i}?", f"It is {2 * i}."),
                "rejected": conv(f"What is {i} plus {i}?", "No idea."),
                "score_chosen": 9.0,
                "score_rejected": 2.0,
            }
            for i in range(n)
        ]
        if bad_row and split == "train_prefs":
            rows[4]["chosen"] = conv(rows[4]["prompt"], "")
        _parquet(repo / "data" / f"{split}-00000-of-00001.parquet", pa.Table.from_pylist(rows))
    splits = [{"split": s, "path": f"data/{s}-*"} for s in ("train_prefs", "test_prefs")]
    (repo / "README.md").write_text(_card([{"config_name": "default", "data_files": splits}]))
    pretrain = root / "datasets" / PRETRAIN_REPO
    pretrain.mkdir(parents=True)
    (pretrain / "README.md").write_text("probe target\n")
    for r in (repo, pretrain):
        _git(r, "init", "-q", "-b", "main")
        _git(r, "add", "-A")
        _git(r, "commit", "-qm", "fixture")


@pytest.mark.slow
@pytest.mark.parametrize("bad_row", [False, True])
def test_hub_chosen_rejected_pairs_through_the_local_mirror(tmp_path, bad_row):
    pytest.importorskip("olah")
    import subprocess
    import sys

    from chatpipe.testing.hub_mirror import Mirror
    from tests.conftest import REPO

    root = tmp_path / "hub"
    build_preference_repos(root, bad_row)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHATPIPE_", "HF_"))}
    with Mirror(root) as mirror:
        env |= {"HF_ENDPOINT": mirror.url, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1"}
        env |= {"CHATPIPE_HUB_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, "-c", READ_HUB, UF_REPO, "train_prefs"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert out.returncode == 0, out.stderr[-3000:]
    if bad_row:
        assert f"ERROR {UF_REPO} train_prefs-00000-of-00001.parquet:row 4: field 'chosen' is empty" in out.stdout
    else:
        assert f"PAIRS 6 {UF_REPO} train_prefs-00000-of-00001.parquet:row 0 " in out.stdout
        assert "It is 0.<|assistant_end|>" in out.stdout
