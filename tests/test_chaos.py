"""bench/chaos.py, shortened: kill -9 the pretrain worker (once at a random moment, once during a
checkpoint write... every third trial) and SIGTERM the flow; every re-run must end bitwise equal
to the uninterrupted run with no process, temp file or RUNNING MLflow run left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.slow
def test_chaos_pretrain_short():
    import chaos

    summary = chaos.main(["--trials", "3", "--flow-trials", "1", "--stages", "pretrain"])
    s = summary["stages"]["pretrain"]
    assert s["trials"] == 4 and s["kills"] >= 3, s
    assert s["during_checkpoint_write"] >= 1, s
    assert s["identical_finals"] == s["trials"], s
    assert s["procs_left"] == s["temps_left"] == s["runs_left_running"] == 0, s
