"""chatpipe.runtime: the CPU allocator setting that training steps rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chatpipe.runtime import MALLOC_ENV, keep_freed_memory_in_heap

# A few d2 training steps in a fresh process (mallopt settings are process-wide and one-way);
# prints the median page faults of a step after the first two. The logits (16 x 256 x 4096
# fp32, 64 MB) exceed the largest mmap threshold glibc picks by itself (32 MB).
STEPS_PROBE = """
import json, resource, statistics, sys, torch
from chatpipe.model.gpt import GPT, config_from_depth
from chatpipe.runtime import keep_freed_memory_in_heap
applied = keep_freed_memory_in_heap() if sys.argv[1] == "keep" else False
torch.manual_seed(0)
model = GPT(config_from_depth(2, 4096, 256, head_dim=64))
model.init_weights()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    idx = torch.randint(0, 4096, (16, 257))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": statistics.median(faults[2:])}))
"""


def _steps(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    out = subprocess.run(
        [sys.executable, "-c", STEPS_PROBE, mode], capture_output=True, text=True, env=env, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_training_steps_stop_faulting_pages_back_in():
    default, kept = _steps("default"), _steps("keep")
    assert kept["applied"] and not default["applied"]
    # glibc's default returns the step's large buffers to the kernel and faults them back in
    # (thousands of pages per step); kept in the heap, later steps reuse them
    assert default["faults"] > 2000
    assert kept["faults"] < default["faults"] / 10


def test_users_malloc_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert keep_freed_memory_in_heap() is False
