"""Pretraining loader: BOS-aligned best-fit rows, world-size invariance, exact resume."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chatpipe.data.loader import RowLoader, TokenDocs, pack_rows, token_dtype, tokenize_shards

BOS = 0


class ByteTokenizer:
    """Bytes shifted by one, id 0 is BOS: enough to exercise tokenize_shards."""

    vocab_size = 257
    bos_id = BOS

    def encode(self, texts, prepend=None):
        return [([prepend] if prepend is not None else []) + [b + 1 for b in t.encode()] for t in texts]


@pytest.fixture
def token_dir(tmp_path):
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train_00000", 120), ("train_00001", 80), ("val_00000", 30)):
        docs = ["x" * int(rng.integers(3, 70)) + str(i) for i in range(n)]
        pq.write_table(pa.table({"text": docs}), text_dir / f"{name}.parquet")
    out = tmp_path / "tokens"
    manifest = tokenize_shards(text_dir, ByteTokenizer(), out, fingerprint="fp")
    assert manifest["shards"] == ["train_00000", "train_00001", "val_00000"]
    return out


def test_pack_rows_fill_exactly_and_start_with_whole_docs():
    lengths = [5, 17, 3, 40, 8, 9, 2, 30]
    rows = pack_rows(lengths, capacity=33, buffer_size=4)
    for _ in range(50):
        row = next(rows)
        assert sum(n for _, n in row) == 33
        # all but possibly the last piece are whole documents (only the filler is cropped)
        assert all(n == lengths[d] for d, n in row[:-1])


def test_rows_start_with_bos_and_have_no_padding(token_dir):
    docs = TokenDocs(token_dir, "train")
    x, y = RowLoader(docs, batch_size=4, seq_len=32).next_batch()
    assert x.shape == (4, 32) and y.shape == (4, 32)
    assert (x[:, 0] == BOS).all()
    assert (y[:, :-1] == x[:, 1:]).all()
    assert (y >= 0).all()


def test_two_ranks_see_what_one_rank_sees_in_two_micro_steps(token_dir):
    docs = TokenDocs(token_dir, "train")
    single = RowLoader(docs, batch_size=3, seq_len=16)
    rank0 = RowLoader(docs, batch_size=3, seq_len=16, rank=0, world_size=2)
    rank1 = RowLoader(docs, batch_size=3, seq_len=16, rank=1, world_size=2)
    for _ in range(5):
        a, b = single.next_batch()[0], single.next_batch()[0]
        assert np.array_equal(a, rank0.next_batch()[0])
        assert np.array_equal(b, rank1.next_batch()[0])
    assert single.state() == rank0.state() == rank1.state() and single.state()["row"] == 30


def test_resume_from_state_continues_the_same_stream(token_dir):
    docs = TokenDocs(token_dir, "train")
    a = RowLoader(docs, batch_size=2, seq_len=24)
    for _ in range(7):
        a.next_batch()
    b = RowLoader(docs, batch_size=2, seq_len=24, start_row=a.state()["row"])
    for _ in range(20):  # runs past the end of the data: epochs wrap the same way
        assert np.array_equal(a.next_batch()[0], b.next_batch()[0])


def test_tokenize_is_cached_by_fingerprint(token_dir, tmp_path):
    stamp = (token_dir / "train_00000.tokens.npy").stat().st_mtime_ns
    tokenize_shards(tmp_path / "text", ByteTokenizer(), token_dir, fingerprint="fp")
    assert (token_dir / "train_00000.tokens.npy").stat().st_mtime_ns == stamp


def test_missing_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.parquet text shards"):
        tokenize_shards(tmp_path, ByteTokenizer(), tmp_path / "t", fingerprint="x")
    with pytest.raises(FileNotFoundError, match="no val_\\*.tokens.npy"):
        TokenDocs(tmp_path, "val")


def test_token_dtype():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


class _StubTokenizer:
    vocab_size, bos_id = 256, 0

    def encode(self, texts, prepend=None):
        return [[prepend, *text.encode()] for text in texts]


def test_corrupt_shard_and_int_text_column_name_the_file(tmp_path):
    """issue 15 item 5: both used to raise pyarrow/tokenizer errors naming no file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from chatpipe.data.loader import tokenize_shards

    text = tmp_path / "text"
    text.mkdir()
    (text / "train_00000.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(ValueError, match=r"train_00000\.parquet"):
        tokenize_shards(text, _StubTokenizer(), tmp_path / "tok", fingerprint="f")
    pq.write_table(pa.table({"text": [1, 2, 3]}), text / "train_00000.parquet")
    with pytest.raises(ValueError, match=r"train_00000\.parquet.*'text'.*int64"):
        tokenize_shards(text, _StubTokenizer(), tmp_path / "tok", fingerprint="f")
