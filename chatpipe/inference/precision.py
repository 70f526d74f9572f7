"""Sampling with the linear layers in bf16: what the RL stage's rollouts run in where the CPU multiplies bf16.

A decode step of the tiny model is mostly its linear layers' matmuls (about half of a rollout on a
2-core AVX-512 CPU, bench/README.md "Rollouts, round eight"). Where the CPU multiplies bf16 natively
(AVX512-BF16, AMX), a bf16 matmul takes about a third to a half of the float32 one's time. Only the
linear layers change: the attention's many tiny matrices are slower in bf16 on these CPUs, so the
keys, values, norms and the residual stream stay in float32. This is the precision the RL stage
trains in on those CPUs (bf16 autocast), so the rollouts come from the policy as the trainer sees it.

The bf16 copies of the weights are made on entry, every time, so a policy updated between two RL
steps is never sampled with the weights of the step before (a d4 model's copy takes about 2 ms).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

# Linear layers narrower than this on either side (the smear and value-embedding gates: 24 or 32
# channels, one to four outputs) cost more to cast than their matmul saves, so they stay in float32.
MIN_WIDTH = 64


def _linear_in(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.to(weight.dtype), weight, bias).to(x.dtype)


@contextmanager
def linears_in(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[int]:
    """Within the block, every plain ``nn.Linear`` of ``model`` at least ``MIN_WIDTH`` wide on both sides
    multiplies in ``dtype``: its input and a copy of its weight are cast, its output cast back.
    ``None`` or the weights' own dtype changes nothing. Yields how many layers it switched; on exit
    (an exception too) every layer is its own again.

    Only for inference: the copies carry no gradient, and a model sampled in two threads at once
    must not enter this twice."""
    switched: list[torch.nn.Module] = []
    try:
        for module in model.modules():
            if type(module) is not torch.nn.Linear:  # not a subclass either (FP8 linears keep their own path)
                continue
            w, b = module.weight, module.bias
            if dtype in (None, w.dtype) or min(w.shape) < MIN_WIDTH:
                continue
            if "forward" in vars(module):
                raise RuntimeError(
                    f"{type(module).__name__} already has its forward replaced: linears_in entered twice?"
                )
            module.forward = partial(_linear_in, w.detach().to(dtype), None if b is None else b.detach().to(dtype))
            switched.append(module)
        yield len(switched)
    finally:
        for module in switched:
            del module.forward
