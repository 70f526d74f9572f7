"""Reward model stage: a scalar head on the SFT trunk, trained on preference pairs (Bradley-Terry).

    python -m stages.reward_model                          # one process, params.yaml `reward_model` section
    python -m stages.reward_model --source=local --path=prefs.jsonl
    python -m chatpipe.launch reward_model                 # through torchx, as DVC does

Pairs come from ``source`` (:mod:`chatpipe.data.preferences`): ``tiny`` makes them offline from the
tiny world's arithmetic problems of the train split's ``preferences`` part, which no other stage
reads (so never one RL prompts with): the init model's own samples ranked by the verifier (what PPO
will show the reward model), plus synthetic contrasts of each gold answer; the held-out pairs are
made the same way from other problems of that part (never RL's val or test problems, which its
pass@k is measured on). ``local`` reads a ``{prompt, chosen, rejected}``
JSONL file, ``hf`` a hub dataset in the chosen/rejected format. Every pair is read and checked
before the model loads. Each step takes ``device_batch_size`` pairs per rank and follows
-log sigmoid(r_chosen - r_rejected - margin), each response scored at its last token. At the end
the mean and std of the scores of the init model's own samples are saved as ``score_norm``, which
RL applies to every score.
The steps run on the shared training loop (:mod:`chatpipe.train.loop`), which logs each step's
loss, batch pair accuracy and gradient norm to MLflow. Held-out pair accuracy and the margin's
quantiles go to MLflow every ``eval_every`` steps and to ``summary`` in
``artifacts/reward_model/meta.json`` (the report card reads them); resumable checkpoints in
``checkpoints/reward_model/``.
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime
from chatpipe.data import preferences as prefs
from chatpipe.data.tasks import build_task
from chatpipe.inference.engine import Engine
from chatpipe.io import fingerprint, sha256_file
from chatpipe.model.files import load_model
from chatpipe.model.gpt import GPT
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.progress import progress
from chatpipe.rl.reward_model import (
    MODEL_KIND,
    RewardModel,
    bradley_terry_loss,
    pad_rows,
    pair_metrics,
    score_norm,
    score_rows,
    scoring_meta,
    unique_rows,
)
from chatpipe.rl.rollout import Problem, sample_problems
from chatpipe.runtime import all_reduce_sum
from chatpipe.settings import RewardModelSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
from chatpipe.train.loop import Every, Loop, LoopState, StepOut, run_loop
from chatpipe.train.optim import build_optimizers, init_lrs
from chatpipe.train.stage import finish_stage, resume_or_fresh, run_meta
from chatpipe.train.step import step_optimizers

log = logging.getLogger("reward_model")


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(RewardModelSettings, train, argv, training=True)


@dataclass
class Parts:
    """What the reward model's step and eval work with, all built before the loop starts."""

    cfg: RewardModelSettings
    rt: runtime.Runtime
    rm: RewardModel
    step_model: torch.nn.Module  # the reward model, DDP-wrapped when there are several ranks
    optimizers: list
    pairs: prefs.PairSet
    pad_id: int
    groups: list[list[int]]  # train pairs sharing a chosen reply (pair_groups), shuffled together each epoch


def train(cfg: RewardModelSettings, rt: runtime.Runtime) -> None:
    work, init_dir, tok_dir = WORK / "reward_model", Path(cfg.init_dir), ARTIFACTS / "tokenizer"
    tok = Tokenizer.load(tok_dir)
    # --- pairs first: a bad file stops the stage before any model loads (tiny needs the model to sample)
    pairs = None if cfg.source == "tiny" else file_pairs(cfg, tok)
    policy, init_meta = load_model(init_dir, rt.device)
    if cfg.max_seq_len > policy.config.sequence_len:
        raise ValueError(
            f"reward_model.max_seq_len = {cfg.max_seq_len} is longer than the model's sequence_len "
            f"{policy.config.sequence_len} ({init_dir}); set it to at most that"
        )
    pairs = pairs or prefs.tiny_pairs(cfg, tok, sampler(cfg, tok, policy))
    log.info("%d train pairs, %d held-out pairs (%s)", len(pairs.train), len(pairs.val), cfg.source)

    # --- model: the init trunk with a zero scalar head; LRs are fractions of the init model's
    rm = RewardModel.from_policy(policy, cfg.pool, tok.encode_special("<|assistant_start|>")).train()
    del policy
    optimizers = reward_optimizers(cfg, rm, init_meta)

    # --- resume from the newest checkpoint made with the same settings, init model and pairs
    inputs = {
        "init": sha256_file(init_dir / "model.pt"),
        "tokenizer": sha256_file(tok_dir / "tokenizer.json"),
        "pairs": fingerprint([[p.chosen, p.rejected] for p in pairs.train]),
    }
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=rm, optimizers=optimizers, rt=rt)
    state = LoopState.resumed(meta, cfg.max_steps)
    parts = Parts(
        cfg, rt, rm, DDP(rm) if rt.world_size > 1 else rm, optimizers, pairs, tok.bos_id, pair_groups(pairs.train)
    )
    loop = Loop(
        "reward_model",
        cfg,
        rt,
        work,
        rm,
        optimizers,
        step=functools.partial(rm_step, parts),
        schedule=lambda step: (1.0 - step / cfg.max_steps, None),  # the LRs decay linearly to 0
        hooks=[Every(lambda step: held_out(parts), cfg.eval_every, from_step=1)],  # a zero head ties every pair at 0
        identity={
            **run_meta("reward_model", run_fp, cfg, inputs, rt, rm.config),
            **scoring_meta(rm),
            "kind": MODEL_KIND,
            "init_dir": str(init_dir),
        },
    )

    # --- loop
    params = {"reward_model": snapshot(cfg), "model_config": rm.config.to_dict(), "world_size": rt.world_size}
    params |= {"train_pairs": len(pairs.train), "val_pairs": len(pairs.val)}
    with tracked_run("reward_model", params, rt) as run:
        metrics = Curves(run, "reward_model", ["train/loss", "val/pair_accuracy"], enabled=rt.is_main)
        run_loop(loop, state, run, metrics)
        finish_stage(
            ARTIFACTS / "reward_model",
            rm,
            {**loop.meta(state), "score_norm": reference_norm(parts)},
            summary(state, pairs),
            step=state.step,
            run=run,
            metrics=metrics,
            rt=rt,
        )
    runtime.barrier()


def reward_optimizers(cfg: RewardModelSettings, rm: RewardModel, init_meta: dict) -> list:
    """The trunk's optimizers at ``lr_frac`` of the init model's LRs (the training defaults for a model
    dir without training settings), the scalar head's at ``head_lr``."""
    lrs = init_lrs(init_meta)
    return build_optimizers(
        rm,
        matrix_lr=lrs["matrix_lr"] * cfg.lr_frac,
        embedding_lr=lrs["embedding_lr"] * cfg.lr_frac,
        unembedding_lr=cfg.head_lr,  # the "lm_head" group holds only the scalar head
        weight_decay=cfg.weight_decay,
    )


def summary(state: LoopState, pairs: prefs.PairSet) -> dict[str, float]:
    """The final ``summary`` of ``meta.json`` (the report card reads it): the newest held-out metrics
    as ``val_<name>``, the pair counts and the training time."""
    held = {k.replace("val/", "val_", 1): v for k, v in state.evals.items()}
    counts = {"train_pairs": len(pairs.train), "val_pairs": len(pairs.val)}
    return {**held, **counts, "train_seconds": state.total("train_seconds")}


def file_pairs(cfg: RewardModelSettings, tok: Tokenizer) -> prefs.PairSet:
    """Train and held-out pairs of a local JSONL file or a hub dataset, every record checked."""
    if cfg.source == "local":
        if not cfg.path:
            raise ValueError(
                "reward_model.source = local needs reward_model.path (a {prompt, chosen, rejected} JSONL file)"
            )
        pairs = prefs.read_jsonl_pairs(cfg.path, tok, cfg.max_seq_len, cfg.limit, cfg.skip_too_long)
        held = (
            prefs.read_jsonl_pairs(cfg.val_path, tok, cfg.max_seq_len, cfg.val_pairs, cfg.skip_too_long)
            if cfg.val_path
            else None
        )
    else:
        config = cfg.hf_config or None
        pairs = prefs.read_hub_pairs(
            cfg.hf_repo, config, cfg.hf_split, tok, cfg.max_seq_len, cfg.limit, cfg.skip_too_long
        )
        held = (
            prefs.read_hub_pairs(
                cfg.hf_repo, config, cfg.hf_val_split, tok, cfg.max_seq_len, cfg.val_pairs, cfg.skip_too_long
            )
            if cfg.hf_val_split
            else None
        )
    if held is None:
        pairs, held = prefs.split_pairs(pairs, cfg.val_pairs, cfg.seed)
    return prefs.PairSet(pairs, held, [prefs.FROM_FILE] * len(held), [prefs.FROM_FILE] * len(pairs))


def sampler(cfg: RewardModelSettings, tok: Tokenizer, policy: GPT) -> prefs.Samples | None:
    """How tiny pairs get the init model's samples: ``tiny_samples`` replies to each problem
    (:func:`chatpipe.rl.rollout.sample_problems`) scored by the task's verifier; None when it samples none."""
    if not cfg.tiny_samples:
        return None

    def sample(name: str, convs: list[dict]) -> list[tuple[list[int], list[list[int]], list[float]]]:
        task = build_task("tinyworld_arith", "train", limit=1)  # the verifier: the same for every split
        problems = [Problem(c, lambda text, c=c: float(task.reward(c, text))) for c in convs]
        with torch.no_grad():
            sampled = sample_problems(
                Engine(policy.eval(), tok),
                problems,
                num_samples=cfg.tiny_samples,
                max_new_tokens=cfg.tiny_max_new_tokens,
                temperature=cfg.tiny_temperature,
                top_k=50,
                seed=cfg.seed,
                desc=f"reward_model {name} pairs: sampling",
            )
        return [(s.prompt, s.seqs, [p.score(x) for x in s.texts]) for p, s in zip(problems, sampled)]

    return sample


def pair_groups(pairs: list[prefs.Pair]) -> list[list[int]]:
    """Indices of the pairs that share a chosen conversation (tiny: one problem's contrasts), each
    group in first-seen order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault(tuple(p.chosen), []).append(i)
    return list(groups.values())


def batch_indices(
    groups: list[list[int]], step: int, per_rank: int, rank: int, world_size: int, seed: int
) -> list[int]:
    """Pair indices this rank trains on at ``step``: every epoch a fresh seeded shuffle of the groups
    (:func:`pair_groups`), each group's pairs kept together so a step scores their shared chosen
    reply once; consecutive slices of it, disjoint over ranks."""
    n, per_step = sum(len(g) for g in groups), per_rank * world_size
    if per_step > n:
        raise ValueError(
            f"{per_step} pairs per step (x{world_size} ranks) but only {n} train pairs; lower device_batch_size"
        )
    epoch, offset = divmod(step, n // per_step)
    perm = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    order = [i for g in perm.tolist() for i in groups[g]]
    start = offset * per_step + rank * per_rank
    return order[start : start + per_rank]


def rm_step(parts: Parts, step: int) -> StepOut:
    """One optimizer step (its LR already set by the loop) on this rank's ``device_batch_size`` pairs,
    -log sigmoid(r_chosen - r_rejected); returns the loss, the gradient norm and the batch pair
    accuracy, each the mean over ranks, for the loop's step row (:func:`chatpipe.train.loop.step_row`)."""
    cfg, rt, pairs = parts.cfg, parts.rt, parts.pairs
    idx = batch_indices(parts.groups, step, cfg.device_batch_size, rt.rank, rt.world_size, cfg.seed)
    batch = [pairs.train[i] for i in idx]
    rows, where = unique_rows([p.chosen for p in batch] + [p.rejected for p in batch])
    ids, last = pad_rows(rows, parts.pad_id)
    with rt.autocast():
        scores = parts.step_model(ids.to(rt.device), last.to(rt.device))[where.to(rt.device)]
    chosen, rejected = scores[: len(batch)], scores[len(batch) :]
    loss = bradley_terry_loss(chosen, rejected, cfg.margin)
    loss.backward()
    # no clipping (grad_clip 0): the norm is read before the step and the weights train as without it
    norm = step_optimizers(parts.step_model, parts.optimizers, grad_clip=0.0)
    accuracy = (chosen > rejected).float().mean()
    # one all-reduce and one device-to-host copy for the three numbers
    sums = all_reduce_sum(torch.stack([loss.detach().float(), accuracy, norm.float()])) / rt.world_size
    loss_mean, accuracy_mean, grad_norm = sums.tolist()
    return StepOut(grad_norm, loss_mean, {"train/pair_accuracy": accuracy_mean})


def reference_norm(parts: Parts, max_rows: int = 2048) -> dict[str, float]:
    """``score_norm`` (:func:`chatpipe.rl.reward_model.score_norm`) over the init model's own sampled
    train replies, the distribution RL's first rollouts come from (every train reply when there
    are no samples, e.g. a JSONL source); at most ``max_rows`` distinct replies, every rank alike."""
    pairs, origins = parts.pairs.train, parts.pairs.train_origins
    own = [p for p, o in zip(pairs, origins) if o == prefs.SAMPLED] or pairs
    rows, _ = unique_rows([r for p in own for r in (p.chosen, p.rejected)])
    rows = random.Random(parts.cfg.seed).sample(rows, min(max_rows, len(rows)))
    parts.rm.eval()
    with parts.rt.autocast(), progress(len(rows), "reward_model score_norm", unit="reply") as bar:
        scores = score_rows(parts.rm, rows, parts.pad_id)
        bar.update(len(rows))
    parts.rm.train()
    return score_norm(scores)


def held_out(parts: Parts) -> dict[str, float]:
    """Held-out pair accuracy, loss and margin quantiles, overall and (tiny) per origin of pair
    (``pair_accuracy_sampled``, ``pair_accuracy_contrast_<mistake>``), as ``val/<name>`` metrics. Every rank scores every held-out pair."""
    rm, pairs, rt = parts.rm, parts.pairs, parts.rt
    rm.eval()
    rows, where = unique_rows([p.chosen for p in pairs.val] + [p.rejected for p in pairs.val])
    with rt.autocast():
        scores = score_rows(rm, rows, parts.pad_id)[where]  # a chosen reply shared by pairs scored once
    rm.train()
    chosen, rejected = scores[: len(pairs.val)], scores[len(pairs.val) :]
    out = pair_metrics(chosen, rejected)
    # every origin the source names, even one alone (tiny's held-out pairs can all be sampled ones)
    for origin in sorted(set(pairs.val_origins) - {prefs.FROM_FILE}):
        of_origin = torch.tensor([o == origin for o in pairs.val_origins])
        out[f"pair_accuracy_{origin}"] = (chosen[of_origin] > rejected[of_origin]).double().mean().item()
        out[f"pairs_{origin}"] = int(of_origin.sum())
    return {f"val/{k}": v for k, v in out.items()}


if __name__ == "__main__":
    main()
