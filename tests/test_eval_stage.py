"""End to end: data -> tokenizer -> pretrain -> eval -> report through `dvc repro`, in a throwaway project."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from chatpipe.testing.project import SMALL_EVAL, dvc, make_project, run

EVAL_PARAMS = {
    "pretrain": {"max_steps": 8, "eval_every": 4, "checkpoint_every": 4},  # still 3 bpb points for the plot
    "eval": {
        **SMALL_EVAL,
        "chatcore_stages": ["base"],
        "chatcore_tasks": {
            "MMLU": {"task": "tinyworld_mc"},
            "GSM8K": {"task": "tinyworld_gsm"},
            "ARC-Easy": {"task": "arc_easy", "source": "local", "path": "no/such/dir"},
        },
    },
    "report": {"cost_per_hour": 3.6},
}


def _base_only_pipeline(project: Path) -> None:
    """Keep the stages up to pretrain plus eval and report, with eval depending on the base model only.

    The chat stages are tested elsewhere; here eval must work with whichever model dirs exist.
    """
    path = project / "dvc.yaml"
    spec = yaml.safe_load(path.read_text())
    keep = ("data", "tokenizer", "pretrain", "eval", "report")
    spec["stages"] = {k: v for k, v in spec["stages"].items() if k in keep}
    deps = spec["stages"]["eval"]["deps"]
    spec["stages"]["eval"]["deps"] = [d for d in deps if d not in ("artifacts/mid", "artifacts/sft", "artifacts/rl")]
    path.write_text(yaml.safe_dump(spec, sort_keys=False))


@pytest.mark.slow
def test_eval_and_report_through_dvc_under_a_parent_run(tmp_path: Path) -> None:
    project = make_project(tmp_path / "p", EVAL_PARAMS)
    _base_only_pipeline(project)
    # the flow's job, done by hand: a parent MLflow run whose id the stages nest under
    made = run(
        project,
        "python",
        "-c",
        (
            "from chatpipe import tracking; from chatpipe.settings import TrackingSettings, load_section; import mlflow;"
            "e = tracking.configure(load_section(TrackingSettings));"
            "print(mlflow.MlflowClient().create_run(e, run_name='pipeline').info.run_id)"
        ),
    )
    parent = made.stdout.strip().splitlines()[-1]
    run(project, "dvc", "repro", "report", CHATPIPE_PARENT_RUN_ID=parent)

    results = json.loads((project / "artifacts/eval/results.json").read_text())
    base = results["stages"]["base"]
    assert list(results["stages"]) == ["base"]
    assert 0 < base["bpb"] < 8
    core = base["core_tinyworld"]  # no DCLM bundle here: only the tiny-world tasks, under their own name
    assert "core" not in base
    assert set(core["tasks"]) == {
        "tinyworld_facts_mc",
        "tinyworld_rivers_schema",
        "tinyworld_facts_lm",
        "tinyworld_arith_lm",
        "tinyworld_spell_lm",
    }
    assert core["core"] == pytest.approx(sum(t["centered"] for t in core["tasks"].values()) / 5)
    chat = base["chatcore"]
    # params merge into the default task map; the ARC files are not in the throwaway project; the
    # tiny-world stand-ins report under their own names, never the benchmark's
    assert set(chat["tasks"]) == {"tinyworld_mc", "tinyworld_gsm", "SpellingBee"}  # tiny runs no HumanEval
    assert chat["tasks"]["tinyworld_gsm"]["stands_in_for"] == "GSM8K"
    assert set(chat["skipped"]) == {"ARC-Easy", "ARC-Challenge"}
    assert chat["tasks"]["tinyworld_gsm"]["num_examples"] == 2 and chat["tasks"]["tinyworld_mc"]["num_examples"] == 6
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert base["dvc_stage_hash"] != "none" and "eval" in lock["stages"]

    md = (project / "artifacts/report/report.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| tiny-world CORE |"))
    assert f"{core['core']:.4f}" in row
    assert "| tinyworld_mc |" in md and "ARC-Easy" in md  # skipped task is listed with its reason
    assert "GSM8K" not in md.split("## Params")[0]
    plots = sorted(p.name for p in (project / "artifacts/report").glob("*.png"))
    assert {"loss.png", "bpb.png"} <= set(plots)
    for stage in ("pretrain", "eval"):
        assert f"| {stage} |" in md

    check = run(
        project,
        "python",
        "-c",
        (
            "import json, mlflow; from chatpipe import tracking; from chatpipe.settings import TrackingSettings, load_section;"
            "tracking.configure(load_section(TrackingSettings)); c = mlflow.MlflowClient();"
            f"print(sorted(a.path for a in c.list_artifacts('{parent}', 'report')));"
            "v = c.search_model_versions(\"name = 'chatpipe'\")[0]; print(v.tags['stage'], v.tags['tiny-world CORE'])"
        ),
    )
    listed, registered = check.stdout.strip().splitlines()[-2:]
    assert "report/report.md" in listed and "report/loss.png" in listed
    assert registered == f"base {core['core']:.4f}"

    # nothing changed: a second repro skips both stages
    again = dvc(project, "repro", "report")
    assert "didn't change, skipping" in again.stdout and "Running stage 'eval'" not in again.stdout

    # the report forced to run again: same weights, so no second version; @latest answers a prompt
    dvc(project, "repro", "--force", "--single-item", "report")
    served = run(
        project,
        "python",
        "-c",
        (
            "import json, mlflow; from chatpipe import tracking; from chatpipe.settings import TrackingSettings, load_section;"
            "tracking.configure(load_section(TrackingSettings)); c = mlflow.MlflowClient();"
            "print(len(c.search_model_versions(\"name = 'chatpipe'\")), c.get_model_version_by_alias('chatpipe', 'champion').version);"
            "m = mlflow.pyfunc.load_model('models:/chatpipe@latest');"
            "print(json.dumps(m.predict(['What is 2 + 3?'], params={'max_tokens': 8})))"
        ),
    )
    counts, reply = served.stdout.strip().splitlines()[-2:]
    assert counts == "1 1"
    (text,) = json.loads(reply)
    assert isinstance(text, str) and text.strip()


def test_core_tasks_named_in_params_must_exist(tmp_path: Path, params_file: Path) -> None:
    """A task asked for by label whose file is missing fails naming the task and the path (not skipped)."""
    import torch

    from chatpipe.evals.core import evaluate_core
    from chatpipe.runtime import Runtime
    from chatpipe.settings import EvalSettings, load_section
    from stages.eval import core_suites

    (tmp_path / "bundle").mkdir()
    cfg = load_section(
        EvalSettings, {"core_bundle_dir": str(tmp_path / "bundle"), "core_tasks": ["copa"], "core_tinyworld": False}
    )
    rt = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    [(key, config, bundle)] = core_suites(cfg, tmp_path / "work", rt)
    assert key == "core" and [t.label for t in config] == ["copa"] and config[0].required
    with pytest.raises(FileNotFoundError, match=r"'copa' is required but .*bundle/copa.jsonl is missing"):
        evaluate_core(None, None, config, bundle, device="cpu", max_seq_len=64, scorer=lambda *a: 0)
    with pytest.raises(ValueError, match=r"eval.core_tasks = \['nope'\]: not in the CORE config"):
        core_suites(
            load_section(EvalSettings, {"core_bundle_dir": str(bundle), "core_tasks": ["nope"]}), tmp_path / "work", rt
        )


def test_core_bundle_is_fetched_when_missing_and_nested_files_are_found(tmp_path: Path, params_file: Path) -> None:
    """eval.core_bundle_url: a zip laid out like the published bundle (category folders) is fetched and scored."""
    import zipfile

    import torch

    from chatpipe.evals.core import evaluate_core
    from chatpipe.runtime import Runtime
    from chatpipe.settings import EvalSettings, load_section
    from stages.eval import core_suites

    rows = [{"query": f"Question: {i}?", "choices": ["yes", "no"], "gold": i % 2} for i in range(6)]
    with zipfile.ZipFile(tmp_path / "bundle.zip", "w") as zf:
        zf.writestr("eval_bundle/eval_data/commonsense_reasoning/copa.jsonl", "\n".join(map(json.dumps, rows)))
    dest = tmp_path / "data" / "eval_bundle"
    cfg = load_section(
        EvalSettings,
        {
            "core_bundle_dir": str(dest),
            "core_bundle_url": (tmp_path / "bundle.zip").as_uri(),
            "core_tasks": ["copa"],
            "core_tinyworld": False,
        },
    )
    rt = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    [(_, config, bundle)] = core_suites(cfg, tmp_path / "work", rt)
    assert bundle == dest and (dest / "eval_data" / "commonsense_reasoning" / "copa.jsonl").is_file()

    out = evaluate_core(
        None, None, config, bundle, device="cpu", max_seq_len=64, scorer=lambda task, row, prompts: row["gold"]
    )  # picks the gold option: accuracy 1.0
    assert out["tasks"]["copa"]["num_examples"] == 6 and out["tasks"]["copa"]["accuracy"] == 1.0


def test_tiny_stand_ins_are_labelled_with_their_own_names(params_file: Path) -> None:
    """The tiny profile runs tinyworld_mc/tinyworld_gsm in MMLU's/GSM8K's place: results, skips and
    MLflow keys carry the task's name; a benchmark's name only where that benchmark ran."""
    from chatpipe.evals.metrics import chatcore_label
    from chatpipe.settings import EvalSettings, load_section
    from stages.eval import chat_tasks, flat_metrics

    tasks, skipped = chat_tasks(load_section(EvalSettings))
    labels = {chatcore_label(slot, task.name) for slot, task in tasks.items()} | set(skipped)
    assert labels == {"ARC-Easy", "ARC-Challenge", "tinyworld_mc", "tinyworld_gsm", "SpellingBee"}

    missing = {"GSM8K": {"task": "gsm8k", "source": "local", "path": "no/such/dir"}}
    _, skipped = chat_tasks(load_section(EvalSettings, {"chatcore_tasks": missing}))
    assert "GSM8K" in skipped  # the real benchmark keeps its name, skipped or not
    missing = {"GSM8K": {"task": "customjson", "path": "no/such.jsonl"}}
    _, skipped = chat_tasks(load_section(EvalSettings, {"chatcore_tasks": missing}))
    assert "customjson" in skipped and "GSM8K" not in skipped

    tiny = {"bpb": 1.0, "chatcore": {"chatcore": 0.5, "tasks": {"tinyworld_gsm": {"accuracy": 0.99}}}}
    assert set(flat_metrics("sft", tiny)) == {"sft/bpb", "sft/ChatCORE", "sft/tinyworld_gsm"}
