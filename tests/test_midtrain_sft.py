"""End to end: `dvc repro sft` runs data -> ... -> sft; a kill -9 during sft resumes; a re-run is a no-op."""

from __future__ import annotations

import json
import re
import subprocess
import time

import psutil
import pytest

from chatpipe.testing.project import BIN, dvc, make_project, mlflow_client, project_env, run


def _kill_project_processes(project) -> None:
    """SIGKILL every process working in ``project``: dvc, the torchx launcher and the workers.

    torchx starts workers in their own session, so killing dvc's process group alone would leave
    them running.
    """
    for proc in psutil.process_iter():
        try:
            if proc.cwd() == str(project):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def grad_norm_steps(project, stage: str) -> list[int]:
    """The steps at which the newest ``stage`` run logged a finite, positive ``train/grad_norm``."""
    client = mlflow_client(project)
    exp = client.get_experiment_by_name("chatpipe")
    newest = client.search_runs([exp.experiment_id], f"tags.stage = '{stage}'", order_by=["start_time DESC"])[0]
    history = client.get_metric_history(newest.info.run_id, "train/grad_norm")
    return sorted(m.step for m in history if 0 < m.value < float("inf"))


def _wait_for(predicate, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_repro_sft_kill_resume_noop(tmp_path):
    # kill, resume and chat are the subject; MLflow is on (~2-3 s of CPU a stage process) for one check: every
    # training stage logs its per-step gradient norm, the loop's, to its run
    project = make_project(tmp_path, {"sft": {"max_steps": 40, "eval_baseline": True}})
    sft_ckpts = project / "checkpoints" / "sft"

    # 1. the whole chain in the background; kill -9 everything once sft has written a checkpoint
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(
        [str(BIN / "dvc"), "repro", "sft"], cwd=project, env=project_env(project), stdout=log, stderr=subprocess.STDOUT
    )
    started = _wait_for(lambda: any(sft_ckpts.glob("step_*")), proc, timeout=600)
    _kill_project_processes(project)
    proc.wait()
    time.sleep(0.5)
    first = (tmp_path / "first.log").read_text()
    assert started, f"sft never checkpointed:\n{first[-3000:]}"
    assert (project / "artifacts" / "mid" / "meta.json").exists()
    assert not (project / "artifacts" / "sft" / "meta.json").exists()

    # 2. re-run: resumes from the checkpoint, finishes, runs the chat checks
    out = dvc(project, "repro", "sft").stdout
    resumed = re.search(r"resuming from checkpoints/sft/step_(\d+)", out)
    assert resumed and 0 < int(resumed.group(1)) < 40, out[-3000:]
    meta = json.loads((project / "artifacts" / "sft" / "meta.json").read_text())
    assert meta["step"] == 40 and meta["source_stage"] == "sft"
    summary = meta["summary"]
    assert summary["train_seconds"] > 0  # the re-run trained the remaining steps
    assert {"end_token_rate", "arith_accuracy", "arith_accuracy_base", "fill_ratio"} <= set(summary)
    assert 0.0 <= summary["end_token_rate"] <= 1.0

    # every step of every training run logs the gradient norm to MLflow (the resumed sft run: the steps it trained)
    for stage, steps in (
        ("pretrain", range(1, 25)),
        ("midtrain", range(1, 9)),
        ("sft", range(int(resumed[1]) + 1, 41)),
    ):
        assert grad_norm_steps(project, stage) == list(steps), stage

    # 3. nothing changed: a second repro runs no stage
    again = dvc(project, "repro", "sft").stdout
    assert "Running stage" not in again, again

    # 4. talk to the trained sft model in the terminal: a prompt goes in, streamed text comes out, /exit works
    import pexpect

    child = pexpect.spawn(
        str(BIN / "chatpipe"),
        ["chat", "--model", "sft", "-t", "0", "--max-tokens", "24"],
        cwd=str(project),
        env={**project_env(project), "TERM": "dumb"},
        encoding="utf-8",
        timeout=120,
    )
    child.expect(r"chatpipe chat: sft \(stage sft, step 40")
    child.expect("You: ")
    child.sendline("What is 12 plus 7?")
    child.expect("Assistant: ")
    child.expect("\r\n\r\nYou: ")
    assert child.before.strip(), "the sft model streamed no reply"
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_bad_conversation_row_stops_midtrain_before_training(tmp_path):
    """A malformed custom-JSON row names file and line, and the stage fails before any training step."""
    project = make_project(tmp_path)
    bad = project / "bad.jsonl"
    bad.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
        + "\n"
        + json.dumps({"messages": [{"content": "no role"}]})
        + "\n"
    )
    # the stage module directly: artifacts/base is not needed to reach the data check
    mixture = json.dumps([{"task": "customjson", "path": str(bad)}])
    proc = run(project, "python", "-m", "stages.midtrain", check=False, CHATPIPE_MIDTRAIN__MIXTURE=mixture)
    assert proc.returncode != 0
    assert "bad.jsonl:2: malformed conversation row" in proc.stdout + proc.stderr
    assert not (project / "checkpoints" / "midtrain").exists()
