"""End to end through the real chain: Prefect flow -> dvc repro -> torchx -> torchrun stage -> MLflow.

Runs in a throwaway git + DVC copy of the repo with small params (chatpipe/testing/project.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chatpipe.settings import dvc_stages
from chatpipe.testing.project import (
    BIN,
    REPO,
    assert_bitwise_equal,
    dvc,
    final_weights,
    make_project,
    mlflow_client,
    prefect_task_runs,
    processes_in,
    project_env,
    run,
    set_params,
)

pytestmark = pytest.mark.slow
FOUNDATION = ["data", "tokenizer", "pretrain"]


def kill_workers_after_checkpoint(proc: subprocess.Popen, project: Path, stage: str, timeout_s: float = 300) -> int:
    """Wait for the stage's first in-progress checkpoint, then SIGKILL its torchrun workers.

    Returns the step of the checkpoint that existed when the workers were killed.
    """
    ckpt_dir = project / "checkpoints" / stage
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = sorted(ckpt_dir.glob("step_*")) if ckpt_dir.exists() else []
        steps = [p for p in steps if (p / "meta.json").exists()]
        if steps:
            break
        if proc.poll() is not None:
            raise AssertionError(f"{stage} ended before it could be killed:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.02)
    else:
        raise AssertionError(f"no {stage} checkpoint appeared within {timeout_s}s")
    workers = [p for p, cmd in processes_in(project) if f"stages.{stage}" in cmd and "torchrun" not in cmd]
    assert workers, "no worker process found to kill"
    for p in workers:
        p.send_signal(signal.SIGKILL)
    return int(steps[-1].name.split("_")[1])


def mlflow_runs(project: Path) -> list[dict]:
    """Every run of the project's MLflow store: name, tags, metric keys, parent id."""
    client = mlflow_client(project)
    exp = client.get_experiment_by_name("chatpipe")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    return [
        {
            "id": r.info.run_id,
            "name": r.info.run_name,
            "status": r.info.status,
            "tags": r.data.tags,
            "metrics": r.data.metrics,
            "params": list(r.data.params),
        }
        for r in runs
    ]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A project on which README command 1 (the Prefect flow, profile tiny) has run the foundation stages."""
    project = make_project(tmp_path_factory.mktemp("pipeline"))
    t0 = time.perf_counter()
    out = run(project, "python", "-m", "flows.pipeline", "--stages", *FOUNDATION)
    print(f"flow took {time.perf_counter() - t0:.1f}s")
    assert "'pretrain': 'ran'" in out.stdout, out.stdout[-3000:]
    (project.parent / "flow-console.log").write_text(out.stdout + out.stderr)  # what a new user sees
    return project


def test_first_run_console_shows_no_traceback_and_no_dvc_warning(finished):
    """A first run prints no traceback that is not a failure (the temporary Prefect server's
    telemetry once logged a sqlite 'database is locked' one) and no DVC warning about empty files."""
    console = (finished.parent / "flow-console.log").read_text()
    assert "Traceback" not in console, console[-4000:]
    assert "is empty" not in console, [line for line in console.splitlines() if "is empty" in line][:5]


def test_flow_trains_and_val_bpb_falls(finished):
    meta = json.loads((finished / "artifacts" / "base" / "meta.json").read_text())
    runs = {r["tags"].get("stage"): r for r in mlflow_runs(finished)}
    history = runs["pretrain"]["metrics"]
    assert meta["summary"]["val_bpb"] == pytest.approx(history["final/val_bpb"])
    # step-0 bpb from the metric history
    history = sorted(
        mlflow_client(finished).get_metric_history(runs["pretrain"]["id"], "val/bpb"), key=lambda m: m.step
    )
    first, last = history[0].value, history[-1].value
    assert last <= 0.7 * first, (first, last)


def test_mlflow_parent_run_with_nested_stage_runs(finished):
    runs = mlflow_runs(finished)
    parents = [r for r in runs if r["tags"].get("stage") == "pipeline"]
    assert len(parents) == 1 and parents[0]["status"] == "FINISHED"
    parent = parents[0]
    assert parent["name"].startswith("pipeline · tiny · ")  # readable: what, which profile, when
    assert parent["tags"]["dvc_lock"] not in ("", "none")
    for stage in FOUNDATION:
        child = next(r for r in runs if r["tags"].get("stage") == stage)
        assert child["tags"]["mlflow.parentRunId"] == parent["id"] and child["name"] == f"{stage} · tiny"
        assert child["tags"]["mlflow.source.git.commit"] and child["tags"]["profile"] == "tiny"
    pretrain = next(r for r in runs if r["tags"].get("stage") == "pretrain")
    assert {"train/loss", "tokens_per_s", "lr_mult", "val/bpb"} <= set(pretrain["metrics"])
    assert "pretrain.depth" in pretrain["params"] and "pretrain.matrix_lr" in pretrain["params"]
    tokenizer = next(r for r in runs if r["tags"].get("stage") == "tokenizer")
    assert tokenizer["metrics"]["ours.bytes_per_token"] > 1.5


def test_second_repro_is_a_noop(finished):
    t0 = time.perf_counter()
    out = dvc(finished, "repro", *FOUNDATION).stdout
    took = time.perf_counter() - t0
    assert "Running stage" not in out and "didn't change" in out, out
    print(f"no-op dvc repro: {took:.2f}s")
    assert took < 10  # target <= 2 s on an idle machine; generous here


def test_flow_run_with_every_stage_up_to_date_keeps_no_mlflow_run(finished, prefect_server):
    before = [r["id"] for r in mlflow_runs(finished) if r["name"] == "pipeline"]
    out = run(finished, "python", "-m", "flows.pipeline", "--stages", *FOUNDATION, PREFECT_API_URL=prefect_server)
    assert "'pretrain': 'skipped'" in out.stdout, out.stdout[-3000:]
    # a nightly schedule over unchanged inputs must not add an empty parent run every night
    assert [r["id"] for r in mlflow_runs(finished) if r["name"] == "pipeline"] == before


def test_kill_9_then_repro_resumes_bitwise_identical(finished):
    reference = final_weights(finished)
    import shutil

    shutil.rmtree(finished / "checkpoints" / "pretrain")
    # Forget DVC's cache, or the re-run would just check out the earlier identical result instead
    # of running the stage (what happens to a kill during a real change of inputs).
    shutil.rmtree(finished / ".dvc" / "cache")
    proc = subprocess.Popen(
        [str(BIN / "dvc"), "repro", "--force", "--single-item", "pretrain"],
        cwd=finished,
        env=project_env(finished),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed_at = kill_workers_after_checkpoint(proc, finished, "pretrain")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, "dvc repro should fail when the workers are killed"
    assert "FAILED" in out, out[-2000:]
    assert list((finished / "checkpoints" / "pretrain").glob("step_*")), "in-progress checkpoints must survive"
    resumed = dvc(finished, "repro", "pretrain").stdout
    import re

    resumed_at = re.search(r"resuming from checkpoints/pretrain/step_(\d+)", resumed)
    assert resumed_at and int(resumed_at.group(1)) >= killed_at, resumed[-3000:]
    assert_bitwise_equal(final_weights(finished), reference)


def test_flow_retry_resumes_killed_stage_to_identical_weights(finished, prefect_api_here, tmp_path, monkeypatch):
    """Prefect retries a stage whose workers were SIGKILLed; the retry resumes to the uninterrupted result.

    A second clean copy with the same seed: final weights and metrics equal the first copy's bit for bit.
    """
    import threading

    from flows.pipeline import pipeline

    reference = final_weights(finished)
    # Prefect's retry and the resume are the subject; a killed stage's MLflow run under a re-run:
    # tests/test_chaos.py. The weights do not depend on tracking: they equal the tracked reference.
    project = make_project(tmp_path / "flaky", {"tracking": {"enabled": False}})
    for key, value in project_env(project).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(project)
    killed: list[int] = []

    def killer():
        class _Running:  # kill_workers_after_checkpoint polls the process; the flow is this process
            stdout = None

            @staticmethod
            def poll():
                return None

        killed.append(kill_workers_after_checkpoint(_Running, project, "pretrain", timeout_s=600))

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    state = pipeline(stages=FOUNDATION, return_state=True)
    assert state.is_completed(), state
    runs = prefect_task_runs("pretrain", state.state_details.flow_run_id)
    thread.join(timeout=5)
    assert killed, "the pretrain workers were never killed"
    assert len(runs) == 1 and runs[0].run_count == 2, [(r.name, r.run_count) for r in runs]
    assert_bitwise_equal(final_weights(project), reference)
    bpb = [
        json.loads((p / "artifacts" / "base" / "meta.json").read_text())["summary"]["val_bpb"]
        for p in (finished, project)
    ]
    assert bpb[0] == bpb[1]


def test_pretrain_param_change_reruns_only_pretrain(finished):
    set_params(finished, {"pretrain": {"max_steps": 12}})
    out = dvc(finished, "repro", *FOUNDATION).stdout
    assert "Running stage 'pretrain'" in out
    assert "Running stage 'tokenizer'" not in out and "Running stage 'data'" not in out


def test_bad_params_stop_the_flow_and_write_nothing(tmp_path):
    project = make_project(tmp_path, {"pretrain": {"depth": -3, "no_such_key": 1}})
    before = {p for p in project.rglob("*") if ".git" not in p.parts}
    out = run(project, "python", "-m", "flows.pipeline", check=False)
    assert out.returncode == 2
    assert "pretrain.depth = -3" in out.stderr and "greater than or equal to 1" in out.stderr
    assert "pretrain.no_such_key" in out.stderr and "unknown key" in out.stderr
    after = {p for p in project.rglob("*") if ".git" not in p.parts and "__pycache__" not in p.parts}
    assert after - before == set()


def test_pipeline_stage_order_is_dvc_order():
    stages = list(dvc_stages())
    assert stages[:4] == ["profile", *FOUNDATION]  # profile: the active overlay files every stage reads


def test_the_flows_read_dvc_yaml_when_asked_not_at_import():
    """As the settings module's rule says: importing flows.pipeline or flows.deploy reads no dvc.yaml
    (counted by a spy on dvc_stages); running them does."""
    code = (
        "import chatpipe.settings as s, chatpipe.settings.pipeline as p\n"
        "calls, real = [], p.dvc_stages\n"
        "s.dvc_stages = p.dvc_stages = lambda *a: calls.append(a) or real(*a)\n"
        "import flows.pipeline, flows.deploy\n"
        "assert calls == [], calls\n"
        "try:\n    flows.deploy.main(['--stages', 'no_such_stage'])\nexcept SystemExit as e:\n    print(e.code, len(calls))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"]  # argparse refused the stage: the choices were read then, once
    assert "invalid choice: 'no_such_stage'" in out.stderr


def test_the_reward_model_trains_only_when_rl_reads_it_by_one_test(params_file):
    """The default RL trains on the verifier: the one test both entry points go by (the flow, and the
    stage's `--if-read` command that `dvc repro` runs) says the stage has nothing to train, and why; a
    model-scored RL set in params.yaml, or reward_model.train_when: always, trains it. The flow itself
    leaves no stage out (tests/test_pipeline_definition.py runs DVC on it)."""
    import yaml

    from chatpipe.settings import RewardModelSettings, RLSettings, load_section, reward_model_unread

    def unread() -> str:
        return reward_model_unread(load_section(RLSettings), load_section(RewardModelSettings))

    assert "rl.reward.source = verifier reads no reward model" in unread()
    raw = yaml.safe_load(params_file.read_text())
    for section, key, value in (("rl", "reward", {"source": "model"}), ("reward_model", "train_when", "always")):
        changed = {**raw, section: {**raw[section], key: value}}
        params_file.write_text(yaml.safe_dump(changed))
        assert unread() == "", (section, key)


def test_dvc_push_then_pull_restores_outputs(finished):
    import shutil

    dvc(finished, "push", *FOUNDATION)
    remote = finished.parent / "chatpipe-dvc-remote"  # the default remote in .dvc/config: beside the repo
    assert any(remote.rglob("*")), "nothing was pushed"
    before = (finished / "artifacts" / "base" / "model.pt").read_bytes()
    shutil.rmtree(finished / "artifacts")
    shutil.rmtree(finished / ".dvc" / "cache")
    dvc(finished, "pull", *FOUNDATION)
    assert (finished / "artifacts" / "base" / "model.pt").read_bytes() == before
    assert "didn't change" in dvc(finished, "repro", *FOUNDATION).stdout


def test_dvc_experiment_shows_up_with_its_params(finished):
    dvc(finished, "exp", "run", "-n", "shorter", "-S", "pretrain.max_steps=8", "pretrain")
    shown = json.loads(dvc(finished, "exp", "show", "--json").stdout)
    text = json.dumps(shown)
    assert "shorter" in text and '"max_steps": 8' in text
    diff = dvc(finished, "params", "diff", "HEAD").stdout
    assert "pretrain.max_steps" in diff
    # its MLflow run is named after the DVC experiment and nested under one run for the experiment
    runs = mlflow_runs(finished)
    (exp_run,) = [r for r in runs if r["tags"].get("dvc_exp") == "shorter" and r["tags"]["stage"] == "pretrain"]
    assert exp_run["name"] == "pretrain · tiny · exp shorter"
    parent = next(r for r in runs if r["id"] == exp_run["tags"]["mlflow.parentRunId"])
    assert parent["name"] == "exp shorter · tiny" and parent["status"] == "FINISHED"
