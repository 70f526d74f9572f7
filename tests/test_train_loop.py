"""The one training loop (chatpipe/train/loop.py) and the step it runs (chatpipe/train/step.py):
cadence, what a checkpoint carries, bitwise resume, and the gradient norm every training stage logs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from chatpipe.runtime import Runtime
from chatpipe.settings import PretrainSettings
from chatpipe.stage_metrics import Curves
from chatpipe.testing.project import dvc, make_project
from chatpipe.train.loop import Every, Loop, LoopState, StepOut, run_loop, step_row
from chatpipe.train.stage import resume_or_fresh
from chatpipe.train.step import train_step_stats

RT = Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
TOTAL = 6


class Recorder:
    """Stands in for the StageRun's log/flush: remembers every metrics row."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics: dict, step: int) -> None:
        self.rows.append((step, dict(metrics)))

    def flush(self) -> None:
        pass


def _toy(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]  # what apply_schedules scales, as build_optimizers sets it
    return model, [opt]


def _batch():
    # drawn from the global RNG: a resume is exact only if the checkpoint restored it
    x = torch.randn(4, 8)
    return x, x.sum(dim=1, keepdim=True)


class ToyNet(torch.nn.Module):
    """The toy model as the LM stages' step calls it: ``model(x, y)`` returns the loss."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.inner(x), y)


def _run(tmp_path, run_id: str, *, stop_after: int | None = None):
    """One run of the loop on the toy model in ``tmp_path/work`` (resuming what is there); stops with
    an exception once ``stop_after`` steps are done, as a killed run would."""
    cfg = PretrainSettings(checkpoint_every=2, keep_checkpoints=10, log_every=1)
    model, optimizers = _toy()
    net = ToyNet(model)
    run_fp, meta = resume_or_fresh(tmp_path / "work", cfg, {"data": "toy"}, model=net, optimizers=optimizers, rt=RT)
    state = LoopState.resumed(meta, TOTAL)
    evals: list[int] = []
    drawn = list(meta.get("drawn", []))  # the stage's own state, as RL's prompt log: carried by the checkpoint

    def step(n: int) -> StepOut:
        if stop_after is not None and n >= stop_after:
            raise KeyboardInterrupt("killed")
        drawn.append(torch.randint(100, ()).item())
        loss, grad_norm = train_step_stats(net, _batch, optimizers, grad_accum=2, rt=RT)
        return StepOut(grad_norm, loss, totals={"tokens": 8})

    def evaluate(n: int) -> dict[str, float]:
        evals.append(n)
        return {"val/loss": float(n)}

    loop = Loop(
        "toy",
        cfg,
        RT,
        tmp_path / "work",
        net,
        optimizers,
        step=step,
        schedule=lambda n: (1.0 - n / TOTAL, None),
        hooks=[Every(evaluate, 4, at_start=True)],
        identity={"stage": "toy", "fingerprint": run_fp, "world_size": 1},
        stage_state=lambda: {"drawn": drawn},
    )
    recorder = Recorder()
    metrics = Curves(recorder, "toy", ["train/loss"], root=tmp_path / "plots")
    try:
        run_loop(loop, state, SimpleNamespace(id=run_id), metrics)
    except KeyboardInterrupt:
        pass
    return net, state, loop, recorder.rows, evals


def test_a_resumed_run_ends_bitwise_where_an_uninterrupted_one_does(tmp_path):
    whole, whole_state, whole_loop, rows, evals = _run(tmp_path / "a", "r0")
    assert evals == [0, 4, 6]  # the start, every 4th step, the last
    assert [s for s, r in rows if "train/loss" in r] == list(range(1, TOTAL + 1))

    _, killed, _, _, _ = _run(tmp_path / "b", "r1", stop_after=3)  # dies in step 3; step 2 was saved
    assert killed.step == 3
    # the batches come from the global RNG, which _toy re-seeds: only the checkpoint's RNG state resumes them right
    resumed, state, loop, _, resumed_evals = _run(tmp_path / "b", "r2")
    assert state.start_step == 2 and resumed_evals == [2, 4, 6]  # at_start: the step it resumed from
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # the totals continue across the resume; the run ids name both runs that trained steps
    assert state.totals["tokens"] == whole_state.totals["tokens"] == 8 * TOTAL
    assert state.run_ids == ["r1", "r2"] and whole_state.run_ids == ["r0"]
    assert state.first_evals == whole_state.first_evals == {"val/loss": 0.0}
    final = loop.meta(state)
    assert final["carried"]["tokens"] == 8 * TOTAL and final["total_steps"] == TOTAL
    assert final["drawn"] == whole_loop.meta(whole_state)["drawn"] and len(final["drawn"]) == TOTAL


def test_every_step_logs_loss_grad_norm_lr_and_throughput(tmp_path):
    _, _, _, rows, _ = _run(tmp_path, "r0")
    steps = [r for _, r in rows if "train/loss" in r]
    assert len(steps) == TOTAL
    for n, row in enumerate(steps):
        assert {"train/loss", "train/grad_norm", "lr_mult", "tokens_per_s"} <= set(row)
        assert row["train/grad_norm"] > 0 and math.isfinite(row["train/grad_norm"])
        assert row["lr_mult"] == pytest.approx(1.0 - n / TOTAL)


def test_the_step_row_is_built_in_one_place_and_a_step_cannot_set_its_keys():
    out = StepOut(2.5, 3.0, {"epoch": 1.0}, {"tokens": 100})
    row = step_row(out, lr_mult=0.5, seconds=2.0, peak=1000.0, flops_per_token=4.0)
    assert row["train/loss"] == 3.0 and row["train/grad_norm"] == 2.5 and row["epoch"] == 1.0
    assert (row["lr_mult"], row["tokens_per_s"], row["mfu"]) == (0.5, 50.0, 0.2)
    # RL: no single loss and, after a batch of solved groups, no optimizer step; no trained tokens
    rl_row = step_row(StepOut(None, metrics={"reward/mean": 0.1}), lr_mult=1.0, seconds=1.0)
    assert rl_row["reward/mean"] == 0.1 and rl_row["lr_mult"] == 1.0
    assert not {"train/loss", "train/grad_norm", "tokens_per_s", "mfu"} & set(rl_row)
    with pytest.raises(ValueError, match=r"\['train/grad_norm'\]; the loop's step_row builds those"):
        step_row(StepOut(1.0, metrics={"train/grad_norm": 1.0}), lr_mult=1.0, seconds=1.0)


def test_a_checkpoint_carries_what_resumed_reads_back():
    state = LoopState(10, step=7, start_step=3, totals={"train_seconds": 1.5, "tokens": 64}, run_ids=["a"])
    state.first_evals, state.evals = {"val/bpb": 2.0}, {"val/bpb": 1.0}
    back = LoopState.resumed({**state.meta(), "step": state.step}, 10)
    assert (back.step, back.start_step, back.totals, back.run_ids) == (7, 7, state.totals, ["a"])
    assert back.first_evals == {"val/bpb": 2.0} and back.evals == {}  # evals are re-run, not carried
    assert LoopState.resumed({}, 10) == LoopState(10)
    # a checkpoint of the stages' own loops before this one: flat totals and run ids, resumed alike
    older = {"step": 4, "carried": {"train_seconds": 2.5, "tokens": 4096, "mlflow_run_ids": ["r"]}}
    assert LoopState.resumed(older, 10) == LoopState(
        10, step=4, start_step=4, totals={"train_seconds": 2.5, "tokens": 4096}, run_ids=["r"]
    )


@pytest.mark.parametrize(
    ("hook", "start", "due_at"),
    [
        (Every(None, 4), 0, [0, 4, 8, 10]),
        (Every(None, 4, at_start=True), 6, [6, 8, 10]),
        (Every(None, 0), 0, [10]),  # 0: only at the last step
        (Every(None, 3, at_last=False, from_step=1), 0, [3, 6, 9]),
        (Every(None, 0, at_last=False), 0, []),
    ],
)
def test_hook_cadence(hook, start, due_at):
    assert [s for s in range(start, 11) if hook.due(s, start=start, last=s == 10)] == due_at


@pytest.mark.parametrize("grad_clip", [0.0, 0.05])
def test_the_step_reports_the_gradient_norm_before_clipping_and_trains_as_before(grad_clip):
    model, optimizers = _toy()
    ref, ref_opts = _toy()
    torch.manual_seed(1)
    batches = [_batch() for _ in range(2)]
    it = iter(batches)
    _, grad_norm = train_step_stats(
        ToyNet(model), lambda: next(it), optimizers, grad_accum=2, rt=RT, grad_clip=grad_clip
    )

    # the same step by hand: accumulate, read the norm, clip, step
    for x, y in batches:
        (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
    norm = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
    if grad_clip:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), grad_clip)
    ref_opts[0].step()
    assert grad_norm == pytest.approx(norm.item(), rel=1e-5)
    assert grad_clip == 0 or grad_norm > grad_clip  # the clip was real, the norm logged before it
    for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_two_ranks_resume_pretrain_and_midtrain_bitwise(tmp_path):
    """2 gloo workers: a run resumed from a middle checkpoint ends with the uninterrupted run's weights."""
    import shutil

    from chatpipe.testing.project import run

    params = {
        "pretrain": {"max_steps": 6, "eval_every": 3, "checkpoint_every": 3, "dtype": "float32"},
        "midtrain": {
            "max_steps": 4,
            "eval_every": 2,
            "checkpoint_every": 2,
            "dtype": "float32",
            "device_batch_size": 2,
        },
        "tracking": {"enabled": False},
    }
    project = make_project(tmp_path, params)
    dvc(project, "repro", "tokenizer")
    for stage, out_dir, last, middle in (("pretrain", "base", 6, 3), ("midtrain", "mid", 4, 2)):
        launch = ("python", "-m", "chatpipe.launch", stage, "--nproc_per_node", "2")
        assert "world 2" in run(project, *launch).stdout
        model = project / "artifacts" / out_dir / "model.pt"
        whole = torch.load(model, weights_only=True)
        # as if killed after the middle checkpoint: the last one and the output gone
        shutil.rmtree(project / "checkpoints" / stage / f"step_{last:06d}")
        model.unlink()
        out = run(project, *launch).stdout
        assert f"resuming from checkpoints/{stage}/step_{middle:06d}" in out, out[-3000:]
        resumed = torch.load(model, weights_only=True)
        assert [k for k in whole if not torch.equal(whole[k], resumed[k])] == [], stage


@pytest.mark.slow
def test_every_training_stage_logs_the_keys_of_the_one_step_row(params_file, tmp_path, monkeypatch):
    """pretrain, midtrain, SFT, the reward model and RL, run in this process for two steps each (data and
    tokenizer before them): every step of every stage's MLflow run holds every key :func:`step_row` puts on
    a row that stepped. A key added there reaches all five; a stage that built its own row would miss it."""
    from chatpipe.testing.project import SMALL_PARAMS, SMALL_RL, mlflow_client, set_params
    from stages import data, midtrain, pretrain, reward_model, rl, sft, tokenizer

    monkeypatch.chdir(tmp_path)
    short = {"max_steps": 2, "eval_every": 0, "checkpoint_every": 0, "log_every": 1}
    overlay = {
        name: {**SMALL_PARAMS.get(name, {}), **short} for name in ("pretrain", "midtrain", "sft", "reward_model")
    }
    overlay["rl"] = {**SMALL_RL, **short, "eval_problems": 2}
    set_params(tmp_path, {**SMALL_PARAMS, **overlay, "tracking": {"enabled": True}})
    always = set(step_row(StepOut(grad_norm=1.0), lr_mult=1.0, seconds=1.0))
    assert {"train/grad_norm", "lr_mult"} <= always
    for stage in (data, tokenizer, pretrain, midtrain, sft, reward_model, rl):
        stage.main([])

    client = mlflow_client(tmp_path)
    exp = client.get_experiment_by_name("chatpipe")
    for stage in ("pretrain", "midtrain", "sft", "reward_model", "rl"):
        (run,) = client.search_runs([exp.experiment_id], f"tags.stage = '{stage}'")
        for key in sorted(always):
            steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert steps == [1, 2], (stage, key)
