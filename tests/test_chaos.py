"""bench/chaos.py, shortened: kill -9 the pretrain worker (once at a random moment, once during a
checkpoint write... every third trial) and SIGTERM the flow; every re-run must end bitwise equal
to the uninterrupted run with no process, temp file or RUNNING MLflow run left behind. And
bench/chaos_writes.py: kill -9 during file writes leaves the old file or the new one.

Each bench runs as the command a person types, its summary read from its ``--json`` file: tests
import nothing from bench/."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, out: Path, *args: str) -> dict:
    """``python bench/<script> <args> --json <out>``; its summary."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args, "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_chaos_pretrain_short(prefect_server, monkeypatch, tmp_path):
    # the flow trial's subject is the SIGTERM, not the flow's own temporary server: both of its flow
    # runs report to this process's server instead of starting one each (~4 s of CPU apiece)
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    args = ("--trials", "3", "--flow-trials", "1", "--stages", "pretrain")
    summary = run_bench("chaos.py", tmp_path / "summary.json", *args)
    s = summary["stages"]["pretrain"]
    assert s["trials"] == 4 and s["kills"] >= 3, s
    assert s["during_checkpoint_write"] >= 1, s
    assert s["identical_finals"] == s["trials"], s
    assert s["procs_left"] == s["temps_left"] == s["runs_left_running"] == 0, s


@pytest.mark.slow
def test_kill_9_during_tokenizer_tokenstore_report_and_settings_writes_leaves_old_or_new(tmp_path):
    """bench/chaos_writes.py: SIGKILL a process rewriting each kind of file (alternating two
    versions) at random moments; every target is then exactly one version, never a partial file."""
    summary = run_bench("chaos_writes.py", tmp_path / "summary.json", "--trials", "3", "--work", str(tmp_path / "w"))
    assert set(summary) == {"tokenizer", "tokenstore", "report", "settings"}
    for kind, s in summary.items():
        assert s["partial"] == [], (kind, s)
    # the kills did land mid-write (each such kill leaves its hidden temp file): the check had work to do
    assert sum(s["temps_left"] for s in summary.values()) >= 1, summary
    # and the check finds the partial files of a writer that writes straight onto the target
    plain = ("--trials", "3", "--kinds", "plain", "--work", str(tmp_path / "plain"))
    control = run_bench("chaos_writes.py", tmp_path / "control.json", *plain)
    assert control["plain"]["partial"], control
