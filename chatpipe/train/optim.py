"""Optimizers and schedules: AdamW for embedding/lm_head, Muon for the hidden matrices.

Two recipes (``optimizer`` argument of :func:`build_optimizers`, params ``pretrain.optimizer``):

- ``muon_newton_schulz``: torch's AdamW + Muon (Newton-Schulz), the late-2025 nanochat recipe;
- ``normuon_polar_express``: nanochat's 2026 ``MuonAdamW`` (:class:`MuonAdamW`): MuonEq, Polar Express,
  Muon+, NorMuon variance reduction, cautious weight decay, and its per-group lrs/betas/decays.

Usage in a stage loop::

    optimizers = build_optimizers(model, matrix_lr=0.02, embedding_lr=0.2, weight_decay=0.0)
    for step in range(total_steps):
        lr_mult = lr_multiplier(step, total_steps, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05)
        apply_schedules(optimizers, lr_mult, muon_momentum(step))
        ...  # forward/backward, then opt.step() for each optimizer

Every param group stores ``initial_lr``; schedules multiply it, so a resumed run needs only the step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.optim._muon as _torch_muon

from chatpipe import runtime
from chatpipe.settings import TrainSettings

SCHEDULES = ("warmdown", "cosine")
OPTIMIZERS = ("muon_newton_schulz", "normuon_polar_express")


def build_optimizers(
    model: torch.nn.Module,
    *,
    matrix_lr: float = 0.02,
    embedding_lr: float = 0.2,
    unembedding_lr: float = 0.004,
    weight_decay: float = 0.0,
    adam_betas: tuple[float, float] = (0.8, 0.95),
    adam_eps: float = 1e-10,
    fused: bool | None = None,
    optimizer: str = "muon_newton_schulz",
    scalar_lr: float = 0.5,
    reduce_grads: bool = False,
    compile: bool = False,
    polar_express: str = "direct",
    polar_dtype: torch.dtype = torch.float32,
) -> list[torch.optim.Optimizer]:
    """Return ``[adamw, muon]`` (``optimizer="muon_newton_schulz"``) or ``[MuonAdamW]`` (``"normuon_polar_express"``).

    Built over ``model.param_groups()`` (a :class:`chatpipe.model.gpt.GPT`). AdamW lrs are scaled
    by (n_embd / 768) ** -0.5 so wider models take smaller embedding steps; Muon's lr is used as
    given (its update is already shape-normalised). ``scalar_lr`` is the lambdas' lr.
    ``reduce_grads``, ``compile``, ``polar_express`` and ``polar_dtype``: see :class:`MuonAdamW` (only
    that recipe).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; allowed: {', '.join(OPTIMIZERS)}")
    if polar_express != "direct" and optimizer != "normuon_polar_express":
        raise ValueError(
            f"polar_express={polar_express!r} needs optimizer='normuon_polar_express' "
            "(muon_newton_schulz uses Newton-Schulz)"
        )
    if polar_dtype != torch.float32 and optimizer != "normuon_polar_express":
        raise ValueError(
            f"polar_dtype={polar_dtype} needs optimizer='normuon_polar_express' "
            "(muon_newton_schulz's Newton-Schulz runs in float32)"
        )
    if optimizer == "normuon_polar_express":
        lrs = {"unembedding_lr": unembedding_lr, "embedding_lr": embedding_lr, "matrix_lr": matrix_lr}
        recipe = {
            "scalar_lr": scalar_lr,
            "weight_decay": weight_decay,
            "reduce_grads": reduce_grads,
            "compile": compile,
            "polar_express": polar_express,
            "polar_dtype": polar_dtype,
        }
        return [build_muon_adamw(model, **lrs, **recipe)]
    groups = model.param_groups()
    scale = (model.config.n_embd / 768) ** -0.5
    extra = [  # the nanochat model options' parameters, when the model has them
        {"params": groups.get("value_embeds", []), "lr": embedding_lr * scale * 0.5},
        {"params": groups.get("resid_lambdas", []), "lr": scalar_lr * 0.01},
        {"params": groups.get("x0_lambdas", []), "lr": scalar_lr},
        {"params": groups.get("gates", []), "lr": 0.2},
    ]
    adamw = torch.optim.AdamW(
        [
            {"params": groups["lm_head"], "lr": unembedding_lr * scale},
            {"params": groups["embedding"], "lr": embedding_lr * scale},
            *(g for g in extra if g["params"]),
        ],
        betas=adam_betas,
        eps=adam_eps,
        weight_decay=0.0,
        fused=fused,
    )
    muon = Muon(groups["matrix"], lr=matrix_lr, momentum=0.95, nesterov=True, weight_decay=weight_decay)
    optimizers: list[torch.optim.Optimizer] = [adamw, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def init_lrs(meta: dict) -> dict[str, float]:
    """The learning rates (:attr:`TrainSettings.LR_KEYS`) a model dir was trained with, read from its
    ``meta.json`` settings: the stages that start from a trained model (reward model, RL) take fractions
    of them. A model dir without training settings (e.g. an import) gets the training defaults."""
    trained = meta.get("settings", {})
    return {k: trained.get(k, TrainSettings.model_fields[k].default) for k in TrainSettings.LR_KEYS}


def newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation (same iteration as torch's), kept in fp32."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon``; on CPU its Newton-Schulz runs in fp32.

    torch runs the iteration in bf16, which is right on GPUs but ~50x slower than fp32 on CPUs
    without bf16 matrix units: 9.8 s of a 11 s tiny-profile step on a 2-core laptop.
    """

    def step(self, closure=None):
        on_gpu = all(p.is_cuda for g in self.param_groups for p in g["params"])
        ctx = contextlib.nullcontext() if on_gpu else _swap_newton_schulz(newton_schulz_fp32)
        with ctx:
            return super().step(closure)


PRIVATE_NEWTON_SCHULZ = "_zeropower_via_newtonschulz"  # torch.optim._muon's, in torch 2.13.0 (pyproject's pin)


@contextlib.contextmanager
def _swap_newton_schulz(fn):
    """``torch.optim._muon``'s private Newton-Schulz swapped for ``fn`` while a step runs. A private
    name can move in any torch release: where it is gone, say so instead of training in bf16 unseen."""
    if not callable(getattr(_torch_muon, PRIVATE_NEWTON_SCHULZ, None)):
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.optim._muon.{PRIVATE_NEWTON_SCHULZ}, which chatpipe's CPU "
            "Muon swaps for an fp32 Newton-Schulz (tested on torch 2.13.0, pyproject.toml's pin); install "
            "torch<2.13.1, or port chatpipe.train.optim.Muon.step to this torch"
        )
    original = _torch_muon._zeropower_via_newtonschulz
    _torch_muon._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        _torch_muon._zeropower_via_newtonschulz = original


def lr_multiplier(
    step: int,
    total_steps: int,
    *,
    warmup_steps: int,
    warmdown_ratio: float,
    final_lr_frac: float,
    schedule: str = "warmdown",
) -> float:
    """LR multiplier for ``step`` in [0, total_steps): reaches ``final_lr_frac`` at the last step.

    "warmdown": linear warmup, flat 1.0, then linear decay over the last ``warmdown_ratio`` of the
    steps. "cosine": linear warmup, then cosine from 1.0 down to ``final_lr_frac``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= warmdown_ratio <= 1.0:
        raise ValueError(f"warmdown_ratio must be in [0, 1], got {warmdown_ratio}")
    last = total_steps - 1
    step = min(max(step, 0), last)
    warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
    if schedule == "cosine":
        span = last - warmup_steps
        progress = 1.0 if span <= 0 else min(max((step - warmup_steps) / span, 0.0), 1.0)
        decay = final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        down = warmdown_ratio * total_steps
        left = (last - step) / down if down > 0 else 1.0
        decay = 1.0 if left >= 1.0 else final_lr_frac + (1.0 - final_lr_frac) * left
    # min of both ramps: a run shorter than warmup + warmdown still ends at final_lr_frac
    return min(warm, decay)


def muon_momentum(step: int, warmup_steps: int = 300, start: float = 0.85, end: float = 0.95) -> float:
    """Muon momentum: linear ramp from ``start`` to ``end`` over ``warmup_steps``, then flat."""
    frac = 1.0 if warmup_steps <= 0 else min(max(step, 0) / warmup_steps, 1.0)
    return (1.0 - frac) * start + frac * end


def apply_schedules(optimizers: list[torch.optim.Optimizer], lr_mult: float, momentum: float | None) -> None:
    """Set lr = initial_lr * lr_mult in every group, and ``momentum`` on Muon groups when given."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_mult
            if momentum is not None and (isinstance(opt, torch.optim.Muon) or group.get("kind") == "muon"):
                group["momentum"] = momentum


# --------------------------------------------------------------------------- nanochat's MuonAdamW

# Polar Express coefficients (arXiv 2505.16932) for 5 iterations, safety factor 2e-2, cushion 2:
# each iteration maps X -> a X + b (X X^T) X + c (X X^T)^2 X.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(x: torch.Tensor, steps: int = 5, form: str = "direct") -> torch.Tensor:
    """Approximate orthogonalisation of a stack of matrices [N, rows, cols] (Polar Express).

    The input should already have spectral norm <= 1. The Gram matrix is taken on the smaller
    side: ``X^T X`` for tall matrices, ``X X^T`` for wide and square ones. ``form="gram"`` runs
    stacks at least :data:`GRAM_SPACE_MIN_ASPECT` times longer than wide through
    :func:`_polar_express_gram` (the same polynomial, fewer FLOPs, different rounding); ``"direct"``
    is nanochat's order of operations.
    """
    if steps > len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"polar_express: steps={steps}; at most {len(POLAR_EXPRESS_COEFFS)} coefficients")
    if form not in POLAR_EXPRESS_FORMS:
        raise ValueError(f"polar_express: form={form!r}; allowed: {', '.join(POLAR_EXPRESS_FORMS)}")
    tall = x.size(-2) > x.size(-1)
    if form == "gram" and max(x.shape[-2:]) >= GRAM_SPACE_MIN_ASPECT * min(x.shape[-2:]):
        return _polar_express_gram(x.mT, steps).mT if tall else _polar_express_gram(x, steps)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        if tall:
            gram = x.mT @ x
            x = a * x + x @ (b * gram + c * (gram @ gram))
        else:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x


# A stack of m x n matrices with n >= 2m runs Polar Express in the small m x m space. Matmul cost,
# direct: 20 m^2 n + 10 m^3 for 5 iterations; in m x m space with one restart: 8 m^2 n + 28 m^3,
# 33% less for the 4:1 MLP matrices. The restart after 2 iterations keeps the fp32 error near the
# direct form's: on an ill-conditioned stack (rank 8 + 1% noise, 256 x 1024) 3.6e-5 relative to
# float64 against the direct form's 1.9e-5 (5.9e-4 without the restart).
GRAM_SPACE_MIN_ASPECT = 2
POLAR_EXPRESS_FORMS = ("direct", "gram")
POLAR_EXPRESS_DTYPES = (torch.float32, torch.bfloat16)
GRAM_SPACE_RESTART = 2


def _polar_express_gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    """Polar Express of wide matrices [N, m, n] with every iteration's work done on m x m matrices.

    Each iteration is X <- Q X with Q = a I + b A + c A^2 and A = X X^T. Q is a polynomial in A,
    so the next Gram matrix is Q A Q and the product of the Qs applies to X once at the end. After
    :data:`GRAM_SPACE_RESTART` iterations X is formed and its Gram matrix taken afresh, which drops
    the rounding the m x m recurrence has gathered.
    """
    coeffs = POLAR_EXPRESS_COEFFS[:steps]
    if not coeffs:
        return x
    eye = torch.eye(x.size(-2), dtype=x.dtype, device=x.device)
    gram, product = x @ x.mT, None
    for i, (a, b, c) in enumerate(coeffs):
        if i == GRAM_SPACE_RESTART:
            x = product @ x
            gram, product = x @ x.mT, None
        q = a * eye + b * gram + c * (gram @ gram)
        product = q if product is None else q @ product
        if i + 1 < len(coeffs) and i + 1 != GRAM_SPACE_RESTART:  # the last Gram matrix is never read
            gram = q @ (gram @ q)
    return product @ x


def muon_update(
    grads: torch.Tensor,
    momentum_buffer: torch.Tensor,
    second_moment: torch.Tensor,
    *,
    momentum: float,
    beta2: float,
    ns_steps: int,
    polar_form: str = "direct",
    polar_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The orthogonalised, variance-normalised update of a stack of same-shaped matrices [N, r, c].

    Nesterov momentum; MuonEq (every row scaled to the mean row norm); Frobenius normalisation;
    Polar Express; Muon+ (Frobenius norm reset to sqrt(min(r, c))); NorMuon-style variance
    reduction: a running second moment per row (tall or square) or per column (wide) rescales the
    update, which then gets its pre-rescaling Frobenius norm back. Updates the two buffers in place.

    From MuonEq's scaling to the end of Polar Express the matrices are ``polar_dtype`` (nanochat:
    bfloat16 when it trains in bfloat16), with MuonEq's norms taken in float32.
    """
    rows, cols = grads.shape[-2:]
    momentum_buffer.lerp_(grads, 1 - momentum)
    g = grads.lerp(momentum_buffer, momentum).to(polar_dtype)
    # MuonEq: equalise row norms so no row dominates the orthogonalisation
    g32 = g.float()  # the norms in float32 (no copy when g already is)
    row_norm = g32.norm(dim=-1, keepdim=True)
    target = g32.norm(dim=(-2, -1), keepdim=True) / rows**0.5
    g = g * (target / row_norm.clamp_min(1e-10)).to(polar_dtype)
    x = g / (1.01 * g.norm(dim=(-2, -1), keepdim=True) + 1e-6)
    x = polar_express(x, ns_steps, polar_form).to(grads.dtype)
    # Muon+: a semi-orthogonal matrix has Frobenius norm sqrt(min(r, c)); restore it exactly
    x = x * (min(rows, cols) ** 0.5 / x.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))
    # NorMuon: normalise by a running per-row (or per-column) second moment, keep the overall norm
    red_dim = -1 if rows >= cols else -2
    v_mean = x.square().mean(dim=red_dim, keepdim=True)
    red_size = x.size(red_dim)
    v_norm = (v_mean.sum(dim=(-2, -1), keepdim=True) * red_size).sqrt()
    second_moment.lerp_(v_mean, 1 - beta2)
    step_size = second_moment.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * red_size) * step_size.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return x * (step_size * (v_norm / v_norm_new.clamp_min(1e-10)))


def adamw_update_(p, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, wd) -> None:
    """One decoupled-weight-decay AdamW step of one parameter, in place (moments too).

    ``lr``, ``beta1``, ``beta2`` and ``wd`` are fp32 0-d tensors: the rounding of nanochat's fused
    step. Under torch.compile ``step`` and ``eps`` are 0-d tensors as well, so one graph serves
    every step and every lr the schedule sets.
    """
    p.mul_(1 - lr * wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.lerp_(grad.square(), 1 - beta2)
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    denom = (exp_avg_sq / bias2).sqrt() + eps
    p.add_(exp_avg / denom * -(lr / bias1))


def muon_step_(
    params,
    grads,
    momentum_buffer,
    second_moment,
    *,
    momentum,
    beta2,
    lr,
    wd,
    ns_steps: int,
    polar_form: str,
    polar_dtype: torch.dtype = torch.float32,
) -> None:
    """:func:`muon_update` of a stack of same-shaped matrices, then the cautious-decay step of each, in place.

    ``lr`` and ``wd`` are fp32 0-d tensors; under torch.compile ``momentum`` and ``beta2`` are too.
    """
    update = muon_update(
        torch.stack([g.float() for g in grads]),
        momentum_buffer,
        second_moment,
        momentum=momentum,
        beta2=beta2,
        ns_steps=ns_steps,
        polar_form=polar_form,
        polar_dtype=polar_dtype,
    )
    for p, u in zip(params, update.unbind(0)):
        u = u.to(p.dtype)
        mask = (u * p) >= 0  # cautious: decay only where the update pulls the same way
        p.sub_(lr * u + lr * wd * p * mask)


_COMPILED: dict[str, Callable] = {}
# AdamW params smaller than this (lambdas, gates) step eagerly even when compiling: their ops cost
# microseconds, less than the seconds a graph per extra shape takes to compile
COMPILE_MIN_NUMEL = 4096


def _compiled(fn: Callable) -> Callable:
    """``fn`` under torch.compile, built once per process (a graph per parameter shape)."""
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = runtime.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[fn.__name__]


def _plain(method: Callable) -> Callable:
    """A ``torch.optim.Optimizer`` method without torch's ``_disable_dynamo`` wrapper.

    torch wraps the base class's bookkeeping (``__init__``, ``add_param_group``, ``zero_grad``,
    ``state_dict``, ``load_state_dict``) so that torch.compile never traces it, and the wrapper's
    first call imports ``torch._dynamo``: ~2.5 s of CPU in every training process, compiled or not
    (a tiny stage's whole step budget is seconds). Nothing compiles a MuonAdamW method (only the
    per-parameter update functions, :func:`_compiled`), so calling the plain function is the same.
    """
    return getattr(method, "__wrapped__", method)


class MuonAdamW(torch.optim.Optimizer):
    """nanochat's combined optimizer: AdamW groups and Muon groups (``kind`` = "adamw" | "muon").

    AdamW group keys: ``lr``, ``betas``, ``eps``, ``weight_decay`` (decoupled, applied first as
    ``p *= 1 - lr*wd``). Muon group keys: ``lr``, ``momentum``, ``ns_steps``, ``beta2``,
    ``weight_decay``; every param of a Muon group has the same shape (they are stacked), the
    effective lr is ``lr * sqrt(max(1, rows/cols))`` and weight decay is cautious: applied only
    where the update and the parameter agree in sign, ``p -= lr*u + lr*wd*p*[u*p >= 0]``.

    ``reduce_grads=True`` averages gradients over the default process group before stepping (for
    callers without DDP); under DDP leave it False, gradients arrive averaged already. State is
    replicated on every rank (nanochat shards it, ZeRO-2 style; same arithmetic).

    ``compile=True`` runs each parameter's AdamW step and each Muon group's step as one
    torch.compile'd graph: the same math (up to float rounding), without the dozens of separate
    elementwise passes and temporaries per parameter. It costs a few seconds of compiling per
    parameter shape on the first step (see ``chatpipe.train.pretrain_plan.compile_pays``).

    ``polar_express`` ("direct" | "gram"): the form of the Muon groups' Polar Express, see
    :func:`polar_express`. It changes rounding only and is a constructor choice, like ``compile``,
    not optimizer state (the pretrain stage's settings fingerprint records it). ``polar_dtype``
    (float32 | bfloat16): the precision of its matmuls, see :func:`muon_update`; a constructor
    choice as well.
    """

    def __init__(
        self,
        param_groups: list[dict],
        *,
        reduce_grads: bool = False,
        compile: bool = False,
        polar_express: str = "direct",
        polar_dtype: torch.dtype = torch.float32,
    ) -> None:
        if polar_express not in POLAR_EXPRESS_FORMS:
            raise ValueError(f"polar_express={polar_express!r}; allowed: {', '.join(POLAR_EXPRESS_FORMS)}")
        if polar_dtype not in POLAR_EXPRESS_DTYPES:
            raise ValueError(f"polar_dtype={polar_dtype}; allowed: {', '.join(map(str, POLAR_EXPRESS_DTYPES))}")
        for g in param_groups:
            if g.get("kind") not in ("adamw", "muon"):
                raise ValueError(f"MuonAdamW group needs kind 'adamw' or 'muon', got {g.get('kind')!r}")
            if g["kind"] == "muon" and len({tuple(p.shape) for p in g["params"]}) > 1:
                raise ValueError("MuonAdamW: a muon group's params must share one shape (they are stacked)")
        _plain(torch.optim.Optimizer.__init__)(self, param_groups, {})
        self.reduce_grads = reduce_grads
        self.compiled = compile
        self.polar_express = polar_express
        self.polar_dtype = polar_dtype
        # 0-d fp32 scalars refilled every step: a compiled graph takes them as inputs, not constants
        self._scalars = {k: torch.zeros((), dtype=torch.float32) for k in ("step", "lr", "b1", "b2", "eps", "wd")}

    def add_param_group(self, param_group: dict) -> None:
        _plain(torch.optim.Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _plain(torch.optim.Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict:
        return _plain(torch.optim.Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict) -> None:
        _plain(torch.optim.Optimizer.load_state_dict)(self, state_dict)

    def _reduce(self) -> None:
        import torch.distributed as dist

        if not (self.reduce_grads and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flat = torch.cat([t.reshape(-1) for t in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM)
        if dist.get_backend() != "nccl":
            flat /= dist.get_world_size()  # gloo has no AVG
        offset = 0
        for t in grads:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    @torch.no_grad()
    def step(self, closure=None):
        """One step of every group (closure, if given, is evaluated first and its loss returned)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reduce()
        for group in self.param_groups:
            if group["kind"] == "adamw":
                self._adamw(group)
            else:
                self._muon(group)
        return loss

    def _scalar(self, name: str, value: float) -> torch.Tensor:
        """The preallocated fp32 0-d CPU tensor ``name``, set to ``value`` (CPU 0-d tensors mix with any device)."""
        return self._scalars[name].fill_(value)

    def _adamw(self, group: dict) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            if self.compiled and p.numel() >= COMPILE_MIN_NUMEL:
                _compiled(adamw_update_)(
                    p,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=self._scalar("step", state["step"]),
                    lr=self._scalar("lr", group["lr"]),
                    beta1=self._scalar("b1", beta1),
                    beta2=self._scalar("b2", beta2),
                    eps=self._scalar("eps", group["eps"]),
                    wd=self._scalar("wd", group["weight_decay"]),
                )
                continue
            # scalars as fp32 0-d tensors: the same rounding as nanochat's fused step
            lr_t, wd_t, b1, b2 = (
                torch.tensor(v, dtype=torch.float32) for v in (group["lr"], group["weight_decay"], beta1, beta2)
            )
            adamw_update_(
                p,
                p.grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                step=state["step"],
                lr=lr_t,
                beta1=b1,
                beta2=b2,
                eps=group["eps"],
                wd=wd_t,
            )

    def _muon(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        rows, cols = params[0].shape
        state = self.state[group["params"][0]]  # the stacked buffers live with the group's first param
        n = len(group["params"])
        if not state:
            state["momentum_buffer"] = torch.zeros(n, rows, cols, dtype=torch.float32, device=params[0].device)
            vshape = (n, rows, 1) if rows >= cols else (n, 1, cols)
            state["second_momentum_buffer"] = torch.zeros(vshape, dtype=torch.float32, device=params[0].device)
        if len(params) != n:
            raise RuntimeError("MuonAdamW: every param of a muon group needs a gradient (or none of them)")
        lr = group["lr"] * max(1.0, rows / cols) ** 0.5
        if self.compiled:
            step_fn = _compiled(muon_step_)
            momentum, beta2 = self._scalar("b1", group["momentum"]), self._scalar("b2", group["beta2"])
            lr_t, wd_t = self._scalar("lr", lr), self._scalar("wd", group["weight_decay"])
        else:
            step_fn, momentum, beta2 = muon_step_, group["momentum"], group["beta2"]
            lr_t, wd_t = (torch.tensor(v, dtype=torch.float32) for v in (lr, group["weight_decay"]))
        step_fn(
            params,
            [p.grad for p in params],
            state["momentum_buffer"],
            state["second_momentum_buffer"],
            momentum=momentum,
            beta2=beta2,
            lr=lr_t,
            wd=wd_t,
            ns_steps=group["ns_steps"],
            polar_form=self.polar_express,
            polar_dtype=self.polar_dtype,
        )


def build_muon_adamw(
    model: torch.nn.Module,
    *,
    unembedding_lr: float,
    embedding_lr: float,
    matrix_lr: float,
    weight_decay: float,
    scalar_lr: float,
    reduce_grads: bool,
    compile: bool,
    polar_express: str,
    polar_dtype: torch.dtype,
) -> MuonAdamW:
    """nanochat's ``setup_optimizer``: the groups, betas, weight decays and lr scalings of its recipe.

    Called through :func:`build_optimizers` (``optimizer="normuon_polar_express"``), which holds the defaults.

    AdamW lrs of the embedding-like groups scale by (n_embd / 768) ** -0.5. Groups whose option is
    off in the model are left out. Every group stores ``initial_lr`` for the schedules.
    """
    groups = model.param_groups()
    s = (model.config.n_embd / 768) ** -0.5

    def adamw(params, lr, betas, wd):
        return {"kind": "adamw", "params": params, "lr": lr, "betas": betas, "eps": 1e-10, "weight_decay": wd}

    adam_groups = [
        adamw(groups["lm_head"], unembedding_lr * s, (0.8, 0.96), 0.01),
        adamw(groups["embedding"], embedding_lr * s, (0.8, 0.995), 0.001),
        adamw(groups.get("value_embeds", []), embedding_lr * s * 0.5, (0.8, 0.995), 0.01),
        adamw(groups.get("resid_lambdas", []), scalar_lr * 0.01, (0.8, 0.95), 0.05),
        adamw(groups.get("x0_lambdas", []), scalar_lr, (0.96, 0.95), 0.0),
        adamw(groups.get("gates", []), 0.2, (0.8, 0.95), 0.0),
    ]
    by_shape: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for p in groups["matrix"]:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    muon_groups = [
        {
            "kind": "muon",
            "params": ps,
            "lr": matrix_lr,
            "momentum": 0.95,
            "ns_steps": 5,
            "beta2": 0.9,
            "weight_decay": weight_decay,
        }
        for _, ps in by_shape.items()
    ]
    opt = MuonAdamW(
        [g for g in adam_groups if g["params"]] + muon_groups,
        reduce_grads=reduce_grads,
        compile=compile,
        polar_express=polar_express,
        polar_dtype=polar_dtype,
    )
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    return opt
