"""Export a chatpipe model as a Hugging Face ``transformers`` directory (built-in ``NanoChat`` class or our remote code).

Run::

    chatpipe export --model sft --out hf/chatpipe-sft          # python -m chatpipe.cli export ...
    chatpipe export --model models:/chatpipe/3 --out DIR --push-to-hub me/chatpipe-d20

What ``DIR`` holds afterwards (``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(DIR)`` load it)::

    model.safetensors        the weights under transformers' NanoChat names (remote code: our names)
    config.json              model_type "nanochat" (rotary base, soft-cap, rms eps, GQA heads, ...),
                             or "chatpipe" with an auto_map to modeling_chatpipe.py
    modeling_chatpipe.py     only on the remote-code path: our model for trust_remote_code=True
    generation_config.json   bos, eos (= <|assistant_end|> and <|bos|>, where our engine stops), pad
    tokenizer.json           byte-level BPE with our ranks, split regex and special tokens
    tokenizer_config.json    PreTrainedTokenizerFast + the chat template
    chat_template.jinja      renders conversations to exactly the ids chatpipe.tokenizer renders
    README.md                model card: report numbers, lineage (git commit, dvc.lock hash)
    chatpipe_export.json     what was exported from where (machine-readable lineage)

The built-in class computes our function exactly only for the options it has (``transformers``
5.23, checked on the sft model: bit-identical fp32 logits), and is the choice whenever the model
fits it: such a directory never needs ``trust_remote_code``. A model that uses an option it lacks
(sliding-window 'S' layers, value embeddings, residual/x0 lambdas, smear, backout, q/k scale, vocab
padding) is written with our own ``modeling_chatpipe.py`` (torch + transformers only, loaded with
``trust_remote_code=True``; fp32 logits within 1e-4 of ours). The choice reads a table of
(GPTConfig field, what the built-in class supports); fields a GPTConfig does not have are skipped,
and a field the exporter knows nothing about is refused (it might change the function). The model
card and ``chatpipe_export.json`` (``path``) say which path was taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from chatpipe.io import atomic_dir, sha256_file, write_json_atomic
from chatpipe.model.gpt import ROTARY_BASE, SOFTCAP, has_value_embed, layer_windows
from chatpipe.runtime import DTYPE_NAMES, dtype_named
from chatpipe.tokenizer import SPECIAL_TOKENS

log = logging.getLogger(__name__)

# F.rms_norm's default eps is the float32 machine epsilon; NanoChat's 1e-6 default leaves ~6e-6 differences.
RMS_NORM_EPS = float(torch.finfo(torch.float32).eps)
WEIGHTS_FILE = "model.safetensors"
LINEAGE_FILE = "chatpipe_export.json"
MODELING = "modeling_chatpipe"  # our remote code: chatpipe/export/modeling_chatpipe.py, copied as is


class ExportError(ValueError):
    """The model cannot be exported as asked; the message names the option or file."""


# --------------------------------------------------------------------------- what the built-in class supports


def _only_full_attention(value: Any, config: Any) -> bool:
    return all(w is None for w in layer_windows(config))


def _no_vocab_padding(value: Any, config: Any) -> bool:
    return int(value) <= 1 or config.vocab_size % int(value) == 0


# (GPTConfig field, test of the value the built-in NanoChat class supports, that value in words).
# A field absent from a GPTConfig is skipped, so this table can name options before they exist.
SUPPORTED: list[tuple[str, Callable[[Any, Any], bool], str]] = [
    ("window_pattern", _only_full_attention, "only 'L' layers (NanoChat has no sliding windows)"),
    ("value_embeds", lambda v, c: not v, "False (NanoChat has no value embeddings)"),
    ("lambdas", lambda v, c: not v, "False (NanoChat has no residual/x0 lambdas)"),
    ("smear", lambda v, c: not v, "False (NanoChat has no smear)"),
    ("backout", lambda v, c: not v, "False (NanoChat has no backout)"),
    ("qk_scale", lambda v, c: float(v) == 1.0, "1.0 (NanoChat does not scale q/k after QK-norm)"),
    ("pad_vocab_to", _no_vocab_padding, "1 or a divisor of vocab_size (NanoChat cannot slice padded logits)"),
]
# Fields that map onto config.json keys (any value is fine) or that only matter with an option above off.
MAPPED = {"sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "rotary_base"}
IRRELEVANT = {"short_window"}  # the window length of 'S' layers, which window_pattern already refuses


def builtin_lacks(config: Any) -> list[str]:
    """The options of ``config`` transformers' built-in NanoChat class lacks, as ``field=value (why)``.

    An empty list means the built-in class computes our function. A field the exporter knows
    nothing about raises :class:`ExportError`: it might change the function, and neither the
    built-in class nor our remote code would carry it.
    """
    problems, unknown = [], []
    checks = {name: (ok, allowed) for name, ok, allowed in SUPPORTED}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in checks:
            ok, allowed = checks[f.name]
            if not ok(value, config):
                problems.append(f"{f.name}={value!r} (NanoChat supports: {allowed})")
        elif f.name not in MAPPED | IRRELEVANT:
            unknown.append(f"{f.name}={value!r} (unknown to the exporter: add it to chatpipe.export.hf.SUPPORTED)")
    if unknown:
        raise ExportError("cannot export a model with option(s) the exporter does not know: " + "; ".join(unknown))
    return problems


def export_path(config: Any) -> str:
    """``"builtin"`` when transformers' NanoChat class fits ``config``, else ``"remote_code"``."""
    return "remote_code" if builtin_lacks(config) else "builtin"


# --------------------------------------------------------------------------- config and weights


def _common_config(tokenizer: Any, dtype: str) -> dict[str, Any]:
    """config.json keys both model classes share: soft-cap, untied head, cache, token ids, dtype."""
    sp = tokenizer.special_ids
    return {
        "final_logit_softcapping": SOFTCAP,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": sp["<|bos|>"],
        "eos_token_id": sp["<|assistant_end|>"],
        "pad_token_id": sp["<|bos|>"],  # <|bos|> pads: generation stops at <|assistant_end|>
        "dtype": dtype,
    }


def hf_config(config: Any, tokenizer: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of the NanoChat model equal to our GPT with ``config``."""
    return {
        "architectures": ["NanoChatForCausalLM"],
        "model_type": "nanochat",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": 4 * config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.n_embd // config.n_head,
        "max_position_embeddings": config.sequence_len,
        "hidden_act": "relu2",
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(getattr(config, "rotary_base", ROTARY_BASE))},
        "attention_bias": False,
        "attention_dropout": 0.0,
        **_common_config(tokenizer, dtype),
    }


def hf_state_dict(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Our parameter names -> NanoChat's (a one-to-one rename; no tensor changes)."""
    names = {"wte.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        for a, b in (("c_q", "q_proj"), ("c_k", "k_proj"), ("c_v", "v_proj"), ("c_proj", "o_proj")):
            names[f"{ours}attn.{a}.weight"] = f"{theirs}self_attn.{b}.weight"
        names[f"{ours}mlp.c_fc.weight"] = f"{theirs}mlp.fc1.weight"
        names[f"{ours}mlp.c_proj.weight"] = f"{theirs}mlp.fc2.weight"
    unmapped = sorted(set(state) - set(names))
    missing = sorted(set(names) - set(state))
    if unmapped or missing:
        raise ExportError(f"state dict does not match the NanoChat layout: unmapped {unmapped}, missing {missing}")
    return {names[k]: v.detach().contiguous() for k, v in state.items()}


def remote_config(config: Any, tokenizer: Any, dtype: str = "float32") -> dict[str, Any]:
    """config.json of our own remote-code model (modeling_chatpipe.py) equal to our GPT with ``config``."""
    n = config.n_layer
    return {
        "architectures": ["ChatpipeForCausalLM"],
        "model_type": "chatpipe",
        # both classes live in the one file copied next to config.json
        "auto_map": {
            "AutoConfig": f"{MODELING}.ChatpipeConfig",
            "AutoModelForCausalLM": f"{MODELING}.ChatpipeForCausalLM",
        },
        "vocab_size": config.vocab_size,
        "padded_vocab_size": config.padded_vocab_size,
        "hidden_size": config.n_embd,
        "num_hidden_layers": n,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "max_position_embeddings": config.sequence_len,
        "layer_windows": [w or 0 for w in layer_windows(config)],
        "value_embed_layers": [i for i in range(n) if config.value_embeds and has_value_embed(i, n)],
        "lambdas": bool(config.lambdas),
        "smear": bool(config.smear),
        "backout": bool(config.backout),
        "rope_theta": float(config.rotary_base),
        "qk_scale": float(config.qk_scale),
        **_common_config(tokenizer, dtype),
    }


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights as plain tensors, whatever wraps its Linear layers.

    torchao's float8 training keeps high-precision weights inside ``Float8Linear`` (a Linear
    subclass), so its state dict already has our names; a tensor subclass is unwrapped here so
    that safetensors writes ordinary tensors.
    """
    out = {}
    for name, value in model.state_dict().items():
        value = value.detach()
        if type(value) is not torch.Tensor:
            value = value.dequantize() if hasattr(value, "dequantize") else torch.Tensor(value)
        out[name] = value
    return out


# --------------------------------------------------------------------------- tokenizer and chat template

# Renders like chatpipe.tokenizer.Tokenizer.render_conversation: <|bos|>, a leading system message
# merged into the first user message ("system\n\nuser"), roles alternating user/assistant, and an
# assistant content that is a string or a list of parts {type: text|python|python_output, text}.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system=none) -%}"
    "{%- set msgs = messages -%}"
    "{%- if msgs and msgs[0]['role'] == 'system' -%}"
    "{%- set ns.system = msgs[0]['content'] -%}{%- set msgs = msgs[1:] -%}"
    "{%- endif -%}"
    "<|bos|>"
    "{%- for m in msgs -%}"
    "{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('roles must alternate user/assistant after an optional leading system message') }}"
    "{%- endif -%}"
    "{%- if m['role'] == 'user' -%}"
    "<|user_start|>"
    "{%- if loop.first and ns.system is not none -%}{{ ns.system ~ '\\n\\n' }}{%- endif -%}"
    "{{ m['content'] }}<|user_end|>"
    "{%- else -%}"
    "<|assistant_start|>"
    "{%- if m['content'] is string -%}{{ m['content'] }}"
    "{%- else -%}{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'python' -%}<|python_start|>{{ p['text'] }}<|python_end|>"
    "{%- elif p['type'] == 'python_output' -%}<|output_start|>{{ p['text'] }}<|output_end|>"
    "{%- else -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "<|assistant_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}"
)


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable unicode char table (what byte-level BPE vocabularies are written in).

    Printable Latin-1 bytes stand for themselves; the other 68 map to U+0100 onwards, in byte order.
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def hf_tokenizer(tokenizer: Any):
    """A ``PreTrainedTokenizerFast`` that encodes exactly like ``tokenizer`` (a chatpipe Tokenizer).

    tiktoken merges, at every step, the adjacent pair whose concatenation has the lowest rank; a
    HF BPE model with one merge per way of splitting each token into two tokens, ordered by the
    merged token's rank, makes the same choices. ``ignore_merges`` takes a whole pre-token that is
    itself in the vocabulary directly, as tiktoken does.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    ranks: dict[bytes, int] = tokenizer.enc._mergeable_ranks
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    vocab = {text(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        merges.extend((rank, ranks[a], ranks[b], a, b) for a, b in splits)
    merges.sort()
    bpe = models.BPE(vocab, [(text(a), text(b)) for *_, a, b in merges], fuse_unk=False, ignore_merges=True)
    raw = RawTokenizer(bpe)
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.enc._pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    # tok(text) starts with <|bos|> like every document we train on (add_special_tokens=False: without);
    # the chat template writes its own <|bos|> and is tokenized without special tokens added.
    bos = tokenizer.bos_id
    raw.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B:1", special_tokens=[("<|bos|>", bos)]
    )
    specials = sorted(tokenizer.special_ids.items(), key=lambda kv: kv[1])
    raw.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    for name, want in specials:
        got = raw.token_to_id(name)
        if got != want:
            raise ExportError(f"special token {name} got id {got} in the HF tokenizer, ours is {want}")
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<|bos|>",
        eos_token="<|assistant_end|>",
        pad_token="<|bos|>",
        additional_special_tokens=[s for s in SPECIAL_TOKENS if s not in ("<|bos|>", "<|assistant_end|>")],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


# --------------------------------------------------------------------------- model card


def model_card(
    meta: dict[str, Any], source: str, lineage: dict[str, Any], report: dict[str, Any] | None, path: str = "builtin"
) -> str:
    """README.md for the exported dir: what it is, which path (``builtin`` | ``remote_code``) was
    taken, how to load it, report numbers and lineage."""
    stage = meta.get("stage", "?")
    cfg = meta.get("model_config", {})
    if path == "builtin":
        target, trust = "transformers' built-in `NanoChat` class (no remote code)", ""
    else:
        target = (
            f"chatpipe's own modeling code (`{MODELING}.py` in this repo, loaded with `trust_remote_code=True`): "
            "the model uses options transformers' built-in `NanoChat` class lacks. It does not take padded "
            "batches. `AutoTokenizer` "
            "reads config.json too, so it also needs `trust_remote_code=True`"
        )
        trust = ", trust_remote_code=True"
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [chatpipe, nanochat]",
        "---",
        f"# chatpipe {stage} model",
        "",
        f"A {cfg.get('n_layer', '?')}-layer, {cfg.get('n_embd', '?')}-wide nanochat-style GPT trained by the "
        f"chatpipe pipeline (stage `{stage}`, step {meta.get('step', '?')}), exported from `{source}` to "
        f"{target}.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tok = AutoTokenizer.from_pretrained("DIR"{trust})',
        f'model = AutoModelForCausalLM.from_pretrained("DIR"{trust})',
        'ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,',
        '                              return_tensors="pt", return_dict=True)["input_ids"]',
        "print(tok.decode(model.generate(ids, max_new_tokens=64)[0, ids.shape[1]:]))",
        "```",
        "",
        "Calculator tool calls appear as `<|python_start|>expr<|python_end|>`; chatpipe's engine evaluates",
        "them and inserts `<|output_start|>result<|output_end|>`. Plain `generate` does not run the tool.",
        "",
        "## Evaluation (chatpipe report)",
        "",
    ]
    summary = (report or {}).get("summary")
    if summary:
        cols = [c for c in ("base", "mid", "sft", "rl") if any(v.get(c) is not None for v in summary.values())]
        lines += ["| metric | " + " | ".join(c.upper() for c in cols) + " |", "|---|" + "---|" * len(cols)]
        for row, values in summary.items():
            cells = ["" if values.get(c) is None else f"{values[c]:.4f}" for c in cols]
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
    else:
        lines.append("No report found (artifacts/report/report.json): run the pipeline's eval and report stages.")
    lines += ["", "## Lineage", "", "| what | value |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in lineage.items()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- export


def _write_model(tmp: Path, model: torch.nn.Module, tokenizer: Any, torch_dtype: torch.dtype, dtype: str) -> str:
    """config, weights, generation config and tokenizer into ``tmp``; returns the path taken.

    The built-in NanoChat class when it fits (no remote code to trust), else our own modeling file
    with the weights under our names.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig, NanoChatConfig

    config = model.config
    state = plain_state_dict(model)
    path = export_path(config)
    if path == "builtin":
        cfg = NanoChatConfig(**{k: v for k, v in hf_config(config, tokenizer, dtype).items() if k != "architectures"})
        cfg.architectures = ["NanoChatForCausalLM"]
        cfg.save_pretrained(tmp)
        state = hf_state_dict(state, config.n_layer)
    else:
        write_json_atomic(tmp / "config.json", remote_config(config, tokenizer, dtype))
        shutil.copyfile(Path(__file__).with_name(f"{MODELING}.py"), tmp / f"{MODELING}.py")
    weights = {k: v.to(torch_dtype).contiguous() for k, v in state.items()}
    save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    sp = tokenizer.special_ids
    GenerationConfig(
        bos_token_id=sp["<|bos|>"],
        eos_token_id=[sp["<|assistant_end|>"], sp["<|bos|>"]],  # where chatpipe's engine stops
        pad_token_id=sp["<|bos|>"],
    ).save_pretrained(tmp)
    hf_tokenizer(tokenizer).save_pretrained(tmp)
    return path


def export_model(
    model: torch.nn.Module,
    tokenizer: Any,
    meta: dict[str, Any],
    out_dir: Path,
    *,
    source: str = "",
    dtype: str = "float32",
    report_path: Path | None = Path("artifacts/report/report.json"),
    lock_path: Path = Path("dvc.lock"),
) -> Path:
    """Write the transformers directory for ``model`` + ``tokenizer`` atomically to ``out_dir``."""
    config = model.config
    builtin_lacks(config)  # refuses an option neither path carries, before anything is written
    torch_dtype = dtype_named(dtype)
    if torch_dtype is None:
        raise ExportError(f"dtype={dtype!r}; allowed: {', '.join(DTYPE_NAMES)}")
    if tokenizer.vocab_size > config.vocab_size:
        raise ExportError(f"tokenizer has {tokenizer.vocab_size} ids, the model only {config.vocab_size}")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        path = _write_export(tmp, model, tokenizer, torch_dtype, dtype, meta, source, report_path, lock_path)
    log.info("exported %s (stage %s) to %s (%s)", source, meta.get("stage"), out_dir, path)
    return out_dir


def _write_export(
    tmp: Path, model, tokenizer, torch_dtype, dtype: str, meta: dict, source: str, report_path, lock_path
) -> str:
    """Fill the export dir ``tmp``: weights, tokenizer, model card and lineage; returns the model path."""
    from chatpipe import tracking

    path = _write_model(tmp, model, tokenizer, torch_dtype, dtype)
    hf_tokenizer(tokenizer).save_pretrained(tmp)

    report = json.loads(report_path.read_text()) if report_path and Path(report_path).exists() else None
    lineage = {
        "source": source,
        "stage": meta.get("stage"),
        "step": meta.get("step"),
        "git_commit": tracking.git_commit(),
        "dvc_lock": tracking.dvc_lock_hash(Path(lock_path)),
        "model_pt_sha256": (meta.get("files") or {}).get("model.pt"),
        "safetensors_sha256": sha256_file(tmp / WEIGHTS_FILE),
        "dtype": dtype,
        "path": path,
    }
    if report:
        lineage["report_git_commit"] = report.get("git_commit")
        lineage["report_dvc_lock"] = (report.get("dvc_lock") or {}).get("dvc.lock")
    (tmp / "README.md").write_text(model_card(meta, source, lineage, report, path))
    write_json_atomic(tmp / LINEAGE_FILE, {**lineage, "model_config": meta.get("model_config")})
    return path


def push_to_hub(out_dir: Path, repo_id: str, *, private: bool = False, token: str | None = None) -> str:
    """Upload an exported directory to the Hugging Face Hub (creating the repo); returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(
        repo_id=repo_id, folder_path=str(out_dir), repo_type="model", commit_message="chatpipe export"
    )
    return str(getattr(info, "commit_url", info))


def log_to_mlflow(client: Any, run_id: str, out_dir: Path, model_name: str | None = None) -> str | None:
    """Log ``out_dir`` as artifact path ``hf`` of ``run_id``; also into the newest registered version of
    ``model_name`` (beside its chatpipe files, under ``model/hf``). Returns that version, or None."""
    client.log_artifacts(run_id, str(out_dir), "hf")
    if not model_name or not client.search_registered_models(f"name = '{model_name}'"):
        return None
    versions = client.search_model_versions(f"name = '{model_name}'")
    if not versions:
        return None
    latest = max(versions, key=lambda v: int(v.version))
    # The report stage registers `<its run>/model`; the version's files are that directory.
    client.log_artifacts(latest.run_id, str(out_dir), "model/hf")
    client.set_model_version_tag(model_name, latest.version, "hf_export", "model/hf")
    return str(latest.version)


def export_by_name(name: str, out_dir: Path, *, dtype: str = "float32", artifacts: Path = Path("artifacts")) -> Path:
    """Export the model ``name`` (base | mid | sft | rl | latest | models:/... | a dir) to ``out_dir``."""
    from chatpipe.model.loading import load_chat_model

    loaded = load_chat_model(name, artifacts=artifacts, device="cpu")
    return export_model(
        loaded.model,
        loaded.tokenizer,
        loaded.meta,
        out_dir,
        source=name,
        dtype=dtype,
        report_path=Path(artifacts) / "report" / "report.json",
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chatpipe export``."""
    p = argparse.ArgumentParser(prog="chatpipe export", description="Export a model as a transformers directory.")
    p.add_argument("--model", default="latest", help="base | mid | sft | rl | latest | models:/<name>/<version> | dir")
    p.add_argument("--out", required=True, help="directory to write (replaced if it exists)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--push-to-hub", dest="push_to_hub", metavar="REPO", help="also upload to this Hub repo id")
    p.add_argument("--private", action="store_true", help="create the Hub repo private")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = export_by_name(args.model, Path(args.out), dtype=args.dtype)
    except (ExportError, FileNotFoundError, ValueError) as e:
        print(f"chatpipe export: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.model} to {out}")
    if args.push_to_hub:
        print(f"pushed to {push_to_hub(out, args.push_to_hub, private=args.private)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
