"""Hypothesis over the readers of every file format chatpipe reads (tokenizer, model dir, checkpoint, token
store, text shards, sweep files): one file damaged at a time is refused with an error naming it, or read
as exactly what the intact files give (chatpipe/testing/fuzz_cases.py's oracle; bench/fuzz.py runs more cases)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import HealthCheck, given, settings

from chatpipe.testing.fuzz_cases import FORMATS, build_artifacts, file_case, run_file_case
from tests.conftest import REPO


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return build_artifacts(tmp_path_factory.mktemp("intact") / "good", REPO)


def _fuzz(n: int):
    return settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("fmt", FORMATS)
def test_damaged_files_are_named_or_read_right(fmt, good, tmp_path_factory, caplog):
    caplog.set_level(logging.ERROR)  # a fallback past a damaged checkpoint warns on every case
    work = tmp_path_factory.mktemp(f"fuzz-{fmt}")

    @_fuzz(12 if fmt in ("tokens", "sweep") else 25)
    @given(case=file_case((fmt,)))
    def check(case) -> None:
        outcome, detail = run_file_case(case, good, work)
        assert outcome == "clean", detail

    check()
