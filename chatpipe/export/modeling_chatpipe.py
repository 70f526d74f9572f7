"""transformers remote code for a chatpipe GPT with options the built-in ``NanoChat`` class lacks.

``chatpipe export`` copies this file into the exported directory and points ``auto_map`` in
config.json at it, so ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads
the model without chatpipe installed: it imports torch and transformers only. Parameter names are
chatpipe's own (``wte``, ``blocks.{i}.attn.c_q``, ``value_embeds.{i}``, ``resid_lambdas``, ...).

The forward pass, from the formulas (pre-norm blocks, parameter-free RMSNorm everywhere):

- ``x = norm(wte[idx])``; smear: ``x[t] += smear_lambda * sigmoid(smear_gate(x[t, :24])) * x[t-1]``
  for t >= 1; ``x0 = x``.
- before block i: ``x = resid_lambdas[i] * x + x0_lambdas[i] * x0``; then
  ``x += attn(norm(x))``, ``x += mlp(norm(x))`` with ``mlp(h) = c_proj(relu(c_fc(h))**2)``.
- attention: q, k, v projections (k, v with ``num_key_value_heads`` heads); on value-embedding
  layers ``v += 3 * sigmoid(ve_gate(h[..., :12])) * value_embeds[i][idx]`` per kv head; rotary on
  q, k (halves paired, base ``rope_theta``), RMSNorm, times ``qk_scale``; causal softmax attention
  scaled by 1/sqrt(head_dim), a query of an 'S' layer seeing only its ``window`` last keys.
- backout: ``x -= backout_lambda * (x after block num_hidden_layers // 2)``; then norm, lm_head,
  slice to ``vocab_size`` (the padded rows are dropped), ``softcap * tanh(logits / softcap)``.

``generate()`` uses transformers' ``DynamicCache`` for keys and values; smear also needs the
previous position's normed embedding, which rides on the cache object as ``chatpipe_prev``.
Padding is not supported: an ``attention_mask`` with zeros is refused.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

VE_GATE_CHANNELS = 12
SMEAR_GATE_CHANNELS = 24


class ChatpipeConfig(PretrainedConfig):
    """Shape and options; ``layer_windows[i]`` = keys a query of layer i sees (0 = all of them)."""

    model_type = "chatpipe"

    def __init__(
        self,
        vocab_size: int = 65536,
        padded_vocab_size: int = 65536,
        hidden_size: int = 1280,
        num_hidden_layers: int = 20,
        num_attention_heads: int = 10,
        num_key_value_heads: int = 10,
        max_position_embeddings: int = 2048,
        layer_windows: list[int] | None = None,
        value_embed_layers: list[int] | None = None,
        lambdas: bool = False,
        smear: bool = False,
        backout: bool = False,
        rope_theta: float = 10000.0,
        qk_scale: float = 1.0,
        final_logit_softcapping: float = 15.0,
        **kwargs,
    ) -> None:
        self.vocab_size, self.padded_vocab_size = vocab_size, padded_vocab_size
        self.hidden_size, self.num_hidden_layers = hidden_size, num_hidden_layers
        self.num_attention_heads, self.num_key_value_heads = num_attention_heads, num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.layer_windows = list(layer_windows or [0] * num_hidden_layers)
        self.value_embed_layers = list(value_embed_layers or [])
        self.lambdas, self.smear, self.backout = lambdas, smear, backout
        self.rope_theta, self.qk_scale = rope_theta, qk_scale
        self.final_logit_softcapping = final_logit_softcapping
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def rms(x: torch.Tensor) -> torch.Tensor:
    # no eps argument: torch then uses the dtype's machine epsilon, as chatpipe's training does
    return F.rms_norm(x, (x.size(-1),))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [B, H, T, D]: the pair (first half, second half) turned by the angle."""
    a, b = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([a * cos + b * sin, b * cos - a * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ChatpipeConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.qk_scale, self.window = config.qk_scale, config.layer_windows[layer]
        d, kv = config.hidden_size, self.kv_heads * self.head_dim
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, kv, bias=False)
        self.c_v = nn.Linear(d, kv, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        has_ve = layer in config.value_embed_layers
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, self.kv_heads, bias=False) if has_ve else None

    def forward(self, h, cos, sin, ve, cache):
        b, t, _ = h.shape
        q = self.c_q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.c_k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.c_v(h).view(b, t, self.kv_heads, self.head_dim)
        if ve is not None:
            gate = 3.0 * torch.sigmoid(self.ve_gate(h[..., :VE_GATE_CHANNELS]))  # [B, T, kv_heads]
            v = v + gate.unsqueeze(-1) * ve.view(b, t, self.kv_heads, self.head_dim)
        v = v.transpose(1, 2)
        q = rms(rotate(q, cos, sin)) * self.qk_scale
        k = rms(rotate(k, cos, sin)) * self.qk_scale
        if cache is not None:  # keys and values of the earlier positions come first
            k, v = cache.update(k, v, self.layer)
        keys = torch.arange(k.size(2), device=h.device)
        lag = keys[-t:, None] - keys[None, :]  # query minus key position
        mask = (lag >= 0) & (lag < self.window) if self.window else lag >= 0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.c_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, h):
        return self.c_proj(F.relu(self.c_fc(h)).square())


class Block(nn.Module):
    def __init__(self, config: ChatpipeConfig, layer: int) -> None:
        super().__init__()
        self.attn = Attention(config, layer)
        self.mlp = MLP(config.hidden_size)

    def forward(self, x, cos, sin, ve, cache):
        x = x + self.attn(rms(x), cos, sin, ve, cache)
        return x + self.mlp(rms(x))


class ChatpipePreTrainedModel(PreTrainedModel):
    config_class = ChatpipeConfig
    base_model_prefix = ""
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    def _init_weights(self, module):
        pass  # every weight comes from model.safetensors; nothing is trained from this class's init


class ChatpipeForCausalLM(ChatpipePreTrainedModel, GenerationMixin):
    """The GPT with a language-modelling head: logits over ``vocab_size`` ids, soft-capped."""

    def __init__(self, config: ChatpipeConfig) -> None:
        super().__init__(config)
        d, n, vocab = config.hidden_size, config.num_hidden_layers, config.padded_vocab_size
        kv = config.num_key_value_heads * (d // config.num_attention_heads)
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(n))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(vocab, kv) for i in config.value_embed_layers})
        if config.lambdas:
            self.resid_lambdas = nn.Parameter(torch.ones(n))
            self.x0_lambdas = nn.Parameter(torch.zeros(n))
        if config.smear:
            self.smear_gate = nn.Linear(SMEAR_GATE_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if config.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def get_output_embeddings(self):
        return self.lm_head

    def _rotary(self, t0: int, t: int, device: torch.device):
        """cos, sin [1, 1, t, head_dim/2] for positions t0 .. t0+t-1."""
        dim = self.config.hidden_size // self.config.num_attention_heads
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        angles = torch.outer(torch.arange(t0 + t, dtype=torch.float32, device=device)[t0:], inv_freq)
        return angles.cos()[None, None], angles.sin()[None, None]

    def _embed(self, input_ids, cache):
        x = rms(self.wte(input_ids))
        if not self.config.smear:
            return x
        # a gated share of the previous position's embedding (a bigram path); the first position of
        # a sequence has none, a continuation takes it from the cache
        prev = getattr(cache, "chatpipe_prev", None) if cache is not None and cache.get_seq_length() else None
        before = x[:, :-1] if prev is None else torch.cat([prev.to(x.dtype), x[:, :-1]], dim=1)
        start = 1 if prev is None else 0
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, start:, :SMEAR_GATE_CHANNELS]))
        if cache is not None:
            cache.chatpipe_prev = x[:, -1:]
        return torch.cat([x[:, :start], x[:, start:] + gate * before], dim=1)

    def forward(self, input_ids, attention_mask=None, labels=None, past_key_values=None, use_cache=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "chatpipe remote code does not support padding: pass unpadded sequences (and an all-ones "
                "attention_mask where the prompt holds the pad id <|bos|>)"
            )
        config = self.config
        cache = past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        t0 = cache.get_seq_length() if cache is not None else 0
        cos, sin = self._rotary(t0, input_ids.size(1), input_ids.device)
        x = x0 = self._embed(input_ids, cache)
        middle = None
        for i, block in enumerate(self.blocks):
            if config.lambdas:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0
            ve = self.value_embeds[str(i)](input_ids) if str(i) in self.value_embeds else None
            x = block(x, cos, sin, ve, cache)
            if i == config.num_hidden_layers // 2:
                middle = x
        if config.backout:  # remove part of the mid-network residual before reading out
            x = x - self.backout_lambda * middle
        logits = self.lm_head(rms(x))[..., : config.vocab_size].float()
        cap = config.final_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:  # transformers' convention: labels are the inputs, shifted here
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
