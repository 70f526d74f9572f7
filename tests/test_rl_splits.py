"""RL's figures on two splits: val for tuning, test held out (rl.test_split), measured alike.

The stage runs in a throwaway project with a byte-level tokenizer and a tiny random init model (as in
tests/test_stage_rl.py): these tests check what is evaluated and what it moves, not learning.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe import runtime
from chatpipe.io import sha256_file
from chatpipe.rl import problems as rl_problems
from chatpipe.settings import ParamsError, RLSettings, load_section
from chatpipe.testing.project import SMALL_RL, plotted_curve, project_env
from tests.test_stage_rl import setup_project as rl_project

RT = runtime.Runtime(0, 0, 1, None, None)


def setup_project(tmp_path: Path, **rl_overrides) -> Path:
    """The RL stage tests' project, without the replay."""
    return rl_project(tmp_path, {"init_dir": "init_model", **SMALL_RL}, **rl_overrides)


def stage(project: Path, *args: str) -> str:
    """Run the rl stage to its end in ``project``; its output."""
    proc = subprocess.run(
        [sys.executable, "-m", "stages.rl", *args],
        cwd=project,
        env=project_env(project, CHATPIPE_TRACKING__ENABLED="false"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    return proc.stdout


def results(project: Path) -> tuple[dict, str]:
    """(metrics/rl.json's values, the final model's sha256)."""
    metrics = json.loads((project / "metrics" / "rl.json").read_text())["rl"]
    return metrics, sha256_file(project / "artifacts" / "rl" / "model.pt")


def fresh(project: Path) -> None:
    for d in ("artifacts/rl", "checkpoints/rl", "metrics/rl.json", "plots/rl"):
        shutil.rmtree(project / d, ignore_errors=True) if (project / d).is_dir() else (project / d).unlink(True)


@pytest.mark.slow
def test_test_split_is_evaluated_beside_val_and_moves_neither_val_nor_training(tmp_path):
    """With the default test_split, pass@k on test at every point val is measured (start, every
    eval_every, end), in metrics/rl.json as first_eval_test / final_eval_test; with none, no test
    figure, and the val figures and the trained weights are the same either way."""
    project = setup_project(tmp_path, eval_every=2, max_steps=4)
    stage(project)
    with_test, sha_with = results(project)
    assert {"first_eval_test/pass_at_1", "final_eval_test/pass_at_2"} <= set(with_test), with_test
    assert len(plotted_curve(project, "rl", "eval_test_pass_at_1")) == 3  # steps 0, 2 and 4
    assert len(plotted_curve(project, "rl", "eval_pass_at_1")) == 3

    fresh(project)
    stage(project, "--test_split=none")
    without, sha_without = results(project)
    assert not [k for k in without if "eval_test" in k], without
    assert sha_with == sha_without  # the test eval samples with its own seeds: training's streams untouched
    val = {k: v for k, v in with_test.items() if k.startswith(("first_eval/", "final_eval/"))}
    assert val and val == {k: without[k] for k in val}


def test_test_split_settings_name_the_key_and_the_allowed_values():
    assert load_section(RLSettings, []).test_split == "test"
    assert load_section(RLSettings, []).eval_split == "val"
    with pytest.raises(
        ParamsError, match=r"rl.test_split = 'holdout' \(from command line --test_split\).*'val', 'test' or 'none'"
    ):
        load_section(RLSettings, ["--test_split=holdout"])
    both = load_section(RLSettings, ["--eval_split=test", "--test_split=val"])
    assert rl_problems.evaluates_test_split(both) and len(rl_problems.load_test_problems(both, RT)) == 256
    # none, or the tuning split itself (the speedrun profile evaluates test only): no second evaluation
    for flags in (["--test_split=none"], ["--eval_split=test"], ["--test_split=val"]):
        cfg = load_section(RLSettings, flags)
        assert not rl_problems.evaluates_test_split(cfg) and rl_problems.load_test_problems(cfg, RT) == []


def test_the_default_task_has_test_problems_disjoint_from_val_and_train():
    cfg = load_section(RLSettings, [])
    test = rl_problems.load_test_problems(cfg, RT)
    assert len(test) == cfg.eval_problems

    def asked(problems) -> set[str]:
        return {p.conversation["messages"][0]["content"] for p in problems}

    train, val = rl_problems.load_rl_problems(cfg, RT)
    assert len(asked(test)) == cfg.eval_problems and not asked(test) & (asked(val) | asked(train))
    # two ranks evaluate disjoint halves of the same problems
    halves = [rl_problems.load_test_problems(cfg, runtime.Runtime(r, r, 2, None, None)) for r in (0, 1)]
    assert asked(halves[0]) | asked(halves[1]) == asked(test) and not asked(halves[0]) & asked(halves[1])


def test_a_task_with_no_problems_in_the_test_split_stops_naming_the_key(monkeypatch):
    monkeypatch.setattr(rl_problems, "load_problems", lambda *a, **k: [])
    with pytest.raises(ValueError, match=r"rl.test_split = 'test': task 'tinyworld_arith' has no problems"):
        rl_problems.load_test_problems(load_section(RLSettings, []), RT)


@pytest.mark.slow
def test_a_rerun_with_other_eval_settings_measures_first_and_final_alike(tmp_path):
    """A rerun in a reused workdir used to resume from the old run's final checkpoint whenever only
    eval settings changed (they are resume-neutral), and so reported the old run's first_eval (old
    split, old problems) beside a final_eval measured with the new settings. The eval settings now
    identify the run: such a rerun starts at step 0; one that changes only eval_every still resumes."""
    project = setup_project(tmp_path, eval_every=0, max_steps=2, checkpoint_every=2)
    stage(project)
    first_meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())

    out = stage(project, "--eval_problems=2")
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    assert "resuming from" not in out, "resumed the run whose first_eval used 4 problems"
    assert meta["settings"]["eval_problems"] == 2 and meta["fingerprint"] != first_meta["fingerprint"]
    assert {"first_eval/pass_at_1", "final_eval/pass_at_1", "first_eval_test/pass_at_1"} <= set(meta["summary"])

    out = stage(project, "--eval_problems=2", "--eval_every=1")  # when, not what, is measured: resumes
    assert "resuming from" in out
