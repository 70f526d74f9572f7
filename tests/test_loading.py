"""Tests for chatpipe.model.loading: stage names, `latest`, paths, the MLflow model registry."""

from __future__ import annotations

import shutil

import pytest
import torch

from chatpipe.model.loading import load_chat_model, pick_device, resolve
from chatpipe.testing.chatmodel import make_artifacts


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return make_artifacts(tmp_path_factory.mktemp("artifacts"))


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_stage_names_latest_and_paths(artifacts, tmp_path):
    arts = tmp_path / "artifacts"
    shutil.copytree(artifacts, arts)
    shutil.copytree(arts / "sft", arts / "base")
    assert resolve("latest", arts) == arts / "sft"  # sft is further down the pipeline than base
    assert resolve("pretrain", arts) == arts / "base"
    shutil.copytree(arts / "sft", arts / "rl")
    assert resolve("latest", arts) == arts / "rl"
    loaded = load_chat_model(str(arts / "sft"), artifacts=arts)
    assert loaded.name == str(arts / "sft") and loaded.stage == "sft" and loaded.device == pick_device()
    named = load_chat_model("latest", artifacts=arts)
    assert named.name == "rl" and same_weights(named.model, loaded.model)
    assert "rl (stage sft, step 7" in named.describe()


def test_missing_stage_and_unknown_name_are_clear_errors(artifacts, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"mid/meta.json not found: run the `mid` stage first"):
        resolve("midtrain", artifacts)
    with pytest.raises(FileNotFoundError, match="not a stage"):
        resolve("gpt-5", artifacts)
    with pytest.raises(FileNotFoundError, match="no trained model"):
        resolve("latest", tmp_path)


def test_tokenizer_from_another_run_is_refused(artifacts, tmp_path):
    from chatpipe.data.synthetic import pretrain_documents
    from chatpipe.tokenizer import Tokenizer

    Tokenizer.train(pretrain_documents(1, 200), vocab_size=1024).save(tmp_path / "tok")
    with pytest.raises(ValueError, match="tokenizer has 1024 ids but the model .* only 512"):
        load_chat_model("sft", artifacts=artifacts, tokenizer_dir=tmp_path / "tok")


@pytest.mark.slow  # MLflow creating its sqlite store takes ~10-20 s here
def test_registered_model_version_loads(artifacts, tmp_path, monkeypatch):
    import tempfile

    mlflow = pytest.importorskip("mlflow")
    temp = tmp_path / "tmp"  # this test's own temporary directory: other tests download too
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    previous = mlflow.get_tracking_uri()
    try:
        check_registry(mlflow, artifacts, tmp_path)
    finally:
        mlflow.set_tracking_uri(previous)
    # the downloads (one loaded, one missing version) are gone once the model is in memory
    assert not list(temp.glob("chatpipe-model-*")), list(temp.iterdir())


def check_registry(mlflow, artifacts, tmp_path) -> None:
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    exp = mlflow.create_experiment("t", artifact_location=(tmp_path / "store").as_uri())
    client = mlflow.MlflowClient()
    with mlflow.start_run(experiment_id=exp) as run:  # as stages/report.py registers the final model
        client.log_artifacts(run.info.run_id, str(artifacts / "sft"), "model")
    client.create_registered_model("chatpipe-test")
    version = client.create_model_version(
        "chatpipe-test", f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    ).version
    loaded = load_chat_model(f"models:/chatpipe-test/{version}", artifacts=artifacts, tracking_uri=uri)
    local = load_chat_model("sft", artifacts=artifacts)
    assert loaded.name == f"models:/chatpipe-test/{version}" and loaded.stage == "sft"
    assert same_weights(loaded.model, local.model)
    with pytest.raises(FileNotFoundError, match="models:/chatpipe-test/99: cannot download"):
        load_chat_model("models:/chatpipe-test/99", artifacts=artifacts, tracking_uri=uri)


# ---------------------------------------------------------------- files checked before they are trusted


def _edit_json(path, edit):
    import json

    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, indent=2))


def test_an_edited_meta_json_is_refused_naming_the_file(artifacts, tmp_path):
    arts = tmp_path / "artifacts"
    shutil.copytree(artifacts, arts)
    load_chat_model("sft", artifacts=arts)  # intact: loads
    _edit_json(arts / "sft" / "meta.json", lambda m: m["model_config"].update(rotary_base=500.0))
    with pytest.raises(ValueError, match=r"sft/meta\.json: sha256 .* does not match .* recorded in .*manifest\.json"):
        load_chat_model("sft", artifacts=arts)


def test_a_model_dir_without_a_manifest_is_refused_and_write_manifest_vouches_for_it(artifacts, tmp_path):
    from chatpipe.model.files import write_manifest

    arts = tmp_path / "artifacts"
    shutil.copytree(artifacts, arts)
    (arts / "sft" / "manifest.json").unlink()
    with pytest.raises(ValueError, match=r"sft/manifest\.json: missing"):
        load_chat_model("sft", artifacts=arts)
    write_manifest(arts / "sft")
    assert load_chat_model("sft", artifacts=arts).stage == "sft"
    (arts / "sft" / "manifest.json").write_text("not json")
    with pytest.raises(ValueError, match=r"sft/manifest\.json: corrupt model manifest"):
        load_chat_model("sft", artifacts=arts)


def test_the_tokenizer_must_be_the_one_meta_json_records(artifacts, tmp_path):
    from chatpipe.io import sha256_file
    from chatpipe.model.files import write_manifest
    from chatpipe.tokenizer import Tokenizer

    arts = tmp_path / "artifacts"
    shutil.copytree(artifacts, arts)
    recorded = sha256_file(arts / "tokenizer" / "tokenizer.json")
    _edit_json(arts / "sft" / "meta.json", lambda m: m.update(inputs={"tokenizer": recorded}))
    write_manifest(arts / "sft")  # as the pipeline writes it: the tokenizer's hash among the inputs
    load_chat_model("sft", artifacts=arts)
    # a tokenizer of the same size from other text: loads on its own, but is not the model's
    from chatpipe.data.synthetic import pretrain_documents

    Tokenizer.train(pretrain_documents(7, 200), vocab_size=512).save(tmp_path / "other")
    with pytest.raises(
        ValueError, match=r"other/tokenizer\.json: sha256 .* is not the tokenizer .*sft/meta\.json records"
    ):
        load_chat_model("sft", artifacts=arts, tokenizer_dir=tmp_path / "other")


def test_an_edited_tokenizer_pattern_is_refused(artifacts, tmp_path):
    from chatpipe.tokenizer import Tokenizer

    shutil.copytree(artifacts / "tokenizer", tmp_path / "tok")
    _edit_json(tmp_path / "tok" / "tokenizer.json", lambda c: c.update(pattern=c["pattern"].replace("{1,2}", "{1,3}")))
    with pytest.raises(ValueError, match=r"tok/tokenizer\.json: edited or corrupted since it was saved"):
        Tokenizer.load(tmp_path / "tok")


# ---------------------------------------------------------------- a model dir carries its tokenizer


def carrying_copy(artifacts, out):
    """``artifacts/sft`` saved as the stages save a model: its tokenizer inside, the tokenizer's hash in
    its meta inputs. Returns ``out``."""
    from chatpipe.io import sha256_file
    from chatpipe.model.files import save_model_dir

    loaded = load_chat_model("sft", artifacts=artifacts, device="cpu")
    meta = {k: v for k, v in loaded.meta.items() if k != "files"}
    meta["inputs"] = {"tokenizer": sha256_file(artifacts / "tokenizer" / "tokenizer.json")}
    save_model_dir(out, loaded.model, meta, tokenizer_dir=artifacts / "tokenizer")
    return out


def greedy(loaded, text: str = "hello there", max_tokens: int = 12) -> str:
    from chatpipe.inference.engine import Engine

    prompt = loaded.tokenizer.render_for_completion({"messages": [{"role": "user", "content": text}]})
    pieces = Engine(loaded.model, loaded.tokenizer).stream(prompt, max_tokens=max_tokens, temperature=0.0)
    return "".join(t for _, t in pieces)


def test_a_copied_model_dir_loads_and_replies_outside_any_project(artifacts, tmp_path, monkeypatch):
    # before: a copy of artifacts/rl elsewhere failed with "artifacts/tokenizer/tokenizer.json: tokenizer file missing"
    import json

    from chatpipe.io import sha256_file

    made = carrying_copy(artifacts, tmp_path / "project" / "rl")
    manifest = json.loads((made / "manifest.json").read_text())["sha256"]
    assert manifest["tokenizer/tokenizer.json"] == sha256_file(artifacts / "tokenizer" / "tokenizer.json")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(made, elsewhere / "my-model")
    monkeypatch.chdir(elsewhere)  # no artifacts/ here: the default artifacts dir does not exist
    copied = load_chat_model(str(elsewhere / "my-model"), device="cpu")
    reference = load_chat_model("sft", artifacts=artifacts, device="cpu")
    assert copied.tokenizer.vocab_size == reference.tokenizer.vocab_size and same_weights(copied.model, reference.model)
    reply = greedy(copied)
    assert reply.strip() and reply == greedy(reference)


def test_an_old_model_dir_without_a_tokenizer_loads_in_its_project_only(artifacts, tmp_path, monkeypatch):
    assert not (artifacts / "sft" / "tokenizer").exists()  # written as models were before they carried one
    loaded = load_chat_model("sft", artifacts=artifacts, device="cpu")  # falls back to artifacts/tokenizer
    assert greedy(loaded).strip()
    shutil.copytree(artifacts / "sft", tmp_path / "old")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"artifacts/tokenizer/tokenizer\.json: tokenizer file missing"):
        load_chat_model(str(tmp_path / "old"), device="cpu")


def test_a_tampered_or_missing_tokenizer_in_a_model_dir_is_refused_naming_the_file(artifacts, tmp_path):
    made = carrying_copy(artifacts, tmp_path / "rl")
    load_chat_model(str(made), artifacts=artifacts, device="cpu")  # intact: loads
    ranks = made / "tokenizer" / "ranks.tiktoken"
    ranks.write_bytes(ranks.read_bytes()[:-40])
    with pytest.raises(ValueError, match=r"rl/tokenizer/ranks\.tiktoken: sha256 .* does not match .*rl/manifest\.json"):
        load_chat_model(str(made), artifacts=artifacts, device="cpu")
    # gone: refused, not silently replaced by the project's tokenizer
    shutil.rmtree(made / "tokenizer")
    with pytest.raises(ValueError, match=r"rl/tokenizer/[a-z_.]+: missing \(listed in .*manifest\.json\)"):
        load_chat_model(str(made), artifacts=artifacts, device="cpu")


def test_saving_refuses_a_tokenizer_other_than_the_one_meta_records(artifacts, tmp_path):
    from chatpipe.model.files import save_model_dir

    loaded = load_chat_model("sft", artifacts=artifacts, device="cpu")
    meta = {"model_config": loaded.model.config.to_dict(), "inputs": {"tokenizer": "0" * 64}}
    with pytest.raises(ValueError, match=r"tokenizer/tokenizer\.json: not the tokenizer the model was trained with"):
        save_model_dir(tmp_path / "rl", loaded.model, meta, tokenizer_dir=artifacts / "tokenizer")
    assert not (tmp_path / "rl").exists()  # all or nothing


def test_the_pyfunc_package_keeps_the_model_dirs_own_tokenizer(artifacts, tmp_path):
    # before: packaging a model dir that carries its tokenizer copied a second one over it (FileExistsError)
    from chatpipe.data.synthetic import pretrain_documents
    from chatpipe.serve.pyfunc import package_model_dir
    from chatpipe.tokenizer import Tokenizer

    made = carrying_copy(artifacts, tmp_path / "rl")
    Tokenizer.train(pretrain_documents(7, 200), vocab_size=512).save(tmp_path / "other")
    out = package_model_dir(made, tmp_path / "other", tmp_path / "package")
    own = (made / "tokenizer" / "tokenizer.json").read_bytes()
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == own
    loaded = load_chat_model(str(out), tokenizer_dir=out / "tokenizer", device="cpu")  # as ChatModel loads it
    assert greedy(loaded) == greedy(load_chat_model(str(made), device="cpu"))
