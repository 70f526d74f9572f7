"""FP8 training matmuls through torchao's float8 training (tensorwise dynamic scaling), and the way back.

Training converts the block matrices' ``nn.Linear`` layers to torchao ``Float8Linear`` (:func:`enable_fp8`).
Their weights stay ordinary high-precision parameters under the same names, so an FP8 run's
checkpoint is a plain model's state dict: it loads into a model without FP8 (evaluation, export) and
back into an FP8 model (resume). Evaluation, sampling and export run with the layers swapped back to
plain ``nn.Linear`` (:func:`plain_linears`), as nanochat does: inference in FP8 would change the
numbers it reports, and FP8 kernels want shapes (multiples of 16 tokens) that decoding does not have.

torchao comes with the ``gpu`` extra (``pip install -e '.[gpu]'``). FP8 needs CUDA with compute
capability >= 8.9 (Ada, Hopper); :func:`check_fp8` refuses anything else before a run does any work.
Tests only: ``CHATPIPE_TEST_FP8_ON_CPU=1`` lets the FP8 path run on CPU through torchao's emulation
(``Float8LinearConfig(emulate=True)``: the same float8 casts and scales, the matmul itself in high
precision), so CI exercises it without a GPU. Never set it for a real run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have FP8 tensor cores
CPU_TEST_ENV = "CHATPIPE_TEST_FP8_ON_CPU"  # test-only allowance, see the module docstring
INSTALL_HINT = "pip install -e '.[gpu]' (the gpu extra: torchao)"


def check_fp8(device: torch.device) -> None:
    """Raise RuntimeError naming what is missing when ``device`` cannot train in FP8 here: torchao
    (the ``gpu`` extra), CUDA, or compute capability >= 8.9. Cheap: call it before any work."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_MIN_CAPABILITY:
            raise RuntimeError(
                f"fp8 needs CUDA with compute capability >= 8.9 (this GPU has {capability}); set fp8: false"
            )
    elif not (device.type == "cpu" and os.environ.get(CPU_TEST_ENV) == "1"):
        raise RuntimeError(
            f"fp8 needs CUDA with compute capability >= 8.9 (this run is on {device.type.upper()}); set fp8: false"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise RuntimeError(f"fp8 needs torchao: {INSTALL_HINT}; or set fp8: false") from None


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Which layers train in FP8: the block matrices whose both dims are multiples of 16 (what the
    float8 matmul accepts); small gates, embeddings and lm_head stay in higher precision."""
    return fqn.startswith("blocks.") and isinstance(module, nn.Linear) and min(module.weight.shape) % 16 == 0


def enable_fp8(model: nn.Module) -> nn.Module:
    """Swap the block matrices' ``nn.Linear`` for torchao ``Float8Linear``, in place (after :func:`check_fp8`)."""
    device = next(model.parameters()).device
    check_fp8(device)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # the CPU (tests only) emulates: the same float8 casts and scales, the matmul in high precision;
    # torch._scaled_mm on CPU is ~100x slower than that on the project's CPUs
    config = Float8LinearConfig(emulate=device.type == "cpu")
    convert_to_float8_training(model, module_filter_fn=fp8_eligible, config=config)
    return model


def float8_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, layer)`` of every torchao Float8Linear in ``model`` (empty without FP8)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child).__name__ == "Float8Linear":  # by name: no torchao import where it is absent
                found.append((parent, name, child))
    return found


@contextlib.contextmanager
def plain_linears(model: nn.Module) -> Iterator[nn.Module]:
    """Run a block with every Float8Linear of ``model`` replaced by an ``nn.Linear`` over the same
    weight (no copy: a step taken inside would train the FP8 run's weights), then put them back.
    A no-op for a model without FP8."""
    swapped = float8_layers(model)
    for parent, name, layer in swapped:
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        plain.weight, plain.bias = layer.weight, layer.bias
        plain.train(layer.training)
        setattr(parent, name, plain)
    try:
        yield model
    finally:
        for parent, name, layer in swapped:
            setattr(parent, name, layer)
