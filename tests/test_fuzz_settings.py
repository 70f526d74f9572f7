"""Hypothesis over the settings (params.yaml, profiles.yaml, env, command line): every case is refused by a
ParamsError naming its key and where it came from, or accepted meaning exactly what it says (the oracle
in chatpipe/testing/fuzz_cases.py). bench/fuzz.py runs the same cases by the thousand."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatpipe.testing.fuzz_cases import SOURCES, VALUES, run_settings_case, scalar_keys, settings_case
from tests.conftest import REPO

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(case=settings_case())
def test_every_settings_case_is_a_named_error_or_means_what_it_says(case, tmp_path_factory):
    outcome, detail = run_settings_case(case, tmp_path_factory.mktemp("fuzz"), REPO)
    assert outcome == "clean", detail


@FUZZ
@given(source=st.sampled_from(SOURCES), key=st.sampled_from(scalar_keys()), value=VALUES)
def test_values_from_every_source(source, key, value, tmp_path_factory):
    outcome, detail = run_settings_case(("value", source, key, value), tmp_path_factory.mktemp("fuzz"), REPO)
    assert outcome == "clean", detail


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=200))
def test_any_bytes_as_params_yaml(data, tmp_path_factory):
    outcome, detail = run_settings_case(("bytes", data), tmp_path_factory.mktemp("fuzz"), REPO)
    assert outcome == "clean", detail
