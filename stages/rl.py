"""RL stage: GRPO-lite or PPO on verifiable rewards, starting from the SFT model.

    python -m stages.rl                                   # one process, params.yaml `rl` section
    python -m stages.rl --algorithm=ppo --max_steps=20
    torchrun --nproc_per_node=2 -m stages.rl              # each rank samples its own prompts
    python -m chatpipe.launch rl                          # through torchx, as DVC does

Per step every rank samples ``prompts_per_step / world_size`` problems x ``group_size`` responses
with the engine (calculator tool use on) and scores them with the verifier. GRPO-lite takes one
policy-gradient step with advantage = score - group mean. PPO adds a frozen reference policy (KL
penalty folded into the token rewards), a critic (GAE) and clipped updates over epochs x
minibatches; both updates are library functions (chatpipe/rl/update.py, unit-tested against
hand-computed values). With ``replay`` set, each optimizer step also follows the assistant-only LM
loss of a few packed chat-stage rows, so what RL does not reward (spelling, multiple choice) is not
worn away. Held-out pass@k every ``eval_every`` steps; resumable checkpoints (policy, critic,
reference, optimizers, KL coefficient, step, replay cursor, RNG) in ``checkpoints/rl/``; the final policy goes to
``artifacts/rl/``.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime
from chatpipe.data.packing import ConversationLoader, pack
from chatpipe.data.tasks import build_mixture
from chatpipe.inference.engine import Engine
from chatpipe.io import sha256_file
from chatpipe.model.files import load_model
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.progress import progress
from chatpipe.rl import losses as rl
from chatpipe.rl.rollout import collect_rollouts, evaluate_problems, load_problems, rank_indices
from chatpipe.rl.update import PPOConfig, grpo_update, ppo_update
from chatpipe.rl.value import ValueModel
from chatpipe.settings import RLSettings, TrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.checkpoint import carried_over, producing_runs
from chatpipe.train.loop import due
from chatpipe.train.optim import apply_schedules, build_optimizers
from chatpipe.train.stage import Checkpointer, finish_stage, resume_or_fresh, run_meta, tracked_run

log = logging.getLogger("rl")


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(RLSettings, train, argv)


def train(cfg: RLSettings, rt: runtime.Runtime) -> None:
    work = WORK / "rl"
    init_dir = Path(cfg.init_dir)
    if cfg.prompts_per_step % rt.world_size:
        raise ValueError(
            f"rl.prompts_per_step = {cfg.prompts_per_step} must be a multiple of the {rt.world_size} ranks"
        )
    per_rank = cfg.prompts_per_step // rt.world_size
    use_critic = cfg.algorithm == "ppo" and not cfg.disable_value

    # --- models: policy from the init stage, a frozen reference copy, a critic for PPO
    tok = Tokenizer.load(ARTIFACTS / "tokenizer")
    policy, init_meta = load_model(init_dir, rt.device)
    policy.train()
    ref = copy.deepcopy(policy).requires_grad_(False).eval()
    critic = ValueModel.from_policy(policy) if use_critic else None
    state = torch.nn.ModuleDict({"policy": policy, "ref": ref, **({"critic": critic} if critic else {})})

    # --- optimizers: a fraction of the init model's LRs, decayed linearly to 0
    init_lrs = {  # a model dir without training settings (e.g. an import) gets the training defaults
        k: init_meta.get("settings", {}).get(k, TrainSettings.model_fields[k].default) for k in TrainSettings.LR_KEYS
    }
    embedding_frac = cfg.lr_frac if cfg.embedding_lr_frac is None else cfg.embedding_lr_frac
    policy_frac = {"matrix_lr": cfg.lr_frac, "embedding_lr": embedding_frac, "unembedding_lr": embedding_frac}
    policy_opts = build_optimizers(
        policy, **{k: v * policy_frac[k] for k, v in init_lrs.items()}, weight_decay=cfg.weight_decay
    )
    critic_opts = (
        build_optimizers(
            critic, **{k: v * cfg.value_lr_frac for k, v in init_lrs.items()}, weight_decay=cfg.weight_decay
        )
        if critic
        else []
    )
    kl_ctl = rl.KLController(
        cfg.kl_coef, adaptive=cfg.kl_ctl == "adaptive", target=cfg.kl_target, horizon=cfg.kl_horizon
    )
    ppo_config = PPOConfig.from_settings(cfg)

    # --- problems: each rank samples its own train prompts and evaluates its share of the held-out ones
    train_problems = load_problems(cfg.task, "train", cfg.num_train_problems, cfg.seed, cfg.reward, cfg.task_source)
    for keep in cfg.keep_tasks:  # skills RL must not wear away: their prompts join the training pool
        n = keep.limit or cfg.num_train_problems
        train_problems += load_problems(
            keep.task, "train", n, cfg.seed, source=keep.source or "", words=keep.words, path=keep.path
        )
    eval_problems = load_problems(cfg.task, cfg.eval_split, cfg.eval_problems, cfg.seed, cfg.reward, cfg.task_source)[
        rt.rank :: rt.world_size
    ]
    # replay: chat-stage conversations whose LM loss joins every optimizer step (rl.replay)
    replay_seq_len = cfg.replay_seq_len or policy.config.sequence_len
    if cfg.replay and replay_seq_len > policy.config.sequence_len:
        raise ValueError(
            f"rl.replay_seq_len = {replay_seq_len} is longer than the model's sequence_len "
            f"{policy.config.sequence_len} ({init_dir}); set it to at most that, or null for the model's"
        )
    replay_pack = pack(build_mixture(cfg.replay, "train", seed=cfg.seed), tok, replay_seq_len) if cfg.replay else None

    # --- resume from the newest checkpoint made with the same settings and init model
    inputs = {
        "init": sha256_file(init_dir / "model.pt"),
        "tokenizer": sha256_file(ARTIFACTS / "tokenizer" / "tokenizer.json"),
    }
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=state, optimizers=policy_opts + critic_opts, rt=rt)
    start_step, prompt_log, first_eval, carried = 0, [], None, {}
    if meta:
        start_step, kl_ctl.value, prompt_log = meta["step"], meta["kl_coef"], meta["prompt_indices"]
        first_eval, carried = meta["first_eval"], carried_over(meta)
    replay_loader = None
    if replay_pack:
        replay_loader = ConversationLoader(
            *replay_pack,
            batch_size=cfg.replay_rows,
            seq_len=replay_seq_len,
            pad_id=tok.bos_id,
            start_row=meta["replay"]["row"] if meta else 0,
            **rt.shard,
        )

    def replay(model) -> torch.Tensor:
        return cfg.replay_coef * model(*replay_loader.next_batch())

    train_policy = DDP(policy) if rt.world_size > 1 else policy
    train_critic = (DDP(critic) if rt.world_size > 1 else critic) if critic else None
    engine = Engine(policy, tok)

    def pass_at_k() -> dict[str, float]:
        policy.eval()
        correct = evaluate_problems(
            engine,
            eval_problems,
            num_samples=cfg.eval_samples,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.eval_temperature,
            top_k=cfg.top_k or None,
            seed=cfg.seed + 10_000 * rt.rank,
        )
        policy.train()
        ks = sorted({1, cfg.eval_samples})
        sums = torch.tensor(
            [len(correct)] + [rl.mean_pass_at_k(correct, k) * len(correct) if correct else 0.0 for k in ks],
            dtype=torch.float64,
            device=rt.device,
        )
        runtime.all_reduce_sum(sums)
        return {f"eval/pass_at_{k}": (sums[i + 1] / sums[0].clamp(min=1)).item() for i, k in enumerate(ks)}

    def checkpoint_meta() -> dict:
        return {
            **run_meta("rl", run_fp, cfg, inputs, rt, policy.config),
            "kl_coef": kl_ctl.value,
            "init_dir": str(init_dir),
            "total_steps": cfg.max_steps,
            "prompt_indices": prompt_log,
            "replay": replay_loader.state() if replay_loader else None,
            "first_eval": first_eval,
            "carried": {
                "gen_seconds": t_gen_total,
                "train_seconds": t_train_total,
                "gen_tokens": gen_tokens_total,
                "mlflow_run_ids": run_ids,
            },
        }

    checkpoints = Checkpointer(
        work, cfg, state, policy_opts + critic_opts, meta=checkpoint_meta, rt=rt, start_step=start_step
    )

    # --- loop
    params = {
        "rl": snapshot(cfg),
        "model_config": policy.config.to_dict(),
        "world_size": rt.world_size,
        "init_lrs": init_lrs,
    }
    with tracked_run("rl", params, rt) as run:
        metrics = Curves(run, "rl", ["reward/mean", "response/length", "kl/mean", "eval/pass_at_1"], enabled=rt.is_main)
        bar = progress(cfg.max_steps, "rl", initial=start_step, unit="step")
        step, evals = start_step, {}
        t_gen_total, t_train_total = carried.get("gen_seconds", 0.0), carried.get("train_seconds", 0.0)
        gen_tokens_total = carried.get("gen_tokens", 0)
        run_ids = producing_runs(carried, run.id, trains=start_step < cfg.max_steps)
        while True:
            last = step == cfg.max_steps
            if last or step == start_step or due(step, cfg.eval_every):
                evals = pass_at_k()
                first_eval = first_eval or evals
                metrics.log(evals, step)
                log.info("step %d | %s", step, " | ".join(f"{k} {v:.3f}" for k, v in evals.items()))
            checkpoints.save_if_due(step, last=last)
            if last:
                break

            lr_mult = 1.0 - step / cfg.max_steps
            apply_schedules(policy_opts + critic_opts, lr_mult, None)

            # rollouts: this rank's prompts x group_size samples, seeded by (seed, step, rank)
            t0 = time.perf_counter()
            idx = rank_indices(len(train_problems), step, per_rank, rt.rank, rt.world_size, cfg.seed)
            prompt_log.append(gather(idx, rt))  # rank 0 keeps who sampled what (tests check no overlap)
            policy.eval()
            batch = collect_rollouts(
                engine,
                [train_problems[i] for i in idx],
                group_size=cfg.group_size,
                max_new_tokens=cfg.max_new_tokens,
                temperature=cfg.temperature,
                top_k=cfg.top_k or None,
                device=rt.device,
                seed=((cfg.seed * 1_000_003 + step) * rt.world_size + rt.rank) * per_rank,
            )
            policy.train()
            t_gen = time.perf_counter() - t0

            # update
            t1 = time.perf_counter()
            scores = rl.shape_scores(
                rl.length_penalties(
                    batch.scores,
                    batch.ended,
                    batch.lengths,
                    no_eos=cfg.no_eos,
                    penalty=cfg.length_penalty,
                    min_length=cfg.min_response_length,
                ),
                scale=cfg.reward_scale,
                bias=cfg.reward_bias,
                clip=cfg.reward_clip,
            )
            if cfg.algorithm == "grpo":
                stats = grpo_update(
                    train_policy,
                    policy_opts,
                    batch,
                    scores,
                    group_size=cfg.group_size,
                    normalize_std=cfg.normalize_std,
                    micro_batch=cfg.device_batch_size,
                    autocast=rt.autocast,
                    replay=replay if replay_loader else None,
                )
            else:
                stats = ppo_update(
                    train_policy,
                    ref,
                    train_critic,
                    policy_opts,
                    critic_opts,
                    batch,
                    scores,
                    kl_ctl,
                    ppo_config,
                    step=step,
                    autocast=rt.autocast,
                    replay=replay if replay_loader else None,
                )
                rl.ema_update(ref, policy, cfg.ref_ema)
            t_train = time.perf_counter() - t1
            step += 1

            # metrics, summed over ranks
            sums = torch.tensor(
                [
                    batch.scores.sum().item(),
                    float(len(batch.scores)),
                    float(batch.lengths.sum()),
                    batch.ended.float().sum().item(),
                    float(batch.num_tokens),
                    stats.pop("kl_sum", 0.0),
                ],
                dtype=torch.float64,
                device=rt.device,
            )
            runtime.all_reduce_sum(sums)
            n = sums[1].item()
            gen_tokens_total += int(sums[4].item())
            t_gen_total, t_train_total = t_gen_total + t_gen, t_train_total + t_train
            row = {
                "reward/mean": sums[0].item() / n,
                "response/length": sums[2].item() / n,
                "response/eos_frac": sums[3].item() / n,
                "kl/mean": sums[5].item() / n,
                "rollout/tokens_per_s": sums[4].item() / max(t_gen, 1e-9),  # ranks sample in parallel
                "time/gen_share": t_gen / (t_gen + t_train),
                "lr_mult": lr_mult,
                "kl/coef": kl_ctl.value,
                **{f"tools/{k}": float(v) for k, v in engine.tool_stats.items()},  # running totals, this rank
                **stats,
            }
            metrics.log(row, step)
            bar.update(reward=row["reward/mean"])
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                log.info(
                    "step %d/%d | reward %.3f | len %.1f | kl %.4f | %s | gen %.0f%% of %.1fs",
                    step,
                    cfg.max_steps,
                    row["reward/mean"],
                    row["response/length"],
                    row["kl/mean"],
                    " ".join(f"{k} {v:.3g}" for k, v in stats.items()),
                    100 * row["time/gen_share"],
                    t_gen + t_train,
                )

        # --- save the final policy for eval and chat
        bar.close()
        summary = {
            "steps": step,
            "gen_seconds": t_gen_total,
            "train_seconds": t_train_total,
            "rollout_tokens_per_s": gen_tokens_total / max(t_gen_total, 1e-9),
            **{f"first_{k}": v for k, v in (first_eval or {}).items()},
            **{f"final_{k}": v for k, v in evals.items()},
        }
        finish_stage(ARTIFACTS / "rl", policy, checkpoint_meta(), summary, step=step, run=run, metrics=metrics, rt=rt)
    runtime.barrier()


def gather(obj, rt: runtime.Runtime) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if rt.world_size == 1:
        return [obj]
    out = [None] * rt.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    main()
