"""The training stages' shared start and end (chatpipe/train/stage.py): resume-or-fresh, model handed on, summary."""

from __future__ import annotations

import json

import pytest
import torch

from chatpipe import tracking
from chatpipe.io import sha256_file
from chatpipe.model.files import load_model
from chatpipe.runtime import Runtime
from chatpipe.stage_metrics import Curves
from chatpipe.train.stage import finish_stage, resume_or_fresh


class Recorder:
    """Stands in for the StageRun's log/flush: remembers what reached it."""

    def __init__(self) -> None:
        self.logged, self.flushed = [], 0

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))

    def flush(self) -> None:
        self.flushed += 1


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from chatpipe.data.synthetic import pretrain_documents
    from chatpipe.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    Tokenizer.train(pretrain_documents(0, 50), vocab_size=300).save(out)
    return out


def _finish(tmp_path, rank: int, tokenizer_dir):
    from chatpipe.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(sequence_len=8, vocab_size=32, n_layer=1, n_head=1, n_kv_head=1, n_embd=128))
    model.init_weights()
    rt = Runtime(rank, rank, 2, torch.device("cpu"), torch.float32)
    buffer = Recorder()
    metrics = Curves(buffer, "pretrain", ["val/bpb"], enabled=rt.is_main, root=tmp_path / "plots")
    meta = {"stage": "pretrain", "model_config": model.config.to_dict(), "carried": {"mlflow_run_ids": ["r1", "r2"]}}
    finish_stage(
        tmp_path / "artifacts" / "base",
        model,
        meta,
        {"val_bpb": 1.25, "tokens": 4096},
        step=10,
        run=tracking.StageRun(),
        metrics=metrics,
        rt=rt,
        tokenizer_dir=tokenizer_dir,
        final={"final/val_bpb": 1.25, "val/bpb": 1.25},
    )
    return model, buffer


def test_rank_0_saves_the_model_with_its_summary_and_writes_the_metrics_files(tmp_path, monkeypatch, tokenizer_dir):
    monkeypatch.chdir(tmp_path)
    model, buffer = _finish(tmp_path, rank=0, tokenizer_dir=tokenizer_dir)
    assert buffer.logged == [(10, {"final/val_bpb": 1.25, "val/bpb": 1.25})] and buffer.flushed == 1
    loaded, meta = load_model(tmp_path / "artifacts" / "base")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert meta["step"] == 10 and meta["source_stage"] == "pretrain" and meta["mlflow_run_id"] == "r2"
    assert meta["summary"] == {"val_bpb": 1.25, "tokens": 4096}
    # the model dir carries the tokenizer it was trained with, listed in its manifest
    manifest = json.loads((tmp_path / "artifacts" / "base" / "manifest.json").read_text())["sha256"]
    assert manifest["tokenizer/tokenizer.json"] == sha256_file(tokenizer_dir / "tokenizer.json")
    assert {"tokenizer/ranks.tiktoken", "tokenizer/token_bytes.pt"} <= set(manifest)
    assert json.loads((tmp_path / "metrics" / "pretrain.json").read_text()) == {
        "pretrain": {"val_bpb": 1.25, "tokens": 4096}
    }
    assert (tmp_path / "plots" / "pretrain" / "val_bpb.csv").read_text().splitlines() == ["step,val_bpb", "10,1.25"]


def test_other_ranks_flush_and_write_nothing(tmp_path, monkeypatch, tokenizer_dir):
    monkeypatch.chdir(tmp_path)
    _, buffer = _finish(tmp_path, rank=1, tokenizer_dir=tokenizer_dir)
    assert buffer.flushed == 1
    assert list(tmp_path.iterdir()) == []


def test_resume_or_fresh_starts_fresh_then_resumes_only_the_same_run(tmp_path):
    from chatpipe.settings import PretrainSettings
    from chatpipe.train.checkpoint import save_checkpoint

    rt = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    cfg = PretrainSettings()
    model = torch.nn.Linear(4, 4)
    opts = [torch.optim.AdamW(model.parameters())]
    run_fp, meta = resume_or_fresh(tmp_path, cfg, {"data": "a"}, model=model, optimizers=opts, rt=rt)
    assert meta == {}
    save_checkpoint(tmp_path, 5, model=model, optimizers=opts, meta={"fingerprint": run_fp, "world_size": 1})
    with torch.no_grad():
        model.weight.zero_()
    # a resume-neutral setting may change; the run and its checkpoint stay the same
    same = cfg.model_copy(update={"log_every": cfg.log_every + 1})
    assert resume_or_fresh(tmp_path, same, {"data": "a"}, model=model, optimizers=opts, rt=rt)[1]["step"] == 5
    assert model.weight.abs().sum() > 0  # the checkpoint's weights are back
    other_fp, fresh = resume_or_fresh(tmp_path, cfg, {"data": "b"}, model=model, optimizers=opts, rt=rt)
    assert fresh == {} and other_fp != run_fp  # other inputs: another run


def test_checkpointer_saves_every_n_steps_and_the_last_but_never_the_start_step(tmp_path):
    from chatpipe.settings import PretrainSettings
    from chatpipe.train.checkpoint import list_checkpoints
    from chatpipe.train.stage import Checkpointer

    rt = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    cfg = PretrainSettings(checkpoint_every=2, keep_checkpoints=10)
    model = torch.nn.Linear(2, 2)
    meta = {"fingerprint": "fp", "world_size": 1, "loader": {"row": 7}, "carried": {"train_seconds": 1.5}}
    saver = Checkpointer(tmp_path, cfg, model, [], meta=lambda: meta, rt=rt, start_step=2)
    for step in range(2, 6):
        saver.save_if_due(step, last=step == 5)
    assert sorted(p.name for p in list_checkpoints(tmp_path)) == ["step_000004", "step_000005"]
