"""Chat-stage evaluation helpers: masked val loss, reply extraction, end-token rate, task accuracy."""

from __future__ import annotations

import math

import pytest
import torch

from chatpipe.data.tasks import build_task
from chatpipe.evals import chat_checks as chateval
from chatpipe.inference.engine import Engine
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.runtime import Runtime
from chatpipe.tokenizer import Tokenizer
from chatpipe.train import step as train_step

TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})  # bytes only: ids 0..255, specials after
RT = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
END = TOK.encode_special("<|assistant_end|>")


def test_val_loss_and_bpb_count_only_trained_targets():
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            sequence_len=16, vocab_size=TOK.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32, window_pattern="L"
        )
    )
    model.init_weights()
    x = torch.randint(0, 256, (2, 16))
    y = torch.randint(0, 256, (2, 16))
    y[:, :10] = -1
    y[0, 15] = END  # a special token: a target for the loss, no bytes for bpb
    per_token = model(x, y, loss_reduction="none")
    loss, bpb = train_step.evaluate_loss_bpb(model, [(x, y)], TOK.token_bytes(), RT)
    assert loss == pytest.approx(per_token[:, 10:].mean().item(), rel=1e-5)
    byte_targets = per_token[:, 10:].flatten().tolist()
    del byte_targets[5]  # row 0, position 15
    assert bpb == pytest.approx(sum(byte_targets) / (math.log(2) * len(byte_targets)), rel=1e-5)
    assert bpb == pytest.approx(train_step.evaluate_bpb(model, [(x, y)], TOK.token_bytes(), RT), rel=1e-5)


def test_evaluation_builds_no_autograd_graph():
    # a graph per eval batch, chained through the running sums, holds every batch's activations
    # until the end (and sends the forward down the training-only attention path)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=TOK.vocab_size, n_layer=1, n_head=1, n_kv_head=1, n_embd=32))
    model.init_weights()
    grad_on = []
    model.register_forward_pre_hook(lambda *_: grad_on.append(torch.is_grad_enabled()))
    x = torch.randint(0, 256, (2, 16))
    train_step.evaluate_loss_bpb(model, [(x, x), (x, x)], TOK.token_bytes(), RT)
    assert grad_on == [False, False]


@pytest.fixture
def scripted(monkeypatch):
    """Engine.generate_many returns replies chosen by the test instead of sampling a model."""
    replies: dict[str, list[int]] = {}

    def fake(self, prompts, num_samples=1, **kw):
        out = []
        for prompt_ids in prompts:
            new = next(v for k, v in replies.items() if k in TOK.decode(prompt_ids))
            out.append(([list(prompt_ids) + new], [[0] * len(prompt_ids) + [1] * len(new)]))
        return out

    monkeypatch.setattr(Engine, "generate_many", fake)
    return replies


def test_complete_and_end_token_rate(scripted):
    convs = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
        for q in ("stops", "rambles")
    ]
    scripted["stops"] = TOK.encode("fine") + [END]
    scripted["rambles"] = TOK.encode("and on and on")
    engine = Engine(None, TOK)
    assert chateval.complete(engine, convs, max_tokens=8) == [("fine", True), ("and on and on", False)]
    assert chateval.end_token_rate(None, TOK, convs) == 0.5


def test_task_accuracy_uses_the_tasks_grader(scripted):
    task = build_task("tinyworld_arith", "test", limit=2)
    q0, q1 = (task[i]["messages"][0]["content"] for i in range(2))
    a0 = task[0]["messages"][1]["content"][-1]["text"]  # "... #### n"
    scripted[q0] = TOK.encode(a0) + [END]
    scripted[q1] = TOK.encode("#### -1") + [END]
    samples: list = []
    assert chateval.task_accuracy(None, TOK, task, samples=samples) == 0.5
    assert [ok for _, _, ok in samples] == [True, False]
