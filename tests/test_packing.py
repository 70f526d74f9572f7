"""Conversation packing: best-fit BOS-aligned rows, padding ignored, assistant-only targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chatpipe.data.packing import ConversationLoader, Rendered, fill_ratio, pack_rows, render_all
from chatpipe.data.tasks import TaskMixture, build_task


class CharTokenizer:
    """Tiny stand-in: one token per character, specials above 255 (render logic mimics chatpipe's)."""

    bos_id = 256

    def render_conversation(self, conv, max_tokens=2048):
        ids, mask = [self.bos_id], [0]
        for m in conv["messages"]:
            text = [ord(c) % 256 for c in str(m["content"])]
            ids += [257, *text, 258]
            mask += [0] + [int(m["role"] == "assistant")] * len(text) + [int(m["role"] == "assistant")]
        return ids[:max_tokens], mask[:max_tokens]


def rendered(lengths):
    ids, mask, offsets = [], [], [0]
    for c, n in enumerate(lengths):
        ids += [1000 + c] + [c] * (n - 1)  # first token marks the conversation start (like BOS)
        mask += [0] + [1] * (n - 1)
        offsets.append(len(ids))
    return Rendered(np.array(ids, dtype=np.int64), np.array(mask, dtype=np.uint8), np.array(offsets))


def test_every_conversation_once_rows_never_overflow():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 60, size=500).tolist()
    rows = pack_rows(lengths, 64)
    placed = sorted(c for row in rows for c, _ in row)
    assert placed == list(range(500))
    for row in rows:
        assert sum(n for _, n in row) <= 64
        assert all(n == lengths[c] for c, n in row)  # nothing cropped: all fit a row
    assert fill_ratio(rows, 64) > 0.9


def test_too_long_conversation_is_cropped_alone():
    rows = pack_rows([10, 100, 10], 32)
    long_row = next(row for row in rows if any(c == 1 for c, _ in row))
    assert long_row == [(1, 32)]


def test_pack_is_deterministic_and_best_fit():
    lengths = [30, 20, 12, 9, 8]
    assert pack_rows(lengths, 32) == pack_rows(lengths, 32)
    assert pack_rows(lengths, 32)[0] == [(0, 30)]  # 30 first, nothing else fits beside it
    assert pack_rows(lengths, 32)[1] == [(1, 20), (2, 12)]


def test_loader_targets_padding_and_bos_alignment():
    data = rendered([6, 5, 9])
    rows = pack_rows(data.lengths.tolist(), 13)  # capacity = seq_len + 1
    loader = ConversationLoader(data, rows, batch_size=len(rows), seq_len=12, pad_id=-7)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (len(rows), 12)
    for r, row in enumerate(rows):
        assert x[r, 0].item() >= 1000  # every row starts at a conversation start
        used = sum(n for _, n in row)
        assert (x[r, used:] == -7).all() and (y[r, used - 1 :] == -1).all()  # padding never a target
    # the start marker of the next conversation (mask 0) is never a target
    assert not (y >= 1000).any()
    assert (y[y >= 0] < 1000).all()


def test_loader_ranks_split_rows_and_resume():
    data = rendered(list(range(5, 45)))
    rows = pack_rows(data.lengths.tolist(), 33)
    one = ConversationLoader(data, rows, batch_size=4, seq_len=32, pad_id=0)
    full = torch.cat([one.next_batch()[0], one.next_batch()[0]])
    r0 = ConversationLoader(data, rows, batch_size=2, seq_len=32, pad_id=0, rank=0, world_size=2)
    r1 = ConversationLoader(data, rows, batch_size=2, seq_len=32, pad_id=0, rank=1, world_size=2)
    assert torch.equal(torch.cat([r0.next_batch()[0], r1.next_batch()[0]]), full[:4])
    assert r0.state() == {"row": 4}
    resumed = ConversationLoader(data, rows, batch_size=4, seq_len=32, pad_id=0, start_row=4)
    assert torch.equal(resumed.next_batch()[0], full[4:])


def test_assistant_only_mask_on_rendered_tasks():
    tok = CharTokenizer()
    task = build_task("tinyworld_chat", "train", limit=3)
    data = render_all(task, tok, max_tokens=1000)
    a = int(data.offsets[0])
    ids, mask = data.ids[a : data.offsets[1]], data.mask[a : data.offsets[1]]
    answer = task[0]["messages"][1]["content"]
    trained = "".join(chr(i) for i, m in zip(ids, mask) if m and i < 256)
    assert answer in trained and task[0]["messages"][0]["content"] not in trained


def test_fill_ratio_on_tiny_mixture_is_high():
    from chatpipe.data.synthetic import pretrain_documents
    from chatpipe.tokenizer import Tokenizer

    tok = Tokenizer.train(pretrain_documents(seed=0, num_docs=2000), 1024)  # the tiny profile's tokenizer
    mix = TaskMixture(
        [
            build_task("tinyworld_chat", "train", limit=400),
            build_task("tinyworld_arith", "train", limit=200),
            build_task("tinyworld_mc", "train", limit=100),
        ],
        seed=0,
    )
    data = render_all(mix, tok, 257)
    assert fill_ratio(pack_rows(data.lengths.tolist(), 257), 257) >= 0.9


def test_render_all_names_bad_example():
    class Bad:
        name = "bad"

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return {"messages": [{"role": "assistant", "content": "x"}]}

    from chatpipe.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="bad example 0"):
        render_all(Bad(), Tokenizer.__new__(Tokenizer), 10)
