"""One way to put a file in place: :func:`chatpipe.io.atomic_write` (and the directory swaps beside it).
A layering-style scan finds no other rename in the library, the stages or the flows; the context
manager leaves the old file or the whole new one, and no temp file behind."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from chatpipe.io import atomic_dir, atomic_write, write_bytes_atomic, write_json_atomic, write_text_atomic

REPO = Path(__file__).resolve().parents[1]
RENAMES = {("os", "replace"), ("os", "rename"), ("os", "renames")}


def renames_in(path: Path, root: Path = REPO) -> list[str]:
    """``file:line`` of every call that renames a file: ``os.replace``/``os.rename``,
    ``<x>.rename(...)``, and ``<x>.replace(one_arg)`` (``Path.replace``; ``str.replace`` takes two,
    ``dataclasses.replace`` and ``datetime.replace`` take keywords). ``shutil.move`` is allowed: it
    copies across filesystems (a download unpacked in /tmp), which is not a temp-then-rename write."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        owner = f.value.id if isinstance(f.value, ast.Name) else None
        path_replace = f.attr == "replace" and len(node.args) == 1 and not node.keywords and owner != "dataclasses"
        if (owner, f.attr) in RENAMES or f.attr == "rename" or path_replace:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def rename_violations(root: Path = REPO) -> list[str]:
    files = [p for top in ("chatpipe", "stages", "flows") for p in sorted((root / top).rglob("*.py"))]
    return [hit for p in files if p != root / "chatpipe" / "io.py" for hit in renames_in(p, root)]


def test_no_rename_outside_chatpipe_io():
    bad = rename_violations()
    assert not bad, "write files through chatpipe.io.atomic_write / atomic_dir, not by hand:\n" + "\n".join(bad)


def test_the_scan_finds_each_kind_of_rename(tmp_path):
    src = tmp_path / "chatpipe" / "x.py"
    src.parent.mkdir()
    src.write_text(
        "import os, shutil\nos.replace(a, b)\nos.rename(a, b)\nshutil.move(a, b)\np.rename(q)\ntmp.replace(path)\n"
        "s.replace('a', 'b')\ndataclasses.replace(t, x=1)\n"
    )
    hits = [h.split(": ", 1)[1] for h in renames_in(src, tmp_path)]
    assert hits == ["os.replace(a, b)", "os.rename(a, b)", "p.rename(q)", "tmp.replace(path)"]


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "a.txt"
    write_text_atomic(path, "old\n")
    with atomic_write(path) as f:
        f.write("new ")
        assert path.read_text() == "old\n"  # readers see the old file until the block ends
        f.write("text\n")
    assert path.read_text() == "new text\n"
    write_bytes_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    write_json_atomic(path, {"b": 1, "a": 2})
    assert path.read_text().startswith('{\n  "a": 2')
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.txt"]


def test_atomic_write_error_keeps_old_file_and_removes_temp(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic_write(path) as f:
            f.write("half")
            raise RuntimeError("mid-write")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def test_atomic_write_keeps_the_umask_mode(tmp_path):
    path = tmp_path / "a.txt"
    write_text_atomic(path, "x")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_write_refuses_other_modes(tmp_path):
    with pytest.raises(ValueError, match="allowed 'w', 'wb'"):
        with atomic_write(tmp_path / "a", "a"):
            pass


def test_atomic_dir_swaps_whole_directory_or_nothing(tmp_path):
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        (tmp / "x").write_text("1")
    with pytest.raises(KeyError):
        with atomic_dir(final) as tmp:
            (tmp / "x").write_text("2")
            raise KeyError("boom")
    assert (final / "x").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
