"""The `rehearsal_gpu` profile: the speedrun's GPU code paths on CPU (bf16 autocast, compiled model and
optimizer, emulated FP8, the automatic batch / LR / weight-decay derivation, 2 ranks over gloo, every
speedrun model option), run through dvc in a throwaway project, each path checked in what the run
logged rather than in what the profile asks for."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from chatpipe.model.fp8 import CPU_TEST_ENV
from chatpipe.settings import PretrainSettings, load_section
from chatpipe.testing.project import BIN, loss_curve, make_project, newest_pretrain_run, run

# The keys rehearsal_gpu may set itself: sizes, and the two switches that make CPU take the GPU's
# paths (auto would pick float32 and no compile on CPU). Every other pretrain key is the speedrun's.
SIZE_KEYS = {
    "depth",
    "head_dim",
    "n_kv_head",
    "sequence_len",
    "device_batch_size",
    "target_param_data_ratio",
    "max_steps",
    "warmup_steps",
    "eval_every",
    "eval_tokens",
    "sample_every",
    "checkpoint_every",
    "log_every",
    "dtype",
    "compile",
}


def pretrain_settings(profile: str, monkeypatch) -> PretrainSettings:
    monkeypatch.setenv("CHATPIPE_PROFILE", profile)
    return load_section(PretrainSettings)


def test_rehearsal_gpu_keeps_the_speedrun_recipe(params_file, monkeypatch):
    speedrun = pretrain_settings("speedrun", monkeypatch).model_dump()
    rehearsal = pretrain_settings("rehearsal_gpu", monkeypatch).model_dump()
    differing = {k for k in speedrun if speedrun[k] != rehearsal[k]}
    assert differing <= SIZE_KEYS, f"rehearsal_gpu overrides recipe keys {sorted(differing - SIZE_KEYS)}"
    assert rehearsal["total_batch_size"] == -1 and rehearsal["lr_scaling"] and rehearsal["wd_scaling"]
    assert rehearsal["fp8"] and rehearsal["compile"] is True and rehearsal["dtype"] == "bfloat16"


def mlflow_params(project: Path) -> dict[str, str]:
    """Params of the newest pretrain run in the project's MLflow store."""
    return newest_pretrain_run(project).data.params


def expected_fp8_layers(project: Path, monkeypatch) -> int:
    """How many block matrices the profile's model has that FP8 takes (counted on the meta device)."""
    import torch

    from chatpipe.model.fp8 import fp8_eligible
    from chatpipe.model.gpt import GPT
    from chatpipe.train.pretrain_plan import model_config_for

    monkeypatch.setenv("CHATPIPE_PARAMS", str(project / "params.yaml"))
    cfg = pretrain_settings("rehearsal_gpu", monkeypatch)
    vocab = json.loads(run(project, str(BIN / "python"), "-c", PLAN_JSON).stdout)["vocab_size"]
    with torch.device("meta"):
        model = GPT(model_config_for(cfg, vocab))
    return sum(fp8_eligible(m, name) for name, m in model.named_modules())


PLAN_JSON = "from chatpipe.train.pretrain_plan import main; main(['--profile', 'rehearsal_gpu', '--json'])"


@pytest.mark.slow
def test_rehearsal_gpu_runs_every_speedrun_path_on_cpu(tmp_path, monkeypatch):
    project = make_project(tmp_path / "project", {"profile": "rehearsal_gpu"}, small=False)
    seconds = {}
    t0 = time.monotonic()
    for stage in ("data", "tokenizer", "pretrain"):
        start = time.monotonic()
        run(project, str(BIN / "dvc"), "repro", "--single-item", stage, **{CPU_TEST_ENV: "1"})
        seconds[stage] = round(time.monotonic() - start, 1)
    print("rehearsal_gpu seconds:", json.dumps({**seconds, "total": round(time.monotonic() - t0, 1)}))

    # bf16 autocast, compiled model and optimizer, FP8 layers, 2 ranks over gloo: as the ranks built them
    logs = sorted((project / "logs" / "torchx").glob("pretrain-*/**/stdout.log"))
    text = "\n".join(p.read_text() for p in logs)
    paths = re.findall(r"code paths: (.*)", text)
    fp8 = expected_fp8_layers(project, monkeypatch)
    assert fp8 >= 12  # q, k, v, proj, fc, mlp proj of each of the 2 blocks
    want = f"autocast bfloat16 | compiled model True, optimizer True | {fp8} Float8Linear layers | world size 2 (gloo)"
    assert paths and all(p.strip() == want for p in paths), paths
    params = mlflow_params(project)
    assert params["world_size"] == "2" and params["pretrain.fp8"] == "True"

    # the automatic derivation: what `chatpipe plan` prints is what the stage used, and it is not the profile's
    plan = json.loads(run(project, str(BIN / "python"), "-c", PLAN_JSON).stdout)
    assert int(params["horizon.total_batch_size"]) == plan["total_batch_size"] == 2**16  # from -1: Power Lines
    assert int(params["horizon.num_iterations"]) == int(params["pretrain.max_steps"]) == plan["steps"] >= 5
    scale = float(params["horizon.batch_lr_scale"])
    assert scale == pytest.approx(plan["batch_lr_scale"]) and scale == pytest.approx((2**16 / 2**19) ** 0.5)
    speedrun = pretrain_settings("speedrun", monkeypatch)
    for key in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr"):  # every LR scaled
        assert float(params[f"pretrain.{key}"]) == pytest.approx(getattr(speedrun, key) * scale), key
    assert float(params["pretrain.weight_decay"]) == pytest.approx(plan["weight_decay"])
    assert float(params["pretrain.weight_decay"]) != pytest.approx(speedrun.weight_decay)  # scaled to this run

    # every speedrun model option is in the model that trained
    config = {k.removeprefix("model_config."): v for k, v in params.items() if k.startswith("model_config.")}
    assert (config["value_embeds"], config["lambdas"], config["smear"], config["backout"]) == ("True",) * 4
    assert config["window_pattern"] == "SSSL" and int(config["short_window"]) < int(config["sequence_len"])
    assert (config["n_head"], config["n_kv_head"]) == ("2", "1")  # GQA

    # and it learned: train loss falls over the derived number of steps
    curve = loss_curve(project)
    assert len(curve) == plan["steps"] and curve[-1] < curve[0] - 1.0, curve

    # the model leaves the pipeline: exported with our modeling file, the same logits in transformers
    start = time.monotonic()
    check_remote_code_export(project, tmp_path)
    print("rehearsal_gpu export + lm-eval seconds:", round(time.monotonic() - start, 1))


def check_remote_code_export(project: Path, tmp_path: Path) -> None:
    """`chatpipe export` of the rehearsal's FP8-trained speedrun-architecture model: transformers loads
    it with trust_remote_code, its fp32 logits are within 1e-4 of ours, and lm-eval scores it."""
    import torch
    from transformers import AutoModelForCausalLM

    from chatpipe.evals.lm_harness import run_lm_eval, write_tasks
    from chatpipe.model.loading import load_chat_model
    from tests.conftest import require_shared_data

    run(project, str(BIN / "chatpipe"), "export", "--model", "base", "--out", "hf")
    hf_dir = project / "hf"
    assert (hf_dir / "modeling_chatpipe.py").is_file()  # options the built-in class lacks: our own file
    ours = load_chat_model("base", artifacts=project / "artifacts", device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True, dtype=torch.float32).eval()
    ids = torch.tensor(
        [ours.tokenizer.encode("Once upon a time the fox walked to the river.", prepend=ours.tokenizer.bos_id)]
    )
    with torch.no_grad():
        expected, got = ours.model(ids), theirs(ids).logits
    assert (got - expected).abs().max().item() <= 1e-4
    include = write_tasks(tmp_path / "tasks", require_shared_data() / "core", rows=4)
    results = run_lm_eval(hf_dir, ["chatpipe_copa"], include, max_length=256)
    assert 0.0 <= results["results"]["chatpipe_copa"]["acc,none"] <= 1.0
    assert len(results["samples"]["chatpipe_copa"]) == 4
