"""Tests for chatpipe.model.loading: stage names, `latest`, paths, the MLflow model registry."""

from __future__ import annotations

import shutil

import pytest
import torch

from chatpipe.model.loading import load_chat_model, pick_device, resolve
from tests.chatmodel import make_artifacts


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
