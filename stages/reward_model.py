"""Reward model stage: a scalar head on the SFT trunk, trained on preference pairs (Bradley-Terry).

    python -m stages.reward_model                          # one process, params.yaml `reward_model` section
    python -m stages.reward_model --source=local --path=prefs.jsonl
    python -m chatpipe.launch reward_model                 # through torchx, as DVC does

Pairs come from ``source`` (:mod:`chatpipe.data.preferences`): ``tiny`` makes them offline from the
tiny world (the init model's own samples on train arithmetic problems, ranked by the verifier, plus
synthetic contrasts of each gold answer: the answer miscopied, the ``####`` line left out; the
held-out pairs are made the same way from the val split's problems), ``local`` reads a
``{prompt, chosen, rejected}`` JSONL file, ``hf`` a hub dataset in the chosen/rejected format. Every
pair is read and checked before the model loads. Each step takes ``device_batch_size`` pairs per
rank and follows -log sigmoid(r_chosen - r_rejected), each response scored at its last token.
Held-out pair accuracy and the margin's quantiles go to MLflow every ``eval_every`` steps and to
``summary`` in ``artifacts/reward_model/meta.json`` (the report card reads them); resumable
checkpoints in ``checkpoints/reward_model/``.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
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
from chatpipe.rl.reward_model import KIND, RewardModel, bradley_terry_loss, pad_rows, pair_metrics, score_rows
from chatpipe.settings import RewardModelSettings, TrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
from chatpipe.train.checkpoint import carried_over, producing_runs
from chatpipe.train.loop import due
from chatpipe.train.optim import apply_schedules, build_optimizers
from chatpipe.train.stage import Checkpointer, finish_stage, resume_or_fresh, run_meta

log = logging.getLogger("reward_model")


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(RewardModelSettings, train, argv, training=True)


@dataclass
class Pairs:
    """Train and held-out pairs, and a name for each held-out pair's kind (tiny: sampled or contrast)."""

    train: list[prefs.Pair]
    val: list[prefs.Pair]
    val_kinds: list[str] = field(default_factory=list)


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
    pairs = pairs or tiny_pairs(cfg, tok, policy)
    log.info("%d train pairs, %d held-out pairs (%s)", len(pairs.train), len(pairs.val), cfg.source)

    # --- model: the init trunk with a zero scalar head; LRs are fractions of the init model's
    rm = RewardModel.from_policy(policy).train()
    del policy
    init_lrs = {
        k: init_meta.get("settings", {}).get(k, TrainSettings.model_fields[k].default) for k in TrainSettings.LR_KEYS
    }
    optimizers = build_optimizers(
        rm,
        matrix_lr=init_lrs["matrix_lr"] * cfg.lr_frac,
        embedding_lr=init_lrs["embedding_lr"] * cfg.lr_frac,
        unembedding_lr=cfg.head_lr,  # the "lm_head" group holds only the scalar head
        weight_decay=cfg.weight_decay,
    )
    inputs = {
        "init": sha256_file(init_dir / "model.pt"),
        "tokenizer": sha256_file(tok_dir / "tokenizer.json"),
        "pairs": fingerprint([[p.chosen, p.rejected] for p in pairs.train]),
    }
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=rm, optimizers=optimizers, rt=rt)
    start_step = meta["step"] if meta else 0
    carried = carried_over(meta) if meta else {}
    state = {"train_seconds": carried.get("train_seconds", 0.0), "run_ids": []}

    def checkpoint_meta() -> dict:
        return {
            **run_meta("reward_model", run_fp, cfg, inputs, rt, rm.config),
            "kind": KIND,
            "init_dir": str(init_dir),
            "carried": {"train_seconds": state["train_seconds"], "mlflow_run_ids": state["run_ids"]},
        }

    checkpoints = Checkpointer(work, cfg, rm, optimizers, meta=checkpoint_meta, rt=rt, start_step=start_step)
    params = {"reward_model": snapshot(cfg), "model_config": rm.config.to_dict(), "world_size": rt.world_size}
    params |= {"train_pairs": len(pairs.train), "val_pairs": len(pairs.val)}
    with tracked_run("reward_model", params, rt) as run:
        metrics = Curves(run, "reward_model", ["train/loss", "val/pair_accuracy"], enabled=rt.is_main)
        state["run_ids"] = producing_runs(carried, run.id, trains=start_step < cfg.max_steps)
        step_model = DDP(rm) if rt.world_size > 1 else rm
        evals = run_loop(
            cfg, rt, rm, step_model, optimizers, pairs, tok.bos_id, start_step, state, checkpoints, metrics
        )
        summary = {**{f"val_{k}": v for k, v in evals.items()}, "train_pairs": len(pairs.train)}
        summary |= {"val_pairs": len(pairs.val), "train_seconds": state["train_seconds"]}
        finish_stage(
            ARTIFACTS / "reward_model",
            rm,
            checkpoint_meta(),
            summary,
            step=cfg.max_steps,
            run=run,
            metrics=metrics,
            rt=rt,
        )
    runtime.barrier()


def file_pairs(cfg: RewardModelSettings, tok: Tokenizer) -> Pairs:
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
    return Pairs(pairs, held, ["file"] * len(held))


def tiny_pairs(cfg: RewardModelSettings, tok: Tokenizer, policy: GPT) -> Pairs:
    """Tiny-world pairs: the train split's problems make the train pairs, the val split's the held-out ones."""
    train = _tiny_split(cfg, tok, policy, "train", cfg.tiny_prompts)
    val = _tiny_split(cfg, tok, policy, "val", max(cfg.val_pairs // 2, 1))
    random.Random(cfg.seed).shuffle(val)
    val = val[: cfg.val_pairs]
    return Pairs([p for p, _ in train], [p for p, _ in val], [k for _, k in val])


def _tiny_split(
    cfg: RewardModelSettings, tok: Tokenizer, policy: GPT, split: str, n: int
) -> list[tuple[prefs.Pair, str]]:
    """(pair, kind) for ``n`` arithmetic problems of ``split``: synthetic contrasts, then the model's
    samples ranked by the task's verifier (a right answer over a wrong or unfinished one)."""
    task = build_task("tinyworld_arith", split, limit=n)
    convs = [task[i] for i in range(min(n, len(task)))]
    made = prefs.contrast_pairs(convs, tok, cfg.seed, f"tinyworld_arith/{split} contrast")
    out = [(p, "contrast_" + p.where.rsplit(" ", 1)[-1]) for p in made]  # contrast_miscopied, ...
    if not cfg.tiny_samples:
        return out
    engine = Engine(policy.eval(), tok)
    prompts = [tok.render_for_completion(c) for c in convs]
    with torch.no_grad():
        generated = engine.generate_many(
            prompts,
            num_samples=cfg.tiny_samples,
            max_tokens=cfg.tiny_max_new_tokens,
            temperature=cfg.tiny_temperature,
            top_k=50,
            seed=cfg.seed,
        )
    end = tok.encode_special("<|assistant_end|>")
    for i, (conv, prompt, (seqs, _)) in enumerate(zip(convs, prompts, generated)):
        texts = [tok.decode([t for t in s[len(prompt) :] if t != end]) for s in seqs]
        scores = [float(task.reward(conv, t)) for t in texts]
        where = f"tinyworld_arith/{split} problem {i}"
        out += [(p, "sampled") for p in prefs.ranked_pairs(prompt, seqs, scores, where)]
    fits = [(p, k) for p, k in out if max(len(p.chosen), len(p.rejected)) <= cfg.max_seq_len]
    if len(fits) < len(out):  # made here, not read from a user's file: longer ones are left out, not an error
        log.info(
            "tiny %s: %d of %d pairs over max_seq_len %d left out",
            split,
            len(out) - len(fits),
            len(out),
            cfg.max_seq_len,
        )
    return fits


def batch_indices(n: int, step: int, per_rank: int, rank: int, world_size: int, seed: int) -> list[int]:
    """Pair indices this rank trains on at ``step``: a fresh seeded shuffle every epoch, disjoint over ranks."""
    per_step = per_rank * world_size
    if per_step > n:
        raise ValueError(
            f"{per_step} pairs per step (x{world_size} ranks) but only {n} train pairs; lower device_batch_size"
        )
    epoch, offset = divmod(step, n // per_step)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    start = offset * per_step + rank * per_rank
    return perm[start : start + per_rank].tolist()


def train_step(
    rt: runtime.Runtime, step_model, optimizers: list, batch: list[prefs.Pair], pad_id: int
) -> tuple[float, float]:
    """One optimizer step on ``batch``: (Bradley-Terry loss, batch pair accuracy)."""
    ids, last = pad_rows([p.chosen for p in batch] + [p.rejected for p in batch], pad_id)
    with rt.autocast():
        scores = step_model(ids.to(rt.device), last.to(rt.device))
    chosen, rejected = scores[: len(batch)], scores[len(batch) :]
    loss = bradley_terry_loss(chosen, rejected)
    loss.backward()
    for opt in optimizers:
        opt.step()
    step_model.zero_grad(set_to_none=True)
    return loss.item(), (chosen > rejected).float().mean().item()


def evaluate(rm: RewardModel, pairs: Pairs, pad_id: int, rt: runtime.Runtime) -> dict[str, float]:
    """Held-out pair accuracy, loss and margin quantiles, overall and (tiny) per kind of pair."""
    rm.eval()
    with rt.autocast():
        chosen = score_rows(rm, [p.chosen for p in pairs.val], pad_id)
        rejected = score_rows(rm, [p.rejected for p in pairs.val], pad_id)
    rm.train()
    out = pair_metrics(chosen, rejected)
    kinds = sorted(set(pairs.val_kinds))
    for kind in kinds if len(kinds) > 1 else []:
        rows = torch.tensor([k == kind for k in pairs.val_kinds])
        out[f"pair_accuracy_{kind}"] = (chosen[rows] > rejected[rows]).double().mean().item()
        out[f"pairs_{kind}"] = int(rows.sum())
    return out


def run_loop(
    cfg, rt, rm, step_model, optimizers, pairs: Pairs, pad_id: int, step: int, state: dict, checkpoints, metrics
) -> dict[str, float]:
    """Train from ``step`` to ``max_steps``: held-out metrics when due and at the end; returns the last."""
    bar = progress(cfg.max_steps, "reward_model", initial=step, unit="step")
    evals: dict[str, float] = {}
    while True:
        last = step == cfg.max_steps
        if last or due(step, cfg.eval_every):
            evals = evaluate(rm, pairs, pad_id, rt)
            metrics.log({f"val/{k}": v for k, v in evals.items()}, step)
            log.info(
                "step %d | held-out pair accuracy %.3f | margin q50 %.3f",
                step,
                evals["pair_accuracy"],
                evals["margin/q50"],
            )
        checkpoints.save_if_due(step, last=last)
        if last:
            bar.close()
            return evals
        apply_schedules(optimizers, 1.0 - step / cfg.max_steps, None)
        idx = batch_indices(len(pairs.train), step, cfg.device_batch_size, rt.rank, rt.world_size, cfg.seed)
        t0 = time.perf_counter()
        loss, acc = train_step(rt, step_model, optimizers, [pairs.train[i] for i in idx], pad_id)
        state["train_seconds"] += time.perf_counter() - t0
        step += 1
        metrics.log({"train/loss": loss, "train/pair_accuracy": acc}, step)
        bar.update(loss=loss)
        if step % cfg.log_every == 0:
            log.info("step %d/%d | loss %.4f | batch pair accuracy %.3f", step, cfg.max_steps, loss, acc)


if __name__ == "__main__":
    main()
