"""Text sources: synthetic, local (parquet / jsonl / txt) and hf (no network), plus error messages."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chatpipe.data import synthetic
from chatpipe.data.sources import iter_documents, prepare_text

SHAKESPEARE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text" / "tinyshakespeare.txt"


def prepare(out_dir: Path, **kw) -> dict:
    args = dict(
        source="synthetic",
        seed=1,
        num_docs=120,
        val_docs=20,
        docs_per_shard=50,
        hf_repo="karpathy/fineweb-edu-100b-shuffle",
        hf_num_shards=2,
        hf_text_column="text",
        local_dir=None,
        cache_dir=out_dir.parent / "cache",
    )
    return prepare_text(out_dir, **(args | kw))


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"real text fixture absent: {SHAKESPEARE} (see ../shared/data/README.md)")
    return [p for p in SHAKESPEARE.read_text().split("\n\n") if p.strip()][:600]


def write_parquet(path: Path, docs: list[str], column: str = "text", extra: bool = False) -> None:
    cols = {column: docs} | ({"id": list(range(len(docs)))} if extra else {})
    pq.write_table(pa.table(cols), path, row_group_size=64)


def test_synthetic_prepare_and_read_back(tmp_path: Path) -> None:
    out = tmp_path / "data"
    manifest = prepare(out)
    docs = synthetic.pretrain_documents(1, 120)
    assert manifest["source"] == "synthetic"
    assert manifest["shards"] == {"train": ["train_00000.parquet", "train_00001.parquet"], "val": ["val_00000.parquet"]}
    assert manifest["num_docs"] == {"train": 100, "val": 20}
    assert manifest["num_chars"]["val"] == sum(map(len, docs[100:]))
    assert list(iter_documents(out, "train")) == docs[:100]
    assert list(iter_documents(out, "val")) == docs[100:]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert pq.read_schema(out / "train_00000.parquet").names == ["text"]
    # Re-running replaces the directory whole and leaves no temp dirs behind.
    prepare(out, seed=2)
    assert list(iter_documents(out, "val")) == synthetic.pretrain_documents(2, 120)[100:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_local_parquet(tmp_path: Path, paragraphs: list[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "shard_00000.parquet", paragraphs[:300])
    write_parquet(src / "shard_00001.parquet", paragraphs[300:500], extra=True)
    write_parquet(src / "shard_00002.parquet", paragraphs[500:])  # last file: val
    manifest = prepare(tmp_path / "data", source="local", local_dir=src, docs_per_shard=128)
    assert manifest["num_docs"] == {"train": 500, "val": 100}
    assert len(manifest["shards"]["train"]) == 4
    assert list(iter_documents(tmp_path / "data", "train")) == paragraphs[:500]
    assert list(iter_documents(tmp_path / "data", "val")) == paragraphs[500:]


def test_local_jsonl_with_val_in_name(tmp_path: Path, paragraphs: list[str]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name, docs in [
        ("a_val.jsonl", paragraphs[:50]),
        ("b.jsonl", paragraphs[50:400]),
        ("c.jsonl", paragraphs[400:]),
    ]:
        (src / name).write_text("".join(json.dumps({"text": d, "meta": 1}) + "\n" for d in docs))
    prepare(tmp_path / "data", source="local", local_dir=src)
    assert list(iter_documents(tmp_path / "data", "val")) == paragraphs[:50]
    assert list(iter_documents(tmp_path / "data", "train")) == paragraphs[50:]


def test_local_single_txt(tmp_path: Path) -> None:
    if not SHAKESPEARE.is_file():
        pytest.skip(f"real text fixture absent: {SHAKESPEARE}")
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(SHAKESPEARE, src / "shakespeare.txt")
    manifest = prepare(tmp_path / "data", source="local", local_dir=src, val_docs=10, docs_per_shard=200)
    docs = list(iter_documents(tmp_path / "data", "train")) + list(iter_documents(tmp_path / "data", "val"))
    assert manifest["num_docs"]["val"] == 10 and len(docs) == sum(manifest["num_docs"].values())
    assert max(map(len, docs)) <= 2000 and min(map(len, docs)) > 100
    assert docs[0].startswith("First Citizen:\nBefore we proceed")
    # Packing only drops blank lines: every non-blank line survives, in order.
    lines = [ln for ln in SHAKESPEARE.read_text().splitlines() if ln.strip()]
    assert [ln for d in docs for ln in d.splitlines() if ln.strip()] == lines


def test_txt_without_blank_lines_is_cut_at_line_boundaries(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    lines = [f"line {i} " + "x" * (i % 70) for i in range(400)]
    (src / "a.txt").write_text("\n".join(lines[:300]))
    (src / "b.txt").write_text("\n".join(lines[300:]))
    prepare(tmp_path / "data", source="local", local_dir=src)
    train = list(iter_documents(tmp_path / "data", "train"))
    assert len(train) > 5 and all(1500 < len(d) <= 2000 for d in train[:-1])
    assert "\n".join(train).split("\n") == lines[:300]


def prefill_hub_cache(cache_dir: Path, repo: str, files: dict[str, Path]) -> Path:
    """Lay ``files`` out as huggingface_hub's cache holds a finished earlier fetch at ``main``: blobs
    named by their sha256 (as the hub's LFS files are), a snapshot of symlinks, ``refs/main``."""
    commit = "0" * 40
    storage = cache_dir / f"datasets--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for name, src in files.items():
        blob = storage / "blobs" / hashlib.sha256(src.read_bytes()).hexdigest()
        os.replace(src, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)
    return snapshot


def forbid_hub(monkeypatch) -> None:
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("tried to reach the hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    monkeypatch.setattr(huggingface_hub.HfApi, "get_paths_info", no_network)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", no_network)


# Downloads themselves (retries, checksums, faults) run against a real mirror in tests/test_hub.py.
def test_hf_from_the_hub_cache_recorded_in_the_data_manifest(
    tmp_path: Path, paragraphs: list[str], monkeypatch
) -> None:
    forbid_hub(monkeypatch)
    src = tmp_path / "src"
    src.mkdir()
    write_parquet(src / "shard_00000.parquet", paragraphs[:200])
    write_parquet(src / "shard_00001.parquet", paragraphs[200:300])
    write_parquet(src / "shard_00002.parquet", paragraphs[300:400])
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()}
    cache = prefill_hub_cache(
        tmp_path / "cache", "karpathy/fineweb-edu-100b-shuffle", {p.name: p for p in src.iterdir()}
    )
    manifest = prepare(tmp_path / "data", source="hf", hf_num_shards=3)
    assert manifest["shards"] == {"train": ["train_00000.parquet", "train_00001.parquet"], "val": ["val_00000.parquet"]}
    assert manifest["num_chars"]["val"] == sum(map(len, paragraphs[300:400]))
    assert [h["file"] for h in manifest["hub_files"]] == [f"shard_0000{i}.parquet" for i in range(3)]
    assert [h["sha256"] for h in manifest["hub_files"]] == [sha[h["file"]] for h in manifest["hub_files"]]
    assert {h["revision"] for h in manifest["hub_files"]} == {"0" * 40}  # the commit refs/main names
    assert list(iter_documents(tmp_path / "data", "train")) == paragraphs[:300]
    assert (cache / "shard_00000.parquet").is_file()  # the cache outlives the data dir


def test_hf_text_column_is_renamed(tmp_path: Path, monkeypatch) -> None:
    forbid_hub(monkeypatch)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("shard_00000.parquet", "shard_00001.parquet"):
        write_parquet(src / name, [f"{name} doc {i}" for i in range(5)], column="body", extra=True)
    prefill_hub_cache(tmp_path / "cache", "me/corpus", {p.name: p for p in src.iterdir()})
    prepare(tmp_path / "data", source="hf", hf_repo="me/corpus", hf_text_column="body")
    assert pq.read_schema(tmp_path / "data" / "val_00000.parquet").names == ["text"]  # column renamed
    assert list(iter_documents(tmp_path / "data", "val"))[0] == "shard_00001.parquet doc 0"


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="allowed: synthetic, hf, local"):
        prepare(tmp_path / "data", source="s3")
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        prepare(tmp_path / "data", source="local", local_dir=missing)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    (src / "b.jsonl").write_text('{"text": "ok"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: bad JSON"):
        prepare(tmp_path / "data", source="local", local_dir=src)
    (src / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl:2: .*'text'"):
        prepare(tmp_path / "data", source="local", local_dir=src)
    (src / "a.jsonl").unlink()
    (src / "c.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"c\.parquet: not a readable parquet"):
        prepare(tmp_path / "data", source="local", local_dir=src)
    assert not (tmp_path / "data").exists()  # failures leave nothing half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # and no temp dirs
    with pytest.raises(FileNotFoundError, match="val_"):
        list(iter_documents(tmp_path, "val"))


def test_int_text_column_of_a_local_parquet_names_the_file(tmp_path):
    """issue 15 item 5: an int ``text`` column went through as ints and failed later, naming no file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import pytest

    from chatpipe.data.sources import read_local_file

    path = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), path)
    with pytest.raises(ValueError, match=r"ints\.parquet.*'text'.*int64.*string"):
        list(read_local_file(path))
