"""A user's own files are refused before training, naming the file, the line and what was expected
(docs/own-data.md); the tokenizer's round trip on the corpus; the verifier's file as rl's DVC dep."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from chatpipe.data import preferences as prefs
from chatpipe.data.synthetic import pretrain_documents
from chatpipe.data.tasks import build_task
from chatpipe.testing.project import dvc, make_project, run, set_params
from chatpipe.tokenizer import Tokenizer, roundtrip_failures

HI = {"role": "user", "content": "¿Dónde vive el gato?"}
YO = {"role": "assistant", "content": "El gato vive en el campo."}


def write_lines(path: Path, lines: list) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line, ensure_ascii=False)) + "\n" for line in lines)
    )
    return path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(pretrain_documents(0, 100), vocab_size=400)


def test_malformed_json_is_refused_naming_file_and_line(tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [HI, YO]}, '{"messages": [}'])
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: bad JSON line \(Expecting value at column 15\)"):
        build_task("customjson", "train", path=path)


def test_a_missing_role_is_refused_naming_file_and_line(tmp_path):
    path = write_lines(tmp_path / "chat.jsonl", [{"messages": [HI, YO]}, {"messages": [HI, {"content": "sin rol"}]}])
    with pytest.raises(
        ValueError, match=r"chat\.jsonl:2: malformed conversation row: message 1: expected role 'assistant', got None"
    ):
        build_task("customjson", "train", path=path)


def test_roles_out_of_order_are_refused_naming_file_and_line(tmp_path):
    path = write_lines(
        tmp_path / "chat.jsonl", [{"messages": [HI, YO]}, {"messages": [HI, YO]}, {"messages": [YO, HI]}]
    )
    with pytest.raises(
        ValueError, match=r"chat\.jsonl:3: malformed conversation row: message 0: expected role 'user', got 'assistant'"
    ):
        build_task("customjson", "train", path=path)


def test_empty_text_is_refused_naming_file_and_line(tmp_path):
    chat = write_lines(
        tmp_path / "chat.jsonl", [{"messages": [HI, YO]}, {"messages": [HI, {"role": "assistant", "content": "  "}]}]
    )
    with pytest.raises(
        ValueError, match=r"chat\.jsonl:2: .*message 1 \(assistant\): empty text; expected a non-empty 'content'"
    ):
        build_task("customjson", "train", path=chat)
    problems = write_lines(tmp_path / "problems.jsonl", [{"prompt": "", "answer": "negro"}])
    with pytest.raises(ValueError, match=r"problems\.jsonl:1: .*message 0 \(user\): empty text"):
        build_task("customjson", "train", path=problems)


def test_a_pair_whose_chosen_equals_its_rejected_is_refused_naming_file_and_line(tok, tmp_path):
    good = {"prompt": "¿De qué color es el gato?", "chosen": "Es negro.", "rejected": "Es rojo."}
    path = write_lines(tmp_path / "prefs.jsonl", [good, {**good, "rejected": good["chosen"]}])
    with pytest.raises(ValueError, match=r"prefs\.jsonl:2: 'chosen' equals 'rejected'; expected two different replies"):
        prefs.read_jsonl_pairs(path, tok, max_len=256)


def test_roundtrip_names_the_text_that_does_not_survive(tok):
    texts = ["El búho vive en el monte. ¡Qué bonito!", "Ünïcödé straße 東京", "half a pair: \ud800 here"]
    assert roundtrip_failures(tok, texts) == [(2, 13)]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return make_project(tmp_path_factory.mktemp("owndata"))


def test_a_corpus_too_small_for_the_vocabulary_is_refused_and_the_old_tokenizer_kept(project):
    corpus = project / "mycorpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("El gato es negro. El perro es blanco.\n\n" * 400)
    (corpus / "val.txt").write_text("El gato vive en el campo.\n")
    set_params(project, {"data": {"source": "local", "local_dir": "mycorpus"}, "tokenizer": {"vocab_size": 1024}})
    old = project / "artifacts" / "tokenizer"
    old.mkdir(parents=True)
    (old / "tokenizer.json").write_text("the last good run's")
    env = {"CHATPIPE_TRACKING__ENABLED": "false"}
    run(project, "python", "-m", "stages.data", **env)
    proc = run(project, "python", "-m", "stages.tokenizer", check=False, **env)
    assert proc.returncode != 0
    want = (
        r"data.local_dir mycorpus \(a.txt, val.txt\): [\d,]+ chars of train text are too few for "
        r"tokenizer.vocab_size=1024: byte-pair merges ran out at \d+ tokens; expected more text"
    )
    assert re.search(want, proc.stderr), proc.stderr[-2000:]
    assert (old / "tokenizer.json").read_text() == "the last good run's" and sorted(old.iterdir()) == [
        old / "tokenizer.json"
    ]


def test_editing_the_verifier_file_makes_rl_stale(project):
    """rl's lock is recorded over stand-in deps and outs (no training): only the verifier changes."""
    mine = project / "mine.py"
    shutil.copy(project / "verifiers" / "exact_answer.py", mine)
    set_params(project, {"rl": {"reward": {"verifier": "custom", "verifier_file": "mine.py"}}})
    run(project, "python", "-m", "chatpipe.settings", "rl")  # profile/rl.yaml, a dep of rl
    for d in ("artifacts/tokenizer", "artifacts/sft", "artifacts/reward_model", "artifacts/rl", "plots/rl"):
        (project / d).mkdir(parents=True, exist_ok=True)
        (project / d / "x").write_text(d)
    (project / "metrics").mkdir(exist_ok=True)
    (project / "metrics" / "rl.json").write_text("{}")
    dvc(project, "commit", "-f", "--force", "rl")
    assert "changed" not in dvc(project, "status", "rl").stdout
    mine.write_text(mine.read_text() + "\n# any edit\n")
    status = dvc(project, "status", "rl").stdout
    assert "rl:" in status and "modified:" in status and "mine.py" in status, status


def test_check_data_stops_at_a_bad_file_before_any_stage_runs(project):
    """`chatpipe check-data`, the walkthrough's first command, names file and line; nothing is written."""
    chat = write_lines(project / "chat.jsonl", [{"messages": [HI, YO]}, {"messages": [HI, YO, YO]}])
    set_params(
        project, {"data": {"source": "synthetic"}, "sft": {"mixture": [{"task": "customjson", "path": "chat.jsonl"}]}}
    )
    before = sorted(p.relative_to(project) for p in project.rglob("*") if not {".git", "__pycache__"} & set(p.parts))
    proc = run(project, "chatpipe", "check-data", check=False)
    assert proc.returncode == 1
    assert (
        "error: chat.jsonl:2: malformed conversation row: message 2: expected role 'user', got 'assistant'"
        in proc.stderr
    )
    chat.write_text(json.dumps({"messages": [HI, YO]}) + "\n")
    proc = run(project, "chatpipe", "check-data")
    assert "ok  chat.jsonl (sft.mixture[0]): 1 rows" in proc.stdout
    assert (
        sorted(p.relative_to(project) for p in project.rglob("*") if not {".git", "__pycache__"} & set(p.parts))
        == before
    )
