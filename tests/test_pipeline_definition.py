"""One pipeline definition: `dvc repro` and the Prefect flow run the same stages, and DVC sees what RL reads.

The reward_model stage's command (``python -m chatpipe.launch reward_model --if-read``) trains only when
RL reads a reward model and otherwise writes a marker, by the one test both entry points go by
(``chatpipe.settings.reward_model_unread``); ``rl`` depends on ``artifacts/reward_model`` in dvc.yaml, and
an environment override that would change whether the stage trains is refused. The real ``dvc`` CLI runs
in a throwaway project; upstream outputs are stand-ins (no training), so each test takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatpipe.settings import ParamsError, check_env_keeps_stages, dvc_stages
from chatpipe.testing.project import dvc, make_project, run, set_params

MARKER = Path("artifacts/reward_model/not_read.json")


def stand_ins(project: Path, *dirs: str) -> None:
    """Upstream stages' outputs as a file each: DVC hashes them like any other."""
    for d in dirs:
        (project / d).mkdir(parents=True, exist_ok=True)
        (project / d / "x").write_text(d)


def stale(project: Path, stage: str) -> dict:
    """``dvc status --json <stage>``: the stale stages among it and its upstream, and why."""
    return json.loads(dvc(project, "status", "--json", stage).stdout)


def test_with_reward_source_model_retraining_the_reward_model_makes_rl_stale(tmp_path):
    """rl's lock is recorded over stand-in deps and outs; then the reward model is "retrained" (its
    model file changes): `dvc status` calls rl stale for it. Before, rl had no such dependency."""
    project = make_project(tmp_path / "p", {"rl": {"reward": {"source": "model"}}})
    stand_ins(project, "artifacts/tokenizer", "artifacts/sft", "artifacts/reward_model", "artifacts/rl", "plots/rl")
    (project / "metrics").mkdir(exist_ok=True)
    (project / "metrics" / "rl.json").write_text("{}")
    dvc(project, "commit", "-f", "--force", "rl")
    assert "rl" not in stale(project, "rl")
    (project / "artifacts" / "reward_model" / "x").write_text("the retrained model")
    why = stale(project, "rl")["rl"]
    assert {"changed deps": {"artifacts/reward_model": "modified"}} in why, why
    dag = dvc(project, "dag", "--dot", "rl").stdout
    assert '"reward_model" -> "rl"' in dag


def test_with_the_verifier_default_dvc_repro_and_the_flow_run_the_same_stages(tmp_path):
    """Under the default (RL on the verifier) the flow runs every stage dvc.yaml has, as `dvc repro`
    does (before, it left the reward model out while `dvc repro` trained it), and the reward_model
    stage's own command, run by `dvc repro`, writes the marker instead of training. Switching
    rl.reward.source in params.yaml makes the stage stale, so it then trains."""
    from flows.pipeline import flow_stages

    project = make_project(tmp_path / "p")
    assert flow_stages() == list(dvc_stages())
    cmd = dvc(project, "stage", "list", "--name-only").stdout.split()
    assert cmd == list(dvc_stages())  # DVC's stages, in the project the flow runs on

    stand_ins(project, "artifacts/tokenizer", "artifacts/sft")
    out = dvc(project, "repro", "--single-item", "reward_model").stdout
    assert "python -m chatpipe.launch reward_model --if-read" in out and "not trained" in out
    marker = json.loads((project / MARKER).read_text())
    assert marker["trained"] is False and "rl.reward.source = verifier reads no reward model" in marker["why"]
    assert sorted(p.name for p in (project / "artifacts" / "reward_model").iterdir()) == ["not_read.json"]
    assert json.loads((project / "metrics" / "reward_model.json").read_text()) == {"reward_model": {"trained": 0}}
    assert "reward_model" not in stale(project, "reward_model")

    set_params(project, {"rl": {"reward": {"source": "model"}}})
    why = stale(project, "reward_model")["reward_model"]
    assert {"changed deps": {"params.yaml": {"rl.reward.source": "modified"}}} in why, why


def test_an_env_override_that_changes_which_stages_train_is_refused(tmp_path, params_file, monkeypatch):
    """CHATPIPE_RL__REWARD__SOURCE=model over a verifier params.yaml would train the reward model while
    DVC records the verifier's params: the launcher (what dvc.yaml runs) refuses it naming the variable
    and params.yaml, before writing anything. An override that leaves the answer alone passes."""
    project = make_project(tmp_path / "p")
    stand_ins(project, "artifacts/tokenizer", "artifacts/sft")
    cmd = ["python", "-m", "chatpipe.launch", "reward_model", "--if-read"]
    proc = run(project, *cmd, check=False, CHATPIPE_RL__REWARD__SOURCE="model")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "environment variable CHATPIPE_RL__REWARD__SOURCE" in proc.stderr
    assert "set rl.reward.source in params.yaml" in proc.stderr
    assert not (project / "artifacts" / "reward_model").exists()

    monkeypatch.setenv("CHATPIPE_REWARD_MODEL__TRAIN_WHEN", "always")
    with pytest.raises(ParamsError, match=r"CHATPIPE_REWARD_MODEL__TRAIN_WHEN: .*set reward_model.train_when in"):
        check_env_keeps_stages()
    monkeypatch.setenv("CHATPIPE_REWARD_MODEL__TRAIN_WHEN", "read")  # what params.yaml says: the same stages
    check_env_keeps_stages()


def test_rl_reading_the_marker_says_to_train_the_reward_model(tmp_path):
    """A model-scored RL that finds the marker (a profile switched rl.reward.source after the stage
    ran) is told what happened and what to run, not that the dir is "not a reward model"."""
    from chatpipe.launch import write_not_read
    from chatpipe.rl.reward_model import load_reward_model

    project = make_project(tmp_path / "p")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(project)
        write_not_read("rl.reward.source = verifier reads no reward model")
    with pytest.raises(ValueError, match=r"holds no reward model: the reward_model stage wrote .*not_read.json"):
        load_reward_model(project / "artifacts" / "reward_model")
