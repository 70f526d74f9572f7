"""Rollouts: disjoint prompts per rank, masks for prompt / tool output / padding, log-probs, the critic."""

from __future__ import annotations

import pytest
import torch

from chatpipe.inference.engine import Engine
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.rl.losses import mean_pass_at_k
from chatpipe.rl.rewards import exact_answer
from chatpipe.rl.rollout import (
    Problem,
    Rollouts,
    best_of_n,
    collect_rollouts,
    evaluate_problems,
    gold_text,
    load_problems,
    rank_indices,
    token_logprobs,
)
from chatpipe.rl.value import ValueModel, token_values
from chatpipe.tokenizer import Tokenizer

TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})  # bytes only + the chat specials


def test_rank_indices_disjoint_across_ranks_and_steps():
    n, per_rank, world = 50, 4, 3
    steps_per_epoch = n // (per_rank * world)  # 4
    seen_in_epoch: set[int] = set()
    for step in range(steps_per_epoch):
        picks = [rank_indices(n, step, per_rank, r, world, seed=7) for r in range(world)]
        flat = [i for p in picks for i in p]
        assert all(len(p) == per_rank for p in picks)
        assert len(set(flat)) == len(flat), f"step {step}: ranks overlap"
        assert not seen_in_epoch & set(flat), "a problem came back within one epoch"
        seen_in_epoch |= set(flat)
    # a new epoch reshuffles; the same call is deterministic
    assert rank_indices(n, steps_per_epoch, per_rank, 0, world, 7) != rank_indices(n, 0, per_rank, 0, world, 7)
    assert rank_indices(n, 5, per_rank, 1, world, 7) == rank_indices(n, 5, per_rank, 1, world, 7)
    with pytest.raises(ValueError, match="prompts per step"):
        rank_indices(10, 0, 4, 0, 3, 0)


class ScriptedModel(torch.nn.Module):
    """Emits a fixed continuation after the prompt, whatever the prompt says (logit 50 on the script)."""

    def __init__(self, script: list[int], prompt_len: int, vocab: int) -> None:
        super().__init__()
        self.config = GPTConfig(sequence_len=256, vocab_size=vocab, n_layer=1, n_head=1, n_kv_head=1, n_embd=8)
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.script, self.prompt_len, self.vocab = script, prompt_len, vocab

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", logits_at=None):
        b, t = idx.shape
        positions = kv_cache.positions() if kv_cache is not None else torch.arange(t).expand(b, t)
        logits = torch.zeros(b, t, self.vocab)
        for i in range(b):
            for j in range(t):
                k = int(positions[i, j]) + 1 - self.prompt_len  # index into the script of the token predicted here
                if 0 <= k < len(self.script):
                    logits[i, j, self.script[k]] = 50.0
        if kv_cache is not None:
            kv_cache.advance(t)
        return logits if logits_at is None else logits.flatten(0, 1)[logits_at]


def conv(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": f"#### {answer}"}]}


def test_collect_rollouts_masks_scores_and_padding():
    sp = TOK.special_ids
    enc = TOK.encode
    # the model calls the calculator with 2+3; the engine forces <|output_start|>5<|output_end|>
    script = [
        sp["<|python_start|>"],
        *enc("2+3"),
        sp["<|python_end|>"],
        sp["<|output_start|>"],
        *enc("5"),
        sp["<|output_end|>"],
        *enc("#### 5"),
        sp["<|assistant_end|>"],
    ]
    long_q, short_q = "what is 2+3?", "2+3"
    problems = [
        Problem(conv(long_q, "5"), lambda text: exact_answer(text, "5")),
        Problem(conv(short_q, "6"), lambda text: exact_answer(text, "6")),
    ]
    prompt_len = len(TOK.render_for_completion(problems[0].conversation))
    short_len = len(TOK.render_for_completion(problems[1].conversation))
    model = ScriptedModel(script, prompt_len, TOK.vocab_size)
    batch = collect_rollouts(Engine(model, TOK), problems[:1], group_size=2, max_new_tokens=40, seed=0)
    n_forced = 3
    assert batch.scores.tolist() == [1.0, 1.0]
    assert batch.ended.tolist() == [True, True]
    assert batch.lengths.tolist() == [len(script) - n_forced] * 2
    assert batch.groups.tolist() == [0, 0]
    assert batch.completions[0].endswith("#### 5")
    # targets are the next tokens; the mask is 1 exactly on the sampled ones
    row_mask, row_targets = batch.mask[0], batch.targets[0]
    assert row_mask[: prompt_len - 1].sum() == 0  # prompt
    assert row_mask.sum() == len(script) - n_forced
    forced = row_targets[row_mask == 0][prompt_len - 1 :].tolist()
    assert forced == [sp["<|output_start|>"], *enc("5"), sp["<|output_end|>"]]

    # two prompts of different length: the shorter rows are padded, padding is masked out
    model_b = ScriptedModel(script, short_len, TOK.vocab_size)
    both = collect_rollouts(Engine(model_b, TOK), problems[1:] + problems[1:], group_size=1, max_new_tokens=40, seed=0)
    assert both.scores.tolist() == [0.0, 0.0]  # answered 5, gold is 6
    assert both.groups.tolist() == [0, 1]

    # cut at max_new_tokens: not ended
    cut = collect_rollouts(Engine(model, TOK), problems[:1], group_size=1, max_new_tokens=4, seed=0)
    assert cut.ended.tolist() == [False] and cut.scores.tolist() == [0.0]


def test_collect_rollouts_pads_rows_of_unequal_length():
    problems = [
        Problem(conv("a much longer question here", "1"), lambda t: 0.0),
        Problem(conv("q", "1"), lambda t: 0.0),
    ]
    lens = [len(TOK.render_for_completion(p.conversation)) for p in problems]
    model = ScriptedModel([], 0, TOK.vocab_size)  # flat logits: random tokens
    batch = collect_rollouts(Engine(model, TOK), problems, group_size=1, max_new_tokens=3, seed=0)
    assert batch.inputs.shape[1] >= max(lens) - 1
    assert batch.mask[1, lens[1] + 3 :].sum() == 0  # past the short row's end is padding


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=TOK.vocab_size, n_layer=2, n_head=2, n_kv_head=2, n_embd=32))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_token_logprobs_match_log_softmax_and_chunking():
    model = tiny_gpt()
    x = torch.randint(0, 256, (5, 12))
    y = torch.randint(0, 256, (5, 12))
    want = torch.log_softmax(model(x), dim=-1).gather(-1, y[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(model, x, y), want, atol=1e-5)
    assert torch.allclose(token_logprobs(model, x, y, micro_batch=2), want, atol=1e-5)


def test_value_model_is_an_independent_copy_with_zero_head():
    policy = tiny_gpt()
    critic = ValueModel.from_policy(policy)
    x = torch.randint(0, 256, (3, 10))
    assert token_values(critic, x, micro_batch=2).shape == (3, 10)
    assert torch.all(critic(x) == 0)  # zero head: every first value is 0
    trainable = [p for p in critic.parameters() if p.requires_grad]
    grouped = [p for ps in critic.param_groups().values() for p in ps]
    assert len(grouped) == len(trainable) and {id(p) for p in grouped} == {id(p) for p in trainable}
    assert not critic.trunk.lm_head.weight.requires_grad
    with torch.no_grad():
        critic.trunk.wte.weight.add_(1.0)
    assert not torch.equal(critic.trunk.wte.weight, policy.wte.weight)


def test_load_problems_tinyworld_held_out():
    train = load_problems("tinyworld_arith", "train", 20, seed=0)
    val = load_problems("tinyworld_arith", "val", 10, seed=0)
    questions = {p.conversation["messages"][0]["content"] for p in train}
    assert not questions & {p.conversation["messages"][0]["content"] for p in val}
    gold = val[0].conversation["messages"][-1]["content"][-1]["text"]
    assert val[0].score(gold) == 1.0 and val[0].score("#### -1") == 0.0


def test_keep_tasks_load_with_their_own_options_and_grader():
    """RL's keep_tasks (e.g. spelling alongside arithmetic) load with task options and score by the task's grader."""
    from chatpipe.settings import RLSettings

    cfg = RLSettings(keep_tasks=[{"task": "spellingbee", "limit": 4, "words": "tinyworld"}])
    keep = cfg.keep_tasks[0]
    problems = load_problems(keep.task, "train", keep.limit, words=keep.words, path=keep.path)
    assert len(problems) == 4
    for p in problems:
        gold = p.conversation["messages"][-1]["content"]
        gold = gold if isinstance(gold, str) else "".join(part["text"] for part in gold)
        assert p.score(gold) == 1.0 and p.score("#### 987654") == 0.0
    with pytest.raises(ValueError, match="does not take"):
        load_problems("tinyworld_arith", "train", 2, words="tinyworld")


def test_pass_at_k_counts_the_tasks_verdict_not_partial_credit():
    # exact_or_format pays 0.1 for a wrong answer in the #### format; that is not a pass.
    # One right, one formatted-wrong and one unformatted answer: pass@1 = 1/3 (not 2/3)
    problem = load_problems("tinyworld_arith", "val", n=1, seed=0, reward="exact_or_format")[0]
    gold = gold_text(problem.conversation).split("####")[-1].strip()
    prompt_len = len(TOK.render_for_completion(problem.conversation))
    end = TOK.special_ids["<|assistant_end|>"]
    answers = [f"#### {gold}", f"#### {int(gold) + 1}", gold]
    assert [problem.score(a) for a in answers] == [1.0, 0.1, 0.0]
    correct = []
    for answer in answers:
        engine = Engine(ScriptedModel([*TOK.encode(answer), end], prompt_len, TOK.vocab_size), TOK)
        kw = dict(num_samples=1, max_new_tokens=16, temperature=1.0, top_k=None, seed=0)
        correct += evaluate_problems(engine, [problem], **kw)[0]
    assert correct == [True, False, False]
    assert mean_pass_at_k([correct], 1) == pytest.approx(1 / 3)
    # a problem without a checker of its own passes on full credit only
    assert not Problem(problem.conversation, lambda text: 0.1).is_correct("x")


def test_token_logprobs_at_a_sampling_temperature_match_tempered_logits():
    model = tiny_gpt()
    x = torch.randint(0, 256, (5, 12))
    y = torch.randint(0, 256, (5, 12))
    want = torch.log_softmax(model(x) / 0.7, dim=-1).gather(-1, y[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(model, x, y, temperature=0.7), want, atol=1e-5)
    assert torch.allclose(token_logprobs(model, x, y, micro_batch=2, temperature=0.7), want, atol=1e-5)
    assert not torch.allclose(token_logprobs(model, x, y), want, atol=1e-3)  # T = 1 is another policy


def test_best_of_n_keeps_the_highest_scores_in_sampling_order():
    # scores 0.1, 1, 0, 1, 0.1: the two 1s, then the earlier 0.1
    assert best_of_n([0.1, 1.0, 0.0, 1.0, 0.1], 3) == [0, 1, 3]
    assert best_of_n([0.0, 0.0], 2) == [0, 1]


def test_generation_size_samples_more_and_keeps_the_best_group():
    problems = [Problem(conv("q", "1"), lambda t: float(sum(map(ord, t)) % 7))]
    model = ScriptedModel([], 0, TOK.vocab_size)  # flat logits: random tokens
    kw = dict(max_new_tokens=4, seed=3)
    everything = collect_rollouts(Engine(model, TOK), problems, group_size=5, **kw)
    kept = collect_rollouts(Engine(model, TOK), problems, group_size=2, generation_size=5, **kw)
    rows = best_of_n(everything.scores.tolist(), 2)
    assert kept.completions == [everything.completions[i] for i in rows]
    assert sorted(kept.scores.tolist(), reverse=True) == sorted(everything.scores.tolist(), reverse=True)[:2]
    assert len(set(everything.scores.tolist())) > 1  # the case has something to choose between
    assert kept.groups.tolist() == [0, 0] and kept.inputs.size(0) == 2


def test_mask_too_long_takes_cut_responses_out_of_the_loss():
    batch = Rollouts(
        inputs=torch.zeros(2, 3, dtype=torch.long),
        targets=torch.zeros(2, 3, dtype=torch.long),
        mask=torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
        scores=torch.tensor([0.5, 1.0]),
        ended=torch.tensor([False, True]),
        lengths=torch.tensor([2, 2]),
        groups=torch.tensor([0, 0]),
    )
    out = batch.without_unfinished()
    assert out.mask.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert out.scores.tolist() == [0.5, 1.0]  # the score still counts in its group's mean
    assert batch.mask.sum() == 4  # the batch itself is unchanged


def test_keep_best_keeps_each_groups_highest_scores_in_sampling_order():
    from chatpipe.rl.rollout import Rollouts, keep_best

    n = 6
    batch = Rollouts(
        inputs=torch.arange(n)[:, None],
        targets=torch.arange(n)[:, None],
        mask=torch.ones(n, 1),
        scores=torch.tensor([0.1, 0.9, 0.5, 2.0, -1.0, 3.0]),
        ended=torch.ones(n, dtype=torch.bool),
        lengths=torch.ones(n, dtype=torch.long),
        groups=torch.tensor([0, 0, 0, 1, 1, 1]),
    )
    kept = keep_best(batch, 2)
    assert kept.inputs.flatten().tolist() == [1, 2, 3, 5]  # group 0: 0.9, 0.5; group 1: 2.0, 3.0
    assert kept.groups.tolist() == [0, 0, 1, 1]


def test_behaviour_logprobs_are_what_the_trainer_recomputes_and_change_no_token():
    """The sampler's log-prob of each sampled token, at the sampling temperature before top-k, is the
    trainer's ``token_logprobs`` of the same rows (float rounding of another batch shape aside): fresh
    rollouts get importance weights of 1. Recording them leaves the sampled tokens as they were."""
    model = tiny_gpt().eval()
    problems = [Problem(conv("q", "1"), lambda t: 0.0), Problem(conv("a longer one", "1"), lambda t: 0.0)]
    kw = dict(group_size=3, max_new_tokens=10, temperature=0.8, top_k=20, seed=4)
    plain = collect_rollouts(Engine(model, TOK), problems, **kw)
    batch = collect_rollouts(Engine(model, TOK), problems, **kw, behaviour_logprobs=True)
    assert plain.behav_logp is None and torch.equal(plain.targets, batch.targets)
    assert batch.behav_logp.shape == batch.targets.shape
    trainer = token_logprobs(model, batch.inputs, batch.targets, temperature=0.8)
    on = batch.mask > 0
    assert on.sum() > 10
    assert torch.allclose(batch.behav_logp[on], trainer[on], atol=1e-4)
    assert not batch.behav_logp[~on].any()  # prompt, forced tokens and padding: 0
