"""Several rollout workers (chatpipe/rl/workers.py): the trainer's weights reach every worker over
torch.distributed (gloo, localhost) with a version number, bit for bit, and no weights file is
written. The workers are processes of their own here, as torchx starts them; the trainer is this
test, stepping as the stage does (take the step's batch, check its staleness, update, publish)."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from chatpipe.rl.exchange import Exchange
from chatpipe.rl.workers import WeightServer, WorkerGone, WorkersExchange, load_flat, pack, store_address
from tests.conftest import REPO


def tiny_model() -> torch.nn.Module:
    """Parameters and buffers of three dtypes, so the flat bytes mix element sizes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model.register_buffer("scale", torch.randn(3).to(torch.bfloat16))
    model.register_buffer("count", torch.tensor([7], dtype=torch.int64))
    return model


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(pack(model.state_dict()).numpy().tobytes()).hexdigest()


def worker_main(root: str, worker: int, workers: int, max_steps: int, max_staleness: int) -> None:
    """A rollout worker's process: the real loop; its "batch" is the digest of the weights it sampled with."""
    from chatpipe.rl.workers import WeightClient, run_rollout_worker

    policy = tiny_model()
    torch.nn.init.zeros_(policy[0].weight)  # not the trainer's: only what it is sent makes them equal
    ex = Exchange(Path(root), dead_after_s=10)
    client = WeightClient(store_address(), worker, torch.device("cpu"), timeout_s=60)

    def sample_step(step: int) -> dict:
        time.sleep(0.05)  # sampling takes a while: the trainer may publish meanwhile
        return {"idx": [step], "digest": digest(policy), "worker": worker}

    with ex.heartbeat(f"rollout-{worker}", {"node": socket.gethostname(), "pid": os.getpid()}):
        run_rollout_worker(ex, client, policy, sample_step, workers=workers, max_steps=max_steps,
                           max_staleness=max_staleness, timeout_s=60)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(root: Path, workers: int, max_steps: int, max_staleness: int, port: int) -> list[subprocess.Popen]:
    env = {**os.environ, "CHATPIPE_RL_STORE": f"127.0.0.1:{port}", "OMP_NUM_THREADS": "1"}
    code = "import sys; from tests.test_rl_workers import worker_main; worker_main(*sys.argv[1:2], *map(int, sys.argv[2:]))"
    return [
        subprocess.Popen(
            [sys.executable, "-c", code, str(root), str(w), str(workers), str(max_steps), str(max_staleness)],
            cwd=REPO,
            env=env,
        )  # fmt: skip
        for w in range(workers)
    ]


def trainer_exchange(root: Path, workers: int, port: int, dead_after_s: float = 10) -> WorkersExchange:
    server = WeightServer(("127.0.0.1", port), workers, torch.device("cpu"), timeout_s=60)
    return WorkersExchange(root, dead_after_s, server)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_two_workers_get_every_version_bit_for_bit_and_no_weights_file(tmp_path, max_staleness):
    root, steps, port = tmp_path / "exchange", 8, free_port()
    procs = start_workers(root, 2, steps, max_staleness, port)
    policy = tiny_model()
    ex = trainer_exchange(root, 2, port)
    published = {0: digest(policy)}
    ex.start(0, policy.state_dict())
    versions: dict[int, list[int]] = {0: [], 1: []}
    try:
        for step in range(steps):
            got = ex.take_rollouts(step, timeout_s=60, alive=lambda: ex.check_alive("rollout") or True)
            version = int(got["version"])
            assert 0 <= step - version <= max_staleness, f"step {step} sampled by version {version}"
            assert got["worker"] == step % 2 and got["idx"] == [step]  # each step whole, by one worker
            assert got["digest"] == published[version], f"worker {got['worker']}'s weights of version {version}"
            versions[got["worker"]].append(version)
            with torch.no_grad():  # an "optimizer step"
                for p in policy.parameters():
                    p.add_(torch.randn_like(p))
                policy.count += 1
            published[step + 1] = digest(policy)
            ex.publish(step + 1, policy.state_dict())
            files = {p.name for p in root.iterdir()}
            assert not any("weight" in f or (f.endswith(".pt") and not f.startswith("rollouts-")) for f in files), files
    finally:
        ex.stop()
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    assert all(v == sorted(v) and v for v in versions.values()), versions  # monotone, both workers used
    if max_staleness == 0:
        assert versions == {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}
    assert not root.exists(), "the trainer removes the exchange dir at the end"


def test_load_flat_is_bit_exact_and_refuses_another_model():
    src, dst = tiny_model(), tiny_model()
    with torch.no_grad():
        for p in src.parameters():
            p.mul_(3.0)
    from chatpipe.rl.workers import layout

    load_flat(dst, pack(src.state_dict()), layout(src.state_dict()))
    for name, want in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], want), name
    other = torch.nn.Linear(5, 3)
    with pytest.raises(ValueError, match="other names, shapes or dtypes"):
        load_flat(other, pack(src.state_dict()), layout(src.state_dict()))


def test_store_address_reads_the_variable_that_holds_the_trainers_host():
    env = {"CHATPIPE_RL_STORE": "SLURM_JOB_NODELIST_HET_GROUP_0:2345", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1"}
    assert store_address(env) == ("n1", 2345)
    assert store_address({"CHATPIPE_RL_STORE": "127.0.0.1:99"}) == ("127.0.0.1", 99)
    with pytest.raises(ValueError, match="CHATPIPE_RL_STORE='': expected"):
        store_address({})


def test_a_killed_worker_is_named_by_the_trainer(tmp_path):
    root, port = tmp_path / "exchange", free_port()
    procs = start_workers(root, 2, 50, 1, port)
    policy = tiny_model()
    ex = trainer_exchange(root, 2, port, dead_after_s=30)  # the socket names it first, not the heartbeat
    ex.start(0, policy.state_dict())
    try:
        ex.take_rollouts(0, timeout_s=60, alive=lambda: ex.check_alive("rollout") or True)
        ex.publish(1, policy.state_dict())
        ex.take_rollouts(1, timeout_s=60, alive=lambda: ex.check_alive("rollout") or True)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        t0 = time.monotonic()
        with pytest.raises(WorkerGone, match=rf"rollout worker 1 \(replica 1, node \S+, pid {procs[1].pid}\)"):
            for step in range(2, 50):
                ex.publish(step, policy.state_dict())
                ex.take_rollouts(step, timeout_s=60, alive=lambda: ex.check_alive("rollout") or True)
        assert time.monotonic() - t0 < 15
    finally:
        ex.stop()
    assert procs[0].wait(timeout=30) is not None  # told to stop: it ends
