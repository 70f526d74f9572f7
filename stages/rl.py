"""RL stage: GRPO-lite or PPO on verifiable rewards (or a reward model's), starting from the SFT model.

    python -m stages.rl                                   # one process, params.yaml `rl` section
    python -m stages.rl --algorithm=ppo --max_steps=20
    torchrun --nproc_per_node=2 -m stages.rl              # each rank samples its own prompts
    python -m chatpipe.launch rl                          # through torchx, as DVC does

Read top to bottom: settings -> roles -> data -> resume -> loop -> save. Per step every rank samples
``prompts_per_step / world_size`` problems x ``group_size`` responses with the engine (calculator
tool use on), scores them (verifier, reward model or both) and takes one update of the chosen
algorithm: GRPO-lite (advantage = score - group mean) or PPO (a frozen reference, a critic, GAE,
clipped epochs x minibatches). With ``replay`` set, each optimizer step also follows the
assistant-only LM loss of a few packed chat-stage rows, so what RL does not reward is not worn away.
pass@k (the task's own verdict, not the reward) every ``eval_every`` steps on ``eval_split`` (val: the
split settings are tuned on) and ``test_split`` (test: held out, the figure to report); resumable
checkpoints in ``checkpoints/rl/``; the final policy goes to ``artifacts/rl/``.

Where each part lives (chatpipe/rl/): the roles (policy, reference, critic, reward models) in
roles.py; prompts and replay in problems.py; sampling in sampling.py; the reward role in
scoring.py; the step (sample -> score -> update -> publish) in step.py; the update math and the one
place the algorithm is chosen in update.py; asynchronous RL's rollout role in async_role.py.
"""

from __future__ import annotations

import functools
import os

from chatpipe import runtime
from chatpipe.inference.engine import Engine
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.rl.async_role import rollout_exchange, rollout_role
from chatpipe.rl.problems import (
    Prompts,
    load_rl_problems,
    load_test_problems,
    replay_rows,
    resumed_replay,
    user_verifier,
)
from chatpipe.rl.roles import load_models, run_inputs
from chatpipe.rl.sampling import rollout_dtype, sampler_is_trainer
from chatpipe.rl.scoring import reward_guard
from chatpipe.rl.step import RLRun, distributed, loop_meta, pass_at_k, ppo_state, rl_state, rl_step, summary
from chatpipe.rl.update import algorithm_config, check_minibatches
from chatpipe.settings import RL_ROLE_ENV, RLSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
from chatpipe.train.loop import Every, Loop, LoopState, run_loop
from chatpipe.train.stage import finish_stage, resume_or_fresh, run_meta


def main(argv: list[str] | None = None) -> None:
    if os.environ.get(RL_ROLE_ENV) == "rollout":  # the second torchx role of asynchronous RL (rl.rollout.role)
        runtime.run_stage(RLSettings, rollout_role, argv)
    else:
        runtime.run_stage(RLSettings, train, argv, training=True)


def train(cfg: RLSettings, rt: runtime.Runtime) -> None:
    # --- settings: what only the world size can check, before any model loads
    work = WORK / "rl"
    check_minibatches(cfg, rt.world_size)

    # --- roles: policy from the init stage, its frozen reference, PPO's critic, the reward model(s);
    # their optimizers; the chosen algorithm's typed config
    tok = Tokenizer.load(ARTIFACTS / "tokenizer")
    models = load_models(cfg, rt)
    sampler_dtype = rollout_dtype(cfg, rt)
    # the rollouts' log-probs weigh the update only where the sampler is not the trainer's own numerics
    algorithm = algorithm_config(cfg, weigh_behaviour=not sampler_is_trainer(cfg, sampler_dtype, rt.dtype))

    # --- data: RL prompts (scored by the verifier), and the chat-stage rows replayed with every optimizer step
    train_problems, eval_problems = load_rl_problems(cfg, rt, verifier := user_verifier(cfg))
    test_problems = load_test_problems(cfg, rt, verifier)  # held out: nothing is tuned on its pass@k
    replay_seq_len, replay_pack = replay_rows(cfg, tok, models.policy)

    # --- resume from the newest checkpoint made with the same settings, init model and role models,
    # and the same evals: a run's first and final pass@k are always measured alike
    inputs = run_inputs(cfg)
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=models.state, optimizers=models.optimizers, rt=rt)
    meta = loop_meta(meta)
    state = LoopState.resumed(meta, cfg.max_steps)
    kl_ctl, value_norm = ppo_state(cfg, models.critic, meta)  # where the checkpoint left them
    run = RLRun(
        cfg,
        rt,
        models,
        Engine(models.policy, tok),
        train_problems,
        eval_problems,
        kl_ctl,
        algorithm,
        replay_loader=resumed_replay(cfg, tok, replay_seq_len, replay_pack, meta, rt),
        train_policy=distributed(models.policy, rt),
        train_critic=distributed(models.critic, rt),
        value_norm=value_norm,
        prompts=Prompts.resumed(meta),
        guard=reward_guard(cfg, meta),
        rollout_dtype=sampler_dtype,
        test_problems=test_problems,
    )

    # --- loop: rl_step per step (sample -> score -> update -> publish), pass@k on val (the tuning split)
    # and test (held out) every eval_every
    loop = Loop(
        "rl",
        cfg,
        rt,
        work,
        models.state,
        models.optimizers,
        step=functools.partial(rl_step, run),
        schedule=lambda step: (1.0 - step / cfg.max_steps, None),  # the RL LRs decay linearly to 0
        hooks=[Every(lambda step: pass_at_k(run), cfg.eval_every, at_start=True)],
        identity=run_meta("rl", run_fp, cfg, inputs, rt, models.policy.config),
        stage_state=functools.partial(rl_state, run),
        headline="reward/mean",
    )
    params = {"rl": snapshot(cfg), "model_config": models.policy.config.to_dict(), "world_size": rt.world_size}
    with tracked_run("rl", params | {"init_lrs": models.init_lrs}, rt) as tracking, rollout_exchange(run, state.step):
        curves = ["reward/mean", "response/length", "kl/mean", "eval/pass_at_1", "eval_test/pass_at_1"]
        metrics = Curves(tracking, "rl", curves, enabled=rt.is_main)
        run_loop(loop, state, tracking, metrics)

        # --- save the final policy for eval and chat
        finish_stage(
            ARTIFACTS / "rl",
            models.policy,
            loop.meta(state),
            summary(state, run.guard, verifier, cfg),
            step=state.step,
            run=tracking,
            metrics=metrics,
            rt=rt,
        )
    runtime.barrier()


if __name__ == "__main__":
    main()
