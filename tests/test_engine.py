"""Tests for chatpipe.inference.engine: cache == recompute, sampling, stopping, batch expansion, tool use."""

from __future__ import annotations

import time

import pytest
import torch

from chatpipe.inference.engine import Engine, StopMatcher
from chatpipe.inference.sampler import draw, sample_next, sampling_candidates, sampling_probs
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.testing.chatmodel import ByteTokenizer

TOK = ByteTokenizer()
S = TOK.special
VOCAB = 256 + len(S) + 35  # 300
# a scripted model's calculator call from <|python_start|> on: "2+3", then "!" after the output, then the end
CALL_2_PLUS_3 = {
    S["<|python_start|>"]: TOK.encode("2")[0],
    TOK.encode("2")[0]: TOK.encode("+")[0],
    TOK.encode("+")[0]: TOK.encode("3")[0],
    TOK.encode("3")[0]: S["<|python_end|>"],
    S["<|output_end|>"]: TOK.encode("!")[0],
    TOK.encode("!")[0]: S["<|assistant_end|>"],
}


def random_model(seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    model = GPT(
        GPTConfig(
            **{
                **dict(
                    sequence_len=64, vocab_size=VOCAB, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SL"
                ),
                **kw,
            }
        )
    )
    model.init_weights()
    with torch.no_grad():  # non-trivial blocks (zero-init projections would make them identities)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@torch.no_grad()
def greedy_recompute(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Reference: re-run the whole sequence every step, no cache."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_kv_cache_greedy_equals_recompute():
    model = random_model()
    with torch.no_grad():  # stop tokens get logit 0, below the max of ~300 random logits: no early stop
        model.lm_head.weight[[S["<|bos|>"], S["<|assistant_end|>"]]] = 0.0
    prompt = [S["<|bos|>"], *TOK.encode("hello there, general")]  # 21 tokens; sliding window is 32
    n = 60  # runs well past the sliding window and past sequence_len (64)
    ref = greedy_recompute(model, prompt, n)
    seqs, masks = Engine(model, TOK).generate_batch(prompt, max_tokens=n, temperature=0.0)
    got = seqs[0][len(prompt) :]
    assert len(got) == n and got == ref and masks[0] == [0] * len(prompt) + [1] * n
    assert len(set(ref)) > 5  # not a degenerate constant stream


def test_sampling_is_reproducible_and_seed_dependent():
    model = random_model(1)
    engine = Engine(model, TOK)
    prompt = [S["<|bos|>"], 104, 105]
    a = engine.generate_batch(prompt, num_samples=3, max_tokens=12, temperature=1.0, seed=7)
    b = engine.generate_batch(prompt, num_samples=3, max_tokens=12, temperature=1.0, seed=7)
    c = engine.generate_batch(prompt, num_samples=3, max_tokens=12, temperature=1.0, seed=8)
    assert a == b and a != c
    seqs, masks = a
    assert len(set(map(tuple, seqs))) > 1  # rows sample independently after the shared prefill
    for seq, mask in zip(seqs, masks):
        assert seq[:3] == prompt and mask[:3] == [0, 0, 0] and len(seq) == len(mask)


@pytest.mark.parametrize("options", [{}, {"smear": True, "value_embeds": True}], ids=["plain", "smear+ve"])
def test_generate_many_batches_any_lengths_and_matches_one_prompt_at_a_time(options):
    model = random_model(2, **options)
    engine = Engine(model, TOK)
    prompts = [[S["<|bos|>"], *TOK.encode(t)] for t in ("ab", "cd", "hello", "xy", "world")]  # lengths 3,3,6,3,6
    batched = engine.generate_many(prompts, num_samples=2, max_tokens=10, temperature=0.0)
    for prompt, (seqs, masks) in zip(prompts, batched):
        alone = engine.generate_batch(prompt, num_samples=2, max_tokens=10, temperature=0.0)
        assert (seqs, masks) == alone  # greedy: same tokens whether batched (and padded) or not
        assert all(s[: len(prompt)] == prompt for s in seqs)
    split = engine.generate_many(prompts, num_samples=2, max_tokens=10, temperature=0.0, max_rows=2)
    assert split == batched  # max_rows=2: one prompt at a time


def test_prompt_errors_name_the_problem():
    engine = Engine(random_model(), TOK)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate_batch([], max_tokens=2)
    with pytest.raises(ValueError, match="max_rows = 2 must be >= num_samples = 4"):
        engine.generate_many([[1]], num_samples=4, max_rows=2)


def test_top_k_limits_choices_and_temperature_zero_is_argmax():
    logits = torch.randn(4, 50)
    rng = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, rng, temperature=0.0), logits.argmax(-1))
    assert torch.equal(sample_next(logits, rng, temperature=1.5, top_k=1), logits.argmax(-1))
    row = torch.zeros(1, 50)
    row[0, [3, 17, 40]] = 1.0  # the top 3, nearly tied with the rest without top_k
    picks = set(sample_next(row.repeat(400, 1), rng, temperature=1.0, top_k=3).tolist())
    assert picks == {3, 17, 40}
    assert len(set(sample_next(row.repeat(400, 1), rng, temperature=1.0).tolist())) > 3


def test_sampling_candidates_hold_the_distribution_of_sampling_probs():
    """The batch's top-k draw looks at the k best tokens only: scattered back over the vocabulary,
    its probabilities are :func:`sampling_probs`'s, with top-p too; without top-k it is that function."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3.0
    for top_k, top_p in ((5, None), (40, None), (40, 0.6), (None, 0.8), (300, None), (1, None)):
        probs, ids = sampling_candidates(logits, 0.7, top_k, top_p)
        if ids is None:
            full = probs
        else:
            assert ids.shape == (6, top_k) and probs.shape == (6, top_k)
            full = torch.zeros_like(logits).scatter(1, ids, probs)
        assert torch.allclose(full, sampling_probs(logits, 0.7, top_k, top_p), atol=1e-6), (top_k, top_p)


def test_top_k_sampling_draws_from_the_renormalised_top_k():
    """Sampling among the k largest logits has the distribution of masking the rest: frequencies over
    40,000 draws match softmax(top-k / temperature) within 4 standard errors."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) * 2.0
    rng = torch.Generator().manual_seed(0)
    picks = sample_next(logits.repeat(40_000, 1), rng, temperature=0.8, top_k=5)
    values, ids = torch.topk(logits[0], 5)
    expected = torch.softmax(values / 0.8, dim=-1)
    assert set(picks.tolist()) <= set(ids.tolist())
    for token, p in zip(ids.tolist(), expected.tolist()):
        freq = (picks == token).float().mean().item()
        assert abs(freq - p) < 4 * (p * (1 - p) / 40_000) ** 0.5 + 1e-4, (token, freq, p)


class ScriptedGPT(GPT):
    """A real GPT (so the KV cache machinery runs) whose logits follow a next-token script."""

    def __init__(self, script: dict[int, int], default: int) -> None:
        super().__init__(GPTConfig(sequence_len=64, vocab_size=VOCAB, n_layer=1, n_head=1, n_kv_head=1, n_embd=64))
        self.init_weights()
        self.script, self.default = script, default

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", logits_at=None):
        super().forward(idx, kv_cache=kv_cache)  # keeps the cache position moving
        nxt = torch.tensor([[self.script.get(int(t), self.default) for t in row] for row in idx])
        logits = torch.nn.functional.one_hot(nxt, VOCAB).float() * 10.0
        return logits if logits_at is None else logits.flatten(0, 1)[logits_at]


def test_tool_use_forces_calculator_output():
    b = TOK.encode
    script = {S["<|assistant_start|>"]: S["<|python_start|>"], **CALL_2_PLUS_3}
    engine = Engine(ScriptedGPT(script, default=b("?")[0]), TOK)
    prompt = [S["<|bos|>"], S["<|user_start|>"], *b("hi"), S["<|user_end|>"], S["<|assistant_start|>"]]
    seqs, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=30, temperature=0.0)
    gen = [
        S["<|python_start|>"],
        *b("2+3"),
        S["<|python_end|>"],
        S["<|output_start|>"],
        *b("5"),
        S["<|output_end|>"],
        *b("!"),
        S["<|assistant_end|>"],
    ]
    want_mask = [1, 1, 1, 1, 1, 0, 0, 0, 1, 1]
    for seq, mask in zip(seqs, masks):
        assert seq == prompt + gen
        assert mask == [0] * len(prompt) + want_mask


def rejected_call_engine() -> Engine:
    """An engine whose model calls the calculator with ``x`` (a call it rejects), then ends its reply."""
    x = TOK.encode("x")[0]
    script = {
        S["<|assistant_start|>"]: S["<|python_start|>"],
        S["<|python_start|>"]: x,
        x: S["<|python_end|>"],
        S["<|python_end|>"]: S["<|assistant_end|>"],
    }
    return Engine(ScriptedGPT(script, default=TOK.encode("?")[0]), TOK)


def test_rejected_tool_call_forces_nothing_and_padding_after_stop():
    engine = rejected_call_engine()
    seqs, masks = engine.generate_batch([S["<|assistant_start|>"]], max_tokens=10, temperature=0.0)
    tokens = seqs[0][1:]
    assert tokens == [S["<|python_start|>"], TOK.encode("x")[0], S["<|python_end|>"], S["<|assistant_end|>"]]
    assert masks[0][1:] == [1] * 4  # nothing forced: "x" is not a valid expression


def test_max_tokens_and_custom_stop_tokens():
    b = TOK.encode
    engine = Engine(ScriptedGPT({}, default=b("a")[0]), TOK)
    seqs, masks = engine.generate_batch([S["<|bos|>"]], num_samples=2, max_tokens=5, temperature=0.0)
    assert seqs == [[S["<|bos|>"]] + [97] * 5] * 2 and masks == [[0] + [1] * 5] * 2
    seqs, masks = engine.generate_batch([S["<|bos|>"]], max_tokens=5, temperature=0.0, stop_tokens=[97])
    assert seqs == [[S["<|bos|>"], 97]] and masks == [[0, 1]]


def test_stream_yields_text_deltas_by_part_and_holds_split_characters():
    b = TOK.encode
    e_acute = b("é")  # two byte tokens: the first alone decodes to U+FFFD and must be held back
    script = {
        S["<|assistant_start|>"]: b("a")[0],
        b("a")[0]: e_acute[0],
        e_acute[0]: e_acute[1],
        e_acute[1]: S["<|python_start|>"],
        **CALL_2_PLUS_3,
    }
    engine = Engine(ScriptedGPT(script, default=b("?")[0]), TOK)
    stats: dict = {}
    pieces = list(engine.stream([S["<|assistant_start|>"]], stats=stats, max_tokens=30, temperature=0.0))
    assert pieces == [
        ("text", "a"),
        ("text", "é"),
        ("python", "2"),
        ("python", "+"),
        ("python", "3"),
        ("python_output", "5"),
        ("text", "!"),
    ]
    assert stats == {"tokens": 13, "finish_reason": "stop"}
    gen = engine.stream([S["<|bos|>"]], stats=stats, max_tokens=4, temperature=0.0)
    assert next(gen) == ("text", "?")  # lazily: the first delta arrives before the rest is generated
    assert list(gen) == [("text", "?")] * 3 and stats == {"tokens": 4, "finish_reason": "length"}


def test_runaway_tool_call_is_cut_and_counted_as_failed():
    # "[calc: 12*7777777..." seen from an RL model: the call never closes. Written before the guard,
    # this ran to max_tokens inside the call (the old engine had no limit and no counter).
    b = TOK.encode
    script = {S["<|assistant_start|>"]: S["<|python_start|>"], S["<|python_start|>"]: b("7")[0], b("7")[0]: b("7")[0]}
    engine = Engine(ScriptedGPT(script, default=b("?")[0]), TOK, max_tool_tokens=5)
    prompt = [S["<|bos|>"], S["<|assistant_start|>"]]
    seqs, masks = engine.generate_batch(prompt, num_samples=2, max_tokens=40, temperature=0.0)
    gen = [S["<|python_start|>"], *b("77777"), S["<|python_end|>"]]
    for seq, mask in zip(seqs, masks):
        assert seq == prompt + gen  # cut after 5 call tokens; the row stops, no padding kept
        assert mask == [0, 0] + [1] * 6 + [0]  # the closing token was forced, not sampled
    assert engine.tool_stats == {"calls": 2, "failed": 2, "cut": 2}
    stats: dict = {}
    parts = list(engine.stream(prompt, stats=stats, max_tokens=40, temperature=0.0))
    assert "".join(t for k, t in parts if k == "python") == "77777"
    assert stats["finish_reason"] == "tool_cut" and stats["tokens"] == 7


def test_rejected_and_good_calls_are_counted():
    engine = rejected_call_engine()
    engine.generate_batch([S["<|assistant_start|>"]], max_tokens=10, temperature=0.0)
    assert engine.tool_stats == {"calls": 1, "failed": 1, "cut": 0}


def test_temperature_and_top_p_that_underflow_sample_without_nan():
    """issue 46: a temperature or top_p too small for the logits' dtype gave inf / NaN and a 500."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [5.0, -1.0, 0.0]], dtype=torch.bfloat16)
    rng = torch.Generator().manual_seed(0)
    for temperature in (1e-50, 1e-320, 1e-40, 5e-324):
        assert sample_next(logits, rng, temperature).tolist() == [1, 0]  # as good as greedy
    for top_p in (1e-50, 1e-320):
        assert sample_next(logits, rng, 1.0, top_p=top_p).tolist() == [1, 0]  # the nucleus keeps its first token
    assert sample_next(logits, rng, 1e-30, top_k=2, top_p=1e-45).tolist() == [1, 0]


def test_one_draw_over_every_request_gives_multinomials_numbers_run_by_run():
    """The continuous batch draws all its requests' tokens in one division and argmax, each request's
    noise from its own generator: the tokens are those of one ``torch.multinomial`` per request."""
    for vocab, counts in ((1024, [1] * 16), (50, [8] * 8), (7, [3, 1, 5, 2])):
        probs = torch.softmax(torch.randn(sum(counts), vocab, generator=torch.Generator().manual_seed(vocab)) * 3, -1)
        probs[0, : vocab // 2] = 0.0  # tokens top-k / top-p removed
        seeds = range(100, 100 + len(counts))
        mine = [torch.Generator().manual_seed(s) for s in seeds]
        theirs = [torch.Generator().manual_seed(s) for s in seeds]
        for _ in range(10):  # the generators advance alike, step after step
            expected, start = [], 0
            for n, g in zip(counts, theirs):
                expected += torch.multinomial(probs[start : start + n], 1, generator=g).squeeze(1).tolist()
                start += n
            assert draw(probs, list(zip(counts, mine))).tolist() == expected


def test_a_draw_refuses_probabilities_that_are_not_finite_and_groups_that_miss_rows():
    probs = torch.full((2, 4), 0.25)
    rng = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="cover 1 rows of 2"):
        draw(probs, [(1, rng)])
    probs[1, 2] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        draw(probs, [(2, rng)])


def test_stop_matcher_cuts_at_the_first_stop_string_to_end_in_linear_time():
    m = StopMatcher(["END", "\n\n"])
    assert m.feed("hello E") == "hello " and m.feed("N") == "" and m.feed("x") == "ENx"
    assert m.feed(" done\n") == " done" and m.feed("\nmore") == "" and m.stopped
    m = StopMatcher(["stop"])
    assert m.feed("no sto") == "no " and m.flush() == "sto"
    m = StopMatcher(["aab", "ab"])  # "ab" ends first; a self-overlapping prefix is not lost
    assert m.feed("xaa") == "x" and m.feed("ab") == "a" and m.stopped
    m = StopMatcher(["abcd", "bc"])  # both end on the same character: the earlier start wins
    assert m.feed("zabc") == "za" and m.stopped
    long = "ab" * 50_000 + "c"  # the held-back text is bounded by the stop string, each character seen once
    m = StopMatcher([long])
    t0 = time.perf_counter()
    out = "".join(m.feed("ab") for _ in range(60_000))
    assert time.perf_counter() - t0 < 2.0 and not m.stopped
    assert out == "ab" * 10_000 and len(m.pending) == 100_000  # all that may still start the stop string
    assert m.feed("c") == "" and m.stopped


def test_stream_cuts_text_at_a_stop_string_and_reports_stop():
    engine = Engine(random_model(), TOK)
    text = "".join(t for _, t in engine.stream([TOK.bos_id], max_tokens=30, temperature=0.0))
    word = text[5:8]
    stats: dict = {}
    cut = "".join(t for _, t in engine.stream([TOK.bos_id], stats, max_tokens=30, temperature=0.0, stop=[word]))
    assert cut == text[: text.index(word)] and stats["finish_reason"] == "stop"


def test_stream_runs_past_sequence_len_as_the_chat_cli_asks():
    """The chat CLI's default max_tokens equals sequence_len: a reply may run past it (the rotary table
    reaches further); the engine refused it once the stream ran on a scheduler sized to sequence_len."""
    engine = Engine(ScriptedGPT({}, default=TOK.encode("a")[0]), TOK)  # sequence_len 64
    stats: dict = {}
    pieces = list(engine.stream([S["<|bos|>"], *TOK.encode("hello")], stats=stats, max_tokens=64, temperature=0.0))
    assert "".join(t for _, t in pieces) == "a" * 64 and stats["finish_reason"] == "length"
