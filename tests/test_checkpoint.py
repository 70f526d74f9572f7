"""Checkpoints: atomic, verified by checksum, exact resume, keep-latest-k, fingerprint guard."""

from __future__ import annotations

import json
import random

import torch

from chatpipe.io import replace_dir, write_json_atomic
from chatpipe.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    save_model_dir,
    verify_checkpoint,
)


def _model_and_opt(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-2)]


def _step(model, opts):
    x = torch.randn(4, 8)  # draws from the global RNG, so RNG restore matters
    loss = model(x).pow(2).mean()
    loss.backward()
    for o in opts:
        o.step()
        o.zero_grad()


def test_resume_is_bitwise_identical(tmp_path):
    model, opts = _model_and_opt()
    for _ in range(3):
        _step(model, opts)
    save_checkpoint(tmp_path, 3, model=model, optimizers=opts, meta={"fingerprint": "f", "world_size": 1})
    for _ in range(3):
        _step(model, opts)
    expected = [p.detach().clone() for p in model.parameters()]

    model2, opts2 = _model_and_opt(seed=99)
    torch.manual_seed(12345)  # scramble the RNG; the checkpoint must restore it
    meta = load_checkpoint(latest_checkpoint(tmp_path, "f"), model=model2, optimizers=opts2)
    assert meta["step"] == 3
    for _ in range(3):
        _step(model2, opts2)
    for a, b in zip(expected, model2.parameters()):
        assert torch.equal(a, b)


def test_keep_latest_k_and_no_temp_dirs_left(tmp_path):
    model, opts = _model_and_opt()
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, model=model, optimizers=opts, meta={}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000030", "step_000020"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_truncated_checkpoint_falls_back_to_previous(tmp_path, caplog):
    model, opts = _model_and_opt()
    save_checkpoint(tmp_path, 1, model=model, optimizers=opts, meta={"fingerprint": "f"})
    save_checkpoint(tmp_path, 2, model=model, optimizers=opts, meta={"fingerprint": "f"})
    newest = tmp_path / "step_000002" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    assert "checksum mismatch" in verify_checkpoint(tmp_path / "step_000002")
    assert latest_checkpoint(tmp_path, "f").name == "step_000001"
    assert "skipping checkpoint" in caplog.text


def test_fingerprint_mismatch_is_not_resumed(tmp_path):
    model, opts = _model_and_opt()
    save_checkpoint(tmp_path, 5, model=model, optimizers=opts, meta={"fingerprint": "old"})
    assert latest_checkpoint(tmp_path, "new") is None
    assert latest_checkpoint(tmp_path, "old").name == "step_000005"


def test_rng_python_state_restored(tmp_path):
    model, opts = _model_and_opt()
    random.seed(7)
    save_checkpoint(tmp_path, 1, model=model, optimizers=opts, meta={"world_size": 1})
    expected = random.random()
    random.seed(8)
    load_checkpoint(tmp_path / "step_000001", model=model, optimizers=opts, world_size=1)
    assert random.random() == expected


def test_save_model_dir_replaces_atomically(tmp_path):
    model, _ = _model_and_opt()
    out = tmp_path / "base"
    save_model_dir(out, model, {"v": 1})
    save_model_dir(out, model, {"v": 2})
    assert json.loads((out / "meta.json").read_text())["v"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_replace_dir_and_json_atomic(tmp_path):
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "x").write_text("1")
    replace_dir(tmp_path / "new", tmp_path / "final")
    assert (tmp_path / "final" / "x").read_text() == "1"
    write_json_atomic(tmp_path / "a.json", {"k": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"k": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "final"]
