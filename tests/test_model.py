"""Tests for chatpipe.model.gpt: shapes, loss, init, GQA, sliding windows, KV cache, param accounting."""

from __future__ import annotations

import pytest
import torch

from chatpipe.model import cpu_kernel
from chatpipe.model.gpt import GPT, GPTConfig, config_from_depth, layer_windows
from chatpipe.model.paged_cache import BlockPool, PackedBatch, PagedBatch, Sequence
from chatpipe.train.optim import build_optimizers


def tiny(seed: int = 0, **kw) -> GPT:
    base = dict(sequence_len=32, vocab_size=97, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**base, **kw}))
    model.init_weights()
    # the zero-initialised output projections make every block an identity; perturb them so
    # attention actually influences the output in these tests
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_config_roundtrip_and_depth_dial():
    c = config_from_depth(4, vocab_size=512, sequence_len=64, n_kv_head=1, window_pattern="SL")
    assert (c.n_embd, c.n_head, c.n_kv_head, c.n_layer) == (256, 2, 1, 4)
    assert GPTConfig.from_dict(c.to_dict()) == c
    assert config_from_depth(1, 10, 8).n_head == 1  # at least one head
    with pytest.raises(ValueError, match="must divide"):
        config_from_depth(12, 100, 64, n_kv_head=4)  # n_head 6
    with pytest.raises(ValueError, match="unknown"):
        GPTConfig.from_dict({"depth": 3})


def test_d20_param_count_on_meta():
    config = config_from_depth(20, vocab_size=65536, sequence_len=2048)
    with torch.device("meta"):
        model = GPT(config)
    n = model.num_params()
    assert abs(n - 561e6) / 561e6 < 0.01, n
    assert model.num_embedding_params() == 65536 * 1280
    expected = 6 * (n - 65536 * 1280) + 12 * 20 * 10 * 128 * 2048
    assert model.flops_per_token() == expected


def test_param_groups_cover_every_param_once():
    model = tiny()
    groups = model.param_groups()
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    assert all(p.dim() == 2 for p in groups["matrix"])
    assert groups["embedding"] == [model.wte.weight] and groups["lm_head"] == [model.lm_head.weight]
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())


def test_init_deterministic_and_shaped():
    a = GPT(GPTConfig(sequence_len=16, vocab_size=50, n_layer=2, n_head=2, n_kv_head=2, n_embd=64))
    torch.manual_seed(3)
    a.init_weights()
    b = GPT(a.config)
    torch.manual_seed(3)
    b.init_weights()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert a.blocks[0].attn.c_proj.weight.abs().sum() == 0 and a.blocks[1].mlp.c_proj.weight.abs().sum() == 0
    assert 0.9 < a.wte.weight.std() < 1.1 and a.lm_head.weight.std() < 0.002
    assert a.blocks[0].mlp.c_fc.weight.abs().max() <= 3**0.5 / 64**0.5


def test_meta_then_to_empty_then_init_matches_direct_build():
    config = GPTConfig(sequence_len=16, vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    with torch.device("meta"):
        m = GPT(config)
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.init_weights()
    d = GPT(config)
    torch.manual_seed(0)
    d.init_weights()
    assert torch.equal(m.cos, d.cos) and torch.equal(m.sin, d.sin)
    x = torch.randint(0, 50, (2, 16))
    assert torch.allclose(m(x), d(x))


def test_shapes_softcap_and_loss_ignore_index():
    model = tiny()
    x = torch.randint(0, 97, (2, 12))
    logits = model(x)
    assert logits.shape == (2, 12, 97) and logits.dtype == torch.float32
    assert logits.abs().max() <= 15.0
    y = torch.randint(0, 97, (2, 12))
    y[0, :5] = -1
    per_tok = model(x, y, loss_reduction="none")
    assert per_tok.shape == (2, 12)
    assert torch.all(per_tok[0, :5] == 0) and torch.all(per_tok[0, 5:] > 0)
    mean = model(x, y)
    assert torch.allclose(mean, per_tok.sum() / (y != -1).sum())
    with pytest.raises(ValueError, match="allowed"):
        model(x, y, loss_reduction="sum")


def test_causality():
    model = tiny()
    x = torch.randint(0, 97, (1, 10))
    x2 = x.clone()
    x2[0, 7] = (x[0, 7] + 1) % 97
    a, b = model(x), model(x2)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-5)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-5)


def test_gqa_runs_and_has_fewer_kv_params():
    full, gqa = tiny(n_kv_head=4), tiny(n_kv_head=1)
    assert gqa.blocks[0].attn.c_k.weight.shape == (16, 64)
    assert gqa.num_params() < full.num_params()
    x = torch.randint(0, 97, (2, 9))
    assert gqa(x).shape == (2, 9, 97)
    assert torch.isfinite(gqa(x, x).detach())


def test_sliding_window_differs_from_full():
    assert layer_windows(GPTConfig(n_layer=3, sequence_len=32, window_pattern="S")) == [16, 16, None]
    with pytest.raises(ValueError, match="'S'/'L'"):
        layer_windows(GPTConfig(window_pattern="SX"))
    full, short = tiny(window_pattern="L"), tiny(window_pattern="S")
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), short.parameters()))
    x = torch.randint(0, 97, (1, 32))
    a, b = full(x), short(x)
    # within the window (16 tokens) both see the same context; beyond it layer 0 forgets
    assert torch.allclose(a[:, :16], b[:, :16], atol=1e-5)
    assert not torch.allclose(a[:, 16:], b[:, 16:], atol=1e-4)
    assert short.flops_per_token() < full.flops_per_token()


def paged(model, pool, seqs, ids, chunks):
    """One forward of ``ids`` [rows, T] continuing ``seqs`` in ``pool`` (each row its first ``chunks[i]`` tokens)."""
    for seq, chunk in zip(seqs, chunks):
        assert pool.reserve(seq, seq.length + chunk)
    return model(ids, kv_cache=PagedBatch(pool, seqs, chunks, torch.device("cpu")))


@pytest.mark.parametrize("pattern,kv", [("L", 4), ("SL", 2)])
def test_paged_kv_forward_in_chunks_matches_full_forward(pattern, kv):
    model = tiny(window_pattern=pattern, n_kv_head=kv, sequence_len=8)
    x = torch.randint(0, 97, (2, 14))  # past the window (4) and past sequence_len
    full = model(x)
    pool = BlockPool(model.config, num_blocks=8, block_size=4)
    seqs = [Sequence(row.tolist()) for row in x]
    chunks = [paged(model, pool, seqs, x[:, :5], [5, 5])]  # prefill a chunk, then one token at a time
    for t in range(5, 14):
        chunks.append(paged(model, pool, seqs, x[:, t : t + 1], [1, 1]))
    assert [s.length for s in seqs] == [14, 14] and pool.used == 8
    assert torch.allclose(torch.cat(chunks, dim=1), full, atol=1e-4)
    assert not pool.reserve(Sequence([1]), 1)  # every block is taken: no more room, nothing taken


def test_paged_rows_of_other_lengths_in_one_forward_and_a_forked_sequence():
    """Rows at different positions with chunks of different lengths (right-padded) compute the logits
    of their sequences alone; a fork shares the full blocks and continues as the whole sequence does."""
    model = tiny(smear=True, value_embeds=True)
    x = torch.randint(0, 97, (2, 11))
    pool = BlockPool(model.config, num_blocks=12, block_size=4)
    a, b = Sequence(x[0].tolist()), Sequence(x[1].tolist())
    paged(model, pool, [a], x[:1, :6], [6])
    ids = torch.stack([x[0, 6:9], torch.cat([x[1, :2], x.new_zeros(1)])])
    out = paged(model, pool, [a, b], ids, [3, 2])  # a: positions 6..8; b: 0..1 and a padding token
    assert torch.allclose(out[0], model(x[:1, :9])[0, 6:9], atol=1e-4)
    assert torch.allclose(out[1, :2], model(x[1:2, :2])[0], atol=1e-4)
    child = pool.fork(a)  # 9 positions: two full blocks shared, the third copied
    assert child.blocks[:2] == a.blocks[:2] and child.blocks[2] != a.blocks[2] and pool.refs[a.blocks[0]] == 2
    nxt = torch.randint(0, 97, (1, 1))
    child.tokens.append(int(nxt))
    step = paged(model, pool, [child], nxt, [1])
    assert torch.allclose(step[0, 0], model(torch.cat([x[:1, :9], nxt], dim=1))[0, -1], atol=1e-4)


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [0, 2, 1, 3]], ids=["groups-in-order", "groups-interleaved"])
def test_samples_of_two_prompts_decode_as_their_sequences_alone_in_any_row_order(order):
    """Two prompts' samples (forks sharing each prompt's full blocks) decode in one forward: each
    prefix is read once for its rows, and every row's logits equal its sequence's full forward,
    whether a prompt's samples sit side by side (the grid is the batch as it is) or interleaved."""
    model = tiny(window_pattern="SL", n_kv_head=2, smear=True)
    torch.manual_seed(3)
    x = torch.randint(0, 97, (2, 10))
    pool = BlockPool(model.config, num_blocks=24, block_size=4)
    a, b = Sequence(x[0].tolist()), Sequence(x[1, :7].tolist())
    paged(model, pool, [a, b], torch.stack([x[0, :9], torch.cat([x[1, :7], x.new_zeros(2)])]), [9, 7])
    rows = [a, pool.fork(a), b, pool.fork(b)]
    nxt = torch.randint(0, 97, (4,))
    for seq, token in zip(rows, nxt.tolist()):
        seq.tokens.append(token)
    batch = [rows[i] for i in order]
    for seq in batch:
        assert pool.reserve(seq, seq.length + 1)
    cache = PagedBatch(pool, batch, [1] * 4, torch.device("cpu"))
    assert cache.shared is not None and cache.shared.groups == 2
    assert cache.shared.in_order == (order == [0, 1, 2, 3])
    out = model(nxt[order][:, None], kv_cache=cache)[:, 0]
    prompts = [x[0, :9], x[0, :9], x[1, :7], x[1, :7]]
    want = [model(torch.cat([prompts[i], nxt[i : i + 1]])[None])[0, -1] for i in order]
    assert torch.allclose(out, torch.stack(want), atol=1e-4)


@pytest.mark.parametrize("short", ["samples-of-a-prompt", "own-prompts"])
def test_rows_far_longer_than_the_rest_are_gathered_apart_and_decode_as_their_sequences_alone(short):
    """40 rows holding one or three keys of their own beside two holding 31 and 51 (a batch that admits
    prompts as others finish): the two long rows' keys past the short ones' are gathered apart
    (LongRows), and every row's logits still equal its sequence's full forward."""
    model = tiny(window_pattern="SL", n_kv_head=2, smear=True, sequence_len=64)
    torch.manual_seed(5)
    pool = BlockPool(model.config, num_blocks=96, block_size=4)
    longs = [Sequence(torch.randint(0, 97, (n,)).tolist()) for n in (30, 50)]
    for seq in longs:
        paged(model, pool, [seq], torch.tensor([seq.tokens]), [len(seq.tokens)])
    if short == "samples-of-a-prompt":  # forks of one 9-token prompt: each holds only its new token
        prompt = Sequence(torch.randint(0, 97, (9,)).tolist())
        paged(model, pool, [prompt], torch.tensor([prompt.tokens]), [9])
        shorts = [prompt] + [pool.fork(prompt) for _ in range(39)]
    else:  # prompts of two tokens each
        shorts = [Sequence(torch.randint(0, 97, (2,)).tolist()) for _ in range(40)]
        paged(model, pool, shorts, torch.tensor([s.tokens for s in shorts]), [2] * 40)
    rows = shorts[:20] + longs[:1] + shorts[20:] + longs[1:]
    history = [list(s.tokens) for s in rows]
    nxt = torch.randint(0, 97, (len(rows),))
    for seq, token in zip(rows, nxt.tolist()):
        seq.tokens.append(token)
        assert pool.reserve(seq, seq.length + 1)
    cache = PagedBatch(pool, rows, [1] * len(rows), torch.device("cpu"))
    assert cache.long is not None and cache.long.rows.tolist() == [20, 41]
    assert cache.long.split == (1 if short == "samples-of-a-prompt" else 3)
    out = model(nxt[:, None], kv_cache=cache)[:, 0]
    want = [model(torch.tensor([h + [t]]))[0, -1] for h, t in zip(history, nxt.tolist())]
    assert torch.allclose(out, torch.stack(want), atol=1e-4)


@pytest.mark.parametrize("options", [{}, {"smear": True, "value_embeds": True}], ids=["plain", "smear+ve"])
def test_a_packed_forward_decodes_and_prefills_as_the_sequences_alone(options):
    """Decode rows (one token each, two of them sharing a prefix) and prefill chunks of other lengths
    (one from position 0, one mid-way) in one row of tokens, the logits taken at each row's last token:
    each matches a full forward of its sequence, and the positions are committed as separate forwards do."""
    model = tiny(window_pattern="SL", n_kv_head=2, **options)
    x = torch.randint(0, 97, (5, 12))
    pool = BlockPool(model.config, num_blocks=24, block_size=4)
    seqs = [Sequence(row.tolist()) for row in x]
    paged(model, pool, seqs[:2], x[:2, :9], [9, 9])  # two decode rows at position 9
    seqs[2].tokens = x[0].tolist()  # a third decode row starts as row 0: it shares row 0's full blocks
    pool.lookup(seqs[2])
    paged(model, pool, [seqs[2]], x[:1, 8:9], [1])
    paged(model, pool, [seqs[4]], x[4:5, :5], [5])  # a prompt prefilled up to position 5 in an earlier chunk
    decode, prefill, chunks = seqs[:3], seqs[3:], [7, 4]  # row 3 prefills positions 0..6, row 4 5..8
    for seq, chunk in zip(seqs, [1, 1, 1, *chunks]):
        assert pool.reserve(seq, seq.length + chunk)
    batch = PackedBatch(pool, decode, prefill, chunks, torch.device("cpu"))
    assert batch.decode.shared is not None  # rows 0 and 2 read their prefix once
    ids = torch.cat([x[[0, 1, 0], 9], x[3, :7], x[4, 5:9]])[None]
    out = model(ids, kv_cache=batch, logits_at=batch.last_index())
    want = [model(x[i : i + 1, :n])[0, -1] for i, n in ((0, 10), (1, 10), (0, 10), (3, 7), (4, 9))]
    assert out.shape == (5, 97) and torch.allclose(out, torch.stack(want), atol=1e-4)
    assert [s.length for s in seqs] == [10, 10, 10, 7, 9]
    with pytest.raises(ValueError, match="decode rows and prefill chunks both"):
        PackedBatch(pool, decode, [], [], torch.device("cpu"))


def test_paged_decode_steps_gather_into_one_buffer_kept_across_forwards(monkeypatch):
    """In inference mode each layer of the torch path gathers a row's keys into the pool's scratch
    buffers, which outlive the forward (a fresh buffer per decode step cost page faults that took
    longer than the copy) and grow at least twofold (each decode step gathers one key more): the
    logits still match a full forward, and the decode steps after the first that outgrew the
    prefill's gather keep its storage. (The C kernel, on by default, gathers nothing.)"""
    monkeypatch.setenv(cpu_kernel.ENABLE_ENV, "0")
    model = tiny(window_pattern="L", n_kv_head=2, sequence_len=16)
    x = torch.randint(0, 97, (1, 12))
    full = model(x)
    pool = BlockPool(model.config, num_blocks=8, block_size=4)
    seq = Sequence(x[0].tolist())

    def storage() -> list[int]:
        return [pool.scratch(w, (1,), torch.float32, torch.device("cpu")).data_ptr() for w in (0, 1)]

    with torch.inference_mode():
        outs = [paged(model, pool, [seq], x[:, :9], [9])]  # 9 keys gathered
        outs.append(paged(model, pool, [seq], x[:, 9:10], [1]))  # 10: the buffers double to 18
        first = storage()
        for t in range(10, 12):
            outs.append(paged(model, pool, [seq], x[:, t : t + 1], [1]))
            assert storage() == first
    assert torch.allclose(torch.cat(outs, dim=1), full, atol=1e-4)


def test_overfit_one_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64))
    model.init_weights()
    opts = build_optimizers(model, embedding_lr=0.2, unembedding_lr=0.02, matrix_lr=0.02)
    x = torch.randint(0, 64, (4, 16))
    y = torch.roll(x, -1, dims=1)
    first = model(x, y).item()
    for _ in range(30):
        loss = model(x, y)
        loss.backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
    last = model(x, y).item()
    assert last < 0.5 * first, (first, last)
