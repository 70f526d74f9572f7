"""The reward model: Bradley-Terry math, last-token scoring, the stage (train, resume, bad input) and RL on its scores."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from datetime import datetime
from pathlib import Path

import pytest
import torch

from chatpipe.model.files import load_model
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.rl.reward_model import (
    RewardModel,
    bradley_terry_loss,
    last_action_index,
    load_reward_model,
    pad_rows,
    pair_metrics,
    refresh_loss,
    rollout_scores,
    unique_rows,
    verifier_pairs,
)
from chatpipe.rl.rewards import combine_rewards, group_win_rates
from chatpipe.rl.value import ValueModel
from chatpipe.testing.chatmodel import make_artifacts

REPO = Path(__file__).resolve().parents[1]


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(sequence_len=32, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=32))
    model.init_weights()
    return model


def trained_head(model: GPT) -> RewardModel:
    rm = RewardModel.from_policy(model)
    with torch.no_grad():
        rm.head.weight.normal_()
    return rm


def test_bradley_terry_loss_and_pair_metrics_by_hand():
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, -1.0, 3.0])
    want = (math.log1p(math.exp(-1)) + math.log(2) + math.log1p(math.exp(-3)) + math.log1p(math.exp(3))) / 4
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(want, rel=1e-6)
    m = pair_metrics(chosen, rejected)  # margins 1, 0, 3, -3: a tie is not a win
    assert m["pair_accuracy"] == 0.5
    assert m["margin/mean"] == pytest.approx(0.25)
    assert m["margin/q50"] == pytest.approx(0.5)  # between the middle two margins, 0 and 1
    assert m["margin/q05"] == pytest.approx(-3 + 0.15 * 3)  # torch.quantile's linear interpolation


def test_verifier_pairs_rank_replies_of_one_prompt_only():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.1, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    chosen, rejected = verifier_pairs(scores, groups)
    # prompt 0: the right reply over each wrong one; prompt 1: 1.0 over partial credit; prompt 2 alone
    assert sorted(zip(chosen.tolist(), rejected.tolist())) == [(0, 1), (0, 2), (3, 4)]


def test_refresh_loss_counts_accuracy_before_the_step_and_still_has_gradients_without_pairs():
    rm = trained_head(tiny_gpt())
    ids, last = pad_rows([[1, 5, 6, 7], [1, 8, 9], [1, 5, 6, 9], [1, 8]], pad_id=0)
    model = rm(ids, last).detach()
    groups = torch.tensor([0, 0, 1, 1])
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])  # chosen 0 over 1, 3 over 2
    loss, stats = refresh_loss(rm, ids, last, scores, groups)
    want = bradley_terry_loss(model[[0, 3]], model[[1, 2]])
    assert loss.item() == pytest.approx(want.item(), abs=1e-6)
    right = float(model[0] > model[1]) + float(model[3] > model[2])
    assert stats == {"reward_model/refresh_pairs": 2.0, "reward_model/refresh_accuracy": right / 2}
    loss, stats = refresh_loss(rm, ids, last, torch.ones(4), groups)  # every reply right: nothing to rank
    loss.backward()
    assert loss.item() == 0.0 and stats == {"reward_model/refresh_pairs": 0.0}
    assert rm.head.weight.grad is not None and not rm.head.weight.grad.any()


def test_a_refreshed_reward_model_needs_reward_source_model():
    from chatpipe.settings import ParamsError, RLSettings, load_section

    with pytest.raises(ParamsError, match="reward.model_lr_frac trains the reward model, which only reward.source"):
        load_section(RLSettings, ["--reward.model_lr_frac=0.2"])
    assert load_section(RLSettings, ["--reward.source=model", "--reward.model_lr_frac=0.2"]).reward.model_lr_frac == 0.2


def test_iterated_rlhf_says_at_start_and_in_its_summary_that_its_reward_carries_the_verifier(caplog):
    """With reward_model_lr_frac > 0 the reward model learns from verifier-ranked pairs during RL, so the
    policy's reward is not verifier-free: turning it on logs a warning saying so, and the stage's summary
    says it (``reward_carries_verifier`` 1); a frozen reward model's run says 0, a verifier run nothing."""
    import logging

    from chatpipe.rl.roles import reward_model_optimizers
    from chatpipe.rl.step import summary
    from chatpipe.settings import RLSettings, load_section
    from chatpipe.train.loop import LoopState
    from chatpipe.train.optim import init_lrs

    iterated = load_section(RLSettings, ["--reward.source=model", "--reward.model_lr_frac=0.5"])
    frozen = load_section(RLSettings, ["--reward.source=model"])
    state = LoopState(step=0, total_steps=1)
    with caplog.at_level(logging.WARNING, logger="rl"):
        assert reward_model_optimizers(iterated, trained_head(tiny_gpt()), init_lrs({}))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "iterated RLHF uses the verifier" in warning and "rl.reward.model_lr_frac = 0.5" in warning
    assert "not verifier-free" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl"):
        assert reward_model_optimizers(frozen, trained_head(tiny_gpt()), init_lrs({})) == []
    assert not caplog.records
    assert summary(state, cfg=iterated)["reward_carries_verifier"] == 1.0
    assert summary(state, cfg=frozen)["reward_carries_verifier"] == 0.0
    assert summary(state, cfg=load_section(RLSettings, ["--reward.source=both"]))["reward_carries_verifier"] == 1.0
    assert "reward_carries_verifier" not in summary(state, cfg=load_section(RLSettings))


def test_a_row_is_scored_at_its_last_token_whatever_the_padding():
    rm = trained_head(tiny_gpt())
    rows = [[1, 5, 6, 7], [1, 8, 9, 10, 11, 12, 13]]
    ids, last = pad_rows(rows, pad_id=0)
    assert last.tolist() == [3, 6]
    batch = rm(ids, last)
    alone = rm(torch.tensor([rows[0]]), torch.tensor([3]))
    assert batch[0].item() == pytest.approx(alone.item(), abs=1e-5)
    assert batch[0].item() == pytest.approx(rm.token_scores(ids)[0, 3].item(), abs=1e-6)


def test_a_shared_chosen_reply_is_scored_once_to_the_same_scores():
    rows = [[1, 5, 6], [1, 7], [1, 5, 6], [1, 8, 9, 10]]
    distinct, where = unique_rows(rows)
    assert distinct == [[1, 5, 6], [1, 7], [1, 8, 9, 10]] and where.tolist() == [0, 1, 0, 2]
    rm = trained_head(tiny_gpt())
    once = rm(*pad_rows(distinct, pad_id=0))[where]
    each = rm(*pad_rows(rows, pad_id=0))
    assert torch.allclose(once, each, atol=1e-5)


def test_pairs_sharing_a_chosen_reply_stay_together_and_an_epoch_trains_each_pair_once():
    from chatpipe.data.preferences import Pair
    from stages.reward_model import batch_indices, pair_groups

    made = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0), (3, 1)]  # (problem, contrast)
    pairs = [Pair([7, g], [7, g, k], "t") for g, k in made]
    groups = pair_groups(pairs)
    assert groups == [[0, 1, 2], [3, 4, 5], [6], [7, 8]]
    for epoch in range(2):
        order = [i for s in range(3) for i in batch_indices(groups, 3 * epoch + s, 3, 0, 1, seed=5)]
        assert sorted(order) == list(range(9))
        for g in groups:  # a group's pairs are consecutive
            first = order.index(g[0])
            assert order[first : first + len(g)] == g
    # two ranks take disjoint consecutive slices of the same order
    one = batch_indices(groups, 0, 4, 0, 1, seed=5)
    assert batch_indices(groups, 0, 2, 0, 2, seed=5) + batch_indices(groups, 0, 2, 1, 2, seed=5) == one
    with pytest.raises(ValueError, match="10 pairs per step .* only 9 train pairs"):
        batch_indices(groups, 0, 10, 0, 1, seed=5)


def test_tiny_pairs_sample_only_the_first_problems_and_fit_the_context(project, monkeypatch):
    """Every problem gets contrasts, only the first ``n_sampled`` (train: ``tiny_sample_prompts``) are
    sampled, and no pair is longer than ``max_seq_len`` (with or without samples)."""
    from chatpipe.data import preferences as prefs
    from chatpipe.settings import RewardModelSettings, load_section
    from chatpipe.tokenizer import Tokenizer
    from stages import reward_model as stage

    tok, (policy, _) = Tokenizer.load(project / "artifacts" / "tokenizer"), load_model(project / "artifacts" / "sft")
    ranked, real = [], prefs.ranked_pairs
    monkeypatch.setattr(prefs, "ranked_pairs", lambda *a: ranked.append(a[3]) or real(*a))
    flags = ["--tiny_samples=2", "--tiny_max_new_tokens=4", "--max_seq_len=128"]
    cfg = load_section(RewardModelSettings, flags)
    got = prefs.tiny_split(cfg, tok, stage.sampler(cfg, tok, policy), "train", 6, 2)
    assert ranked == ["tinyworld_arith/train problem 0", "tinyworld_arith/train problem 1"]
    assert {int(p.where.split(":")[1].split()[0]) for p, k in got if k.startswith("contrast")} == set(range(6))
    ranked.clear()
    lengths = sorted(max(len(p.chosen), len(p.rejected)) for p, _ in got)
    limit = lengths[len(lengths) // 2]  # about half the pairs are longer
    cfg = load_section(RewardModelSettings, ["--tiny_samples=0", f"--max_seq_len={limit}"])
    short = prefs.tiny_split(cfg, tok, stage.sampler(cfg, tok, policy), "train", 6, 2)
    assert ranked == [] and 0 < len(short) < len(got)
    assert all(max(len(p.chosen), len(p.rejected)) <= limit for p, _ in short)


def test_rollout_rows_are_read_at_their_last_sampled_token():
    # ids = [bos, p, a1, a2, pad]: targets = ids[1:], the mask marks a1 and a2 (targets 1 and 2) -> ids index 3
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert last_action_index(mask).tolist() == [3, 2]
    rm = trained_head(tiny_gpt())
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 5, 0, 0]])
    got = rollout_scores(rm, ids[:, :-1], ids[:, 1:], mask)
    want = rm.token_scores(ids)
    assert got.tolist() == pytest.approx([want[0, 3].item(), want[1, 2].item()], abs=1e-6)


def test_critic_from_reward_model_starts_at_its_scores():
    rm = trained_head(tiny_gpt())
    critic = ValueModel.from_reward_model(rm)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert torch.allclose(critic(ids), rm.token_scores(ids))
    assert critic.trunk is not rm.trunk and critic.head.weight.requires_grad


def test_combine_rewards():
    v, m = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -2.0])
    assert combine_rewards("verifier", v, m).tolist() == [1.0, 0.0]
    assert combine_rewards("model", v, m).tolist() == [0.5, -2.0]
    assert combine_rewards("both", v, m).tolist() == [1.5, -2.0]
    with pytest.raises(ValueError, match="allowed: verifier, model, both"):
        combine_rewards("rm", v, m)


def test_group_win_rates_by_hand():
    # group 0: scores 1, 0, 0.5 at scale 2 -> each row's mean sigmoid(2 (s_i - s_j)) over its two rivals
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 3.0, 3.0, 7.0]), torch.tensor([0, 0, 0, 1, 1, 2])
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [(sig(2) + sig(1)) / 2, (sig(-2) + sig(-1)) / 2, (sig(-1) + sig(1)) / 2, 0.5, 0.5, 0.5]
    got = group_win_rates(scores, groups, scale=2.0)
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    # a prompt's offset is dropped: shifting one group's scores changes nothing
    assert torch.equal(group_win_rates(scores + torch.tensor([5.0, 5, 5, 0, 0, 0]), groups, 2.0), got)


def test_under_win_rate_the_policy_trains_on_each_replys_win_rate_in_its_group():
    """score_rollouts with ``reward_model_scores: win_rate``: the scores that train are the Bradley-Terry
    win rates of the model's raw scores within each group (its normalised scores times score_std); the
    verifier's mean and the model's normalised mean are still what the step logs."""
    from types import SimpleNamespace

    from chatpipe import runtime
    from chatpipe.rl import scoring as rl
    from chatpipe.rl.rollout import Rollouts
    from chatpipe.settings import RLSettings, load_section

    rm = trained_head(tiny_gpt())
    rm.score_mean, rm.score_std = 0.3, 2.5
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (4, 7))
    mask = torch.tensor([[0.0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    verifier = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1])
    batch = Rollouts(
        ids[:, :-1], ids[:, 1:], mask, verifier, torch.ones(4, dtype=torch.bool), mask.sum(1).long(), groups
    )
    rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    cfg = load_section(RLSettings, ["--reward.source=model", "--reward.model_scores=win_rate", "--device_batch_size=4"])
    models = SimpleNamespace(reward_model=rm, reward_model_opts=[], ensemble=[])
    parts = SimpleNamespace(cfg=cfg, rt=rt, guard=None, models=models)
    scored, stats = rl.score_rollouts(parts, batch)
    with torch.no_grad():
        normalised = rollout_scores(rm, batch.inputs, batch.targets, batch.mask)
    assert torch.allclose(scored.scores, group_win_rates(normalised, groups, scale=2.5))
    assert torch.allclose(scored.scores[:2].sum(), torch.tensor(1.0)) and not torch.equal(scored.scores, normalised)
    assert stats["reward/verifier_mean"] == 0.5 and stats["reward/model_mean"] == pytest.approx(
        normalised.mean().item()
    )


def test_filter_solved_fires_under_win_rate_on_the_normalised_scores():
    """Under the default ``reward_model_scores: win_rate`` a group's win rates average 0.5, so the
    check before (``scores >= solved_score``, 1.0) could never call a reply solved. A reply now counts as
    solved when its normalised reward-model score reaches ``solved_score``: a model that scores every
    reply of the batch 2 std above its reference mean solves every group; one that scores them all
    below solves none."""
    from types import SimpleNamespace

    from chatpipe import runtime
    from chatpipe.rl import losses
    from chatpipe.rl import scoring as rl
    from chatpipe.rl.rollout import Rollouts
    from chatpipe.rl.step import solved_threshold
    from chatpipe.settings import RLSettings, load_section

    torch.manual_seed(1)
    ids = torch.randint(1, 64, (4, 7))
    mask = torch.tensor([[0.0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    groups = torch.tensor([0, 0, 1, 1])
    batch = Rollouts(
        ids[:, :-1], ids[:, 1:], mask, torch.zeros(4), torch.ones(4, dtype=torch.bool), mask.sum(1).long(), groups
    )
    batch.correct = torch.zeros(4, dtype=torch.bool)  # the verifier's verdict, which a model-scored run ignores
    rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    cfg = load_section(RLSettings, ["--reward.source=model", "--filter_solved=1.0", "--device_batch_size=4"])
    assert cfg.reward.model_scores == "win_rate" and cfg.solved_score == 1.0  # the defaults
    rm = trained_head(tiny_gpt())
    with torch.no_grad():
        raw = rollout_scores(rm, batch.inputs, batch.targets, batch.mask)
    rates = {}
    # every reply at least 2 std above the reference mean, then at least 2 below
    for where, mean in (("above", raw.min().item() - 2.0), ("below", raw.max().item() + 2.0)):
        rm.score_mean, rm.score_std = mean, 1.0
        spec = SimpleNamespace(reward_model=rm, reward_model_opts=[], ensemble=[])
        scored, _ = rl.score_rollouts(SimpleNamespace(cfg=cfg, rt=rt, guard=None, models=spec), batch)
        assert not (scored.scores >= cfg.solved_score).any()  # win rates: what the old check compared
        rates[where] = losses.group_solve_rates(scored.solved(solved_threshold(cfg)), groups)
        assert scored.select(torch.tensor([1, 2])).model_scores.tolist() == scored.model_scores[1:3].tolist()
    assert rates["above"] == {0: 1.0, 1: 1.0} and rates["below"] == {0: 0.0, 1: 0.0}
    verifier_run = load_section(RLSettings, ["--filter_solved=1.0"])
    assert torch.equal(batch.solved(solved_threshold(verifier_run)), batch.correct)  # the verdict decides


def test_an_ensemble_trains_on_the_mean_of_its_models_win_rates():
    """score_rollouts with ``reward_model_ensemble``: each row's reward is the mean over the models of
    its win rate in its group (each at its own score_std); the step logs the mean normalised score.
    A model beside a copy of itself gives the model's own rewards, bit for bit."""
    import copy
    from types import SimpleNamespace

    from chatpipe import runtime
    from chatpipe.rl import scoring as rl
    from chatpipe.rl.rewards import ensemble_rewards
    from chatpipe.rl.rollout import Rollouts
    from chatpipe.settings import RLSettings, load_section

    first, second = trained_head(tiny_gpt()), trained_head(tiny_gpt(seed=3))
    first.score_std, second.score_std = 2.5, 0.5
    torch.manual_seed(1)
    ids = torch.randint(1, 64, (4, 7))
    mask = torch.tensor([[0.0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    groups = torch.tensor([0, 0, 1, 1])
    batch = Rollouts(
        ids[:, :-1],
        ids[:, 1:],
        mask,
        torch.tensor([1.0, 0, 0, 1]),
        torch.ones(4, dtype=torch.bool),
        mask.sum(1).long(),
        groups,
    )
    rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    cfg = load_section(RLSettings, ["--reward.source=model", "--device_batch_size=4"])

    def score(*models):
        spec = SimpleNamespace(reward_model=models[0], reward_model_opts=[], ensemble=list(models[1:]))
        return rl.score_rollouts(SimpleNamespace(cfg=cfg, rt=rt, guard=None, models=spec), batch)

    with torch.no_grad():
        a, b = (rollout_scores(m, batch.inputs, batch.targets, batch.mask) for m in (first, second))
    scored, stats = score(first, second)
    want = (group_win_rates(a, groups, scale=2.5) + group_win_rates(b, groups, scale=0.5)) / 2
    assert torch.allclose(scored.scores, want) and not torch.allclose(scored.scores, group_win_rates(a, groups, 2.5))
    assert stats["reward/model_mean"] == pytest.approx(((a + b) / 2).mean().item())
    assert torch.equal(score(first, copy.deepcopy(first))[0].scores, score(first)[0].scores)
    assert torch.equal(ensemble_rewards([a, b], [1.0, 1.0], groups, win_rate=False), torch.stack([a, b]).mean(0))
    cfg = load_section(
        RLSettings, ["--reward.source=model", "--reward.model_scores=normalized", "--device_batch_size=4"]
    )
    assert torch.allclose(score(first, second)[0].scores, (a + b) / 2)  # the mean normalised score trains


def test_an_ensemble_needs_reward_source_model_and_no_refresh(monkeypatch):
    from chatpipe.settings import ParamsError, RLSettings, load_section

    monkeypatch.setenv("CHATPIPE_RL__REWARD__MODEL_ENSEMBLE", '["x"]')  # a list setting comes from the environment
    with pytest.raises(ParamsError, match=r"reward.model_ensemble = \['x'\] is read only with reward.source: model"):
        load_section(RLSettings, [])
    with pytest.raises(ParamsError, match="reward.model_lr_frac refreshes one reward model, not an ensemble"):
        load_section(RLSettings, ["--reward.source=model", "--reward.model_lr_frac=0.1"])
    assert load_section(RLSettings, ["--reward.source=both"]).reward.model_ensemble == ["x"]


# --------------------------------------------------------------------------- the stage, in this process


@pytest.fixture
def project(params_file, tmp_path, monkeypatch) -> Path:
    """A project dir with a tokenizer and a random sft model, MLflow off, small reward_model settings."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CHATPIPE_TRACKING__ENABLED", "false")
    make_artifacts(tmp_path / "artifacts", sequence_len=128)
    return tmp_path


def write_prefs(path: Path, n: int, start: int = 0) -> Path:
    """Learnable pairs: the chosen reply says yes, the rejected one no."""
    rows = [
        {"prompt": f"Question {i}?", "chosen": f"Yes, {i}.", "rejected": f"No, {i}."} for i in range(start, start + n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


STAGE_ARGS = [
    "--source=local",
    "--path=prefs.jsonl",
    "--val_path=val.jsonl",
    "--max_seq_len=128",
    "--device_batch_size=8",
]
STAGE_ARGS += [
    "--eval_every=0",
    "--checkpoint_every=3",
    "--lr_frac=1.0",
    "--head_lr=0.05",
    "--device=cpu",
    "--dtype=float32",
]


@pytest.mark.slow
def test_stage_trains_held_out_accuracy_and_resumes_to_the_same_weights(project):
    from stages import reward_model as stage

    write_prefs(project / "prefs.jsonl", 48)
    write_prefs(project / "val.jsonl", 16, start=1000)  # prompts never trained on
    stage.main([*STAGE_ARGS, "--max_steps=6"])
    out = project / "artifacts" / "reward_model"
    meta = json.loads((out / "meta.json").read_text())
    assert meta["summary"]["val_pair_accuracy"] == 1.0 and meta["summary"]["val_pairs"] == 16
    assert meta["summary"]["val_margin/q05"] > 0
    rm, _ = load_reward_model(out)
    full = {k: v.clone() for k, v in rm.state_dict().items()}
    # the checkpoint carries the shared loop's state (LoopState.meta), read back on resume
    step3 = json.loads((project / "checkpoints" / "reward_model" / "step_000003" / "meta.json").read_text())
    assert step3["total_steps"] == 6 and step3["step"] == 3 and step3["kind"] == "reward_model"
    assert step3["carried"]["train_seconds"] > 0 and step3["carried"]["first_evals"] == {}  # eval_every 0: none yet
    # eval_every 0: the one held-out eval is the final one, so it is also the first on record; these pairs
    # are separable (the chosen reply says yes, the rejected one no), so every held-out one ranks right,
    # where chance ranks half and the zero-initialised head ties them all (none right)
    assert meta["carried"]["first_evals"]["val/pair_accuracy"] == meta["summary"]["val_pair_accuracy"] == 1.0

    # lose the final checkpoint and the output: the rerun resumes from step 3 and ends on the same weights
    shutil.rmtree(project / "checkpoints" / "reward_model" / "step_000006")
    shutil.rmtree(out)
    stage.main([*STAGE_ARGS, "--max_steps=6"])
    resumed, meta2 = load_reward_model(out)
    assert meta2["summary"]["val_pair_accuracy"] == 1.0
    for k, v in resumed.state_dict().items():
        assert torch.equal(v, full[k]), k
    with pytest.raises(ValueError, match="not a reward model"):
        load_reward_model(project / "artifacts" / "sft")


@pytest.mark.slow
def test_stage_logs_loss_and_gradient_norm_to_mlflow_every_step(project, monkeypatch):
    """The shared loop's per-step metrics reach the reward model's MLflow run, as for every training stage."""
    from chatpipe.testing.project import mlflow_client
    from stages import reward_model as stage

    monkeypatch.setenv("CHATPIPE_TRACKING__ENABLED", "true")
    write_prefs(project / "prefs.jsonl", 16)
    write_prefs(project / "val.jsonl", 4, start=100)
    stage.main([*STAGE_ARGS, "--max_steps=3", "--eval_every=2"])
    client = mlflow_client(project)
    exp = client.get_experiment_by_name("chatpipe")
    (run,) = client.search_runs([exp.experiment_id], "tags.stage = 'reward_model'")
    for name in ("train/loss", "train/grad_norm", "train/pair_accuracy", "lr_mult"):
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted(m.step for m in history) == [1, 2, 3], name
    assert all(0 < m.value < math.inf for m in client.get_metric_history(run.info.run_id, "train/grad_norm"))
    held_out = client.get_metric_history(run.info.run_id, "val/pair_accuracy")
    assert sorted(m.step for m in held_out) == [2, 3]  # eval_every 2 (not step 0: a zero head ties), and the last


@pytest.mark.slow
def test_two_ranks_resume_to_the_same_weights(project):
    """2 gloo workers through the shared loop: a run resumed from its middle checkpoint ends with the
    uninterrupted run's weights."""
    import subprocess
    import sys

    write_prefs(project / "prefs.jsonl", 32)
    write_prefs(project / "val.jsonl", 8, start=1000)
    args = [a for a in STAGE_ARGS if not a.startswith(("--device_batch_size", "--checkpoint_every"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    cmd += ["stages.reward_model", *args, "--device_batch_size=4", "--checkpoint_every=2", "--max_steps=4"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def launch() -> str:
        proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout + proc.stderr

    launch()
    out = project / "artifacts" / "reward_model"
    whole, meta = load_reward_model(out)
    assert meta["world_size"] == 2 and meta["step"] == 4
    shutil.rmtree(project / "checkpoints" / "reward_model" / "step_000004")
    shutil.rmtree(out)
    assert "resuming from checkpoints/reward_model/step_000002" in launch()
    resumed, _ = load_reward_model(out)
    wanted = whole.state_dict()
    assert [k for k, v in resumed.state_dict().items() if not torch.equal(v, wanted[k])] == []


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "Q", "chosen": "A"}', "missing field 'rejected'"),
        ('{"prompt": "Q", "chosen": "", "rejected": "B"}', "'chosen' is empty"),
    ],
)
def test_stage_bad_pair_fails_before_training_naming_file_and_line(project, line, message):
    from stages import reward_model as stage

    path = write_prefs(project / "prefs.jsonl", 5)
    path.write_text(path.read_text() + line + "\n")
    write_prefs(project / "val.jsonl", 4)
    with pytest.raises(ValueError, match=message) as err:
        stage.main([*STAGE_ARGS, "--max_steps=2"])
    assert str(err.value).startswith("prefs.jsonl:6: ")
    assert not (project / "checkpoints").exists() and not (project / "artifacts" / "reward_model").exists()


def test_stage_pair_longer_than_the_context_fails_naming_file_and_line(project):
    from stages import reward_model as stage

    path = write_prefs(project / "prefs.jsonl", 3)
    path.write_text(path.read_text() + json.dumps({"prompt": "Q", "chosen": "yes " * 200, "rejected": "no"}) + "\n")
    write_prefs(project / "val.jsonl", 4)
    with pytest.raises(ValueError, match=r"^prefs.jsonl:4: 'chosen' is \d+ tokens, longer than the context of 128"):
        stage.main([*STAGE_ARGS, "--max_steps=2"])
    assert not (project / "checkpoints").exists()


@pytest.mark.slow
def test_rl_on_reward_model_scores_with_role_dirs(project, monkeypatch):
    """PPO scored by the reward model: the critic starts from it, the reference from ref_dir, and the
    checkpoint inputs hold each role's hash."""
    from chatpipe import runtime
    from chatpipe.rl.roles import load_models
    from chatpipe.settings import RLSettings, load_section
    from stages import reward_model as rm_stage
    from stages import rl

    write_prefs(project / "prefs.jsonl", 16)
    write_prefs(project / "val.jsonl", 4, start=100)
    rm_stage.main([*STAGE_ARGS, "--max_steps=2"])
    make_artifacts(project / "other", seed=1, sequence_len=128)  # another model for the reference role
    monkeypatch.setenv("CHATPIPE_RL__REPLAY", "[]")
    args = ["--algorithm=ppo", "--reward.source=model", "--ref_dir=other/sft", "--max_steps=1", "--prompts_per_step=2"]
    args += ["--group_size=2", "--max_new_tokens=6", "--eval_problems=2", "--eval_samples=1", "--num_train_problems=4"]
    args += ["--device_batch_size=4", "--device=cpu", "--dtype=float32"]

    models = load_models(load_section(RLSettings, args), runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32))
    rm, _ = load_reward_model(project / "artifacts" / "reward_model")
    # torchtune's critic init, on the scale of the normalised scores RL trains on
    assert torch.equal(models.critic.head.weight, rm.head.weight / rm.score_std) and rm.score_std != 1.0
    assert torch.equal(models.reward_model.head.weight, rm.head.weight)
    ref, _ = load_model(project / "other" / "sft")
    assert all(torch.equal(a, b) for a, b in zip(models.ref.state_dict().values(), ref.state_dict().values()))
    default = load_models(
        load_section(RLSettings, args[:1]), runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    )
    assert default.reward_model is None and not default.critic.head.weight.any()  # today's: zero head, policy copy

    rl.main(args)
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    assert set(meta["inputs"]) >= {"ref", "reward_model"}
    assert meta["settings"]["reward"]["source"] == "model"


def test_report_card_shows_held_out_pair_accuracy_and_margins():
    from chatpipe.report import reward_model_section

    summary = {"val_pair_accuracy": 0.95, "val_pairs": 200, "train_pairs": 900, "val_margin/mean": 4.2}
    summary |= {"val_margin/q05": -0.5, "val_margin/q50": 4.0, "val_pair_accuracy_sampled": 0.9}
    text = "\n".join(reward_model_section({"summary": summary, "settings": {"source": "tiny"}, "step": 60}))
    assert "| pair accuracy | 0.950 [0.91, 0.97] n=200 |" in text
    assert "| margin q05 | -0.500 |" in text and "| margin q50 | 4.000 |" in text
    assert "| pair accuracy, sampled pairs | 0.900 |" in text
    assert reward_model_section({"summary": {}}) == []


def test_role_dirs_load_their_own_checkpoints_and_a_mismatch_names_the_key(project, monkeypatch):
    from chatpipe import runtime
    from chatpipe.rl import roles as rl
    from chatpipe.settings import RLSettings, load_section

    rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    make_artifacts(project / "other", seed=1, sequence_len=128)
    models = rl.load_models(load_section(RLSettings, ["--algorithm=ppo", "--ppo.critic_init_dir=other/sft"]), rt)
    other, _ = load_model(project / "other" / "sft")
    assert torch.equal(models.critic.trunk.wte.weight, other.wte.weight)  # trunk from critic_init_dir
    assert not models.critic.head.weight.any()  # a GPT dir: zero head
    assert not torch.equal(models.policy.wte.weight, other.wte.weight)
    make_artifacts(project / "short", seed=1, sequence_len=64)
    with pytest.raises(ValueError, match=r"rl.ref_dir = short/sft: vocab_size 512 / sequence_len 64 differ"):
        rl.load_models(load_section(RLSettings, ["--ref_dir=short/sft"]), rt)
    with pytest.raises(FileNotFoundError, match="reward_model"):  # reward_source model needs the stage's output
        rl.load_models(load_section(RLSettings, ["--reward.source=model"]), rt)


def train_reward_model(project: Path, *flags: str) -> Path:
    """A 2-step reward model on the yes/no pairs, in ``project``'s artifacts."""
    from stages import reward_model as rm_stage

    write_prefs(project / "prefs.jsonl", 16)
    write_prefs(project / "val.jsonl", 4, start=100)
    rm_stage.main([*STAGE_ARGS, "--max_steps=2", *flags])
    return project / "artifacts" / "reward_model"


def test_a_reward_model_of_another_tokenizer_or_a_shorter_context_is_refused_before_any_rollout(project, monkeypatch):
    """Both checks run in load_models, before a rollout: the error names the reward model's dir and
    the policy's, and the two tokenizers' hashes or the two contexts."""
    from chatpipe import runtime
    from chatpipe.rl import roles as rl
    from chatpipe.settings import RLSettings, load_section

    rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    args = ["--algorithm=ppo", "--reward.source=model"]
    short = train_reward_model(project, "--max_seq_len=64")  # the policy's context is 128
    with pytest.raises(ValueError, match=r"reward.model_dir = artifacts/reward_model: the reward model's context is "
                       r"64 tokens .* policy's \(rl.init_dir = artifacts/sft\) is 128"):  # fmt: skip
        rl.load_models(load_section(RLSettings, args), rt)
    shutil.rmtree(short)
    shutil.rmtree(project / "checkpoints")
    # another project with another tokenizer trains a reward model; this project's RL is handed it
    other = project / "other"
    other.mkdir()
    make_artifacts(other / "artifacts", seed=1, sequence_len=128)
    monkeypatch.chdir(other)
    train_reward_model(other)
    monkeypatch.chdir(project)
    with pytest.raises(ValueError, match=r"reward.model_dir = other/artifacts/reward_model: .* another tokenizer "
                       r"\(sha256 \w{12}\.\.\.\) than the policy's artifacts/tokenizer/tokenizer.json"):  # fmt: skip
        rl.load_models(load_section(RLSettings, [*args, "--reward.model_dir=other/artifacts/reward_model"]), rt)
    models = rl.load_models(load_section(RLSettings, args[:1]), rt)  # verifier runs read no reward model
    assert models.reward_model is None
    # every model of an ensemble is checked the same way, and the error names its place in the list
    good = train_reward_model(project)
    monkeypatch.setenv("CHATPIPE_RL__REWARD__MODEL_ENSEMBLE", '["other/artifacts/reward_model"]')
    with pytest.raises(ValueError, match=r"rl.reward.model_ensemble\[0\] = other/artifacts/reward_model: .* another "):
        rl.load_models(load_section(RLSettings, args), rt)
    shutil.copytree(good, project / "second")
    monkeypatch.setenv("CHATPIPE_RL__REWARD__MODEL_ENSEMBLE", '["second"]')
    cfg = load_section(RLSettings, args)
    models = rl.load_models(cfg, rt)
    assert len(models.ensemble) == 1 and not any(p.requires_grad for p in models.ensemble[0].parameters())
    assert rl.role_inputs(cfg)["reward_model_ensemble_0"] == rl.role_inputs(cfg)["reward_model"]  # a resume checks it


def test_scores_are_normalised_by_the_stages_score_norm(project):
    """The stage saves the mean and std of its scores; load applies them, so RL reads scores of mean 0."""
    from chatpipe.rl.reward_model import score_norm

    out = train_reward_model(project)
    meta = json.loads((out / "meta.json").read_text())
    norm = meta["score_norm"]
    assert norm["rows"] == 32 and norm["std"] > 0  # every distinct train reply (no samples in a JSONL source)
    rm, _ = load_reward_model(out)
    assert (rm.score_mean, rm.score_std) == (norm["mean"], norm["std"])
    raw = torch.tensor([norm["mean"], norm["mean"] + 2 * norm["std"]])
    assert rm.normalized(raw).tolist() == pytest.approx([0.0, 2.0])
    assert score_norm(torch.tensor([1.0, 3.0])) == {"mean": 2.0, "std": pytest.approx(2**0.5), "rows": 2}


def test_the_margin_keeps_pushing_pairs_already_ranked_right():
    chosen, rejected = torch.tensor([2.0]), torch.tensor([0.0])
    assert bradley_terry_loss(chosen, rejected, margin=2.0).item() == pytest.approx(math.log(2))
    assert bradley_terry_loss(chosen, rejected, margin=1.0).item() == pytest.approx(math.log1p(math.exp(-1)))


def test_mean_pooling_averages_the_reply_after_the_last_response_start():
    """pool "mean": the mean of the head over the tokens after the row's last start token, up to its
    last real token; padding and the prompt do not count."""
    model = tiny_gpt()
    rm = RewardModel.from_policy(model, pool="mean", response_start=9)
    with torch.no_grad():
        rm.head.weight.normal_()
    rows = [[1, 9, 5, 9, 6, 7], [1, 2, 9, 8]]  # row 0: reply 6, 7 (after the second 9); row 1: reply 8
    ids, last = pad_rows(rows, pad_id=0)
    per_token = rm.token_scores(ids)
    got = rm(ids, last)
    assert got[0].item() == pytest.approx(per_token[0, 4:6].mean().item(), abs=1e-6)
    assert got[1].item() == pytest.approx(per_token[1, 3].item(), abs=1e-6)
    with pytest.raises(ValueError, match="'mean' needs the response_start token id"):
        RewardModel(tiny_gpt(), pool="mean")


def test_report_card_states_rl_beside_the_replay_only_control_and_the_guard():
    from chatpipe.report import rl_section

    meta = {
        "inputs": {"init": "abc"},
        "settings": {"eval_problems": 256, "eval_samples": 2, "algorithm": "ppo", "reward": {"source": "model"}},
        "summary": {"first_eval/pass_at_1": 0.80, "final_eval/pass_at_1": 0.90, "steps": 80, "guard_trips": 1.0},
    }
    meta["summary"] |= {"guard_first_model_mean": 0.1, "guard_last_model_mean": 0.4, "guard_last_verifier_mean": 0.6}
    controls = {"init": "abc", "arms": {"replay_only": {"mean_change": 0.06, "runs": 3}}}
    text = "\n".join(rl_section(meta, controls))
    assert "| replay-only control on `val` (mean of 3 seeds) | +0.060 |" in text
    assert "| RL over the control on `val` | +0.040 |" in text
    assert "chat replay off" in text and "**tripped 1 times**" in text and "0.100 -> 0.400" in text
    other = "\n".join(rl_section(meta, {**controls, "init": "another sft model"}))
    assert "not measured on this SFT model" in other and "RL over the control" not in other


@pytest.mark.slow
def test_a_reward_model_preferring_shorter_answers_trips_the_guard_in_its_first_window(project, monkeypatch, capfd):
    """The stage, end to end: a reward model trained on the policy's own replies to prefer the shorter
    ones, and a verifier that prefers longer ones (over the median length of those replies). RL on
    the model's scores checks every two steps: with ``guard.mode: stop`` the run stops at the end of the first window, naming
    the reward model's accuracy and the setting; with ``guard.mode: warn`` it logs that and finishes, and
    the summary counts the trips."""
    from chatpipe.inference.engine import Engine
    from chatpipe.rl import rewards
    from chatpipe.rl.guard import RewardHacking
    from chatpipe.rl.rollout import collect_rollouts, load_problems
    from chatpipe.tokenizer import Tokenizer
    from stages import reward_model as rm_stage
    from stages import rl

    # the policy's own replies, the shorter of each two chosen: a reward model that prefers shorter answers
    policy, _ = load_model(project / "artifacts" / "sft")
    engine = Engine(policy.eval(), Tokenizer.load(project / "artifacts" / "tokenizer"))
    problems = load_problems("tinyworld_arith", "train", 240)
    sampled = collect_rollouts(engine, problems, group_size=4, max_new_tokens=8, seed=1)
    lengths = sorted(len(text) for text in sampled.completions)
    median = lengths[len(lengths) // 2]
    for name, part in (("prefs.jsonl", range(200)), ("val.jsonl", range(200, 240))):
        rows = []
        for i in part:
            texts = sorted(sampled.completions[4 * i : 4 * i + 4], key=len)
            prompt = problems[i].conversation["messages"][0]["content"]
            rows += [
                {"prompt": prompt, "chosen": a, "rejected": b}
                for a, b in zip(texts[:2], texts[2:])
                if 0 < len(a) < len(b)
            ]
        (project / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    rm_stage.main([*STAGE_ARGS, "--max_steps=100", "--eval_every=100"])
    monkeypatch.setitem(rewards.REWARDS, "longer_reply", lambda text, gold: float(len(text) > median))
    monkeypatch.setenv("CHATPIPE_RL__REPLAY", "[]")
    args = [
        "--algorithm=grpo",
        "--reward.source=model",
        "--reward.verifier=longer_reply",
        "--max_steps=4",
        "--guard.every=2",
    ]
    args += ["--guard.min_accuracy=0.5", "--prompts_per_step=4", "--group_size=4", "--max_new_tokens=8"]
    args += ["--eval_problems=2", "--eval_samples=1", "--num_train_problems=16", "--device_batch_size=8"]
    args += ["--device=cpu", "--dtype=float32"]

    with pytest.raises(RewardHacking, match=r"guard at step 2: the reward model ranks 0\.\d+ of the window's "
                       r"verifier-ranked pairs right, below rl.guard.min_accuracy = 0.5 \(rl.guard.mode: stop"):  # fmt: skip
        rl.main([*args, "--guard.mode=stop"])
    assert not (project / "artifacts" / "rl").exists()  # stopped: no model written
    shutil.rmtree(project / "checkpoints" / "rl", ignore_errors=True)  # the warn run starts afresh too

    capfd.readouterr()
    rl.main([*args, "--guard.mode=warn"])
    log = capfd.readouterr().out  # the stage logs to stdout
    summary = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())["summary"]
    assert summary["guard_trips"] >= 1 and summary["guard_first_accuracy"] < 0.5 and summary["steps"] == 4
    assert "reward-hacking guard at step 2" in log and "rl.guard.mode: warn, going on" in log


@pytest.mark.slow
def test_iterated_rlhf_trains_the_reward_model_and_a_resume_restores_it(project, monkeypatch):
    """reward_model_lr_frac > 0: the reward model takes a step on each step's verifier-ranked replies;
    the checkpoints hold it and its optimizer, so a run resumed from one ends with the same policy."""
    from chatpipe.io import sha256_file
    from chatpipe.rl import rewards
    from stages import rl

    train_reward_model(project)
    before, _ = load_reward_model(project / "artifacts" / "reward_model")
    # a verifier that passes about half of any model's replies, so every group has pairs to rank
    monkeypatch.setitem(rewards.REWARDS, "even_length", lambda text, gold: float(len(text) % 2 == 0))
    monkeypatch.setenv("CHATPIPE_RL__REPLAY", "[]")
    args = ["--algorithm=ppo", "--reward.source=model", "--reward.verifier=even_length", "--reward.model_lr_frac=0.5"]
    args += ["--max_steps=3", "--checkpoint_every=1", "--prompts_per_step=2", "--group_size=4", "--max_new_tokens=8"]
    args += ["--eval_problems=2", "--eval_samples=1", "--num_train_problems=8", "--device_batch_size=8"]
    args += ["--device=cpu", "--dtype=float32"]
    rl.main(args)
    out = project / "artifacts" / "rl"
    want = sha256_file(out / "model.pt")
    checkpoints = sorted((project / "checkpoints" / "rl").glob("step_*"))
    state = torch.load(checkpoints[-1] / "model.pt", weights_only=True)
    trained = {k.removeprefix("reward_model."): v for k, v in state.items() if k.startswith("reward_model.")}
    assert trained and not torch.equal(trained["head.weight"], before.head.weight)  # it learned

    shutil.rmtree(out)
    shutil.rmtree(checkpoints[-1])  # resume from the step before the last
    rl.main(args)
    assert sha256_file(out / "model.pt") == want


@pytest.mark.parametrize(
    ("origins", "expect"),
    [
        # the float32 SFT model of a 2-core Intel kind made 627 sampled pairs on 600 held-out problems,
        # more than val_pairs, so no contrast joined: the one origin PPO needs ranked must still be reported
        (["sampled"] * 4, {"pair_accuracy_sampled": 0.75, "pairs_sampled": 4}),
        (
            ["sampled", "sampled", "contrast_miscopied", "contrast_miscopied"],
            {
                "pair_accuracy_sampled": 1.0,
                "pairs_sampled": 2,
                "pair_accuracy_contrast_miscopied": 0.5,
                "pairs_contrast_miscopied": 2,
            },
        ),
        (["file"] * 4, {}),  # a user's file names no origins: the overall accuracy says it all
    ],
)
def test_held_out_reports_the_accuracy_of_every_named_origin_of_pair(origins, expect, monkeypatch):
    import contextlib
    from types import SimpleNamespace

    from chatpipe.data.preferences import Pair, PairSet
    from stages import reward_model as stage

    val = [Pair([1, 2, 10 + i], [1, 2, 20 + i], f"pair {i}") for i in range(4)]
    scores = {10: 1.0, 20: 0.0, 11: 1.0, 21: 0.0, 12: 1.0, 22: 0.0, 13: 0.0, 23: 1.0}  # the last pair misranked
    monkeypatch.setattr(stage, "score_rows", lambda rm, rows, pad: torch.tensor([scores[r[-1]] for r in rows]))
    rm = SimpleNamespace(eval=lambda: None, train=lambda: None)
    rt = SimpleNamespace(autocast=contextlib.nullcontext)
    parts = SimpleNamespace(rm=rm, rt=rt, pad_id=0, pairs=PairSet([], val, origins))
    got = stage.held_out(parts)
    assert got["val/pair_accuracy"] == 0.75
    by_origin = {
        k.removeprefix("val/"): v for k, v in got.items() if k.startswith(("val/pair_accuracy_", "val/pairs_"))
    }
    assert by_origin == expect


LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \[rank0\] ")


@pytest.mark.slow
def test_the_tiny_stage_logs_a_line_every_interval_from_start_to_end(project, monkeypatch, capfd):
    """The tiny run sampled for 4 min 31 s without a line on the AVX2 kind. Scaled down here (a progress
    line every 0.3 s instead of 30 s, 256 train samples): from the first log line to the saved model no two
    lines are more than a few intervals apart (f18dbe9 on a busy machine: 27 s of silent sampling), and
    sampling writes its progress lines (phase, done/total, elapsed; f18dbe9 wrote none). Training and
    its evals are covered by the shared loop's progress line, score_norm by its own."""
    from stages import reward_model as stage

    monkeypatch.setenv("CHATPIPE_PROGRESS_EVERY", "0.3")
    capfd.readouterr()
    sizes = ["--tiny_prompts=64", "--tiny_sample_prompts=64", "--tiny_samples=4", "--tiny_val_problems=16"]
    short = ["--val_pairs=32", "--tiny_max_new_tokens=48", "--max_steps=16", "--device_batch_size=8", "--eval_every=8"]
    rest = ["--checkpoint_every=8", "--max_seq_len=128", "--device=cpu", "--dtype=float32"]
    stage.main(["--source=tiny", *sizes, *short, *rest])
    lines = [line for line in capfd.readouterr().out.splitlines() if LOG_LINE.match(line)]
    stamps = [datetime.strptime(LOG_LINE.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f") for line in lines]
    gaps = [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    # 0.3 s lines while a phase runs; the steps between phases (loading, building the model) take ~2 s here
    assert gaps[worst] <= 6, f"{gaps[worst]:.1f} s silent between:\n{lines[worst]}\n{lines[worst + 1]}"
    assert "saved artifacts/reward_model" in lines[-1]
    sampling = [line for line in lines if "reward_model train pairs: sampling: " in line]
    assert sampling and "/256 sample |" in sampling[-1] and "elapsed" in sampling[-1], lines


def test_the_flat_reward_keys_of_before_the_section_are_refused_naming_the_new_key():
    from chatpipe.settings import ParamsError, RLSettings, load_section

    with pytest.raises(ParamsError, match=r"rl.reward is a section now: set reward.verifier: exact_or_format"):
        load_section(RLSettings, {"reward": "exact_or_format"})
    with pytest.raises(ParamsError, match=r"rl.reward_source = 'model'.*moved to rl.reward.source"):
        load_section(RLSettings, {"reward_source": "model"})
    with pytest.raises(ParamsError, match=r"rl.reward_scale = 2.0.*moved to rl.reward.scale"):
        load_section(RLSettings, {"reward_scale": 2.0})
    assert load_section(RLSettings, {"reward": {"verifier": "exact_or_format"}}).reward.verifier == "exact_or_format"
