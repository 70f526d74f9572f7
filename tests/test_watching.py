"""Watching a run: progress with ETA, the flow's console without noise, dvc.lock committed on request."""

from __future__ import annotations

import io
import json
import logging
import subprocess

import pytest

from chatpipe.progress import Progress, iterate
from chatpipe.stage_metrics import Curves, write_metrics
from flows.pipeline import commit_lock, console_line

DVC_ADVICE = """Updating lock file 'dvc.lock'

To track the changes with git, run:

\tgit add dvc.lock

To enable auto staging, run:

\tdvc config core.autostage true
Use `dvc push` to send your updates to remote storage."""


def test_console_drops_dvc_git_advice_and_rustbpe_progress():
    kept = [console_line(line) for line in DVC_ADVICE.splitlines()]
    assert [k for k in kept if k is not None] == ["Updating lock file 'dvc.lock'"]
    assert console_line("2026-11-23 rustbpe INFO Progress: 37% (140/378 merges) - Last merge: (32, 116)") is None
    assert console_line("[launch] pretrain: SUCCEEDED (61.4 s)") == "[launch] pretrain: SUCCEEDED (61.4 s)"


def test_console_shortens_tiktoken_connection_errors():
    line = (
        "tokenizer: vocab 512; {'gpt2': {'skipped': \"could not load tiktoken encoding 'gpt2': ConnectionError: "
        "HTTPSConnectionPool(host='example', port=443): Max retries exceeded with url: /vocab.bpe (Caused by "
        "NewConnectionError('<urllib3.connec\"}, 'train_chars': 300000}"
    )
    out = console_line(line)
    assert "could not load tiktoken encoding 'gpt2' (offline)" in out
    assert "ConnectionError" not in out and "train_chars': 300000" in out


def test_progress_bar_off_without_a_terminal_but_logs_eta(caplog):
    logging.getLogger("chatpipe.progress").disabled = False  # Prefect's logging setup (imported above) disables it
    caplog.set_level(logging.INFO, logger="chatpipe.progress")
    bar = Progress(10, "pretrain", unit="step", stream=io.StringIO(), every_s=10)
    assert bar.bar is None  # not a terminal: no tqdm bar
    bar.t0 -= 20  # as if 20 s went by for the first 4 steps
    bar.last_line -= 20
    bar.update(4, loss=2.5)
    bar.close()
    line = caplog.records[-1].getMessage()
    assert line.startswith("pretrain: 4/10 step | 0:20 elapsed | ETA 0:30") and "loss 2.5" in line


def test_a_line_comes_on_time_while_one_item_takes_longer_and_none_after_close(caplog):
    """The timer writes the line while a single item (a long generation call, a checkpoint write)
    runs longer than every_s; closing the bar stops it."""
    import time

    logging.getLogger("chatpipe.progress").disabled = False
    caplog.set_level(logging.INFO, logger="chatpipe.progress")
    with Progress(4, "sampling", unit="sample", stream=io.StringIO(), every_s=0.2) as bar:
        bar.update(1)
        time.sleep(1.1)  # no update for 1.1 s: about five timed lines
        ticks = [r.getMessage() for r in caplog.records]
    assert len(ticks) >= 3 and all(t.startswith("sampling: 1/4 sample |") and "ETA" in t for t in ticks), ticks
    gaps = [b.created - a.created for a, b in zip(caplog.records, caplog.records[1:])]
    assert max(gaps) < 0.2 + 0.15, gaps
    time.sleep(0.5)
    assert len(caplog.records) == len(ticks)  # closed: no line after the phase ended


def test_progress_bar_on_a_terminal_and_off_by_env(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Tty()
    with Progress(3, "eval", stream=stream) as bar:
        bar.update(3)
    assert "3/3" in stream.getvalue()  # tqdm drew its bar with elapsed time
    monkeypatch.setenv("CHATPIPE_PROGRESS", "off")
    quiet = Tty()
    assert list(iterate([1, 2], "x", stream=quiet)) == [1, 2] and quiet.getvalue() == ""
    monkeypatch.setenv("CHATPIPE_PROGRESS", "loud")
    with pytest.raises(ValueError, match="CHATPIPE_PROGRESS"):
        Progress(1, "x")


def test_metrics_and_curves_files(tmp_path):
    path = write_metrics("pretrain", {"val_bpb": 1.25, "nan": float("nan"), "tokens": 10}, root=tmp_path)
    assert json.loads(path.read_text()) == {"pretrain": {"val_bpb": 1.25, "nan": None, "tokens": 10}}

    sent = []

    class Buffer:
        def log(self, metrics, step):
            sent.append((step, metrics))

        def flush(self):
            sent.append("flush")

    curves = Curves(Buffer(), "sft", ["train/loss"], root=tmp_path)
    curves.log({"train/loss": 3.0, "lr_mult": 1.0}, 1)
    curves.log({"train/loss": 2.0}, 2)
    curves.log({"train/loss": 1.5}, 2)  # the same step logged again: the newer value wins
    curves.flush()
    assert sent[0] == (1, {"train/loss": 3.0, "lr_mult": 1.0}) and sent[-1] == "flush"
    assert (tmp_path / "sft" / "train_loss.csv").read_text().splitlines() == ["step,train_loss", "1,3.0", "2,1.5"]


def test_commit_lock_commits_only_the_lock_and_stage_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.email=t@x", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q"], check=True)
    (tmp_path / "notes.txt").write_text("work in progress\n")
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "start"], check=True)
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "pretrain.json").write_text("{}\n")
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t")
    sha = commit_lock("pipeline run: dvc.lock")
    assert sha
    files = subprocess.run(["git", "show", "--name-only", "--format=", sha], capture_output=True, text=True).stdout
    assert sorted(files.split()) == ["dvc.lock", "metrics/pretrain.json"]  # notes.txt stays uncommitted
    assert commit_lock("again") is None  # nothing changed
