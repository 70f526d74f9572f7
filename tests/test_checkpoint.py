"""Checkpoints: atomic, verified by checksum, exact resume, keep-latest-k, fingerprint guard."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from chatpipe.io import atomic_dir, write_json_atomic
from chatpipe.model.files import save_model_dir
from chatpipe.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
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


def test_atomic_dir_replaces_an_old_folder_and_json_atomic(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "stale").write_text("0")
    with atomic_dir(tmp_path / "final") as tmp:
        (tmp / "x").write_text("1")
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["x"]
    assert (tmp_path / "final" / "x").read_text() == "1"
    write_json_atomic(tmp_path / "a.json", {"k": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"k": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "final"]


# --------------------------------------------------------------------------- issue 15: runs, pruning, failed writes


def test_new_runs_checkpoint_survives_pruning_beside_an_old_runs_later_steps(tmp_path):
    """A settings change starts a new fingerprint at step 5: pruning must not prefer the old run's step 100."""
    model, opts = _model_and_opt()
    for step in (75, 100):
        save_checkpoint(tmp_path, step, model=model, optimizers=opts, meta={"fingerprint": "old"}, keep=2)
    save_checkpoint(tmp_path, 5, model=model, optimizers=opts, meta={"fingerprint": "new"}, keep=2)
    assert latest_checkpoint(tmp_path, "new").name == "step_000005"
    save_checkpoint(tmp_path, 10, model=model, optimizers=opts, meta={"fingerprint": "new"}, keep=2)
    # the stated rule: once the current run has a checkpoint of its own, other runs' checkpoints go
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010", "step_000005"]


def test_list_checkpoints_orders_by_step_within_a_fingerprint(tmp_path):
    model, opts = _model_and_opt()
    for step in (999_999, 1_000_000):
        save_checkpoint(tmp_path, step, model=model, optimizers=opts, meta={"fingerprint": "a"}, keep=10)
    other = tmp_path / "step_000007"  # another run's checkpoint, as a settings change leaves it
    other.mkdir()
    write_json_atomic(other / "meta.json", {"fingerprint": "b", "step": 7, "files": {}})
    assert [p.name for p in list_checkpoints(tmp_path, "a")] == ["step_1000000", "step_999999"]
    assert [p.name for p in list_checkpoints(tmp_path, "b")] == ["step_000007"]


def test_pruning_keeps_the_newest_valid_checkpoint_over_a_corrupt_later_one(tmp_path):
    """Resumed from step 1 because step 3 was corrupt: the step-2 save must survive keep=1."""
    model, opts = _model_and_opt()
    for step in (1, 3):
        save_checkpoint(tmp_path, step, model=model, optimizers=opts, meta={"fingerprint": "f"}, keep=5)
    (tmp_path / "step_000003" / "model.pt").write_bytes(b"garbage")
    save_checkpoint(tmp_path, 2, model=model, optimizers=opts, meta={"fingerprint": "f"}, keep=1)
    assert latest_checkpoint(tmp_path, "f").name == "step_000002"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]


def test_stale_temp_dirs_of_a_killed_save_are_swept(tmp_path):
    model, opts = _model_and_opt()
    (tmp_path / ".step_000010.tmp").mkdir()
    (tmp_path / ".step_000010.tmp" / "model.pt").write_bytes(b"half")
    (tmp_path / ".step_000005.old4242").mkdir()
    save_checkpoint(tmp_path, 20, model=model, optimizers=opts, meta={"fingerprint": "f"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000020"]


FULL_DISK = r"""
import resource, signal, sys, torch
from pathlib import Path
from chatpipe.train.checkpoint import save_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
model = torch.nn.Linear(512, 512)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    save_checkpoint(Path(sys.argv[1]), 3, model=model, optimizers=[], meta={"fingerprint": "f"})
except OSError as e:
    print("ERROR:", e)
    sys.exit(3)
"""


def test_failed_checkpoint_write_gives_a_clear_error_and_leaves_no_temp(tmp_path):
    import subprocess
    import sys

    work = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(work)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "step_000003" in done.stdout and "model.pt" in done.stdout, done.stdout
    assert "free" in done.stdout  # says how much room is left
    assert list(work.iterdir()) == []


def test_load_model_verifies_the_recorded_sha256(tmp_path):
    import pytest

    from chatpipe.model.files import load_model
    from chatpipe.model.gpt import GPT, config_from_depth

    config = config_from_depth(1, 64, 16, head_dim=16)
    model = GPT(config)
    model.init_weights()
    out = tmp_path / "base"
    save_model_dir(out, model, {"model_config": config.to_dict()})
    load_model(out)  # intact: loads
    data = bytearray((out / "model.pt").read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside a tensor
    (out / "model.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.pt.*sha256"):
        load_model(out)


# ---------------------------------------------------------------- damaged checkpoints: resume falls back


def _two_checkpoints(tmp_path):
    model, opts = _model_and_opt()
    save_checkpoint(tmp_path, 1, model=model, optimizers=opts, meta={"fingerprint": "f", "world_size": 1})
    _step(model, opts)
    save_checkpoint(tmp_path, 2, model=model, optimizers=opts, meta={"fingerprint": "f", "world_size": 1})
    return tmp_path / "step_000002" / "meta.json"


def _edit_meta(path, **changes):
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.write_text("{not json"), r"step_000002/meta\.json: unreadable"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00"), r"step_000002/meta\.json: unreadable"),
        (lambda p: p.write_text("[1, 2]"), r"step_000002/meta\.json: not a JSON object"),
        (lambda p: _edit_meta(p, step="two"), r"step_000002/meta\.json: step = 'two'"),
        (lambda p: _edit_meta(p, step=5), r"step_000002/meta\.json: step = 5, but the directory is step_000002"),
        (lambda p: _edit_meta(p, files={}), r"step_000002/meta\.json: 'files' must list .* got \{\}"),
        (lambda p: _edit_meta(p, files=None), r"step_000002/meta\.json: 'files' must list"),
        (lambda p: _edit_meta(p, files=[1]), r"step_000002/meta\.json: 'files' must list"),
    ],
)
def test_a_damaged_checkpoint_meta_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage, reason):
    from chatpipe.train.checkpoint import resume_latest

    damage(_two_checkpoints(tmp_path))
    assert re.search(reason, verify_checkpoint(tmp_path / "step_000002"))
    model, opts = _model_and_opt(seed=5)
    meta = resume_latest(tmp_path, "f", model=model, optimizers=opts)
    assert meta["step"] == 1  # not a traceback, and not a fresh start
    assert re.search(reason, caplog.text)


def test_a_checkpoint_that_verifies_but_does_not_load_is_skipped_and_leaves_the_model_alone(tmp_path, caplog):
    from chatpipe.io import sha256_file
    from chatpipe.train.checkpoint import resume_latest

    meta_path = _two_checkpoints(tmp_path)
    optim = meta_path.parent / "optim.pt"
    torch.save({"not": "a list"}, optim)  # re-recorded: the checksum holds, the content is wrong
    meta = json.loads(meta_path.read_text())
    meta["files"]["optim.pt"] = sha256_file(optim)
    meta_path.write_text(json.dumps(meta))
    assert verify_checkpoint(meta_path.parent) is None
    model, opts = _model_and_opt(seed=5)
    assert resume_latest(tmp_path, "f", model=model, optimizers=opts)["step"] == 1
    assert "does not load" in caplog.text and "optim.pt" in caplog.text


class _Planted:
    """A pickle that runs code when unpickled: it writes the file named in its argument."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path, name: str, marker) -> None:
    """Replace ``path/name`` with a code-running pickle and rewrite meta.json's hash to match, as an
    attacker who can write the checkpoint folder would."""
    import pickle

    from chatpipe.io import sha256_file

    (path / name).write_bytes(pickle.dumps([_Planted(str(marker))]))
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][name] = sha256_file(path / name)
    (path / "meta.json").write_text(json.dumps(meta))


def test_a_planted_pickle_in_optim_and_rank_files_never_runs_on_resume(tmp_path, caplog):
    """Both files of the newest checkpoint replaced by code-running pickles, hashes rewritten: resume
    loads data only, so nothing runs; the checkpoint is skipped naming optim.pt, and the run
    resumes from the one before it."""
    from chatpipe.train.checkpoint import resume_latest

    meta_path = _two_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    for name in ("optim.pt", "rank0.pt"):
        _plant(meta_path.parent, name, marker)
    assert verify_checkpoint(meta_path.parent) is None  # the checksums hold: they prove nothing
    model, opts = _model_and_opt(seed=5)
    assert resume_latest(tmp_path, "f", model=model, optimizers=opts)["step"] == 1
    assert not marker.exists()
    assert "step_000002: it does not load" in caplog.text


def test_a_planted_rank_file_alone_resumes_with_a_fresh_rng_and_runs_nothing(tmp_path, caplog):
    """An RNG file that needs unpickling (planted, or written by an older chatpipe) is not loaded:
    model and optimizers resume from the checkpoint, the RNG is re-seeded, a warning names the file."""
    meta_path = _two_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    _plant(meta_path.parent, "rank0.pt", marker)
    model, opts = _model_and_opt(seed=5)
    meta = load_checkpoint(meta_path.parent, model=model, optimizers=opts, world_size=1)
    assert meta["step"] == 2 and not marker.exists()
    assert "rank0.pt: not loaded, it needs unpickling" in caplog.text


def test_rng_states_are_saved_as_data_and_restore_every_generator(tmp_path):
    import numpy as np

    model, opts = _model_and_opt()
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    save_checkpoint(tmp_path, 1, model=model, optimizers=opts, meta={"world_size": 1})
    state = torch.load(tmp_path / "step_000001" / "rank0.pt", weights_only=True)  # data only
    assert isinstance(state["numpy"]["keys"], torch.Tensor) and isinstance(state["python"], list)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    load_checkpoint(tmp_path / "step_000001", model=model, optimizers=opts, world_size=1)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
