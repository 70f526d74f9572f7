"""Fetching a zipped bundle: unpacked in place, all or nothing, errors name the URL."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from chatpipe.data.fetch import fetch_zip


def make_zip(path: Path, files: dict[str, str]) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return path.as_uri()


def test_single_top_folder_is_unpacked_as_dest(tmp_path):
    url = make_zip(
        tmp_path / "b.zip", {"eval_bundle/eval_data/x/copa.jsonl": "{}\n", "eval_bundle/core.yaml": "a: 1\n"}
    )
    dest = fetch_zip(url, tmp_path / "data" / "eval_bundle")
    assert (dest / "eval_data" / "x" / "copa.jsonl").read_text() == "{}\n" and (dest / "core.yaml").is_file()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["eval_bundle"]  # no temp dirs left behind


def test_flat_zip_and_existing_dest_is_kept(tmp_path):
    url = make_zip(tmp_path / "b.zip", {"a.jsonl": "1\n", "b.jsonl": "2\n"})
    dest = fetch_zip(url, tmp_path / "bundle")
    assert sorted(p.name for p in dest.iterdir()) == ["a.jsonl", "b.jsonl"]
    (dest / "a.jsonl").write_text("mine\n")
    fetch_zip(make_zip(tmp_path / "c.zip", {"a.jsonl": "other\n"}), dest)
    assert (dest / "a.jsonl").read_text() == "mine\n"


@pytest.mark.parametrize("kind", ["missing", "not a zip"])
def test_failure_names_the_url_and_writes_nothing(tmp_path, kind):
    src = tmp_path / "b.zip"
    if kind == "not a zip":
        src.write_text("<html>503</html>")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(RuntimeError, match=rf"could not fetch {src.as_uri()} into .*bundle"):
        fetch_zip(src.as_uri(), out / "bundle")
    assert list(out.iterdir()) == []
