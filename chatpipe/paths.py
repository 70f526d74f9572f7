"""Where the pipeline keeps its files, relative to the project root (the stages' working directory)."""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = Path("artifacts")  # DVC-tracked stage outputs
WORK = Path("checkpoints")  # in-progress checkpoints; not DVC outs, so they survive a failed run
# what the reward_model stage leaves in its output dir instead of a model when RL reads none
# (`python -m chatpipe.launch reward_model --if-read`, dvc.yaml's command); RL reading it says so
REWARD_MODEL_NOT_READ = "not_read.json"
