"""issue 15 item 4: `dvc repro -f pretrain` resuming from the final checkpoint rewrites the same
artifact (summary, run ids and all), so nothing downstream re-runs."""

from __future__ import annotations

import json

import pytest

from chatpipe.testing.project import dvc, make_project


@pytest.mark.slow
def test_resume_from_final_keeps_the_summary_and_the_artifact_hash(tmp_path):
    project = make_project(tmp_path, {"pretrain": {"max_steps": 4, "checkpoint_every": 2, "eval_every": 2}})
    dvc(project, "repro", "pretrain")
    base = project / "artifacts" / "base"
    before = {name: (base / name).read_bytes() for name in ("model.pt", "meta.json")}
    meta = json.loads(before["meta.json"])
    assert meta["summary"]["tokens"] > 0 and meta["summary"]["train_seconds"] > 0
    assert meta["mlflow_run_id"]

    dvc(project, "repro", "-f", "--single-item", "pretrain")  # resumes from checkpoints/pretrain/step_000004
    after = {name: (base / name).read_bytes() for name in ("model.pt", "meta.json")}
    assert after == before, (json.loads(after["meta.json"]).get("summary"), meta["summary"])
