"""The user's own RL verifier (rl.reward.verifier: custom, chatpipe/rl/verifier.py): scores, and every way a
call fails, reported with the problem's index and never counted as a score."""

from __future__ import annotations

import json
import math
import textwrap

import pytest
import torch

from chatpipe.rl.rollout import Rollouts, drop_failed, load_problems
from chatpipe.rl.verifier import Verifier
from chatpipe.sandbox import SandboxUnavailable, sandbox_mode

VERIFIER = """
import time

def score(reply, problem):
    kind = problem["kind"]
    if kind == "ok":
        return float(reply.strip() == problem["answer"])
    if kind == "raise":
        raise KeyError("no such field")
    if kind == "text":
        return "yes"
    if kind == "nan":
        return float("nan")
    if kind == "big":
        return 1.5
    if kind == "slow":
        while True:
            time.sleep(0.01)
    if kind == "swallow":  # a verifier that catches everything still cannot outlast its limit
        try:
            while True:
                pass
        except Exception:
            return 1.0
"""


@pytest.fixture
def verifier_file(tmp_path):
    path = tmp_path / "my_verifier.py"
    path.write_text(textwrap.dedent(VERIFIER))
    return path


def test_scores_come_back_and_failures_are_reported_with_the_index_never_as_scores(verifier_file):
    v = Verifier(verifier_file, "score", timeout_s=0.3)
    assert v("42", {"kind": "ok", "answer": "42"}, index=0) == 1.0
    assert v("41", {"kind": "ok", "answer": "42"}, index=1) == 0.0
    cases = {2: "raise", 3: "text", 4: "nan", 5: "big", 6: "slow", 7: "swallow"}
    for index, kind in cases.items():
        assert v("x", {"kind": kind}, index=index) is None, kind
    by_index = {e.index: e.error for e in v.errors}
    assert sorted(by_index) == sorted(cases)
    assert "raised KeyError" in by_index[2] and "no such field" in by_index[2]
    assert "returned str 'yes', expected a number in [0, 1]" in by_index[3]
    assert "nan" in by_index[4] and "1.5" in by_index[5]
    assert "took longer than 0.3 s" in by_index[6] and "took longer" in by_index[7]
    assert v.summary() == {"verifier_calls": 8, "verifier_errors": 6}
    # the same reply again is neither run nor reported twice (pass@k asks after the reward did)
    assert v("x", {"kind": "raise"}, index=2) is None and len(v.errors) == 6


def test_a_missing_file_or_function_is_refused_before_any_call(tmp_path, verifier_file):
    with pytest.raises(FileNotFoundError, match="nope.py: rl.reward.verifier_file not found"):
        Verifier(tmp_path / "nope.py")
    with pytest.raises(ValueError, match=r"no top-level function 'grade'.*defines \['score'\]"):
        Verifier(verifier_file, "grade")
    broken = tmp_path / "broken.py"
    broken.write_text("def score(reply, problem):\n    return (\n")
    with pytest.raises(ValueError, match=r"broken\.py:\d+: rl.reward.verifier_file is not valid Python"):
        Verifier(broken)


def test_problems_from_a_jsonl_file_get_their_row_and_the_verifier_decides_the_pass(tmp_path, verifier_file):
    rows = [{"prompt": f"Q{i}?", "answer": str(i), "kind": "ok" if i != 3 else "raise"} for i in range(6)]
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    v = Verifier(verifier_file, timeout_s=1.0)
    problems = load_problems("customjson", "all", 6, reward="custom", verifier=v, path=str(path))
    assert [p.conversation["messages"][0]["content"] for p in problems] == [r["prompt"] for r in rows]
    assert problems[2].score("2") == 1.0 and problems[2].is_correct("2")
    assert problems[2].score("5") == 0.0 and not problems[2].is_correct("5")
    assert math.isnan(problems[3].score("3")) and not problems[3].is_correct("3")
    assert [e.index for e in v.errors] == [3]  # the row's place in the file


def test_a_failed_row_leaves_the_update_and_its_groups_baseline():
    scores = torch.tensor([1.0, math.nan, 0.0, math.nan, math.nan, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    batch = Rollouts(
        inputs=torch.zeros(6, 3, dtype=torch.long),
        targets=torch.zeros(6, 3, dtype=torch.long),
        mask=torch.ones(6, 3),
        scores=scores,
        ended=torch.ones(6, dtype=torch.bool),
        lengths=torch.full((6,), 3),
        groups=groups,
    )
    out = drop_failed(batch)
    assert out.scores.tolist() == [1.0, 0.5, 0.0, 0.0, 0.0, 0.5]  # the group's mean: advantage 0
    assert out.mask.sum(1).tolist() == [3, 0, 3, 0, 0, 3]


def test_sandboxed_verifier_scores_and_reports_the_same(verifier_file):
    try:
        sandbox_mode()
    except SandboxUnavailable as e:
        pytest.skip(str(e))
    v = Verifier(verifier_file, sandbox=True, timeout_s=2.0)
    assert v("42", {"kind": "ok", "answer": "42"}, index=0) == 1.0
    assert v("x", {"kind": "raise"}, index=1) is None
    assert v("x", {"kind": "text"}, index=2) is None
    assert v("x", {"kind": "slow"}, index=3) is None
    errors = {e.index: e.error for e in v.errors}
    assert "KeyError" in errors[1] and "returned str" in errors[2] and "took longer" in errors[3]
