"""chatpipe's GPT and optimizer against vectors produced by nanochat's own code (CPU, fp32).

The vectors live in ``../shared/reference/nanochat`` (override with ``CHATPIPE_NANOCHAT_REF``);
see its README for what each case holds. Every model check goes through ``import-nanochat``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chatpipe.inference.engine import Engine
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.model.loading import load_chat_model
from chatpipe.model.nanochat_import import import_nanochat
from chatpipe.train.checkpoint import load_model

REPO = Path(__file__).resolve().parents[1]
REF = Path(os.environ.get("CHATPIPE_NANOCHAT_REF", REPO.parent / "shared" / "reference" / "nanochat"))
CASES = ["d4_L_mha", "d4_SSSL_gqa"]

pytestmark = pytest.mark.skipif(not (REF / "README.md").exists(), reason=f"nanochat reference vectors not at {REF}")


@pytest.fixture(scope="module", params=CASES)
def imported(request, tmp_path_factory):
    """(case, model dir written by import-nanochat, loaded model, io vectors)."""
    case = request.param
    out = import_nanochat(REF / case, tmp_path_factory.mktemp(case) / "model")
    model, _ = load_model(out)
    return case, out, model, torch.load(REF / case / "io.pt", weights_only=True)


def test_logits_and_loss_equal_reference(imported):
    _, _, model, io = imported
    with torch.no_grad():
        logits = model(io["idx"])
        loss = model(io["idx"], io["targets"])
    assert logits.shape == io["logits"].shape
    assert (logits - io["logits"]).abs().max().item() <= 1e-5
    assert abs(loss.item() - io["loss"].item()) <= 1e-6


@pytest.mark.parametrize("use_cache", [False, True], ids=["no_cache", "kv_cache"])
def test_greedy_continuation_equals_reference(imported, use_cache):
    _, _, model, io = imported
    assert list(model.generate(io["prompt"], len(io["greedy"]), use_cache=use_cache)) == io["greedy"]


def test_engine_greedy_with_kv_cache_and_prefill_broadcast(imported):
    """The inference engine (prefill at batch 1, cache copied to 2 rows, then one token per step)."""
    _, out, _, io = imported
    loaded = load_chat_model(str(out), device="cpu")
    seqs, _ = Engine(loaded.model, loaded.tokenizer).generate_batch(
        io["prompt"], num_samples=2, max_tokens=len(io["greedy"]), temperature=0.0
    )
    assert [s[len(io["prompt"]) :] for s in seqs] == [io["greedy"]] * 2


def test_imported_dir_is_a_model_dir(imported):
    case, out, model, _ = imported
    meta = json.loads((out / "meta.json").read_text())
    cfg = json.loads((REF / case / "config.json").read_text())
    assert {k: meta["model_config"][k] for k in cfg} == cfg
    assert meta["stage"] == "pretrain" and meta["source_stage"] == "nanochat"
    assert set(meta["settings"]) == {"matrix_lr", "embedding_lr", "unembedding_lr"}
    assert (out / "tokenizer" / "tokenizer.json").exists()
    assert model.wte.weight.shape[0] % 64 == 0  # padded rows kept


def test_chat_cli_runs_on_imported_reference(imported):
    _, out, _, _ = imported
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "chatpipe.cli", "chat", "--model", str(out), "--device", "cpu"]
        + ["-p", "hello", "--max-tokens", "8", "-t", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def test_import_cli_and_nanochat_layout(tmp_path):
    """nanochat's own layout (model_<step>.pt + meta_<step>.json, compiled-module prefixes, bf16)."""
    src = tmp_path / "base_checkpoints" / "d4"
    src.mkdir(parents=True)
    state = torch.load(REF / "d4_L_mha" / "model.pt", weights_only=True)
    torch.save({f"_orig_mod.{k}": v.bfloat16() for k, v in state.items()}, src / "model_000700.pt")
    cfg = json.loads((REF / "d4_L_mha" / "config.json").read_text())
    (src / "meta_000700.json").write_text(json.dumps({"step": 700, "model_config": cfg, "user_config": {}}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "chatpipe.cli", "import-nanochat", str(src), "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    model, meta = load_model(tmp_path / "out")
    assert meta["step"] == 700 and meta["stage"] == "pretrain"
    assert torch.equal(model.wte.weight, state["transformer.wte.weight"].bfloat16().float())


def test_import_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_<step>.pt"):
        import_nanochat(tmp_path, tmp_path / "out")


def test_old_model_config_without_new_keys_loads():
    """A model_config written before the nanochat options existed: every option is off."""
    old = dict(sequence_len=32, vocab_size=97, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="L")
    config = GPTConfig.from_dict(old)
    assert not (config.value_embeds or config.lambdas or config.smear or config.backout)
    assert config.padded_vocab_size == 97 and config.rotary_base == 10000.0 and config.qk_scale == 1.0
    keys = set(GPT(config).state_dict())
    assert keys == {"wte.weight", "lm_head.weight"} | {
        f"blocks.{i}.{m}.weight"
        for i in range(2)
        for m in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    }
