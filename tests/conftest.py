"""Shared test fixtures: repo paths, a params.yaml sandbox, the shared real-data folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Three workers on two cores: one thread each (OpenMP threads beyond the cores spin and slow
    # every worker down). Commands the tests start inherit it, as chatpipe/testing/project.py sets anyway.
    os.environ["OMP_NUM_THREADS"] = "1"

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def params_file(tmp_path, monkeypatch) -> Path:
    """A private copy of params.yaml (and profiles.yaml beside it) that CHATPIPE_PARAMS points at; env cleared."""
    for key in list(os.environ):
        if key.startswith("CHATPIPE_"):
            monkeypatch.delenv(key)
    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    shutil.copy(REPO / "profiles.yaml", tmp_path / "profiles.yaml")
    monkeypatch.setenv("CHATPIPE_PARAMS", str(path))
    return path


@pytest.fixture(scope="session")
def tiny_sft(tmp_path_factory) -> Path:
    """The tiny profile's project trained through sft, once for the whole session (every xdist worker
    sees the same one: :func:`chatpipe.testing.project.tiny_sft_project`). Copy from it; never write to it."""
    from chatpipe.testing.project import tiny_sft_project

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: the workers' common dir
    return tiny_sft_project(shared / "shared-artifacts")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory) -> Iterator[str]:
    """The API URL of one Prefect server for this test process (started on first use, stopped at the end).

    A flow command without ``PREFECT_API_URL`` starts its own temporary server (~4 s of CPU and a
    few seconds of wall time each). Tests whose subject is not that first-run path point their flows
    here instead (``PREFECT_API_URL=prefect_server`` in the command's environment, or
    :func:`prefect_api_here` in this process), as a user with ``prefect server start`` running would.
    The server is the one the flows start themselves (:class:`flows.prefect_api.TemporaryServer`),
    with its own ``PREFECT_HOME`` (database) under this session's temporary directory.
    """
    from chatpipe.io import env_set
    from flows.prefect_api import TemporaryServer

    with env_set(PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home"))):  # the child copies the environment
        server = TemporaryServer()
    try:
        if not server.wait_ready():
            pytest.fail("the tests' Prefect server did not start (flows.prefect_api.TemporaryServer)")
        yield server.api_url
    finally:
        server.stop()


@pytest.fixture
def prefect_api_here(prefect_server) -> Iterator[str]:
    """This test process's Prefect client talks to :func:`prefect_server` while the test runs."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_server}):
        yield prefect_server


def require_shared_data() -> Path:
    """The ../shared/data folder, or skip the test with the reason."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real test data not found at {SHARED_DATA} (../shared/data beside the repo)")
    return SHARED_DATA


# Under pytest-xdist (pyproject's addopts: three workers, `--dist loadfile`) a test file runs whole on
# one worker, and files are handed out in collection order. The longest files (measured with
# `pytest --durations`) go first, so that no worker picks up a long file when the others are almost
# done; every other file keeps its place after them.
#
# Three workers on two cores, not two: many end-to-end tests spend part of their time waiting (a
# server starting, a Slurm job being scheduled, a signal's effect, a browser page), and with two
# workers the two cores were busy ~77% of the time. On the 2-core AMD EPYC (Zen 4), pytest took
# 1,143 s with two workers and 1,088 s with three (CPU 153% and 167%); about 20 s of that gap is
# test_lineage's cut, which came with the switch.
HEAVIEST_FIRST = (
    "test_readme_examples.py",  # the default pipeline, data -> rl (a third of the serial time)
    "test_slurm.py",
    "test_rehearsal_gpu.py",  # cold torch.compile of model, eval model and optimizer on 2 ranks
    "test_hub.py",
    "test_launch.py",
    "test_screenshots.py",
    "test_pipeline.py",
    "test_sweep.py",
    "test_lm_eval.py",
    "test_export.py",
    "test_eval_stage.py",
    "test_lineage.py",
    "test_prefect_schedule.py",
    "test_midtrain_sft.py",
    "test_chaos.py",
    "test_stage_rl_async.py",
    "test_fp8.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort
