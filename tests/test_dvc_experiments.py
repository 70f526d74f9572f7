"""DVC experiments compare: metrics and curves per stage, a readable `dvc exp show`, profiles out of params."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import yaml

from chatpipe.testing.project import dvc, make_project

REPO = Path(__file__).resolve().parents[1]


def test_every_training_stage_declares_metrics_and_plots():
    config = yaml.safe_load((REPO / "dvc.yaml").read_text())
    stages = config["stages"]
    for name in ["tokenizer", "pretrain", "midtrain", "sft", "rl", "eval"]:
        assert stages[name]["metrics"] == [{f"metrics/{name}.json": {"cache": False}}], name
    for name in ["pretrain", "midtrain", "sft", "rl"]:
        assert {f"plots/{name}": {"cache": False}} in stages[name]["outs"], name
    for name, stage in stages.items():
        params = [p for p in stage.get("params", []) if isinstance(p, str)]
        assert "profiles" not in params, f"{name}: profile overlays must not be DVC params"
        if name != "profile":
            assert f"profile/{name}.yaml" in stage["deps"], f"{name} does not follow the active profile's overlay"
    plotted = {path for plot in config["plots"] for spec in plot.values() for path in spec["y"]}
    assert {"plots/pretrain/train_loss.csv", "plots/pretrain/val_bpb.csv", "plots/rl/reward_mean.csv"} <= plotted


@pytest.mark.slow
def test_two_experiments_show_changed_metrics_in_diff_and_exp_show(tmp_path):
    # DVC's experiments are the subject; MLflow (tests/test_pipeline.py) stays off: ~5 s of CPU a stage process
    project = make_project(tmp_path / "project", {"tracking": {"enabled": False}})
    dvc(project, "exp", "run", "pretrain", "-S", "pretrain.max_steps=6", "-n", "steps6")
    dvc(project, "exp", "run", "pretrain", "-S", "pretrain.max_steps=12", "-n", "steps12")

    # the workspace holds the last experiment's files: a metrics file and curves of its 12 steps
    metrics = json.loads((project / "metrics" / "pretrain.json").read_text())["pretrain"]
    assert metrics["tokens"] == 12 * 1024 and metrics["val_bpb"] > 0 and metrics["tokens_per_s"] > 0
    loss = list(csv.DictReader((project / "plots" / "pretrain" / "train_loss.csv").open()))
    assert [int(r["step"]) for r in loss] == list(range(1, 13))

    diff = json.loads(dvc(project, "metrics", "diff", "steps6", "steps12", "--json").stdout)
    changed = diff["metrics/pretrain.json"]
    assert changed["pretrain.tokens"] == {"old": 6 * 1024, "new": 12 * 1024, "diff": 6 * 1024}
    assert changed["pretrain.val_bpb"]["old"] != changed["pretrain.val_bpb"]["new"]
    assert "metrics/tokenizer.json" not in diff  # same tokenizer in both: nothing to report

    table = dvc(project, "exp", "show", "--csv").stdout
    rows = {r["Experiment"]: r for r in csv.DictReader(io.StringIO(table)) if r["Experiment"]}
    assert {"steps6", "steps12"} <= set(rows), table[:2000]
    assert (rows["steps6"]["pretrain.max_steps"], rows["steps12"]["pretrain.max_steps"]) == ("6", "12")
    assert rows["steps6"]["pretrain.val_bpb"] != rows["steps12"]["pretrain.val_bpb"]
    assert float(rows["steps12"]["pretrain.tokens"]) == 12 * 1024
    header = table.splitlines()[0].split(",")
    assert not [c for c in header if "speedrun" in c], "profile overlays leaked into the params"

    # docs/dvc.md's readable view: only what differs between the experiments
    short = dvc(project, "exp", "show", "--csv", "--only-changed").stdout.splitlines()[0].split(",")
    assert "pretrain.max_steps" in short and "pretrain.val_bpb" in short and len(short) < 40, short

    # `dvc plots diff` renders both experiments' curves
    out = tmp_path / "plots"
    dvc(project, "plots", "diff", "steps6", "steps12", "-o", str(out))
    html = (out / "index.html").read_text()
    assert "train_loss" in html and "steps12" in html
