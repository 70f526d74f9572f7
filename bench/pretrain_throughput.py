"""Pretrain loop throughput vs a bare single-process PyTorch loop on the same model.

    python bench/pretrain_throughput.py [--steps 20] [--profile tiny]

1. runs the real pretrain stage (``python -m stages.pretrain``) for ``--steps`` steps in a scratch
   directory (reusing artifacts/data and artifacts/tokenizer; evals, samples, checkpoints and MLflow off)
   and reads its training tokens/s from the saved summary;
2. runs a bare loop: same model config, same batch, the same optimizers, random tokens, nothing else;
3. prints both and their ratio last (goal >= 0.95: orchestration costs the loop nothing).

Needs the tokenizer stage to have run (``dvc repro tokenizer``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.model.gpt import GPT  # noqa: E402
from chatpipe.runtime import Runtime  # noqa: E402
from chatpipe.settings import PretrainSettings, load_section  # noqa: E402
from chatpipe.train.optim import build_optimizers  # noqa: E402
from chatpipe.train.pretrain_plan import compile_pays, model_config_for, polar_express_dtype  # noqa: E402


def stage_tokens_per_s(steps: int, profile: str) -> float:
    """Training tokens/s reported by the real stage for ``steps`` steps."""
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        (scratch / "artifacts").mkdir()
        for name in ("data", "tokenizer"):
            (scratch / "artifacts" / name).symlink_to(REPO / "artifacts" / name)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "CHATPIPE_PARAMS": str(REPO / "params.yaml"),
            "CHATPIPE_PROFILE": profile,
            "CHATPIPE_TRACKING__ENABLED": "false",
        }
        args = [f"--max_steps={steps}", "--eval_every=0", "--sample_every=0", "--checkpoint_every=0", "--eval_tokens=1"]
        subprocess.run(
            [sys.executable, "-m", "stages.pretrain", *args],
            cwd=scratch,
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        meta = json.loads((scratch / "artifacts" / "base" / "meta.json").read_text())
        return meta["summary"]["tokens_per_s"]


def bare_tokens_per_s(cfg: PretrainSettings, vocab_size: int, steps: int) -> float:
    """The same model and optimizers stepping on random tokens, nothing else around them.

    Compiled where the stage would compile (``compile`` / ``compile_pays``), so both run the same code.
    """
    torch.manual_seed(0)
    model = GPT(model_config_for(cfg, vocab_size))  # the stage's own config, recipe options included
    model.init_weights()
    cpu = torch.device("cpu")
    opts = build_optimizers(
        model,
        **cfg.optimizer_kwargs(),
        compile=compile_pays(cfg.compile, steps, cpu, part="optimizer"),
        polar_dtype=polar_express_dtype(cfg, Runtime(0, 0, 1, cpu, torch.float32)),
    )
    step_model = torch.compile(model) if compile_pays(cfg.compile, steps, cpu) else model
    accum = cfg.total_batch_size // (cfg.device_batch_size * cfg.sequence_len)
    x = torch.randint(0, vocab_size, (cfg.device_batch_size, cfg.sequence_len))
    train_time = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(accum):
            (step_model(x, x) / accum).backward()
        for opt in opts:
            opt.step()
        model.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t0
    return steps * cfg.total_batch_size / train_time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile", default="tiny")
    args = p.parse_args()
    os.chdir(REPO)
    if not (REPO / "artifacts" / "tokenizer" / "tokenizer.json").exists():
        sys.exit("artifacts/tokenizer missing: run `dvc repro tokenizer` first")
    os.environ["CHATPIPE_PROFILE"] = args.profile
    cfg = load_section(PretrainSettings)
    vocab = json.loads((REPO / "artifacts" / "tokenizer" / "report.json").read_text())["vocab_size"]
    # bare, stage, bare: average the bare runs so slow drift of a noisy machine cancels out
    bare_a = bare_tokens_per_s(cfg, vocab, args.steps)
    stage = stage_tokens_per_s(args.steps, args.profile)
    bare_b = bare_tokens_per_s(cfg, vocab, args.steps)
    bare = (bare_a + bare_b) / 2
    print(
        f"profile {args.profile}: depth {cfg.depth}, {cfg.total_batch_size} tokens/step, {args.steps} steps, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"bare loop tokens/s:     {bare:,.0f} ({bare_a:,.0f} / {bare_b:,.0f})")
    print(f"pretrain stage tokens/s: {stage:,.0f}")
    print(f"ratio stage/bare: {stage / bare:.3f}")


if __name__ == "__main__":
    main()
