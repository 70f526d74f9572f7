"""chatpipe export -> transformers: same logits, same greedy tokens, same tokenizer and chat ids.

Both paths: transformers' built-in NanoChat class (the GQA model of tests/trained.py) and our own
remote code (a d2 model with every speedrun option, tests/trained.py's ``speedrun_model``)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from chatpipe import cli
from chatpipe.data.synthetic import pretrain_documents
from chatpipe.export import hf
from chatpipe.inference.engine import Engine
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.model.loading import load_chat_model
from tests.trained import speedrun_model, train_artifacts

transformers = pytest.importorskip("transformers")

TOOL_CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Mia has 12 apples and buys 7 more. How many now?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "She has 12 + 7 = "},
                {"type": "python", "text": "12+7"},
                {"type": "python_output", "text": "19"},
                {"type": "text", "text": "19 apples.\n\n#### 19"},
            ],
        },
        {"role": "user", "content": "And if she eats 3?  Ünïcode ✓"},
        {"role": "assistant", "content": "16."},
        {"role": "user", "content": "thanks"},
    ]
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    root = train_artifacts(tmp_path_factory.mktemp("artifacts"))
    report = {"summary": {"CORE": {"base": 0.1234, "sft": None}, "ChatCORE": {"sft": 0.0567}}, "git_commit": "abc"}
    (root / "report").mkdir()
    (root / "report" / "report.json").write_text(json.dumps(report))
    return root


@pytest.fixture(scope="module")
def ours(artifacts):
    return load_chat_model("sft", artifacts=artifacts, device="cpu")


@pytest.fixture(scope="module")
def exported(artifacts, tmp_path_factory) -> Path:
    return hf.export_by_name("sft", tmp_path_factory.mktemp("hf") / "sft", artifacts=artifacts)


@pytest.fixture(scope="module")
def theirs(exported):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, attn_implementation="sdpa").eval()
    return model, transformers.AutoTokenizer.from_pretrained(exported)


def test_directory_has_what_from_pretrained_needs(exported):
    names = {p.name for p in exported.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= names
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "nanochat" and config["hidden_act"] == "relu2"
    assert config["rms_norm_eps"] == pytest.approx(1.1920929e-07) and config["final_logit_softcapping"] == 15.0
    assert config["num_key_value_heads"] == 1 and config["tie_word_embeddings"] is False
    assert "auto_map" not in config and not (exported / f"{hf.MODELING}.py").exists()
    assert "built-in `NanoChat` class (no remote code)" in (exported / "README.md").read_text()
    assert json.loads((exported / hf.LINEAGE_FILE).read_text())["path"] == "builtin"


def test_logits_equal_ours_in_fp32(ours, theirs):
    model, _ = theirs
    texts = pretrain_documents(7, 4)
    for text in texts:
        ids = torch.tensor([ours.tokenizer.encode(text, prepend=ours.tokenizer.bos_id)[:128]])
        with torch.no_grad():
            diff = (ours.model(ids) - model(ids).logits).abs().max().item()
        assert diff <= 1e-4, f"max abs logit difference {diff}"


def test_greedy_generation_matches_token_for_token(ours, theirs):
    model, _ = theirs
    prompt = ours.tokenizer.encode("Mia lives in", prepend=ours.tokenizer.bos_id)
    # ours: the KV-cached engine at temperature 0, stopping where it stops (<|assistant_end|> or <|bos|>)
    seqs, _ = Engine(ours.model, ours.tokenizer).generate_batch(prompt, max_tokens=32, temperature=0.0)
    mine = seqs[0][len(prompt) :]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    assert out[0, len(prompt) : len(prompt) + len(mine)].tolist() == mine
    assert len(mine) == 32  # the trained model writes on: the whole budget was compared


def test_plain_text_ids_equal_ours(ours, theirs):
    _, tok = theirs
    texts = [
        *pretrain_documents(11, 20),
        "Numbers 1234567 and 3.14159, 'quotes' I'LL we've\n\n\n  tabs\tand   spaces   \r\n end",
        "Ünïcödé ✓ 日本語 emoji 🙂 and mixed-case CamelCaseWords__underscores!!??",
    ]
    for text in texts:
        assert tok(text, add_special_tokens=False)["input_ids"] == ours.tokenizer.encode(text)
        assert tok.decode(ours.tokenizer.encode(text)) == text
    assert tok(texts[0])["input_ids"] == ours.tokenizer.encode(texts[0], prepend=ours.tokenizer.bos_id)
    # Special-token names inside text: ours encode them as ordinary text, HF does with split_special_tokens.
    text = "a <|bos|> b"
    assert tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] == ours.tokenizer.encode(text)


def test_chat_template_renders_the_tool_conversation_like_ours(ours, theirs):
    _, tok = theirs
    messages = TOOL_CONVERSATION["messages"]
    ids, _ = ours.tokenizer.render_conversation(TOOL_CONVERSATION, max_tokens=1 << 20)
    got = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert list(got) == ids
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert list(prompt) == ours.tokenizer.render_for_completion(TOOL_CONVERSATION)
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}], tokenize=False)


def test_model_card_has_report_numbers_and_lineage(exported):
    card = (exported / "README.md").read_text()
    assert "library_name: transformers" in card and "| CORE | 0.1234 |" in card and "0.0567" in card
    lineage = json.loads((exported / hf.LINEAGE_FILE).read_text())
    for key in ("git_commit", "dvc_lock", "model_pt_sha256", "safetensors_sha256"):
        assert lineage[key] and f"`{lineage[key]}`" in card


def test_options_the_builtin_class_lacks_choose_remote_code_and_unknown_ones_are_refused(artifacts, tmp_path):
    sliding = GPTConfig(
        sequence_len=64, vocab_size=512, n_layer=3, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SL"
    )
    assert any("window_pattern='SL'" in p for p in hf.builtin_lacks(sliding))
    assert hf.export_path(sliding) == "remote_code"
    assert hf.export_path(dataclasses.replace(sliding, window_pattern="L")) == "builtin"
    assert hf.export_path(GPTConfig()) == "builtin"  # every nanochat-2026 option off: the built-in class
    on = GPTConfig(value_embeds=True, smear=True, qk_scale=1.2, pad_vocab_to=64, vocab_size=500)
    lacks = " ".join(hf.builtin_lacks(on))
    for name in ("value_embeds=True", "smear=True", "qk_scale=1.2", "pad_vocab_to=64"):
        assert name in lacks
    assert "lambdas" not in lacks and "backout" not in lacks

    @dataclasses.dataclass
    class Future(GPTConfig):
        mystery: int = 3

    with pytest.raises(hf.ExportError, match="mystery=3.*unknown to the exporter"):
        hf.builtin_lacks(Future())
    # neither path carries an unknown option: refused before anything is written
    model = GPT(GPTConfig(sequence_len=64, vocab_size=512, n_layer=1, n_head=2, n_kv_head=2, n_embd=64))
    model.config = Future(sequence_len=64, vocab_size=512, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    tok = load_chat_model("sft", artifacts=artifacts, device="cpu").tokenizer
    with pytest.raises(hf.ExportError, match="mystery"):
        hf.export_model(model, tok, {}, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_exports_and_pushes_through_huggingface_hub(artifacts, tmp_path, monkeypatch):
    calls = []

    class FakeApi:  # the Hub is unreachable here: record what would be sent
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kw):
            calls.append(("create_repo", repo_id, kw["private"]))

        def upload_folder(self, **kw):
            calls.append(("upload_folder", kw["repo_id"], sorted(p.name for p in Path(kw["folder_path"]).iterdir())))
            return type("Info", (), {"commit_url": f"https://hf.co/{kw['repo_id']}/commit/1"})()

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").symlink_to(artifacts)
    assert cli.main(["export", "--model", "base", "--out", "out", "--push-to-hub", "me/tiny", "--private"]) == 0
    assert calls[0] == ("create_repo", "me/tiny", True)
    assert calls[1][0] == "upload_folder" and "model.safetensors" in calls[1][2]
    assert json.loads((tmp_path / "out" / hf.LINEAGE_FILE).read_text())["stage"] == "base"
    assert cli.main(["export", "--model", "rl", "--out", "out2"]) == 2  # no rl model: a clear error, exit 2


@pytest.mark.slow
def test_export_stage_logs_the_dir_to_mlflow_and_the_registered_version(artifacts, tmp_path, monkeypatch, params_file):
    import mlflow

    from stages import export as export_stage

    monkeypatch.chdir(tmp_path)
    (tmp_path / "artifacts").mkdir()
    for name in ("tokenizer", "base", "sft", "report"):
        (tmp_path / "artifacts" / name).symlink_to(artifacts / name)
    monkeypatch.setenv("CHATPIPE_TRACKING__URI", f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    monkeypatch.setenv("CHATPIPE_TRACKING__ARTIFACT_ROOT", str(tmp_path / "mlruns" / "artifacts"))
    monkeypatch.delenv("CHATPIPE_PARENT_RUN_ID", raising=False)
    # what the report stage leaves behind: a run with the model dir, registered as a version
    from chatpipe import tracking
    from chatpipe.settings import TrackingSettings, load_section

    experiment = tracking.configure(load_section(TrackingSettings))
    client = mlflow.MlflowClient()
    report_run = client.create_run(experiment, run_name="report")
    client.log_artifacts(report_run.info.run_id, str(artifacts / "sft"), "model")
    client.create_registered_model("chatpipe")
    client.create_model_version("chatpipe", f"{report_run.info.artifact_uri}/model", run_id=report_run.info.run_id)

    export_stage.main([])
    assert json.loads((tmp_path / "artifacts/export/config.json").read_text())["model_type"] == "nanochat"
    run = client.search_runs([experiment], "tags.stage = 'export'")[0]
    assert "config.json" in {Path(f.path).name for f in client.list_artifacts(run.info.run_id, "hf")}
    version = client.get_model_version("chatpipe", "1")
    assert version.tags["hf_export"] == "model/hf"
    files = {Path(f.path).name for f in client.list_artifacts(report_run.info.run_id, "model/hf")}
    assert {"model.safetensors", "tokenizer.json", "README.md"} <= files

    # a model with an option NanoChat lacks: the stage fails, or with on_unsupported=skip says why
    monkeypatch.setattr(
        export_stage, "export_by_name", lambda *a, **k: (_ for _ in ()).throw(hf.ExportError("smear=True"))
    )
    with pytest.raises(hf.ExportError):
        export_stage.main([])
    export_stage.main(["--on_unsupported=skip"])
    assert "smear=True" in (tmp_path / "artifacts/export/SKIPPED.md").read_text()


# --------------------------------------------------------------------------- the remote-code path


@pytest.fixture(scope="module")
def speedrun(ours):
    """Our speedrun-architecture model (every option on) with the trained tokenizer."""
    model = speedrun_model(ours.tokenizer.vocab_size)
    c = model.config
    assert c.window_pattern == "SSSL" and c.short_window == 128 and c.n_kv_head < c.n_head
    assert c.value_embeds and c.lambdas and c.smear and c.backout and c.qk_scale == 1.2
    assert c.padded_vocab_size != c.vocab_size
    return model


@pytest.fixture(scope="module")
def speedrun_dir(speedrun, ours, tmp_path_factory) -> Path:
    meta = {"stage": "base", "step": 0, "model_config": speedrun.config.to_dict()}
    return hf.export_model(speedrun, ours.tokenizer, meta, tmp_path_factory.mktemp("hf") / "speedrun", report_path=None)


def _ids(tokenizer, n: int = 400) -> torch.Tensor:
    """Real text, longer than the 128-token window (so windowed and full layers differ)."""
    text = " ".join(pretrain_documents(3, 40))
    ids = tokenizer.encode(text, prepend=tokenizer.bos_id)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


def test_remote_code_dir_has_modeling_file_auto_map_and_card(speedrun_dir):
    config = json.loads((speedrun_dir / "config.json").read_text())
    assert config["model_type"] == "chatpipe"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_chatpipe.ChatpipeForCausalLM"
    assert config["layer_windows"] == [129, 0] and config["value_embed_layers"] == [1]
    assert (speedrun_dir / "modeling_chatpipe.py").read_text() == Path(hf.__file__).with_name(
        "modeling_chatpipe.py"
    ).read_text()
    card = (speedrun_dir / "README.md").read_text()
    assert "trust_remote_code=True" in card and "built-in `NanoChat` class lacks" in card
    assert json.loads((speedrun_dir / hf.LINEAGE_FILE).read_text())["path"] == "remote_code"


def test_modeling_file_imports_only_torch_and_transformers():
    tree = ast.parse(Path(hf.__file__).with_name("modeling_chatpipe.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert names == {"__future__", "torch", "transformers"}


def test_remote_code_loads_offline_without_chatpipe_and_logits_equal_ours(speedrun, speedrun_dir, ours, tmp_path):
    ids = _ids(ours.tokenizer)
    torch.save(ids, tmp_path / "ids.pt")
    # a fresh interpreter, hub offline, chatpipe unimportable: what a user without chatpipe gets
    script = (
        "import sys, torch; sys.modules['chatpipe'] = None\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"d = {str(speedrun_dir)!r}\n"
        "m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()\n"
        "AutoTokenizer.from_pretrained(d, trust_remote_code=True)\n"
        f"ids = torch.load({str(tmp_path / 'ids.pt')!r})\n"
        "with torch.no_grad():\n"
        f"    torch.save(m(ids).logits, {str(tmp_path / 'logits.pt')!r})\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"), "PYTHONPATH": ""}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
    with torch.no_grad():
        diff = (speedrun(ids) - torch.load(tmp_path / "logits.pt")).abs().max().item()
    print(f"max abs logit difference (speedrun options, fp32): {diff:.3g}")
    assert diff <= 1e-4


@pytest.fixture(scope="module")
def speedrun_theirs(speedrun_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(speedrun_dir, trust_remote_code=True).eval()
    # AutoTokenizer reads config.json too: without trust_remote_code it would ask (or fall back)
    return model, transformers.AutoTokenizer.from_pretrained(speedrun_dir, trust_remote_code=True)


@pytest.mark.parametrize(
    "shape",
    [
        {"depth": 4},  # SSSL over four layers: three windowed, value embeddings on layers 1 and 3
        {"depth": 3, "value_embeds": False, "lambdas": False, "smear": False, "backout": False},  # windows etc.
        {"depth": 2, "window_pattern": "SL", "short_window": "half"},  # chatpipe's original half window
    ],
)
def test_remote_code_logits_equal_ours_for_other_option_sets(shape, ours, tmp_path):
    model = speedrun_model(ours.tokenizer.vocab_size, seed=1, **shape)
    out = hf.export_model(model, ours.tokenizer, {}, tmp_path / "hf", report_path=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = _ids(ours.tokenizer)
    with torch.no_grad():
        diff = (model(ids) - theirs(ids).logits).abs().max().item()
    assert diff <= 1e-4, (shape, diff)


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_remote_code_greedy_generation_matches_ours(speedrun, speedrun_theirs, ours, use_cache):
    model, _ = speedrun_theirs
    prompt = ours.tokenizer.encode("Mia lives in", prepend=ours.tokenizer.bos_id)
    seqs, _ = Engine(speedrun, ours.tokenizer).generate_batch(prompt, max_tokens=24, temperature=0.0)
    mine = seqs[0][len(prompt) :]  # ours: paged KV cache, smear's previous embedding from it (may stop early)
    ids = torch.tensor([prompt])
    # no eos (the random model may write one); the mask is explicit, else transformers takes
    # <|bos|> (the pad id) for padding and the model refuses the padded batch
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False, eos_token_id=None
    )
    assert out[0, len(prompt) : len(prompt) + len(mine)].tolist() == mine


def test_remote_code_tokenizer_and_chat_template_give_our_ids(speedrun_theirs, ours):
    _, tok = speedrun_theirs
    text = " ".join(pretrain_documents(5, 3))
    assert tok(text)["input_ids"] == ours.tokenizer.encode(text, prepend=ours.tokenizer.bos_id)
    ids, _ = ours.tokenizer.render_conversation(TOOL_CONVERSATION, max_tokens=1 << 20)
    got = tok.apply_chat_template(TOOL_CONVERSATION["messages"], tokenize=True, return_dict=True)["input_ids"]
    assert list(got) == ids


NANOCHAT_REF = Path(__file__).resolve().parents[2] / "shared" / "reference" / "nanochat"


@pytest.mark.skipif(not (NANOCHAT_REF / "README.md").exists(), reason="nanochat reference vectors not found")
@pytest.mark.parametrize("case", ["d4_L_mha", "d4_SSSL_gqa"])
def test_remote_code_export_of_nanochats_reference_model_gives_nanochats_outputs(case, tmp_path):
    """nanochat's own logits and greedy ids (its code, not ours) from the exported directory."""
    from chatpipe.model.nanochat_import import import_nanochat

    model_dir = import_nanochat(NANOCHAT_REF / case, tmp_path / "model")
    out = hf.export_by_name(str(model_dir), tmp_path / "hf", artifacts=tmp_path)
    assert json.loads((out / hf.LINEAGE_FILE).read_text())["path"] == "remote_code"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    io = torch.load(NANOCHAT_REF / case / "io.pt", weights_only=True)
    with torch.no_grad():
        assert (model(io["idx"]).logits - io["logits"]).abs().max().item() <= 1e-4
    prompt = torch.tensor([io["prompt"]])
    got = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=len(io["greedy"]),
        do_sample=False,
        eos_token_id=None,
    )
    assert got[0, prompt.size(1) :].tolist() == io["greedy"]


def test_a_model_with_float8_layers_exports_its_plain_weights(ours, tmp_path):
    """torchao's Float8Linear (FP8 training) keeps the high-precision weights under the Linear's names."""
    float8 = pytest.importorskip("torchao.float8")
    model = speedrun_model(ours.tokenizer.vocab_size, seed=2)
    plain = {k: v.clone() for k, v in model.state_dict().items()}
    float8.convert_to_float8_training(  # what the FP8 run does to the block matrices (dims divisible by 16)
        model, module_filter_fn=lambda m, fqn: fqn.startswith("blocks.") and min(m.weight.shape) % 16 == 0
    )
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
    out = hf.export_model(model, ours.tokenizer, {}, tmp_path / "hf", report_path=None)
    from safetensors.torch import load_file

    weights = load_file(out / hf.WEIGHTS_FILE)
    assert set(weights) == set(plain) and all(torch.equal(weights[k], v) for k, v in plain.items())
