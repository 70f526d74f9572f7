"""docs/own-data.md as written: its yaml blocks go into params.yaml, its bash blocks run in order, in a
throwaway project (tests/project.py), on its example files (Spanish text, chats, pairs, problems and
a verifier). Steps are fewer and the model smaller than on the page (SHRINK); data, tasks, verifier
and commands are the page's own, so page and test cannot drift. Every stage runs, and RL's pass@1
on the verifier rises."""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path

import pytest
import yaml

from chatpipe.testing.project import REPO, dvc, make_project, run, set_params

DOC = REPO / "docs" / "own-data.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)

# Only sizes and step counts: what the page trains on and how is left as written.
SHRINK = {
    "pretrain": {"max_steps": 60, "depth": 2, "eval_every": 30, "checkpoint_every": 30, "sample_every": 0},
    "midtrain": {"max_steps": 12, "eval_every": 0, "checkpoint_every": 6},
    "sft": {"max_steps": 40, "eval_every": 0, "checkpoint_every": 20},
    "reward_model": {"max_steps": 6, "eval_every": 3, "checkpoint_every": 3},
    "rl": {"max_steps": 40, "checkpoint_every": 20, "log_every": 5},
}


def walkthrough(doc: Path = DOC) -> tuple[list[dict], list[str]]:
    """The page's params overlays (its yaml blocks) and commands (its bash blocks' lines), in order."""
    overlays, commands = [], []
    for lang, body in BLOCK.findall(doc.read_text()):
        if lang == "yaml":
            overlays.append(yaml.safe_load(body))
        elif lang == "bash":
            commands += [line for line in body.splitlines() if line.strip() and not line.startswith("#")]
    return overlays, commands


def test_the_page_has_params_and_a_command_for_every_stage():
    overlays, commands = walkthrough()
    assert overlays and overlays[0]["rl"]["reward"]["verifier"] == "custom"
    assert any("make_files.py" in c for c in commands)
    for stage in ("sft", "reward_model", "rl"):
        assert f"dvc repro {stage}" in commands


@pytest.mark.slow
def test_walkthrough_as_written_trains_every_stage_and_rl_raises_pass_at_1_on_the_users_verifier(tmp_path):
    project = make_project(tmp_path, small=False)
    overlays, commands = walkthrough()
    for overlay in [*overlays, SHRINK]:
        set_params(project, overlay)
    times = {}
    for command in commands:
        t0 = time.perf_counter()
        out = run(project, *shlex.split(command))
        times[command] = round(time.perf_counter() - t0, 1)
    print("walkthrough times (s):", json.dumps(times, ensure_ascii=False))

    tokenizer = json.loads((project / "metrics" / "tokenizer.json").read_text())["tokenizer"]
    assert tokenizer["roundtrip_docs"] > 0 and tokenizer["roundtrip_failures"] == 0
    manifest = json.loads((project / "artifacts" / "data" / "manifest.json").read_text())
    assert manifest["source"] == "local" and "val.parquet" in manifest["files"]
    for stage in ("base", "mid", "sft", "reward_model", "rl"):
        assert (project / "artifacts" / stage / "model.pt").is_file(), stage
    rl = json.loads((project / "metrics" / "rl.json").read_text())["rl"]
    print("rl metrics:", {k: v for k, v in rl.items() if "pass" in k or "verifier" in k})
    assert rl["verifier_calls"] > 0 and rl["verifier_errors"] == 0
    assert rl["final_eval/pass_at_1"] > rl["first_eval/pass_at_1"], rl
    assert out.stdout.strip(), "chatpipe chat printed no reply"

    # editing the verifier's file makes rl, and only what follows it, stale
    assert "rl" not in dvc(project, "status", "rl").stdout
    verifier = project / overlays[0]["rl"]["reward"]["verifier_file"]
    verifier.write_text(verifier.read_text() + "\n# stricter next time\n")
    status = dvc(project, "status", "rl").stdout
    assert (
        "rl:" in status
        and "changed deps" in status
        and str(Path(overlays[0]["rl"]["reward"]["verifier_file"])) in status
    )
