"""The roles' shared dir of asynchronous RL (chatpipe/rl/exchange.py): whole files, versions, the
staleness bound the rollout role keeps, and restarts. The rollout role runs in a thread here; the
stage tests run it as its own torchx role."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from chatpipe.rl.exchange import Exchange, ExchangeTimeout, run_rollout_role


def test_weights_and_rollouts_round_trip(tmp_path):
    ex = Exchange(tmp_path / "x")
    ex.start(3, {"w": torch.ones(2)})
    assert ex.version() == 3 and ex.start_mark()["step"] == 3
    ex.publish(4, {"w": torch.full((2,), 2.0)})
    version, state = ex.weights()
    assert version == 4 and state["w"].tolist() == [2.0, 2.0]
    ex.put_rollouts(3, {"run": "stale", "version": 4, "texts": ["b"]})  # an earlier run's: skipped
    ex.put_rollouts(3, {"run": ex.run_id, "version": 4, "texts": ["a"], "t": torch.arange(3)})
    got = ex.take_rollouts(3, timeout_s=1)
    assert got["texts"] == ["a"] and got["t"].tolist() == [0, 1, 2]
    assert not list(ex.root.glob("rollouts-*")), "a taken batch is removed"


def test_start_clears_an_earlier_run_and_names_a_new_one(tmp_path):
    ex = Exchange(tmp_path / "x")
    first = ex.start(0, {"w": torch.ones(1)})
    ex.put_rollouts(0, {"version": 0})
    ex.stop(grace_s=0)
    second = ex.start(5, {"w": torch.ones(1)})
    assert second != first and not ex.stopped() and not list(ex.root.glob("rollouts-*"))
    assert ex.start_mark() == {"step": 5, "id": second}


def test_start_survives_the_role_beating_into_the_directory_while_it_clears_it(tmp_path):
    """The role (another process, maybe another node) beats into the directory once a second. A beat
    that lands while start clears the directory used to fail the start ("exists" between removing and
    making it, "not empty" during the removal); here a role beats without pause through many starts."""
    root, done = tmp_path / "x", threading.Event()

    def beat_without_pause():
        while not done.is_set():
            try:
                root.mkdir(parents=True, exist_ok=True)
                (root / "rollout.beat").write_text("1")
            except (FileNotFoundError, FileExistsError):
                pass  # the directory went away under this beat; the next one comes soon

    ex = Exchange(root)
    role = threading.Thread(target=beat_without_pause)
    role.start()
    try:
        for step in range(100):
            run_id = ex.start(step, {"w": torch.full((1,), float(step))})
    finally:
        done.set()
        role.join()
    assert ex.start_mark() == {"step": 99, "id": run_id}
    assert ex.version() == 99 and torch.equal(ex.weights()[1]["w"], torch.full((1,), 99.0))


def test_waiting_for_a_batch_that_never_comes_names_the_setting(tmp_path):
    ex = Exchange(tmp_path / "x")
    ex.start(0, {"w": torch.ones(1)})
    with pytest.raises(ExchangeTimeout, match=r"no rollouts of step 0 .* after 0 s \(rl.rollout.timeout_s\)"):
        ex.take_rollouts(0, timeout_s=0.05)


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_the_rollout_role_keeps_the_staleness_bound(tmp_path, max_staleness):
    """A trainer that takes step s's batch and then publishes version s + 1: every batch it gets was
    sampled by weights at most ``max_staleness`` versions old, with the very weights of that version
    loaded into the role's model, and the role runs ahead exactly as far as the bound allows."""
    ex, model, steps = Exchange(tmp_path / "x"), torch.nn.Linear(1, 1, bias=False), 6
    sampled_with = {}

    def sample_step(step: int) -> dict:
        sampled_with[step] = model.weight.item()  # the weights the role holds while it samples
        return {"step": step}

    ex.start(0, {"weight": torch.zeros(1, 1)})
    role = threading.Thread(
        target=run_rollout_role,
        args=(ex, model, sample_step),
        kwargs=dict(max_steps=steps, max_staleness=max_staleness, timeout_s=10),
    )
    role.start()
    versions = []
    for step in range(steps):
        got = ex.take_rollouts(step, timeout_s=10)
        versions.append(got["version"])
        assert got["step"] == step and sampled_with[step] == got["version"]  # version v's weights are v
        ex.publish(step + 1, {"weight": torch.full((1, 1), float(step + 1))})
    ex.stop()
    role.join(timeout=10)
    assert not role.is_alive(), "the role ends when the trainer stops"
    staleness = [step - v for step, v in enumerate(versions)]
    assert max(staleness) <= max_staleness and min(staleness) >= 0
    assert staleness[-1] == 0 or max_staleness > 0
    if max_staleness == 0:
        assert versions == list(range(steps))  # synchronous: each step sampled by the weights it updates


def test_the_rollout_role_begins_again_when_the_trainer_restarts(tmp_path):
    """A trainer that resumes from step 2 clears the dir: the role, waiting ahead, starts again from 2."""
    ex, model = Exchange(tmp_path / "x"), torch.nn.Linear(1, 1, bias=False)
    ex.start(0, {"weight": torch.zeros(1, 1)})
    role = threading.Thread(
        target=run_rollout_role,
        args=(ex, model, lambda step: {"step": step}),
        kwargs=dict(max_steps=4, max_staleness=0, timeout_s=10),
    )
    role.start()
    assert ex.take_rollouts(0, timeout_s=10)["version"] == 0
    ex.start(2, {"weight": torch.ones(1, 1)})  # "killed" after step 0; resumed from a checkpoint at step 2
    got = [ex.take_rollouts(2, timeout_s=10)]
    ex.publish(3, {"weight": torch.ones(1, 1)})
    got.append(ex.take_rollouts(3, timeout_s=10))
    ex.stop()
    role.join(timeout=10)
    assert [(g["step"], g["version"]) for g in got] == [(2, 2), (3, 3)] and not role.is_alive()


def test_a_launch_reaps_only_the_dirs_of_trainers_that_are_provably_dead(tmp_path):
    """Two trainers' launch dirs under one parent, one owner alive and one dead: starting a third launch
    removes only the dead one's (and one whose pid now belongs to a later process), never a live one's,
    one on another host, one with no owner record, nor a user's own dir. Before, every 12-hex sibling
    was removed, so two launches sharing a parent deleted each other's exchange."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from chatpipe.procs import process_start
    from chatpipe.rl.exchange import OWNER, claim, reap_dead_launches

    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        owners = {
            "aaaaaaaaaaaa": {"host": host, "pid": live.pid, "start": process_start(live.pid)},
            "bbbbbbbbbbbb": {"host": host, "pid": dead.pid, "start": "12.00"},
            "cccccccccccc": {"host": host, "pid": live.pid, "start": "12.00"},  # its pid, reused by another
            "dddddddddddd": {"host": host + "-other-node", "pid": dead.pid, "start": "12.00"},
        }
        base = tmp_path / "shared"
        for name, owner in owners.items():
            (base / name).mkdir(parents=True)
            (base / name / OWNER).write_text(json.dumps(owner))
            (base / name / "weights.pt").write_bytes(b"w")
        (base / "eeeeeeeeeeee").mkdir()  # a role beat before its trainer claimed the dir: not provably dead
        (base / "notes").mkdir()
        mine = base / "ffffffffffff"
        claim(mine)
        removed = reap_dead_launches(mine)
        assert sorted(p.name for p in removed) == ["bbbbbbbbbbbb", "cccccccccccc"]
        assert sorted(p.name for p in base.iterdir()) == [
            "aaaaaaaaaaaa",
            "dddddddddddd",
            "eeeeeeeeeeee",
            "ffffffffffff",
            "notes",
        ]
        assert (base / "aaaaaaaaaaaa" / "weights.pt").exists()
        # the live trainer's own dir cannot be claimed by another trainer
        with pytest.raises(RuntimeError, match=rf"belongs to another RL trainer \(pid {live.pid} on {host}\)"):
            claim(base / "aaaaaaaaaaaa")
        # a start keeps the owner record it clears the rest around
        ex = Exchange(mine)
        ex.start(0, {"w": torch.ones(1)})
        assert json.loads((mine / OWNER).read_text())["pid"] == os.getpid()
    finally:
        live.kill()
        live.wait()


def test_the_launch_dir_is_decided_in_one_place(tmp_path, monkeypatch):
    """launch_dir: rl.rollout.exchange_dir when set; else shared memory on one host; else the checkpoints dir
    (roles on two nodes, or a host without /dev/shm); one dir per launch id under it."""
    from pathlib import Path

    from chatpipe.rl.exchange import launch_dir

    assert launch_dir(str(tmp_path), "0123456789ab") == tmp_path / "0123456789ab"
    assert launch_dir("", "0123456789ab", one_host=False) == Path("checkpoints/rl/exchange/0123456789ab")
    if Path("/dev/shm").is_dir():
        monkeypatch.chdir(tmp_path)
        shm = launch_dir("")
        assert shm.parent.parent == Path("/dev/shm") and shm.name == "default"
        monkeypatch.chdir(tmp_path.parent)
        assert launch_dir("").parent != shm.parent  # one dir per project


def test_a_heartbeat_names_its_node_and_pid_before_the_block_runs(tmp_path):
    # CI once killed a rollout worker after it had connected but before its heartbeat thread first wrote:
    # the trainer's error said "no heartbeat yet" instead of the worker's node and pid
    ex = Exchange(tmp_path / "x")
    with ex.heartbeat("rollout-1", {"node": "n2", "pid": 4242}):
        beat = json.loads((tmp_path / "x" / "rollout-1.beat").read_text())
        assert (beat["node"], beat["pid"], beat["beat"]) == ("n2", 4242, 1)
