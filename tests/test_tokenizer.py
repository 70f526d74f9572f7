"""Tokenizer: BPE training, encode/decode, save/load, chat rendering and masks."""

from __future__ import annotations

import json
import re

import pytest

from chatpipe.data import synthetic
from chatpipe.tokenizer import SPECIAL_TOKENS, Tokenizer, compression_report


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(synthetic.pretrain_documents(seed=0, num_docs=300), vocab_size=512)


def conv(*messages: tuple[str, object]) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in messages]}


def test_vocab_and_specials_take_last_ids(tok: Tokenizer) -> None:
    assert tok.vocab_size == 512
    ids = [tok.encode_special(s) for s in SPECIAL_TOKENS]
    assert ids == list(range(512 - len(SPECIAL_TOKENS), 512))
    assert tok.bos_id == ids[0]
    with pytest.raises(KeyError, match=re.escape("<|nope|>")):
        tok.encode_special("<|nope|>")


def test_small_corpus_stops_early_with_warning(caplog) -> None:
    with caplog.at_level("WARNING"):
        small = Tokenizer.train(["the cat sat on the mat"] * 20, vocab_size=400)
    assert 256 + len(SPECIAL_TOKENS) < small.vocab_size < 400 and "ran out of merges" in caplog.text
    assert small.encode_special("<|output_end|>") == small.vocab_size - 1
    assert small.encode(" the cat") == [small.encode(" the")[0], small.encode(" cat")[0]]
    with pytest.raises(ValueError, match="too small"):
        Tokenizer.train(["x"], vocab_size=264)


def test_training_learned_merges(tok: Tokenizer) -> None:
    text = synthetic.pretrain_documents(seed=1, num_docs=5)[0]
    assert len(tok.encode(text)) < len(text.encode()) / 2  # real compression, not bytes


@pytest.mark.parametrize(
    "text",
    [
        "",
        "hello world",
        "Ünïcödé — 日本語テキスト 🙂🚀\n\ttabs  and  spaces",
        "12345678901 + 7 = ?",
        "Ω≈ç√∫˜µ≤≥÷ العربية עברית",
    ],
)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_special_text_is_not_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|bos|> hi <|assistant_end|>")
    assert not set(ids) & set(tok.special_ids.values())
    assert tok.encode("hi", prepend="<|bos|>")[0] == tok.bos_id
    assert tok.encode("hi", prepend=tok.bos_id) == [tok.bos_id, *tok.encode("hi")]


def test_batch_encode_matches_single(tok: Tokenizer) -> None:
    texts = ["Alice is a baker.", "", "The river Lumen flows through Oakton."]
    assert tok.encode(texts, prepend=tok.bos_id, num_threads=2) == [tok.encode(t, prepend=tok.bos_id) for t in texts]


def test_token_bytes_sum_to_utf8_length(tok: Tokenizer) -> None:
    tb = tok.token_bytes()
    assert tb.dtype.is_floating_point is False and tb.shape == (512,)
    assert all(tb[tok.encode_special(s)] == 0 for s in SPECIAL_TOKENS)
    text = "Élan: 12 cows said moo, 日本"
    assert int(tb[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    (a,) = tok.encode("a")
    assert tb[a] == 1 and tok.decode([a]) == "a"


def test_save_load_round_trip(tok: Tokenizer, tmp_path) -> None:
    tok.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    assert loaded.vocab_size == tok.vocab_size and loaded.special_ids == tok.special_ids
    assert loaded.enc._mergeable_ranks == tok.enc._mergeable_ranks
    text = "Mira's pet is a sheep named Moss. 日本"
    assert loaded.encode(text) == tok.encode(text)
    assert json.loads((tmp_path / "tokenizer.json").read_text())["vocab_size"] == 512
    assert not list(tmp_path.glob(".*tmp*"))  # no temp files left behind


def test_load_errors_name_the_file(tok: Tokenizer, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    tok.save(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
    tok.save(tmp_path)
    with open(tmp_path / "ranks.tiktoken", "a") as f:
        f.write("@@@ not-a-rank\n")
    with pytest.raises(ValueError, match=r"ranks.tiktoken:\d+"):
        Tokenizer.load(tmp_path)


def test_render_masks(tok: Tokenizer) -> None:
    ids, mask = tok.render_conversation(
        conv(
            ("user", "How old is Alice?"),
            ("assistant", "Alice is 30."),
            ("user", "Thanks"),
            ("assistant", "You are welcome!"),
        )
    )
    sp = tok.special_ids
    assert len(ids) == len(mask) and ids[0] == tok.bos_id and mask[0] == 0
    user_q = tok.encode("How old is Alice?")
    assert ids[1 : 3 + len(user_q)] == [sp["<|user_start|>"], *user_q, sp["<|user_end|>"]]
    assert set(mask[1 : 3 + len(user_q)]) == {0}
    a0 = ids.index(sp["<|assistant_start|>"])
    answer = tok.encode("Alice is 30.")
    assert mask[a0] == 0
    assert ids[a0 + 1 : a0 + 2 + len(answer)] == [*answer, sp["<|assistant_end|>"]]
    assert set(mask[a0 + 1 : a0 + 2 + len(answer)]) == {1}
    # Trained tokens are exactly the two answers and their end tokens.
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "Alice is 30.<|assistant_end|>You are welcome!<|assistant_end|>"


def test_render_tool_use(tok: Tokenizer) -> None:
    parts = [
        {"type": "text", "text": "Let me compute."},
        {"type": "python", "text": "12*7"},
        {"type": "python_output", "text": "84"},
        {"type": "text", "text": "#### 84"},
    ]
    ids, mask = tok.render_conversation(conv(("user", "What is 12 times 7?"), ("assistant", parts)))
    sp = tok.special_ids
    ps, pe = ids.index(sp["<|python_start|>"]), ids.index(sp["<|python_end|>"])
    os_, oe = ids.index(sp["<|output_start|>"]), ids.index(sp["<|output_end|>"])
    assert tok.decode(ids[ps + 1 : pe]) == "12*7" and set(mask[ps : pe + 1]) == {1}
    assert tok.decode(ids[os_ + 1 : oe]) == "84" and set(mask[os_ : oe + 1]) == {0}
    assert mask[oe + 1] == 1 and ids[-1] == sp["<|assistant_end|>"] and mask[-1] == 1


def test_system_merged_into_first_user(tok: Tokenizer) -> None:
    merged = tok.render_conversation(conv(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")))
    plain = tok.render_conversation(conv(("user", "Be brief.\n\nHi"), ("assistant", "Hello")))
    assert merged == plain


@pytest.mark.parametrize(
    "messages, index",
    [
        ((("user", "a"), ("user", "b")), 1),
        ((("assistant", "a"),), 0),
        ((("user", "a"), ("assistant", "b"), ("system", "c")), 2),
        ((("system", "s"), ("assistant", "a")), 1),
        ((("user", "a"), ("assistant", [{"type": "code", "text": "x"}])), 1),
    ],
)
def test_bad_conversations_name_the_index(tok: Tokenizer, messages, index: int) -> None:
    with pytest.raises(ValueError, match=f"message {index}"):
        tok.render_conversation(conv(*messages))


def test_truncation(tok: Tokenizer) -> None:
    ids, mask = tok.render_conversation(conv(("user", "word " * 200), ("assistant", "ok")), max_tokens=16)
    assert len(ids) == len(mask) == 16


def test_render_for_completion(tok: Tokenizer) -> None:
    c = conv(("user", "How old is Alice?"), ("assistant", "Alice is 30."))
    prompt = tok.render_for_completion(c)
    full, _ = tok.render_conversation(c)
    assert prompt[-1] == tok.encode_special("<|assistant_start|>")
    assert prompt == full[: len(prompt)] and tok.encode("Alice is 30.")[0] == full[len(prompt)]
    # A conversation that already ends with the user gets the same prompt.
    assert tok.render_for_completion(conv(("user", "How old is Alice?"))) == prompt


def test_compression_report_offline_skips(tok: Tokenizer) -> None:
    text = synthetic.pretrain_documents(seed=3, num_docs=3)[0]
    report = compression_report(tok, text, timeout=5.0)
    assert report["bytes"] == len(text.encode())
    assert report["ours"]["bytes_per_token"] > 2
    for name in ("gpt2", "cl100k_base"):  # offline: skipped with a reason; online: measured
        assert "skipped" in report[name] or report[name]["bytes_per_token"] > 1


def test_edited_ranks_or_config_are_refused_naming_the_file(tok: Tokenizer, tmp_path) -> None:
    tok.save(tmp_path)
    ranks = tmp_path / "ranks.tiktoken"
    good = ranks.read_bytes()
    lines = good.splitlines(keepends=True)
    ranks.write_bytes(b"".join([lines[300], *lines[1:300], lines[0], *lines[301:]]))  # two tokens swap ranks
    with pytest.raises(ValueError, match=r"ranks\.tiktoken: sha256 .* recorded in .*tokenizer\.json"):
        Tokenizer.load(tmp_path)
    ranks.write_bytes(good)
    config = tmp_path / "tokenizer.json"
    data = json.loads(config.read_text())
    data["special_tokens"]["<|bos|>"], data["special_tokens"]["<|user_end|>"] = (
        data["special_tokens"]["<|user_end|>"],
        data["special_tokens"]["<|bos|>"],
    )
    config.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"tokenizer\.json: edited or corrupted since it was saved"):
        Tokenizer.load(tmp_path)


def test_ranks_that_are_not_a_bpe_table_are_named(tok: Tokenizer, tmp_path) -> None:
    tok.save(tmp_path)
    config = tmp_path / "tokenizer.json"
    data = json.loads(config.read_text())
    data.pop("checksums")  # a tokenizer saved before checksums: the ranks are still checked for sense
    config.write_text(json.dumps(data))
    ranks = tmp_path / "ranks.tiktoken"
    lines = ranks.read_bytes().splitlines(keepends=True)
    ranks.write_bytes(b"".join([*lines[:-1], lines[-1].split()[0] + b" 3\n"]))  # a rank given twice
    with pytest.raises(ValueError, match=r"ranks\.tiktoken: corrupt ranks \(not the numbers 0\.\."):
        Tokenizer.load(tmp_path)


def test_a_reply_drops_only_its_final_sampled_assistant_end(tok: Tokenizer) -> None:
    """The one reply-text rule (RL rollouts and pass@k, chat checks, reward-model pairs)."""
    from chatpipe.tokenizer import reply_text

    end = tok.encode_special("<|assistant_end|>")
    words = tok.encode("the answer is 5")
    assert reply_text(tok, [*words, end], [1] * (len(words) + 1)) == ("the answer is 5", True)
    assert reply_text(tok, words, [1] * len(words)) == ("the answer is 5", False)  # cut at max_tokens
    # an end the engine forced in is not the model ending its turn, and an earlier one stays in the text
    assert reply_text(tok, [*words, end], [1] * len(words) + [0]) == ("the answer is 5<|assistant_end|>", False)
    got = reply_text(tok, [end, *words, end], [1] * (len(words) + 2))
    assert got == ("<|assistant_end|>the answer is 5", True)
    assert reply_text(tok, [], []) == ("", False)
