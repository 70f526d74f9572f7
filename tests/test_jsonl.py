"""JSON Lines reading: line numbers, blank lines, and errors that name file and line."""

from __future__ import annotations

import pytest

from chatpipe.data.jsonl import iter_jsonl


def test_yields_line_numbers_and_skips_blank_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n\n  \n[2, 3]\n"x"\n')
    assert list(iter_jsonl(path)) == [(1, {"a": 1}), (4, [2, 3]), (5, "x")]


def test_bad_line_names_file_line_and_column_after_earlier_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n{"a": 2,}\n')
    rows = iter_jsonl(path)
    assert next(rows) == (1, {"a": 1})  # lazy: good rows come before the bad one is read
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: bad JSON line \(.* at column 9\)"):
        next(rows)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: file not found"):
        list(iter_jsonl(tmp_path / "nope.jsonl"))


def test_non_utf8_file_is_named(tmp_path):
    """issue 15 item 5: a UnicodeDecodeError used to name no file."""
    import pytest

    from chatpipe.data.jsonl import iter_jsonl

    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8"):
        list(iter_jsonl(bad))


def test_empty_custom_jsonl_is_named(tmp_path):
    import pytest

    from chatpipe.data.tasks.customjson import CustomJSON

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match=r"empty\.jsonl.*no rows"):
        CustomJSON(path=empty)
