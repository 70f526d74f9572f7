"""The flow's ran/skipped decision comes from `dvc status --json`, not from DVC's log wording.

A tiny git + DVC repo with one stage, run through the flow's own `repro` (the same
`dvc repro --single-item` child the Prefect task starts), under a DVC whose skip message is
reworded by a sitecustomize on PYTHONPATH. Grepping for "didn't change, skipping" would call the
second, skipped run "ran"; the decision here must not move.
"""

from __future__ import annotations

import os
import subprocess

from chatpipe.testing.project import BIN
from flows.pipeline import repro, stage_is_current

# Loaded by every Python the dvc children start: rewrites DVC's log records before any handler
# formats them, so "Stage 'x' didn't change, skipping" reads "Stage 'x' is up to date, nothing to do".
_REWORD = """
import logging
_make = logging.getLogRecordFactory()
def _reworded(*args, **kwargs):
    record = _make(*args, **kwargs)
    if isinstance(record.msg, str) and "didn't change, skipping" in record.msg:
        record.msg = record.msg.replace("didn't change, skipping", "is up to date, nothing to do")
    return record
logging.setLogRecordFactory(_reworded)
"""


def test_ran_or_skipped_does_not_depend_on_dvc_message_text(tmp_path, monkeypatch):
    repo, site = tmp_path / "repo", tmp_path / "site"
    repo.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(_REWORD)
    (repo / "dvc.yaml").write_text("stages:\n  hello:\n    cmd: echo hi > out.txt\n    outs: [out.txt]\n")
    env = {**os.environ, "PYTHONPATH": str(site), "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=repo, env=env, check=True)
    monkeypatch.chdir(repo)

    lines: list[str] = []
    assert repro("hello", env, lines.append) == "ran"
    assert (repo / "out.txt").read_text() == "hi\n"
    lines.clear()
    assert repro("hello", env, lines.append) == "skipped"
    # the reworded DVC really ran: its skip line no longer has the words a grep would look for
    assert any("is up to date, nothing to do" in line for line in lines), lines
    assert not any("didn't change" in line for line in lines), lines

    (repo / "dvc.yaml").write_text("stages:\n  hello:\n    cmd: echo bye > out.txt\n    outs: [out.txt]\n")
    assert repro("hello", env, lines.append) == "ran"
    assert (repo / "out.txt").read_text() == "bye\n"


def test_decision_reads_status_json():
    """The decision is a function of DVC's JSON: a stage listed there runs, one absent is current."""
    assert stage_is_current({}, "pretrain")
    assert stage_is_current({"tokenizer": [{"changed deps": {"data": "modified"}}]}, "pretrain")
    assert not stage_is_current({"pretrain": [{"changed command": True}]}, "pretrain")
