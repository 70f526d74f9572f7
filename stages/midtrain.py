"""Midtrain stage: teach the base model the chat format, tool use and multiple choice.

    python -m stages.midtrain                                   # one process
    torchrun --nproc_per_node=2 -m stages.midtrain              # DDP
    python -m chatpipe.launch midtrain -- --max_steps=20        # through torchx, as DVC does

Starts from ``artifacts/base``; trains on the task mixture of ``params.yaml`` (``midtrain.mixture``),
rendered to conversations and best-fit packed into rows of ``max_seq_len`` (loss on assistant
tokens only). In-progress checkpoints go to ``checkpoints/midtrain/`` (a re-run resumes), the
final model to ``artifacts/mid/``. Logs loss, lr, val loss/bpb and the packing fill ratio to MLflow.
"""

from __future__ import annotations

from chatpipe import runtime
from chatpipe.paths import ARTIFACTS
from chatpipe.settings import MidtrainSettings
from chatpipe.train.chat import train_chat


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(MidtrainSettings, train, argv, training=True)


def train(cfg: MidtrainSettings, rt: runtime.Runtime) -> None:
    train_chat(cfg, rt, stage="midtrain", init_dir=ARTIFACTS / "base", out_dir=ARTIFACTS / "mid")


if __name__ == "__main__":
    main()
