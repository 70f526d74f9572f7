"""The training stages' shared end (chatpipe/train/stage.py): model handed on, summary, metrics files."""

from __future__ import annotations

import json

import torch

from chatpipe import tracking
from chatpipe.runtime import Runtime
from chatpipe.stage_metrics import Curves
from chatpipe.train.checkpoint import load_model
from chatpipe.train.stage import finish_stage


class Recorder:
    """Stands in for MetricBuffer: remembers what reached it."""

    def __init__(self) -> None:
        self.logged, self.flushed = [], 0

    def log(self, metrics: dict, step: int) -> None:
        self.logged.append((step, metrics))

    def flush(self) -> None:
        self.flushed += 1


def _finish(tmp_path, rank: int):
    from chatpipe.model.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(sequence_len=8, vocab_size=32, n_layer=1, n_head=1, n_kv_head=1, n_embd=128))
    model.init_weights()
    rt = Runtime(rank, rank, 2, torch.device("cpu"), torch.float32)
    buffer = Recorder()
    metrics = Curves(buffer, "pretrain", ["val/bpb"], enabled=rt.is_main, root=tmp_path / "plots")
    meta = {"stage": "pretrain", "model_config": model.config.to_dict(), "carried": {"mlflow_run_ids": ["r1", "r2"]}}
    finish_stage(
        "pretrain",
        tmp_path / "artifacts" / "base",
        model,
        meta,
        {"val_bpb": 1.25, "tokens": 4096},
        step=10,
        run=tracking.StageRun(),
        run_ids=["r1", "r2"],
        metrics=metrics,
        rt=rt,
        final={"final/val_bpb": 1.25, "val/bpb": 1.25},
    )
    return model, buffer


def test_rank_0_saves_the_model_with_its_summary_and_writes_the_metrics_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, buffer = _finish(tmp_path, rank=0)
    assert buffer.logged == [(10, {"final/val_bpb": 1.25, "val/bpb": 1.25})] and buffer.flushed == 1
    loaded, meta = load_model(tmp_path / "artifacts" / "base")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert meta["step"] == 10 and meta["source_stage"] == "pretrain" and meta["mlflow_run_id"] == "r2"
    assert meta["summary"] == {"val_bpb": 1.25, "tokens": 4096}
    assert json.loads((tmp_path / "metrics" / "pretrain.json").read_text()) == {
        "pretrain": {"val_bpb": 1.25, "tokens": 4096}
    }
    assert (tmp_path / "plots" / "pretrain" / "val_bpb.csv").read_text().splitlines() == ["step,val_bpb", "10,1.25"]


def test_other_ranks_flush_and_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, buffer = _finish(tmp_path, rank=1)
    assert buffer.flushed == 1
    assert list(tmp_path.iterdir()) == []
