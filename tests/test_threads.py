"""Threads by share: every process chatpipe starts computes with its share of the cores it may use.

The sweep's end-to-end check (concurrency 2 on 2 cores: 1 thread per training process, read from the
processes' MLflow params) is in tests/test_sweep.py, on the sweep it already runs; one process alone
against two workers on the same cores is in tests/test_launch.py's two-worker run.
"""

from __future__ import annotations

import os

import pytest

from chatpipe.launch import build_app, worker_threads
from chatpipe.runtime import choose_threads, share_cores, thread_params, thread_share, usable_cores
from chatpipe.settings import LaunchSettings, ParamsError


@pytest.fixture(autouse=True)
def no_user_threads(monkeypatch):
    """The shares under test, not the test runner's own OMP_NUM_THREADS or Slurm job."""
    for name in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK", "CHATPIPE_CORES"):
        monkeypatch.delenv(name, raising=False)


def _threads(app) -> int:
    return int(app.roles[0].env["OMP_NUM_THREADS"])


@pytest.mark.parametrize("cores, sharers, share", [(2, 1, 2), (2, 2, 1), (8, 3, 2), (2, 4, 1), (1, 1, 1)])
def test_a_share_is_the_cores_divided_at_least_one(cores, sharers, share):
    assert thread_share(cores, sharers) == share


def test_the_cores_are_the_affinity_mask_or_the_slurm_jobs_cpus(monkeypatch):
    assert usable_cores() == len(os.sched_getaffinity(0))
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    assert usable_cores() == 6
    assert choose_threads(2) == (3, "6 cores / 2")


def test_the_users_omp_num_threads_then_the_setting_win_over_the_share(monkeypatch):
    assert choose_threads(1, setting=3, cores=2) == (3, "launch.threads")
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert choose_threads(1, setting=3, cores=2) == (5, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "4,2")  # OpenMP's nested form: the outer level counts
    assert choose_threads(2, cores=2)[0] == 4


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_omp_num_threads_is_an_error_naming_it(monkeypatch, value):
    monkeypatch.setenv("OMP_NUM_THREADS", value)
    with pytest.raises(ParamsError, match=f"OMP_NUM_THREADS={value!r}: expected a positive integer"):
        worker_threads(LaunchSettings(), 1)


def test_a_stage_launched_alone_gets_every_core_and_workers_split_them(params_file):
    cores = usable_cores()
    assert _threads(build_app("pretrain", LaunchSettings(), [])) == cores
    assert (
        _threads(build_app("data", LaunchSettings(nproc_per_node=2), [])) == cores
    )  # one process whatever the topology
    assert _threads(build_app("pretrain", LaunchSettings(nproc_per_node=2), [])) == thread_share(cores, 2)
    assert _threads(build_app("pretrain", LaunchSettings(threads=3, nproc_per_node=2), [])) == 3


def test_a_sweep_points_share_and_a_remote_nodes_cpus_set_the_count(params_file, monkeypatch):
    monkeypatch.setenv("CHATPIPE_CORES", "1")  # what the sweep gives each of 2 points on 2 cores
    assert _threads(build_app("pretrain", LaunchSettings(), [])) == 1
    # on Slurm the node's CPUs are the job's --cpus-per-task (launch.cpus_per_node), not this host's
    slurm = LaunchSettings(scheduler="slurm", cpus_per_node=16, nproc_per_node=4)
    assert _threads(build_app("pretrain", slurm, [])) == 4
    monkeypatch.setenv("CHATPIPE_CORES", "half")
    with pytest.raises(ParamsError, match="CHATPIPE_CORES='half': expected a positive number of cores"):
        build_app("pretrain", LaunchSettings(), [])


def test_serve_engines_times_threads_fit_the_cores(params_file):
    import torch

    before = torch.get_num_threads()
    try:
        for engines in (1, 2, 3):
            threads = share_cores(engines)
            assert threads == torch.get_num_threads() == thread_share(usable_cores(), engines)
            assert engines * threads <= max(usable_cores(), engines)
        assert thread_params() == {"runtime/threads": torch.get_num_threads()}
    finally:
        torch.set_num_threads(before)
        os.environ.pop("OMP_NUM_THREADS", None)
