"""ChatCORE scoring with scripted models and fake tasks: results that cannot pass by accident."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch

import chatpipe.evals.chatcore as chatcore_mod
from chatpipe.evals.chatcore import ChatcoreSettings, choose_letters, evaluate_chatcore, evaluate_task, letter_token_ids
from chatpipe.evals.metrics import pass_at_k
from chatpipe.settings import EvalSettings
from chatpipe.tokenizer import SPECIAL_TOKENS

LETTERS = ["A", "B", "C", "D"]


class ByteTokenizer:
    """Bytes are ids 0..255, special tokens follow; renders chats like the project tokenizer."""

    def __init__(self) -> None:
        self.special = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.bos_id = self.special["<|bos|>"]
        self.vocab_size = 256 + len(SPECIAL_TOKENS)

    def encode(self, text: str, prepend: int | None = None) -> list[int]:
        return ([] if prepend is None else [prepend]) + list(text.encode())

    def encode_special(self, name: str) -> int:
        return self.special[name]

    def decode(self, ids: list[int]) -> str:
        names = {v: k for k, v in self.special.items()}
        return "".join(names[i] if i in names else chr(i) for i in ids)

    def render_for_completion(self, conv: dict) -> list[int]:
        sp = self.special
        return [
            self.bos_id,
            sp["<|user_start|>"],
            *self.encode(conv["messages"][0]["content"]),
            sp["<|user_end|>"],
            sp["<|assistant_start|>"],
        ]


class FakeMC:
    """Categorical task; the user message ends with the gold letter so a copy model can 'know' it."""

    eval_type = "categorical"

    def __init__(self, n: int, seed: int = 0, name: str = "fake_mc") -> None:
        self.name = name  # the chatpipe.data.tasks name it plays: decides the label of its result
        rng = random.Random(seed)
        self.gold = [rng.choice(LETTERS) for _ in range(n)]
        self.seen: list[int] = []

    def __len__(self) -> int:
        return len(self.gold)

    def __getitem__(self, i: int) -> dict:
        self.seen.append(i)
        return {
            "messages": [
                {"role": "user", "content": f"question {i}? hint {self.gold[i]}"},
                {"role": "assistant", "content": self.gold[i]},
            ],
            "letters": LETTERS,
        }

    def evaluate(self, conv: dict, completion: str) -> bool:
        return completion == conv["messages"][-1]["content"]


class CopyModel(torch.nn.Module):
    """Next-token logits = one-hot of the token two places back (the hint letter before <|user_end|>)."""

    def __init__(self, vocab: int, distractor: int | None = None) -> None:
        super().__init__()
        self.vocab, self.distractor = vocab, distractor
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        logits = torch.zeros(b, t, self.vocab)
        logits[:, 2:].scatter_(2, idx[:, :-2].unsqueeze(-1), 10.0)
        if self.distractor is not None:  # a non-letter token that beats every letter
            logits[:, :, self.distractor] = 100.0
        return logits


class ConstantModel(CopyModel):
    """Always prefers the letter A."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*idx.shape, self.vocab)
        logits[:, :, ord("A")] = 1.0
        return logits


class ScriptedGen:
    """Generative task: item i has n scripted completions "0".."n-1", of which the first c_i are right."""

    eval_type = "generative"

    def __init__(self, correct: list[int], name: str = "fake_gen") -> None:
        self.correct, self.name = correct, name

    def __len__(self) -> int:
        return len(self.correct)

    def __getitem__(self, i: int) -> dict:
        return {"messages": [{"role": "user", "content": str(i)}, {"role": "assistant", "content": "-"}], "i": i}

    def evaluate(self, conv: dict, completion: str) -> bool:
        return int(completion) < self.correct[conv["i"]]


def options(**given) -> SimpleNamespace:
    """ChatCORE settings by hand: the eval section's defaults, every item (max_per_task 0), and ``given``."""
    defaults = {name: EvalSettings.model_fields[name].default for name in ChatcoreSettings.__annotations__}
    return SimpleNamespace(**{**defaults, "max_per_task": 0, **given})


@pytest.fixture
def scripted_samples(monkeypatch):
    def fake(engine, tokenizer, convs, sampling, *, seed):
        return [[str(j) for j in range(sampling.num_samples)] for _ in convs]

    monkeypatch.setattr(chatcore_mod, "generate_completions", fake)


TOK = ByteTokenizer()


def test_gold_preferring_model_scores_one_and_constant_model_the_letter_rate() -> None:
    task = FakeMC(200)
    r = evaluate_task(CopyModel(TOK.vocab_size), TOK, task, device="cpu", batch_size=7)
    assert (r["accuracy"], r["num_examples"]) == (1.0, 200)
    r = evaluate_task(ConstantModel(TOK.vocab_size), TOK, task, device="cpu")
    assert r["accuracy"] == task.gold.count("A") / 200
    assert 0.15 < r["accuracy"] < 0.35  # near the 0.25 random baseline


def test_only_answer_letters_are_compared() -> None:
    task = FakeMC(20)
    convs = [task[i] for i in range(20)]
    picked = choose_letters(CopyModel(TOK.vocab_size, distractor=ord("Z")), TOK, convs, "cpu")
    assert picked == task.gold


def test_letter_must_be_one_token() -> None:
    assert letter_token_ids(TOK, ["A", "B"]) == [65, 66]
    with pytest.raises(ValueError, match="'AB' encodes to 2 tokens"):
        letter_token_ids(TOK, ["AB"])


def test_generative_score_is_unbiased_pass_at_k(scripted_samples) -> None:
    task = ScriptedGen([0, 1, 2, 4])
    r = evaluate_task(CopyModel(1), TOK, task, device="cpu", sampling=options(num_samples=4, pass_k=2))
    # hand values: pass@2 of n=4 with c = 0, 1, 2, 4 is 0, 1/2, 5/6, 1
    assert r["accuracy"] == pytest.approx((0 + 0.5 + 5 / 6 + 1) / 4)
    assert [pass_at_k(4, c, 2) for c in (0, 1, 2, 4)] == pytest.approx([0, 0.5, 5 / 6, 1])
    r1 = evaluate_task(CopyModel(1), TOK, task, device="cpu", sampling=options(num_samples=4, pass_k=1))
    assert r1["accuracy"] == pytest.approx((0 + 1 + 2 + 4) / 16)


def test_bad_k_and_eval_type_are_rejected() -> None:
    with pytest.raises(ValueError, match="1 <= pass_k <= num_samples, got pass_k=3, num_samples=2"):
        evaluate_task(CopyModel(1), TOK, ScriptedGen([1]), device="cpu", sampling=options(num_samples=2, pass_k=3))
    with pytest.raises(ValueError, match="generative task 'fake_gen' needs sampling settings"):
        evaluate_task(CopyModel(1), TOK, ScriptedGen([1]), device="cpu")
    bad = ScriptedGen([1])
    bad.eval_type = "ranking"
    with pytest.raises(ValueError, match="allowed: 'categorical', 'generative'"):
        evaluate_task(CopyModel(1), TOK, bad, device="cpu")


def test_items_are_split_across_ranks_and_capped() -> None:
    seen = []
    for rank in (0, 1):
        task = FakeMC(100)
        r = evaluate_task(CopyModel(TOK.vocab_size), TOK, task, device="cpu", max_examples=10, rank=rank, world_size=2)
        assert r["num_examples"] == 5  # no process group: each rank reports its own share
        seen.append(set(task.seen))
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 10
    assert max(seen[0] | seen[1]) >= 90  # spread over the file, not its first 10 rows


def test_chatcore_is_mean_centered_accuracy(scripted_samples) -> None:
    tasks = {"MMLU": FakeMC(40, name="mmlu"), "GSM8K": ScriptedGen([1, 1, 1, 1], name="gsm8k")}
    out = evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, tasks, options(num_samples=2, pass_k=1), device="cpu")
    assert out["tasks"]["MMLU"]["centered"] == 1.0
    assert out["tasks"]["GSM8K"]["accuracy"] == pytest.approx(0.5)
    assert out["chatcore"] == pytest.approx((1.0 + 0.5) / 2)
    tasks = {"ARC-Easy": FakeMC(40, name="arc_easy")}
    out = evaluate_chatcore(ConstantModel(TOK.vocab_size), TOK, tasks, options(), device="cpu")
    acc = tasks["ARC-Easy"].gold.count("A") / 40
    assert out["chatcore"] == pytest.approx((acc - 0.25) / 0.75)
    with pytest.raises(ValueError, match="unknown ChatCORE task"):
        evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, {"TriviaQA": FakeMC(2)}, options(), device="cpu")


def test_the_eval_settings_pass_whole_and_cap_generative_tasks_apart(scripted_samples, params_file) -> None:
    """The eval stage hands evaluate_chatcore its ``eval`` section as it is: 0 means every item, the
    generative cap applies to generative tasks only, pass_k scores num_samples completions."""
    from chatpipe.settings import EvalSettings, load_section

    cfg = load_section(EvalSettings, ["--max_per_task=6", "--generative_max_per_task=2", "--num_samples=2"])
    tasks = {"MMLU": FakeMC(40, name="mmlu"), "GSM8K": ScriptedGen([1] * 10, name="gsm8k")}
    out = evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, tasks, cfg, device="cpu")
    assert out["tasks"]["MMLU"]["num_examples"] == 6 and out["tasks"]["GSM8K"]["num_examples"] == 2
    assert out["tasks"]["GSM8K"]["accuracy"] == 0.5  # pass@1 over 2 completions, 1 right
    every = load_section(EvalSettings, ["--max_per_task=0", "--generative_max_per_task=0", "--num_samples=2"])
    out = evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, tasks, every, device="cpu")
    assert out["tasks"]["MMLU"]["num_examples"] == 40 and out["tasks"]["GSM8K"]["num_examples"] == 10


def test_a_stand_in_reports_under_its_own_name_never_the_benchmarks(scripted_samples) -> None:
    tasks = {"MMLU": FakeMC(40, name="tinyworld_mc"), "GSM8K": ScriptedGen([1, 1], name="tinyworld_gsm")}
    out = evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, tasks, options(num_samples=2, pass_k=1), device="cpu")
    assert set(out["tasks"]) == {"tinyworld_mc", "tinyworld_gsm"}
    assert out["tasks"]["tinyworld_gsm"]["stands_in_for"] == "GSM8K"
    # centered with the baseline of the place it took (four letters: 0.25), as the benchmark would be
    assert out["tasks"]["tinyworld_mc"]["centered"] == 1.0 and out["chatcore"] == pytest.approx((1.0 + 0.5) / 2)
    real = evaluate_chatcore(
        CopyModel(TOK.vocab_size), TOK, {"GSM8K": ScriptedGen([1], name="gsm8k")}, options(), device="cpu"
    )
    assert set(real["tasks"]) == {"GSM8K"} and "stands_in_for" not in real["tasks"]["GSM8K"]
    with pytest.raises(ValueError, match="under one name"):
        evaluate_chatcore(CopyModel(1), TOK, {"MMLU": FakeMC(2), "ARC-Easy": FakeMC(2)}, options(), device="cpu")


def test_a_task_running_code_records_its_sandbox_mode(scripted_samples) -> None:
    code_task = ScriptedGen([1, 1], name="humaneval")
    code_task.sandbox = "fallback (bwrap not found)"  # as HumanEval reports it
    tasks = {"HumanEval": code_task, "GSM8K": ScriptedGen([1, 1], name="gsm8k")}
    out = evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, tasks, options(num_samples=2, pass_k=1), device="cpu")
    assert out["tasks"]["HumanEval"]["sandbox"] == "fallback (bwrap not found)"
    assert "sandbox" not in out["tasks"]["GSM8K"]


def test_generative_path_runs_the_real_engine() -> None:
    """A random tiny GPT through Engine: completions reach evaluate without the stop token."""
    from chatpipe.model.gpt import GPT, config_from_depth

    torch.manual_seed(0)
    model = GPT(config_from_depth(1, TOK.vocab_size, 32, head_dim=16))
    model.init_weights()
    got = []

    class Recorder(ScriptedGen):
        def evaluate(self, conv, completion):
            got.append(completion)
            return False

    r = evaluate_task(
        model,
        TOK,
        Recorder([0, 0, 0]),
        device="cpu",
        sampling=options(num_samples=2, max_new_tokens=5, temperature=1.0),
    )
    assert r["accuracy"] == 0.0 and len(got) == 6
    assert all("<|assistant_end|>" not in c and "<|bos|>" not in c for c in got)


def test_long_prompts_keep_their_end() -> None:
    """A prompt longer than the model's positions is cut from the left, so the answer hint survives."""
    model = CopyModel(TOK.vocab_size)
    model.cos = torch.zeros(1, 1, 16, 2)  # pretend the rotary table covers 16 positions
    conv = {"messages": [{"role": "user", "content": "x" * 100 + " hint C"}], "letters": LETTERS}
    assert choose_letters(model, TOK, [conv], "cpu") == ["C"]
    assert len(chatcore_mod._fit(list(range(100)), model, room=6)) == 10


class SlowMC(FakeMC):
    """A multiple-choice task whose every verdict takes a while, as a big task's items do in total."""

    def evaluate(self, conversation, answer):
        time.sleep(0.02)
        return super().evaluate(conversation, answer)


def test_chatcore_writes_a_progress_line_while_a_long_task_runs(monkeypatch, caplog) -> None:
    """A ChatCORE pass longer than CHATPIPE_PROGRESS_EVERY is never silent for longer (issue 72)."""
    monkeypatch.setenv("CHATPIPE_PROGRESS_EVERY", "0.1")
    monkeypatch.setenv("CHATPIPE_PROGRESS", "auto")
    with caplog.at_level("INFO", logger="chatpipe.progress"):
        evaluate_chatcore(CopyModel(TOK.vocab_size), TOK, {"MMLU": SlowMC(20, name="mmlu")}, options(), device="cpu")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("chatcore:")]
    assert len(lines) >= 2 and "0/1 task" in lines[0]
