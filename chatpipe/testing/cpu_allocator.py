"""One training process's median step (wall, kernel seconds, page faults) in a malloc setting: the probe
tests/test_runtime.py runs and bench/cpu_allocator.py prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from chatpipe.runtime import MALLOC_ENV

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import json, resource, statistics, sys, time, torch
from chatpipe.model.gpt import GPT, config_from_depth
from chatpipe.runtime import keep_freed_memory_in_heap
mode, vocab, steps, depth = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
if mode == "kept":
    assert keep_freed_memory_in_heap()
torch.manual_seed(0)
model = GPT(config_from_depth(depth, vocab, 256, head_dim=64))
model.init_weights()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
wall, system, faults = [], [], []
for i in range(steps + 3):
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    idx = torch.randint(0, vocab, (16, 257))
    model(idx[:, :-1], idx[:, 1:]).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    if i >= 3:
        wall.append(t1 - t0)
        system.append(r1.ru_stime - r0.ru_stime)
        faults.append(r1.ru_minflt - r0.ru_minflt)
print(json.dumps({k: statistics.median(v) for k, v in (("wall", wall), ("system", system), ("faults", faults))}))
"""


def run(mode: str, vocab: int, steps: int, depth: int = 4) -> dict:
    """One process's median step: wall seconds, kernel seconds, page faults."""
    env = {k: v for k, v in os.environ.items() if k not in MALLOC_ENV}
    cmd = [sys.executable, "-c", PROBE, mode, str(vocab), str(steps), str(depth)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])
