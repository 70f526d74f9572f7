"""FP8 training matmuls with tensorwise dynamic scaling, and the way back.

Two recipes compute the same thing (:data:`FP8_RECIPES`; :func:`enable_fp8` takes one):

- ``torchao``: torchao's ``Float8Linear`` (``convert_to_float8_training``). Its backward keeps the
  high-precision input and weight and casts them to FP8 again.
- ``tensorwise``: :class:`TensorwiseFloat8Linear`, chatpipe's own: one amax scale per tensor, e4m3
  for input and weight, e5m2 for the output's gradient, ``torch._scaled_mm`` for the three matmuls,
  and the FP8 copies of input and weight (1 byte an element, not 2 or 4) are what the backward keeps.

Which one the speedrun uses is decided by ``bench/gpu_acceptance.py``, which times both on the GPU
(:data:`DEFAULT_FP8_RECIPE` is what it last chose; bench/README.md has the rows).

Training converts the block matrices' ``nn.Linear`` layers (:func:`enable_fp8`).
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
FP8_RECIPES = ("torchao", "tensorwise")
DEFAULT_FP8_RECIPE = "torchao"  # until a GPU run of bench/gpu_acceptance.py measures tensorwise faster
E4M3_MAX = 448.0  # largest finite float8_e4m3fn: inputs and weights
E5M2_MAX = 57344.0  # largest finite float8_e5m2: gradients (more range, less precision)
FP8_LAYER_TYPES = ("Float8Linear", "TensorwiseFloat8Linear")


def check_fp8(device: torch.device, recipe: str = DEFAULT_FP8_RECIPE) -> None:
    """Raise RuntimeError naming what is missing when ``device`` cannot train in FP8 here: torchao
    (the ``gpu`` extra, for the torchao recipe), CUDA, or compute capability >= 8.9. Cheap: call it
    before any work."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}; allowed: {', '.join(FP8_RECIPES)}")
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
    if recipe == "tensorwise":  # plain torch: nothing to import
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise RuntimeError(f"fp8 needs torchao: {INSTALL_HINT}; or set fp8: false") from None


def fp8_eligible(module: nn.Module, fqn: str) -> bool:
    """Which layers train in FP8: the block matrices whose both dims are multiples of 16 (what the
    float8 matmul accepts); small gates, embeddings and lm_head stay in higher precision."""
    return fqn.startswith("blocks.") and isinstance(module, nn.Linear) and min(module.weight.shape) % 16 == 0


def enable_fp8(model: nn.Module, recipe: str = DEFAULT_FP8_RECIPE) -> nn.Module:
    """Swap the block matrices' ``nn.Linear`` for FP8 layers of ``recipe``, in place (after :func:`check_fp8`)."""
    device = next(model.parameters()).device
    check_fp8(device, recipe)
    if recipe == "tensorwise":
        return _swap_to_tensorwise(model)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # the CPU (tests only) emulates: the same float8 casts and scales, the matmul in high precision;
    # torch._scaled_mm on CPU is ~100x slower than that on the project's CPUs
    config = Float8LinearConfig(emulate=device.type == "cpu")
    convert_to_float8_training(model, module_filter_fn=fp8_eligible, config=config)
    return model


def float8_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """``(parent, attribute, layer)`` of every FP8 layer (either recipe) in ``model`` (empty without FP8)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child).__name__ in FP8_LAYER_TYPES:  # by name: no torchao import where it is absent
                found.append((parent, name, child))
    return found


@contextlib.contextmanager
def plain_linears(model: nn.Module) -> Iterator[nn.Module]:
    """Run a block with every FP8 layer of ``model`` replaced by an ``nn.Linear`` over the same
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


def _to_float8(x: torch.Tensor, dtype: torch.dtype, max_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` cast to ``dtype`` with one scale for the whole tensor (its amax maps to the format's
    largest value), and the inverse scale that multiplies the FP8 values back."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = max_value / amax
    fp8 = (x.float() * scale).clamp(-max_value, max_value).to(dtype)
    return fp8, scale.reciprocal()


def _scaled_matmul(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` of FP8 ``a`` [M, K] and ``b`` [K, N]: ``torch._scaled_mm`` on CUDA
    (it wants ``a`` row-major and ``b`` column-major); on CPU (tests) the same values multiplied in
    float32, as torchao's emulation does. ``fast_accum``: Hopper's faster, less exact accumulation,
    for the forward only (torchao's default too); the gradients accumulate exactly."""
    if a.device.type == "cuda":
        b = b.t().contiguous().t() if b.stride(0) != 1 else b
        return torch._scaled_mm(
            a.contiguous(), b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype, use_fast_accum=fast_accum
        )
    return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)


class _TensorwiseFloat8Matmul(torch.autograd.Function):
    """``x @ w.T`` with x, w in e4m3 and the output's gradient in e5m2; the backward reads the FP8 x and w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:  # type: ignore[override]
        x2 = x.reshape(-1, x.size(-1))
        x8, x_inv = _to_float8(x2, torch.float8_e4m3fn, E4M3_MAX)
        w8, w_inv = _to_float8(weight, torch.float8_e4m3fn, E4M3_MAX)
        out = _scaled_matmul(x8, x_inv, w8.t(), w_inv, out_dtype, fast_accum=True)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.shapes = (x.shape, x.dtype, weight.dtype)
        return out.view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        x_shape, x_dtype, w_dtype = ctx.shapes
        g8, g_inv = _to_float8(d_out.reshape(-1, d_out.size(-1)), torch.float8_e5m2, E5M2_MAX)
        d_x = _scaled_matmul(g8, g_inv, w8, w_inv, d_out.dtype)  # [M, N] @ [N, K]
        d_w = _scaled_matmul(g8.t(), g_inv, x8, x_inv, torch.float32)  # [N, M] @ [M, K]
        return d_x.view(x_shape).to(x_dtype), d_w.to(w_dtype), None


class TensorwiseFloat8Linear(nn.Linear):
    """``nn.Linear`` (no bias) whose matmuls run in FP8 with tensorwise scales (see the module docstring).
    The weight stays an ordinary parameter under the same name: state dicts are a plain model's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        with torch.autocast(device, enabled=False):  # the casts above decide every dtype
            return _TensorwiseFloat8Matmul.apply(x, self.weight, out_dtype)


def _swap_to_tensorwise(model: nn.Module) -> nn.Module:
    """Replace each eligible ``nn.Linear`` by a TensorwiseFloat8Linear over the same weight (no copy)."""
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not fp8_eligible(module, fqn) or module.bias is not None:
            continue
        parent_name, _, attr = fqn.rpartition(".")
        layer = TensorwiseFloat8Linear(module.in_features, module.out_features, bias=False, device="meta")
        layer.weight = module.weight
        layer.train(module.training)
        setattr(model.get_submodule(parent_name), attr, layer)
    return model
