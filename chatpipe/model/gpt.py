"""The GPT: a nanochat-style decoder-only transformer, plus the KV cache used for generation.

Rotary positions, QK-norm, parameter-free RMSNorm, ReLU^2 MLP, no biases, untied embedding and
lm_head, logit soft-capping, grouped-query attention and an optional sliding-window pattern.

Options from nanochat's 2026 recipe, each a :class:`GPTConfig` field that defaults off (so every
checkpoint written before they existed loads and computes what it did): value embeddings with
per-head gates, per-layer residual and x0 lambdas, smear, backout, quarter-context sliding windows,
rotary base, q/k scale and vocab padding. :func:`nanochat_options` turns all of them on, the way
nanochat's own ``GPT`` computes (``chatpipe import-nanochat`` relies on it).

Usage::

    from chatpipe.model.gpt import GPT, config_from_depth
    config = config_from_depth(depth=4, vocab_size=4096, sequence_len=256)
    with torch.device("meta"):          # or any real device
        model = GPT(config)
    model.to_empty(device="cpu")        # only needed after "meta"
    model.init_weights()                # never called by __init__: do it explicitly
    loss = model(idx, targets)          # scalar mean cross-entropy (targets == -1 ignored)
    logits = model(idx)                 # float32 [B, T, vocab]

``init_weights`` also rebuilds the rotary tables, so a model built on "meta" is complete after
``to_empty`` + ``init_weights``. A model built on a real device already has correct tables and can
load a state dict directly (rotary tables are non-persistent buffers, not in the state dict).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from chatpipe.model.attention import MAX_LEN as BLOCKWISE_MAX_LEN
from chatpipe.model.attention import (
    BlockwiseCausal,
    FlexWindow,
    blockwise_causal_attention,
    flex_window_attention,
    sliding_window_block_mask,
)
from chatpipe.model.eager_ops import apply_rotary, relu_squared, rms_norm, softcap
from chatpipe.model.paged_cache import PackedBatch, PagedBatch, PagedPlan

SOFTCAP = 15.0
ROTARY_BASE = 10000.0
ROTARY_LEN_FACTOR = 10  # rotary tables cover 10x sequence_len so generation can run past training length


@dataclass
class GPTConfig:
    """Model shape and options; exactly the keys a checkpoint's ``model_config`` holds.

    Fields (names are stable: exports to other frameworks read them):

    - ``sequence_len``: training context; rotary tables cover 10x this.
    - ``vocab_size``: real vocabulary (logits have this many entries).
    - ``n_layer``, ``n_head``, ``n_kv_head`` (grouped-query attention when < n_head), ``n_embd``.
    - ``window_pattern``: per-layer 'S' (sliding window) / 'L' (full) string, tiled over the
      layers; the last layer is always 'L'.
    - ``short_window``: 0 = an 'S' layer's query sees the last ``sequence_len // 2`` positions
      (itself included; the original chatpipe window). > 0 = it sees itself and ``short_window``
      positions to its left (nanochat: ``ceil(sequence_len / 4 / 128) * 128``, see
      :func:`quarter_window`).
    - ``value_embeds``: value embeddings on alternating layers (those with
      ``i % 2 == (n_layer - 1) % 2``): a second token embedding of width n_kv_head*head_dim added
      to v, gated per kv head by ``3 * sigmoid(ve_gate(x[..., :12]))``.
    - ``lambdas``: learnable per-layer scalars; before block i,
      ``x = resid_lambdas[i] * x + x0_lambdas[i] * x0`` (x0 = the normed, smeared embedding).
    - ``smear``: ``x[t] += smear_lambda * sigmoid(smear_gate(x[t, :24])) * x[t-1]`` on the normed
      embedding (a cheap bigram path); the KV cache keeps the previous position's embedding.
    - ``backout``: subtract ``backout_lambda`` x the residual after block ``n_layer // 2`` from the
      final residual before the last norm.
    - ``rotary_base``: rotary frequency base (10000 original, 100000 nanochat).
    - ``qk_scale``: q and k are multiplied by this after QK-norm (1.0 original, 1.2 nanochat);
      attention still scales by 1/sqrt(head_dim).
    - ``pad_vocab_to``: wte, lm_head and value embeddings get ``vocab_size`` rounded up to a multiple
      of this (1 = no padding, 64 nanochat); padded logits are sliced off.
    """

    sequence_len: int = 2048
    vocab_size: int = 65536
    n_layer: int = 20
    n_head: int = 10
    n_kv_head: int = 10
    n_embd: int = 1280
    window_pattern: str = "L"
    short_window: int = 0
    value_embeds: bool = False
    lambdas: bool = False
    smear: bool = False
    backout: bool = False
    rotary_base: float = ROTARY_BASE
    qk_scale: float = 1.0
    pad_vocab_to: int = 1

    @property
    def padded_vocab_size(self) -> int:
        """Rows of wte / lm_head: vocab_size rounded up to a multiple of ``pad_vocab_to``."""
        m = max(1, self.pad_vocab_to)
        return -(-self.vocab_size // m) * m

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.n_embd // self.n_head

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON sidecars and MLflow params."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error so typos surface."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GPTConfig keys {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**d)


# names of the nanochat-recipe options in GPTConfig and the value each takes in nanochat
MODEL_OPTIONS = (
    "value_embeds",
    "lambdas",
    "smear",
    "backout",
    "short_window",
    "rotary_base",
    "qk_scale",
    "pad_vocab_to",
)
VE_GATE_CHANNELS = 12  # input channels of a value-embedding gate
SMEAR_GATE_CHANNELS = 24  # input channels of the smear gate


def quarter_window(sequence_len: int) -> int:
    """nanochat's short window: a quarter of the context, rounded up to a multiple of 128 tokens."""
    return math.ceil(sequence_len / 4 / 128) * 128


def nanochat_options(sequence_len: int) -> dict[str, Any]:
    """GPTConfig keyword arguments that make the model compute what nanochat's 2026 ``GPT`` does."""
    return dict(
        short_window=quarter_window(sequence_len),
        value_embeds=True,
        lambdas=True,
        smear=True,
        backout=True,
        rotary_base=100000.0,
        qk_scale=1.2,
        pad_vocab_to=64,
    )


def has_value_embed(layer_idx: int, n_layer: int) -> bool:
    """Whether layer ``layer_idx`` gets a value embedding (alternating, the last layer always does)."""
    return layer_idx % 2 == (n_layer - 1) % 2


def config_from_depth(
    depth: int,
    vocab_size: int,
    sequence_len: int,
    head_dim: int = 128,
    n_kv_head: int | None = None,
    window_pattern: str = "L",
    **options: Any,
) -> GPTConfig:
    """Derive the whole shape from one dial: n_embd = 64*depth, n_head = n_embd // head_dim (>= 1).

    ``options`` are the other GPTConfig fields (``value_embeds=True``, ...; see :data:`MODEL_OPTIONS`).
    """
    unknown = set(options) - set(MODEL_OPTIONS)
    if unknown:
        raise ValueError(f"unknown model options {sorted(unknown)}; allowed: {', '.join(MODEL_OPTIONS)}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    n_embd = depth * 64
    n_head = max(1, n_embd // head_dim)
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}; pick another head_dim")
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    if n_kv_head < 1 or n_head % n_kv_head:
        divisors = [d for d in range(1, n_head + 1) if n_head % d == 0]
        raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={n_head}; allowed: {divisors}")
    shape = {"n_layer": depth, "n_head": n_head, "n_kv_head": n_kv_head, "n_embd": n_embd}
    return GPTConfig(
        sequence_len=sequence_len, vocab_size=vocab_size, window_pattern=window_pattern, **shape, **options
    )


@dataclass(frozen=True)
class ModelCounts:
    """A model's numbers that planning derives everything else from (the training horizon, FLOPs,
    memory: :mod:`chatpipe.train.pretrain_plan`), counted once by :meth:`GPT.counts`."""

    num_params: int  # all parameters
    embedding_params: int  # the lookup tables (:meth:`GPT.num_embedding_params`)
    scaling_params: int  # what the data:param ratio counts (:meth:`GPT.scaling_params`)
    flops_per_token: int  # training FLOPs per token (:meth:`GPT.flops_per_token`)
    n_layer: int
    n_embd: int
    padded_vocab_size: int  # the rows lm_head computes
    value_embeds: bool


def count_model(config: GPTConfig) -> ModelCounts:
    """:meth:`GPT.counts` of a model of ``config``, built on the meta device (allocates nothing)."""
    with torch.device("meta"):
        return GPT(config).counts()


def layer_windows(config: GPTConfig) -> list[int | None]:
    """Keys a query may see per layer (itself included): None = full causal ('L').

    'S' layers see ``sequence_len // 2`` keys, or ``short_window + 1`` when ``short_window`` is set.
    """
    pattern = config.window_pattern.upper()
    if not pattern or set(pattern) - {"S", "L"}:
        raise ValueError(f"window_pattern={config.window_pattern!r} must be a non-empty string of 'S'/'L'")
    chars = [pattern[i % len(pattern)] for i in range(config.n_layer)]
    chars[-1] = "L"  # the last layer always sees the whole context
    short = config.short_window + 1 if config.short_window > 0 else max(1, config.sequence_len // 2)
    return [short if c == "S" else None for c in chars]


def norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without learnable parameters."""
    return rms_norm(x)


def _attention_mask(t0: int, t: int, window: int | None, device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(attn_mask, is_causal) for queries at t0..t0+t over keys 0..t0+t with an optional window.

    Fast paths avoid a mask: full causal from position 0 uses is_causal; a single query that sees
    every key needs no mask at all. True in the mask = may attend.
    """
    if window is None or window >= t0 + t:
        if t0 == 0:
            return None, True
        if t == 1:
            return None, False
    return _causal_mask(t0, t, window, device), False


def _causal_mask(t0: int, t: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[t, t0 + t]: True where query t0+i may attend key j (j <= t0+i, within ``window`` keys)."""
    q_pos = torch.arange(t0, t0 + t, device=device).unsqueeze(1)
    k_pos = torch.arange(t0 + t, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask


# One attention call: queries [q0, q1) against keys [k0, k1) with (attn_mask, is_causal); positions
# relative to the call's first query
AttentionSpan = tuple[int, int, int, int, torch.Tensor | None, bool]
CPU_ATTENTION_BLOCK = 128  # query rows per call for windowed attention over a whole sequence on CPU
# devices whose sliding-window layers go through FlexAttention (chatpipe.model.attention): CUDA only.
# On CPU the compiled flex forward is no faster than the paths below (bench/README.md) and has no backward.
FLEX_DEVICES = ("cuda",)
AttentionPlan = list[AttentionSpan] | BlockwiseCausal | FlexWindow | PagedPlan


def _attention_plan(
    t0: int, t: int, window: int | None, device: torch.device, training: bool = False, flex: bool = True
) -> AttentionPlan:
    """How to compute one layer's attention: usually one call over everything.

    On CUDA a sliding window over a whole sequence (``window < t``) goes through FlexAttention with a
    block mask that skips the blocks the window hides (:class:`FlexWindow`); full-context layers stay
    one ``is_causal`` SDPA call (the flash kernel). ``flex=False`` (a prefill into the KV cache, whose
    prompt lengths vary: each new length would compile FlexAttention again) keeps masked SDPA.

    CPU training on a whole sequence of up to :data:`BLOCKWISE_MAX_LEN` positions goes through
    :func:`blockwise_causal_attention` (batched matmuls at full rate; torch's CPU kernel is slower
    there). Otherwise on CPU, a sliding window over a whole sequence (prefill; ``window < t``) goes in
    blocks of ``window - 1`` query rows (at least :data:`CPU_ATTENTION_BLOCK`): the first block is
    plain causal, each later one sees only the keys its window reaches. torch's CPU attention
    computes every (query, key) pair of a mask, so one T x T masked call costs about T^2, the blocks
    about 0.75 T^2 at window T/2. Each query row sees the same keys with the same weights, so the
    result equals the single call up to float rounding (bitwise at the tiny config, where the
    kernel's own row and key blocks line up with these).
    """
    if flex and device.type in FLEX_DEVICES and t0 == 0 and window is not None and window < t:
        return FlexWindow(window, t)
    if device.type == "cpu" and training and t0 == 0 and 1 < t <= BLOCKWISE_MAX_LEN:
        return BlockwiseCausal(window if window is not None and window < t else None)
    if device.type != "cpu" or t0 != 0 or window is None or window >= t:
        return [(0, t, 0, t0 + t, *_attention_mask(t0, t, window, device))]
    block = max(window - 1, CPU_ATTENTION_BLOCK)
    spans: list[AttentionSpan] = [
        (0, min(block, t), 0, min(block, t), *_attention_mask(0, min(block, t), window, device))
    ]
    for start in range(block, t, block):
        end, k0 = min(start + block, t), max(0, start - window + 1)
        q_pos = torch.arange(start, end, device=device).unsqueeze(1)
        k_pos = torch.arange(k0, end, device=device).unsqueeze(0)
        spans.append((start, end, k0, end, (k_pos <= q_pos) & (q_pos - k_pos < window), False))
    return spans


class CausalSelfAttention(nn.Module):
    """Multi-head attention with rotary, QK-norm, grouped-query k/v heads and an optional value embedding gate."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.qk_scale = config.qk_scale
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=False)
        self.ve_gate = (
            nn.Linear(VE_GATE_CHANNELS, self.n_kv_head, bias=False)
            if config.value_embeds and has_value_embed(layer_idx, config.n_layer)
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        kv_cache: PagedBatch | PackedBatch | None,
        ve: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.c_q(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(b, t, self.n_kv_head, self.head_dim)
        if ve is not None:  # value embedding, gated per kv head by the first channels of the input
            gate = 3.0 * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate.unsqueeze(-1) * ve.view(b, t, self.n_kv_head, self.head_dim)
        v = v.transpose(1, 2)
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        if isinstance(plan, PagedPlan):  # rows of the KV pool, each at its own positions: the pool attends
            y = kv_cache.attend(self.layer_idx, q, k, v, plan)
            return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))
        if isinstance(plan, BlockwiseCausal):
            y = blockwise_causal_attention(q, k, v, plan.window)
        elif isinstance(plan, FlexWindow):
            y = flex_window_attention(q, k, v, plan)
        else:
            gqa = self.n_kv_head != self.n_head
            parts = [
                F.scaled_dot_product_attention(
                    q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=m, is_causal=causal, enable_gqa=gqa
                )
                for q0, q1, k0, k1, m, causal in plan
            ]
            y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """Two matrices with ReLU^2 between, 4x hidden width."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(relu_squared(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        """``attn_args``: what :meth:`CausalSelfAttention.forward` takes after its input."""
        x = x + self.attn(norm(x), *attn_args)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    """The language model. Build, then call :meth:`init_weights` (see the module docstring)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}")
        if config.n_head % config.n_kv_head:
            raise ValueError(f"n_kv_head={config.n_kv_head} must divide n_head={config.n_head}")
        if (config.n_embd // config.n_head) % 2:
            raise ValueError(f"head_dim={config.n_embd // config.n_head} must be even for rotary embeddings")
        if config.smear and config.n_embd < SMEAR_GATE_CHANNELS:
            raise ValueError(f"smear needs n_embd >= {SMEAR_GATE_CHANNELS}, got {config.n_embd}")
        if config.value_embeds and config.n_embd < VE_GATE_CHANNELS:
            raise ValueError(f"value_embeds needs n_embd >= {VE_GATE_CHANNELS}, got {config.n_embd}")
        self.config = config
        self.windows = layer_windows(config)
        vocab = config.padded_vocab_size
        self.wte = nn.Embedding(vocab, config.n_embd)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, vocab, bias=False)
        kv_dim = config.n_kv_head * config.head_dim
        # keys are layer indices; only layers with a value embedding have one
        self.value_embeds = nn.ModuleDict(
            {
                str(i): nn.Embedding(vocab, kv_dim)
                for i in range(config.n_layer)
                if config.value_embeds and has_value_embed(i, config.n_layer)
            }
        )
        if config.lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
            self.x0_lambdas = nn.Parameter(torch.zeros(config.n_layer))
        if config.smear:
            self.smear_gate = nn.Linear(SMEAR_GATE_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if config.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        cos, sin = self._rotary_tables(self.wte.weight.device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._build_block_masks()

    def _build_block_masks(self) -> None:
        """Build the FlexAttention block masks of the training length now, outside any compiled forward:
        the compiled step then finds them cached and neither traces their construction nor recompiles."""
        device = self.wte.weight.device
        seq = self.config.sequence_len
        if device.type in FLEX_DEVICES:
            for window in {w for w in self.windows if w is not None and w < seq}:
                sliding_window_block_mask(seq, window, device)

    def _rotary_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        head_dim = self.config.n_embd // self.config.n_head
        length = ROTARY_LEN_FACTOR * self.config.sequence_len
        inv_freq = 1.0 / self.config.rotary_base ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        )
        angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
        return angles.cos()[None, None], angles.sin()[None, None]  # [1, 1, length, head_dim/2]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic (given the torch seed) init; also rebuilds the rotary tables on the current device."""
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        s = math.sqrt(3.0) / math.sqrt(self.config.n_embd)  # uniform with std 1/sqrt(n_embd)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -s, s)
            # zero output projections: every block starts as the identity on the residual stream
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)  # every gate starts at 3 * sigmoid(0) = 1.5
        for ve in self.value_embeds.values():
            nn.init.uniform_(ve.weight, -s, s)  # like c_v: the two sums start at similar scale
        if self.config.lambdas:
            nn.init.ones_(self.resid_lambdas)
            nn.init.constant_(self.x0_lambdas, 0.1)
        if self.config.smear:
            nn.init.zeros_(self.smear_gate.weight)
            nn.init.zeros_(self.smear_lambda)  # smear starts off; training opens it
        if self.config.backout:
            nn.init.constant_(self.backout_lambda, 0.2)
        cos, sin = self._rotary_tables(self.wte.weight.device)
        self.cos, self.sin = cos, sin
        self._build_block_masks()

    def hidden(self, idx: torch.Tensor, kv_cache: PagedBatch | PackedBatch | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, n_embd] (what lm_head reads; a value head reads them too).

        With ``kv_cache`` (a :class:`chatpipe.model.paged_cache.PagedBatch`, the engine's), row ``i``
        continues its sequence in the KV pool; without, each row is a whole sequence from position 0."""
        cos, sin, plans = self._attention_inputs(idx, kv_cache)
        config = self.config
        x = norm(self.wte(idx))
        if config.smear:
            x = self._smear(x, kv_cache)
        x0 = x
        backout_at = config.n_layer // 2 if config.backout else -1
        x_mid = None
        for i, (block, window) in enumerate(zip(self.blocks, self.windows)):
            if config.lambdas:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](idx) if block.attn.ve_gate is not None else None
            x = block(x, cos, sin, plans[window], kv_cache, ve)
            if i == backout_at:
                x_mid = x
        if x_mid is not None:
            x = x - self.backout_lambda * x_mid
        if kv_cache is not None:
            kv_cache.advance(idx.size(1))
        return norm(x)

    def _attention_inputs(self, idx: torch.Tensor, kv_cache: PagedBatch | PackedBatch | None) -> tuple[Any, Any, dict]:
        """The rotary tables of the input's positions and each window's attention plan."""
        t = idx.size(1)
        if kv_cache is None:  # whole sequences: training, evaluation, a forward with no cache
            if t > self.cos.size(2):
                raise ValueError(f"positions 0..{t} exceed the rotary table length {self.cos.size(2)}")
            training = torch.is_grad_enabled()
            plans = {w: _attention_plan(0, t, w, idx.device, training) for w in set(self.windows)}
            return self.cos[:, :, :t], self.sin[:, :, :t], plans
        positions = kv_cache.positions()  # rows of sequences in KV blocks, each at its own positions
        if int(positions.max()) >= self.cos.size(2):
            raise ValueError(f"position {int(positions.max())} exceeds the rotary table length {self.cos.size(2)}")
        if self.config.smear:
            kv_cache.prev_embed = self._previous_embeds(kv_cache.previous_tokens(), idx.device)
        plans = {w: kv_cache.plan(w) for w in set(self.windows)}
        return self.cos[0, 0, positions][:, None], self.sin[0, 0, positions][:, None], plans

    def _previous_embeds(self, tokens: list[int | None], device: torch.device) -> torch.Tensor:
        """[rows, 1, n_embd]: the smear's previous embedding of each row, zeros where a row starts its
        sequence (x + gate * 0 is x: that row's first token is not smeared, as at position 0)."""
        ids = torch.tensor([0 if t is None else t for t in tokens], device=device)
        embeds = self.embed_for_smear(ids)
        starts = torch.tensor([t is None for t in tokens], device=device)
        return embeds.masked_fill(starts[:, None, None], 0.0)

    def embed_for_smear(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, 1, n_embd]: what a KV cache keeps as ``prev_embed`` after tokens ``ids`` [B] (their normed embedding)."""
        return norm(self.wte(ids[:, None]))

    def _smear(self, x: torch.Tensor, kv_cache: PagedBatch | PackedBatch | None) -> torch.Tensor:
        """Mix each position's embedding with the previous one's, gated by its first channels."""
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :SMEAR_GATE_CHANNELS]))  # [B, T, 1]
        prev = x[:, :-1]
        if kv_cache is not None and kv_cache.pos > 0:
            if kv_cache.prev_embed is None:
                raise ValueError("smear: the KV cache holds positions but no previous embedding")
            smeared = x + gate * kv_cache.previous(x)
        else:  # the first position has no predecessor
            smeared = torch.cat([x[:, :1], x[:, 1:] + gate[:, 1:] * prev], dim=1)
        return smeared

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        kv_cache: PagedBatch | PackedBatch | None = None,
        loss_reduction: str = "mean",
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (float32 [B, T, V]) without targets; cross-entropy with targets (-1 = ignore).

        ``loss_reduction="none"`` returns per-token losses [B, T] (0.0 where ignored). With a
        ``kv_cache`` (the engine's :class:`chatpipe.model.paged_cache.PagedBatch` or ``PackedBatch``), each
        row continues its sequence in the KV pool and its new keys/values are stored there.
        ``logits_at`` (indices into the B*T positions) gives the logits of those positions only, [n, V]:
        generation needs a row's last position, and the head over every prompt token is wasted work.
        """
        b, t = idx.shape
        hidden = self.hidden(idx, kv_cache)
        if logits_at is not None:
            hidden = hidden.flatten(0, 1).index_select(0, logits_at)
        logits = self.lm_head(hidden)
        if self.config.padded_vocab_size != self.config.vocab_size:
            logits = logits[..., : self.config.vocab_size]
        logits = logits.float()
        logits = softcap(logits, SOFTCAP)
        if targets is None:
            return logits
        if loss_reduction not in ("mean", "none"):
            raise ValueError(f"loss_reduction={loss_reduction!r}; allowed: 'mean', 'none'")
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1, reduction=loss_reduction
        )
        return loss if loss_reduction == "mean" else loss.view(b, t)

    def num_params(self) -> int:
        """All parameters."""
        return sum(p.numel() for p in self.parameters())

    def num_embedding_params(self) -> int:
        """Lookup tables (wte and value embeddings); lm_head is a real matmul and counts as compute."""
        return self.wte.weight.numel() + sum(ve.weight.numel() for ve in self.value_embeds.values())

    def scaling_params(self) -> int:
        """Parameters the data:param ratio and the FLOPs count: the block matrices (value-embedding
        gates included) and lm_head. Not wte or value embeddings (lookups) nor the lambdas and
        smear gate (a few elementwise ops): nanochat's N in its scaling laws."""
        return sum(p.numel() for p in self.blocks.parameters()) + self.lm_head.weight.numel()

    def flops_per_token(self) -> int:
        """Training FLOPs per token, counted as nanochat does: 6 * the matmul weights (:meth:`scaling_params`
        and the smear gate, a small linear) plus attention, 12 * heads * head_dim * the keys before each
        query per layer (the whole sequence for 'L' layers, the window's left part for 'S' layers)."""
        matmul = self.scaling_params() + (self.smear_gate.weight.numel() if self.config.smear else 0)
        head_dim = self.config.n_embd // self.config.n_head
        seq = self.config.sequence_len
        # a window of w keys includes the query itself; nanochat counts the w - 1 before it
        attn = sum(12 * self.config.n_head * head_dim * (seq if w is None else min(w - 1, seq)) for w in self.windows)
        return 6 * matmul + attn

    def counts(self) -> ModelCounts:
        """The numbers planning reads of this model, in one record (:class:`ModelCounts`)."""
        c = self.config
        return ModelCounts(
            num_params=self.num_params(),
            embedding_params=self.num_embedding_params(),
            scaling_params=self.scaling_params(),
            flops_per_token=self.flops_per_token(),
            n_layer=c.n_layer,
            n_embd=c.n_embd,
            padded_vocab_size=c.padded_vocab_size,
            value_embeds=c.value_embeds,
        )

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by optimizer role: ``matrix`` (Muon: every block matrix, gates included);
        ``embedding``, ``lm_head``, ``value_embeds``, ``resid_lambdas``, ``x0_lambdas`` and
        ``gates`` (smear gate and lambda, backout lambda) for AdamW. Groups of options that are
        off are empty lists."""
        config = self.config
        gates = [self.smear_gate.weight, self.smear_lambda] if config.smear else []
        gates += [self.backout_lambda] if config.backout else []
        return {
            "matrix": [p for p in self.blocks.parameters() if p.dim() == 2],
            "embedding": [self.wte.weight],
            "lm_head": [self.lm_head.weight],
            "value_embeds": [ve.weight for ve in self.value_embeds.values()],
            "resid_lambdas": [self.resid_lambdas] if config.lambdas else [],
            "x0_lambdas": [self.x0_lambdas] if config.lambdas else [],
            "gates": gates,
        }
