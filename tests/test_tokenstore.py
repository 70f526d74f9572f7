"""The memory-mapped token store and O(1) resume (issue 32): the rows the pretrain stage sees are
exactly those of the loader before the store (kept below as a reference), bad files are named."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chatpipe.data import synthetic
from chatpipe.data.loader import Packer, RowLoader, TokenDocs, tokenize_shards
from chatpipe.data.tokenstore import verify_store
from chatpipe.tokenizer import Tokenizer
from tests.conftest import require_shared_data


# --- the loader before issue 32, kept verbatim in its logic as the reference the new one must match
def old_pack_rows(lengths, capacity, buffer_size=64):
    n_docs, next_doc, buffer = len(lengths), 0, []
    while True:
        row, space = [], capacity
        while space > 0:
            while len(buffer) < buffer_size:
                buffer.append(next_doc)
                next_doc = (next_doc + 1) % n_docs
            best = -1
            for j, doc in enumerate(buffer):
                if lengths[doc] <= space and (best < 0 or lengths[doc] > lengths[buffer[best]]):
                    best = j
            if best < 0:
                best = min(range(len(buffer)), key=lambda j: lengths[buffer[j]])
            doc = buffer.pop(best)
            take = min(lengths[doc], space)
            row.append((doc, take))
            space -= take
        yield row


def old_batches(texts_by_shard, tok, *, batch_size, seq_len, n_steps, rank=0, world_size=1):
    """The old path end to end: encode with BOS per document, pack, concatenate this rank's rows."""
    docs = [np.asarray(ids) for texts in texts_by_shard for ids in tok.encode(texts, prepend=tok.bos_id)]
    rows = old_pack_rows([len(d) for d in docs], seq_len + 1)
    out = []
    for _ in range(n_steps):
        mine = []
        for k in range(batch_size * world_size):
            row = next(rows)
            if k // batch_size == rank:
                mine.append(np.concatenate([docs[d][:n] for d, n in row]))
        out.append(np.stack(mine))
    return out


def write_text_shards(directory, texts_by_shard):
    directory.mkdir(parents=True, exist_ok=True)
    for i, texts in enumerate(texts_by_shard):
        pq.write_table(pa.table({"text": texts}), directory / f"train_{i:05d}.parquet")


@pytest.fixture(scope="module")
def tiny_world(tmp_path_factory):
    """Tiny-world text in two shards, its tokenizer, and the store built from it."""
    texts = synthetic.pretrain_documents(seed=42, num_docs=400)
    by_shard = [texts[:250], texts[250:]]
    tok = Tokenizer.train(texts, vocab_size=512)
    root = tmp_path_factory.mktemp("tinyworld")
    write_text_shards(root / "text", by_shard)
    tokenize_shards(root / "text", tok, root / "tokens", fingerprint="fp")
    return by_shard, tok, TokenDocs(root / "tokens", "train")


@pytest.mark.parametrize("world_size", [1, 2])
def test_new_loader_gives_the_old_loaders_batches(tiny_world, world_size):
    by_shard, tok, docs = tiny_world
    for rank in range(world_size):
        shape = dict(batch_size=4, seq_len=64, rank=rank, world_size=world_size)
        ref = old_batches(by_shard, tok, n_steps=40, **shape)  # 40 steps: past one epoch of the data
        loader = RowLoader(docs, prefetch=True, **shape)
        for step, want in enumerate(ref):
            x, y = loader.next_batch()
            assert np.array_equal(x.numpy(), want[:, :-1]) and np.array_equal(y.numpy(), want[:, 1:]), step
        loader.close()


@pytest.mark.parametrize("world_size", [1, 2])
def test_killed_at_step_k_and_resumed_from_state_gets_the_same_batches(tiny_world, world_size, monkeypatch):
    _, _, docs = tiny_world
    for rank in range(world_size):
        shape = dict(batch_size=3, seq_len=48, rank=rank, world_size=world_size)
        full = RowLoader(docs, **shape)
        uninterrupted = [full.next_batch()[0].numpy() for _ in range(30)]
        first = RowLoader(docs, prefetch=True, **shape)
        for _ in range(11):  # killed after step 11 (a batch was already prefetched: it must not count)
            first.next_batch()
        state = json.loads(json.dumps(first.state()))  # through the checkpoint's JSON
        first.close()
        # O(1): restoring the cursor packs no row at all before the first batch
        with monkeypatch.context() as m:
            m.setattr(Packer, "next_row", _must_not_pack)
            resumed = RowLoader(docs, state=state, **shape)
        for want in uninterrupted[11:]:
            assert np.array_equal(resumed.next_batch()[0].numpy(), want)
        resumed.close()


def _must_not_pack(self):
    raise AssertionError("resume replayed the packing")


def test_state_without_cursor_replays_like_before(tiny_world):
    _, _, docs = tiny_world
    a = RowLoader(docs, batch_size=2, seq_len=32)
    for _ in range(5):
        a.next_batch()
    b = RowLoader(docs, batch_size=2, seq_len=32, state={"row": a.state()["row"]})  # an old checkpoint
    assert b.state() == a.state()
    assert np.array_equal(a.next_batch()[0], b.next_batch()[0])


def test_tinyshakespeare_store_gives_the_old_rows():
    lines = (require_shared_data() / "text" / "tinyshakespeare.txt").read_text().split("\n\n")
    by_shard = [lines[:3000], lines[3000:6000]]
    tok = Tokenizer.train(lines[:2000], vocab_size=400)
    ref = old_batches(by_shard, tok, batch_size=8, seq_len=128, n_steps=20)
    return_dir = _store(by_shard, tok)
    loader = RowLoader(TokenDocs(return_dir, "train"), batch_size=8, seq_len=128, prefetch=True)
    for want in ref:
        assert np.array_equal(loader.next_batch()[0].numpy(), want[:, :-1])
    loader.close()


def _store(by_shard, tok):
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp())
    write_text_shards(root / "text", by_shard)
    tokenize_shards(root / "text", tok, root / "tokens", fingerprint="fp")
    return root / "tokens"


@pytest.fixture
def small_store(tmp_path):
    tok = Tokenizer.train(synthetic.pretrain_documents(seed=1, num_docs=50), vocab_size=300)
    write_text_shards(tmp_path / "text", [synthetic.pretrain_documents(seed=1, num_docs=60)[i::2] for i in (0, 1)])
    tokenize_shards(tmp_path / "text", tok, tmp_path / "tokens", fingerprint="fp")
    return tmp_path, tok


def test_truncated_token_file_is_named(small_store):
    root, _ = small_store
    path = root / "tokens" / "train_00001.tokens.npy"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"train_00001\.tokens\.npy.*truncated"):
        TokenDocs(root / "tokens", "train")


def test_corrupt_token_file_is_named(small_store):
    root, _ = small_store
    path = root / "tokens" / "train_00000.tokens.npy"
    good = path.read_bytes()
    path.write_bytes(b"\x93NUMPY garbage" + good[20:])
    with pytest.raises(ValueError, match=r"train_00000\.tokens\.npy.*corrupt"):
        TokenDocs(root / "tokens", "train")
    path.write_bytes(good)
    offsets = root / "tokens" / "train_00001.offsets.npy"
    np.save(offsets, np.array([0, 5, 3], dtype=np.int64))  # a valid npy that does not fit its tokens
    with pytest.raises(ValueError, match=r"train_00001\.tokens\.npy"):
        TokenDocs(root / "tokens", "train")


class DiesOnSecondShard:
    """A tokenizer whose process is 'killed' while it tokenizes the second shard."""

    def __init__(self, tok):
        self.tok, self.calls, self.vocab_size, self.bos_id = tok, 0, tok.vocab_size, tok.bos_id

    def encode(self, texts, prepend=None):
        self.calls += 1
        if self.calls == 2:
            raise KeyboardInterrupt  # what SIGINT does; SIGKILL stops it at any byte, caught by the renames
        return self.tok.encode(texts, prepend=prepend)


def test_a_killed_tokenizing_run_leaves_nothing_half_written(small_store):
    root, tok = small_store
    before = {p.name: p.read_bytes() for p in (root / "tokens").iterdir()}
    with pytest.raises(KeyboardInterrupt):
        tokenize_shards(root / "text", DiesOnSecondShard(tok), root / "tokens", fingerprint="other", batch_docs=40)
    after = {p.name: p.read_bytes() for p in (root / "tokens").iterdir() if not p.name.startswith(".")}
    assert "manifest.json" not in after  # the old store is no longer claimed current ...
    for name, data in after.items():
        assert data == before[name]  # ... and every file under its final name is a complete one
    manifest = tokenize_shards(root / "text", tok, root / "tokens", fingerprint="other")  # the re-run rebuilds
    assert manifest["fingerprint"] == "other"
    assert len(TokenDocs(root / "tokens", "train").lengths) == 60


KILL_SCRIPT = """
import sys, time
from pathlib import Path
from chatpipe.data.tokenstore import tokenize_shards
from chatpipe.tokenizer import Tokenizer

class Slow:
    def __init__(self, tok):
        self.tok, self.vocab_size, self.bos_id, self.calls = tok, tok.vocab_size, tok.bos_id, 0
    def encode(self, texts, prepend=None):
        self.calls += 1
        if self.calls == 2:
            print("first shard written", flush=True)
            time.sleep(60)  # killed here, on the second shard
        return self.tok.encode(texts, prepend=prepend)

root = Path(sys.argv[1])
tokenize_shards(root / "text", Slow(Tokenizer.load(root / "tok")), root / "tokens", fingerprint="killed", batch_docs=40)
"""


def test_sigkill_while_tokenizing_leaves_no_half_written_file(small_store):
    import os
    import subprocess
    import sys

    root, tok = small_store
    tok.save(root / "tok")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "first shard written"
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait()
    files = {p.name for p in (root / "tokens").iterdir() if not p.name.startswith(".")}
    assert "manifest.json" not in files  # the store does not claim to be current
    for name in files:  # whatever carries a final name loads whole
        np.load(root / "tokens" / name, mmap_mode="r")
    tokenize_shards(root / "text", tok, root / "tokens", fingerprint="killed")  # the re-run completes
    assert not [p for p in (root / "tokens").iterdir() if ".tmp" in p.name]
    assert len(TokenDocs(root / "tokens", "train").lengths) == 60


# ---------------------------------------------------------------- a damaged store is named, never read as data


def _rewrite(path, edit):
    array = np.load(path).copy()
    np.save(path, edit(array))


def test_a_token_id_beyond_the_vocabulary_is_named_and_the_cached_store_rebuilt(small_store, caplog):
    root, tok = small_store
    path = root / "tokens" / "train_00000.tokens.npy"
    _rewrite(path, lambda a: np.where(np.arange(len(a)) == 5, tok.vocab_size + 3, a).astype(a.dtype))
    docs = TokenDocs(root / "tokens", "train")  # the header and offsets still hold: opening stays cheap
    with pytest.raises(ValueError, match=rf"train_00000\.tokens\.npy: document 0 holds token id {tok.vocab_size + 3}"):
        docs.slice(0, 50)
    with pytest.raises(ValueError, match=r"train_00000\.tokens\.npy: missing or changed since written"):
        verify_store(root / "tokens")
    tokenize_shards(root / "text", tok, root / "tokens", fingerprint="fp")  # same fingerprint: rebuilt, not reused
    assert "rebuilding the token store" in caplog.text
    assert int(TokenDocs(root / "tokens", "train").slice(0, 50).max()) < tok.vocab_size


@pytest.mark.parametrize(
    ("target", "edit", "message"),
    [
        ("train_00001.offsets.npy", lambda a: np.concatenate([a[:1], a[2:3], a[1:2], a[3:]]), "offsets go backwards"),
        ("train_00001.offsets.npy", lambda a: np.concatenate([a[:1], a[1:-1] + 1, a[-1:]]), "changed since written"),
        ("train.index.npy", lambda a: a[::-1].copy(), "does not match shard 0's offsets"),
        ("train.index.npy", lambda a: a + np.array([0, 1, 0]), "does not match shard 0's offsets"),
        ("train.index.npy", lambda a: a[:-1], "does not match shard 1's offsets"),
    ],
)
def test_shifted_offsets_and_a_scrambled_index_are_named(small_store, target, edit, message):
    root, _ = small_store
    _rewrite(root / "tokens" / target, edit)
    with pytest.raises(ValueError, match=re.escape(target) + ": .*" + message):
        TokenDocs(root / "tokens", "train")


def test_a_damaged_npy_header_is_named(small_store):
    root, _ = small_store
    path = root / "tokens" / "train_00001.offsets.npy"
    data = path.read_bytes()
    shape = data.index(b"'shape': (") + len(b"'shape': (")
    path.write_bytes(data[:shape] + data[shape:].replace(b",)", b", ", 1))  # numpy's header parser: TokenError
    with pytest.raises(ValueError, match=r"train_00001\.offsets\.npy: corrupt or truncated token file"):
        TokenDocs(root / "tokens", "train")


def test_a_corrupt_store_manifest_is_named(small_store):
    root, _ = small_store
    (root / "tokens" / "manifest.json").write_text('{"fingerprint": ')
    with pytest.raises(ValueError, match=r"manifest\.json: corrupt token store manifest"):
        TokenDocs(root / "tokens", "train")


@pytest.mark.parametrize(("field", "value"), [("max_id", None), ("docs", "12"), ("tokens_crc32", True), ("vocab", 3.5)])
def test_a_manifest_field_of_the_wrong_type_is_named(small_store, field, value):
    """A well-formed manifest with a null or a string where a number was (found by tests/test_fuzz_files.py:
    max_id null was a TypeError from int())."""
    root, _ = small_store
    path = root / "tokens" / "manifest.json"
    manifest = json.loads(path.read_text())
    if field == "vocab":
        manifest["vocab_size"], field = value, "vocab_size"
    else:
        manifest["checks"]["train_00001"][field] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest\.json: corrupt token store manifest \(.*" + field):
        TokenDocs(root / "tokens", "train")
