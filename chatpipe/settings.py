"""Typed settings: one pydantic-settings model per section of params.yaml.

Resolution order, lowest to highest priority:

1. the section in ``params.yaml`` (path from ``CHATPIPE_PARAMS``, default ``./params.yaml``),
2. the active profile's overlay ``<profile>.<section>`` of ``profiles.yaml`` (beside params.yaml,
   or ``$CHATPIPE_PROFILES``; profile from ``CHATPIPE_PROFILE`` or params.yaml's ``profile`` key).
   Keeping the overlays out of params.yaml keeps them out of DVC's params (``dvc exp show``);
   DVC sees the active profile's resolved overlay through ``profile/<section>.yaml``, written by
   :func:`write_overlays` (the ``profile`` stage of dvc.yaml),
3. environment variables ``CHATPIPE_<SECTION>__<KEY>`` (e.g. ``CHATPIPE_PRETRAIN__DEPTH=12``),
4. command-line overrides ``--key=value`` / ``key=value`` given to a stage.

Unknown keys, wrong types and out-of-range values raise :class:`ParamsError` naming the
file, the key, the bad value and what is allowed, before any work starts.

    from chatpipe.settings import load_section, PretrainSettings
    cfg = load_section(PretrainSettings, cli=["--depth=6"])
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

# The pipeline's stages in run order (dvc.yaml lists the same, in the same order; a test checks it),
# and the model each training stage hands on: artifacts/<model stage>/, made by its training stage.
STAGES = ("data", "tokenizer", "pretrain", "midtrain", "sft", "rl", "eval", "report", "export")
MODEL_STAGES = {"base": "pretrain", "mid": "midtrain", "sft": "sft", "rl": "rl"}
ModelStage = Literal[tuple(MODEL_STAGES)]


def resume_neutral(default: Any, **kwargs: Any) -> Any:
    """A field that only changes what is observed (logging, evals, checkpoint cadence), never the weights.

    Such a setting may differ between a run and its resume: it is left out of the run's fingerprint
    (see :func:`math_settings`), so changing it keeps the in-progress checkpoints.
    """
    return Field(default, json_schema_extra={"resume_neutral": True}, **kwargs)


def math_settings(settings: BaseModel) -> dict[str, Any]:
    """The settings that decide the trained weights: everything but the :func:`resume_neutral` fields."""
    neutral = {
        name
        for name, f in type(settings).model_fields.items()
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("resume_neutral")
    }
    return {k: v for k, v in snapshot(settings).items() if k not in neutral}


class ParamsError(ValueError):
    """A params.yaml / env / CLI value that is not allowed; the message names key and value."""


def params_path() -> Path:
    """The params file in use: ``$CHATPIPE_PARAMS`` or ``./params.yaml``."""
    return Path(os.environ.get("CHATPIPE_PARAMS", "params.yaml"))


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ParamsError(f"{path}: params file not found (set CHATPIPE_PARAMS or run from the repo root)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ParamsError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    return data


def _deep_merge(base: dict, overlay: dict) -> dict:
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def profiles_path(params: Path | None = None) -> Path:
    """The profile overlays file: ``$CHATPIPE_PROFILES`` or ``profiles.yaml`` beside the params file."""
    env = os.environ.get("CHATPIPE_PROFILES")
    return Path(env) if env else (params or params_path()).with_name("profiles.yaml")


def read_profiles(params: Path | None = None, raw: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every profile overlay: profiles.yaml's top-level entries (plus a legacy ``profiles:`` of params.yaml)."""
    params = params or params_path()
    legacy = (raw if raw is not None else _read_yaml(params)).get("profiles") or {}
    path = profiles_path(params)
    own = _read_yaml(path) if path.exists() else {}
    clash = set(legacy) & set(own)
    if clash:
        raise ParamsError(f"{params}: profiles {sorted(clash)} are defined both here and in {path}; keep one")
    return {**legacy, **own}


def resolve_params(path: Path | None = None, profile: str | None = None) -> dict[str, Any]:
    """Return params.yaml with the active profile's overlay applied (no env/CLI)."""
    path = path or params_path()
    raw = _read_yaml(path)
    profiles = read_profiles(path, raw)
    raw.pop("profiles", None)
    chosen = profile or os.environ.get("CHATPIPE_PROFILE") or raw.get("profile", "tiny")
    allowed = ["tiny", *profiles.keys()]
    if chosen not in allowed:
        raise ParamsError(f"{path}: profile = {chosen!r} is not defined; allowed: {', '.join(allowed)}")
    raw["profile"] = chosen
    return _deep_merge(raw, profile_overlay(profiles, chosen, path))


def profile_overlay(profiles: dict[str, Any], name: str, path: Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The overlay of profile ``name``, with ``extends: <parent>`` profiles merged in beneath it."""
    if name in seen:
        raise ParamsError(f"{path}: profiles.{name}.extends forms a cycle: {' -> '.join((*seen, name))}")
    overlay = dict(profiles.get(name) or {})
    parent = overlay.pop("extends", None)
    if parent is None:
        return overlay
    if parent not in profiles:
        raise ParamsError(
            f"{path}: profiles.{name}.extends = {parent!r} is not defined; allowed: {', '.join(profiles)}"
        )
    return _deep_merge(profile_overlay(profiles, parent, path, (*seen, name)), overlay)


def active_profile() -> str:
    """Name of the profile in force (``CHATPIPE_PROFILE`` or params.yaml's ``profile``)."""
    return resolve_params()["profile"]


def write_profile(name: str, path: Path | None = None) -> None:
    """Set the top-level ``profile:`` of params.yaml (atomically), so DVC sees the change."""
    import re

    path = path or params_path()
    resolve_params(path, name)  # raises if the profile is not defined
    text = path.read_text()
    new, n = re.subn(r"(?m)^profile:.*$", f"profile: {name}", text, count=1)
    if n == 0:
        new = f"profile: {name}\n" + text
    if new != text:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(new)
        os.replace(tmp, path)


class _ParamsFileSource(PydanticBaseSettingsSource):
    """Feeds one section of the resolved params.yaml into a settings model."""

    def __call__(self) -> dict[str, Any]:
        section = self.settings_cls.section
        values = resolve_params().get(section, {}) or {}
        if not isinstance(values, dict):
            raise ParamsError(f"{params_path()}: section {section!r} must be a mapping, got {values!r}")
        return values

    def get_field_value(self, field, field_name):  # pragma: no cover - required by the ABC
        return None, field_name, False


class StageSettings(BaseSettings):
    """Base for a params.yaml section: forbids unknown keys, reads env and the params file."""

    section: ClassVar[str] = ""
    # keys this section used to have -> what replaced them; a params file that still sets one fails with it
    removed: ClassVar[dict[str, str]] = {}
    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__", validate_default=True)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        # CLI overrides arrive as init kwargs; they beat env, which beats the file.
        return init_settings, env_settings, _ParamsFileSource(settings_cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.section:
            cls.model_config = {**cls.model_config, "env_prefix": f"CHATPIPE_{cls.section.upper()}__"}
            SECTIONS[cls.section] = cls  # every section model defined below is validated by validate_all


# section name -> settings model, filled as the classes below are defined
SECTIONS: dict[str, type[StageSettings]] = {}


# --------------------------------------------------------------------------- sections


class DataSettings(StageSettings):
    """Where pretraining text comes from (`data` stage)."""

    section: ClassVar[str] = "data"
    removed: ClassVar[dict[str, str]] = {
        "chat_examples": "nothing read it; chat examples per task are each mixture item's `limit` in midtrain/sft"
    }
    source: Literal["synthetic", "hf", "local"] = "synthetic"
    seed: int = Field(42, ge=0)
    num_docs: int = Field(4000, ge=10, description="synthetic: documents to generate")
    val_docs: int = Field(200, ge=1, description="documents held out for validation")
    docs_per_shard: int = Field(2000, ge=1)
    hf_repo: str = "karpathy/fineweb-edu-100b-shuffle"
    hf_num_shards: int = Field(2, ge=2, description="hf: shards to download; the last one is val")
    hf_text_column: str = "text"
    local_dir: str = ""
    cache_dir: str = "data/cache"


class TokenizerSettings(StageSettings):
    """Byte-level BPE training (`tokenizer` stage)."""

    section: ClassVar[str] = "tokenizer"
    vocab_size: int = Field(2048, ge=256 + 9, le=1 << 20)
    max_chars: int = Field(2_000_000, ge=1000, description="train on the first N chars of the train split")
    eval_chars: int = Field(200_000, ge=100, description="held-out chars for the compression report")


class RunSettings(StageSettings):
    """What every training-like stage reads: seed, device, batch rows, length, checkpoint and log cadence."""

    seed: int = Field(1337, ge=0)
    device: Literal["auto", "cpu", "cuda"] = resume_neutral("auto")
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    device_batch_size: int = Field(16, ge=1)
    max_steps: int = Field(200, ge=-1, description="-1: derive from target_param_data_ratio")
    eval_every: int = resume_neutral(50, ge=0, description="val bpb every N steps (0: only at the end)")
    checkpoint_every: int = resume_neutral(50, ge=0, description="0: only at the end")
    keep_checkpoints: int = resume_neutral(2, ge=1)
    log_every: int = resume_neutral(10, ge=1)


class TrainSettings(RunSettings):
    """Settings shared by the gradient-descent stages: total batch, optimizer, LR schedule."""

    compile: bool = resume_neutral(False)
    total_batch_size: int = Field(4096, ge=1, description="tokens per optimizer step, all ranks")
    matrix_lr: float = Field(0.02, gt=0)
    embedding_lr: float = Field(0.2, gt=0)
    unembedding_lr: float = Field(0.004, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    warmdown_ratio: float = Field(0.65, ge=0, le=1)
    final_lr_frac: float = Field(0.05, ge=0, le=1)
    schedule: Literal["warmdown", "cosine"] = "warmdown"
    momentum_warmup_steps: int = Field(300, ge=0)
    grad_clip: float = Field(0.0, ge=0, description="0 disables clipping")
    eval_tokens: int = resume_neutral(32768, ge=1)

    # the learning rates build_optimizers takes (Muon matrices, AdamW embeddings and head)
    LR_KEYS: ClassVar[tuple[str, ...]] = ("matrix_lr", "embedding_lr", "unembedding_lr")

    # the LR schedule's knobs, as lr_multiplier names them
    SCHEDULE_KEYS: ClassVar[tuple[str, ...]] = ("warmup_steps", "warmdown_ratio", "final_lr_frac", "schedule")

    def lrs(self, frac: float = 1.0) -> dict[str, float]:
        """The :attr:`LR_KEYS` learning rates times ``frac``, as keyword arguments of build_optimizers."""
        return {k: getattr(self, k) * frac for k in self.LR_KEYS}

    def lr_schedule(self) -> dict[str, Any]:
        """The :attr:`SCHEDULE_KEYS` settings, as keyword arguments of lr_multiplier."""
        return {k: getattr(self, k) for k in self.SCHEDULE_KEYS}


class PretrainSettings(TrainSettings):
    """Base-model pretraining (`pretrain` stage); `depth` derives the model shape."""

    section: ClassVar[str] = "pretrain"
    depth: int = Field(4, ge=1, le=128)
    head_dim: int = Field(64, ge=8)
    n_kv_head: int = Field(0, ge=0, description="0: same as n_head (no GQA)")
    window_pattern: str = Field("L", pattern=r"^[SL]+$")
    sequence_len: int = Field(256, ge=8)
    target_param_data_ratio: float = Field(
        20.0, description="tokens to train per scaling param; -1: off (then target_flops or max_steps sets the length)"
    )
    target_flops: float = Field(
        -1.0, description="train for this many FLOPs (nanochat's --target-flops; wins over the ratio); -1: off"
    )
    lr_scaling: bool = Field(False, description="multiply every LR by sqrt(total_batch_size / 2**19) (nanochat 2026)")
    wd_scaling: bool = Field(
        False, description="weight_decay * sqrt(B / 2**19) * D(d12) / D: nanochat's T_epoch scaling from a d12 value"
    )
    sample_every: int = resume_neutral(100, ge=0)
    embedding_lr: float = Field(0.2, gt=0)
    total_batch_size: int = Field(
        4096, ge=-1, description="tokens per optimizer step, all ranks; -1: automatic from the tokens to train"
    )
    compile: bool | Literal["auto"] = resume_neutral(
        "auto", description="torch.compile the model; auto: when the run has enough steps to amortise compiling"
    )
    # nanochat 2026 recipe options (chatpipe.model.gpt.GPTConfig documents each); all off = the 2025 model
    value_embeds: bool = False
    lambdas: bool = Field(False, description="per-layer residual and x0 lambdas")
    smear: bool = False
    backout: bool = False
    short_window: Literal["half", "quarter"] = Field(
        "half", description="'S' layers: half the context, or nanochat's ceil(seq/4/128)*128 tokens"
    )
    rotary_base: float = Field(10000.0, gt=0)
    qk_scale: float = Field(1.0, gt=0)
    pad_vocab_to: int = Field(1, ge=1, description="round wte/lm_head rows up to a multiple of this (nanochat: 64)")
    optimizer: Literal["muon", "muon_adamw"] = Field(
        "muon", description="muon: torch AdamW + Muon; muon_adamw: nanochat's MuonAdamW"
    )
    scalar_lr: float = Field(0.5, gt=0, description="muon_adamw: lr of the x0 lambdas (resid lambdas: x0.01)")
    polar_express: Literal["direct", "gram"] = Field(
        "direct",
        description="muon_adamw: 'direct' is nanochat's Polar Express; 'gram' computes the same polynomial of "
        "matrices at least 2:1 in their small side's Gram space, 33% fewer FLOPs at the MLP's 4:1, rounded differently",
    )
    polar_express_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="muon_adamw: precision of Polar Express's matmuls; auto: bfloat16 where the run trains in "
        "bfloat16 (nanochat) or the CPU has bfloat16 dot products (AVX512-BF16, AMX), else float32",
    )
    fp8: bool = Field(
        False,
        description="FP8 matmuls of the block matrices via torchao (pip install -e '.[gpu]'); needs CUDA with compute "
        "capability >= 8.9. Tests only: CHATPIPE_TEST_FP8_ON_CPU=1 emulates it on CPU (chatpipe.model.fp8)",
    )

    @field_validator("target_param_data_ratio")
    @classmethod
    def _ratio_positive_or_off(cls, v: float) -> float:
        if v <= 0 and v != -1:
            raise ValueError(f"target_param_data_ratio = {v}; allowed: a number > 0, or -1 (off: set target_flops)")
        return v

    @field_validator("target_flops")
    @classmethod
    def _flops_positive_or_off(cls, v: float) -> float:
        if v <= 0 and v != -1:
            raise ValueError(f"target_flops = {v}; allowed: a number > 0, or -1 (off)")
        return v

    @model_validator(mode="after")
    def _horizon_is_set(self) -> PretrainSettings:
        if self.target_param_data_ratio == -1 and self.target_flops <= 0 and self.max_steps <= 0:
            raise ValueError("target_param_data_ratio = -1 (off) needs target_flops > 0 or max_steps > 0")
        return self

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The recipe's keyword arguments of build_optimizers (LRs, weight decay, optimizer, scalar LR), so a
        benchmark builds exactly the optimizer the stage does."""
        return {
            **self.lrs(),
            "weight_decay": self.weight_decay,
            "optimizer": self.optimizer,
            "scalar_lr": self.scalar_lr,
            "polar_express": self.polar_express,
        }


TaskName = Literal[
    "tinyworld_chat",
    "tinyworld_arith",
    "tinyworld_gsm",
    "tinyworld_mc",
    "smoltalk",
    "mmlu",
    "arc_easy",
    "arc_challenge",
    "gsm8k",
    "identity",
    "simplespelling",
    "spellingbee",
    "customjson",
    "humaneval",
]  # = chatpipe.data.tasks.TASK_NAMES (a test keeps them equal)


class MixItem(BaseModel):
    """One task of a chat-stage mixture: ``{task: gsm8k, limit: 8000, epochs: 2, source: local, path: ...}``."""

    model_config = {"extra": "forbid"}
    task: TaskName
    limit: int | None = Field(None, ge=0, description="examples taken from the task (None: all / its default)")
    epochs: int = Field(1, ge=1, description="times every example appears in one pass of the mixture")
    source: Literal["synthetic", "local", "hf"] | None = None
    path: str = ""
    words: Literal["english", "tinyworld"] | None = Field(None, description="spelling tasks: word list")


class ChatTrainSettings(TrainSettings):
    """Shared by midtrain and sft: the task mixture, packing length, identity, chat LR schedule."""

    mixture: list[MixItem] = Field(default_factory=lambda: [MixItem(task="tinyworld_chat")])
    val_limit: int = Field(100, ge=1, description="val examples per task (its val split) for val loss/bpb")
    max_seq_len: int = Field(256, ge=8, description="packed row length")
    max_steps: int = Field(-1, ge=-1, description="-1: one pass over the mixture")
    model_name: str = "chatpipe"
    model_maker: str = "the chatpipe authors"
    warmdown_ratio: float = Field(0.2, ge=0, le=1)  # flat, then linear decay over the last 20%
    final_lr_frac: float = Field(0.0, ge=0, le=1)
    init_lr_frac: float = Field(1.0, gt=0, le=1, description="scales every lr relative to the values above")


class MidtrainSettings(ChatTrainSettings):
    """Midtraining (`midtrain` stage): chat format, tool use, multiple choice; starts from artifacts/base."""

    section: ClassVar[str] = "midtrain"


class SFTSettings(ChatTrainSettings):
    """Supervised fine-tuning (`sft` stage); starts from artifacts/mid, ends with a held-out chat eval."""

    section: ClassVar[str] = "sft"
    eval_prompts: int = resume_neutral(
        100, ge=0, description="held-out tiny-world prompts sampled for the end-token rate"
    )
    eval_arith: int = resume_neutral(100, ge=0, description="held-out tiny-world arithmetic problems (exact match)")
    eval_max_tokens: int = resume_neutral(64, ge=1)
    eval_temperature: float = resume_neutral(0.7, ge=0, description="sampling temperature for the end-token rate")
    eval_baseline: bool = resume_neutral(
        True, description="also score artifacts/base on the arithmetic, for comparison"
    )


class LaunchSettings(StageSettings):
    """How torchx starts stage workers: scheduler and topology."""

    section: ClassVar[str] = "launch"
    scheduler: Literal["local_cwd", "slurm", "kubernetes"] = "local_cwd"
    nnodes: int = Field(1, ge=1)
    nproc_per_node: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_node: int = Field(2, ge=1)
    mem_mb: int = Field(8192, ge=256)
    image: str = "chatpipe:latest"
    partition: str = ""
    queue: str = "default"
    namespace: str = "default"
    rdzv_backend: str = "c10d"
    rdzv_port: int = Field(29500, ge=1, le=65535)
    max_retries: int = Field(0, ge=0)
    log_dir: str = "logs"
    volume: str = Field(
        "chatpipe",
        description="kubernetes: where artifacts/, checkpoints/ and mlruns/ persist: a PVC name prefix "
        "(claims <name>-artifacts, <name>-checkpoints, <name>-mlruns) or an absolute hostPath dir; "
        "empty: none (outputs are lost with the pod)",
    )
    workdir: str = Field("/workspace", description="kubernetes: the repo's path inside the image (its WORKDIR)")


class TrackingSettings(StageSettings):
    """MLflow: where runs go and under which experiment."""

    section: ClassVar[str] = "tracking"
    uri: str = "sqlite:///mlruns/mlflow.db"
    artifact_root: str = "mlruns/artifacts"
    experiment: str = "chatpipe"
    enabled: bool = True


class ChatSettings(StageSettings):
    """The chat CLI (`chatpipe chat`): which model, how to sample."""

    section: ClassVar[str] = "chat"
    model: str = Field("latest", description="stage (base|mid|sft|rl|latest), models:/<name>/<version> or a dir")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    temperature: float = Field(0.6, ge=0, le=5)
    top_k: int = Field(50, ge=0, description="0: no top-k filtering")
    max_tokens: int = Field(256, ge=1, le=8192, description="new tokens per reply")
    seed: int = Field(42, ge=0)


class ServeSettings(ChatSettings):
    """The web UI and JSON API (`chatpipe serve`): sampling defaults plus the server's limits."""

    section: ClassVar[str] = "serve"
    host: str = Field("127.0.0.1", description="0.0.0.0 exposes the server to the network")
    port: int = Field(8000, ge=0, le=65535)
    num_engines: int = Field(2, ge=1, le=64, description="replies generated at once; more requests queue")
    max_queue: int = Field(32, ge=0, description="requests waiting for an engine before 503s")
    max_message_chars: int = Field(4000, ge=1)
    max_turns: int = Field(32, ge=1, description="messages in one conversation")
    max_tokens_limit: int = Field(1024, ge=1, description="the most max_tokens a request may ask for")


class EvalSettings(StageSettings):
    """Evaluate every model stage that exists: bpb, CORE, ChatCORE (`eval` stage)."""

    section: ClassVar[str] = "eval"
    stages: list[ModelStage] = list(MODEL_STAGES)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_per_task: int = Field(50, ge=0, description="items per CORE/ChatCORE task (0: all)")
    generative_max_per_task: int = Field(0, ge=0, description="generative ChatCORE tasks (0: max_per_task)")
    bpb_tokens: int = Field(32768, ge=1, description="val tokens for bits per byte")
    device_batch_size: int = Field(16, ge=1)
    core_stages: list[ModelStage] = ["base"]
    core_config: str = Field("", description="CORE task YAML ('' = chatpipe/evals/core_tasks.yaml)")
    core_bundle_dir: str = Field("", description="dir with the CORE jsonl files ('' = no real tasks)")
    core_bundle_url: str = Field("", description="zip fetched into core_bundle_dir when that dir is missing")
    core_tasks: list[str] = Field([], description="labels to run from core_config ([] = all found)")
    core_tinyworld: bool = Field(True, description="also run the synthetic tiny-world CORE tasks")
    tinyworld_examples: int = Field(200, ge=10)
    chatcore_stages: list[ModelStage] = ["mid", "sft", "rl"]
    # ChatCORE name -> build_task spec: {task: <chatpipe.data.tasks name>, <its keyword args>...}
    chatcore_tasks: dict[
        Literal["ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee"], dict[str, Any]
    ] = {
        "ARC-Easy": {"task": "arc_easy", "source": "hf"},
        "ARC-Challenge": {"task": "arc_challenge", "source": "hf"},
        "MMLU": {"task": "mmlu", "source": "hf"},
        "GSM8K": {"task": "gsm8k", "source": "hf"},
        "HumanEval": {"task": "humaneval"},
        "SpellingBee": {"task": "spellingbee"},
    }
    chatcore_split: Literal["train", "val", "test"] = "test"
    num_samples: int = Field(1, ge=1, description="generative tasks: samples per problem")
    pass_k: int = Field(1, ge=1, description="pass@k over num_samples")
    temperature: float = Field(0.0, ge=0)
    top_k: int = Field(50, ge=0)
    max_new_tokens: int = Field(256, ge=1)
    seed: int = Field(0, ge=0)

    @field_validator("chatcore_tasks")
    @classmethod
    def _each_spec_names_a_task(cls, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, spec in specs.items():
            if not isinstance(spec.get("task"), str):
                raise ValueError(
                    f"chatcore_tasks.{name} needs a 'task' key naming a chatpipe.data.tasks task, got {spec!r}"
                )
        return specs


class ReportSettings(StageSettings):
    """report.md, plots and the MLflow model registry (`report` stage)."""

    section: ClassVar[str] = "report"
    cost_per_hour: float = Field(0.0, ge=0, description="USD per hour of the machine(s) that ran the stages")
    register_model: bool = True
    model_name: str = Field("chatpipe", min_length=1)


class ExportSettings(StageSettings):
    """Hugging Face transformers export of the final model (`export` stage, after `report`)."""

    section: ClassVar[str] = "export"
    model: str = Field("latest", description="stage (base|mid|sft|rl|latest), models:/<name>/<version> or a dir")
    dtype: Literal["float32", "bfloat16"] = "float32"
    on_unsupported: Literal["fail", "skip"] = Field(
        "fail",
        description="a model option neither transformers' NanoChat nor our remote code carries (an option unknown "
        "to the exporter): fail the stage, or skip with the reason",
    )
    push_to_hub: str = Field("", description="Hub repo id to upload to ('' = do not upload)")
    hub_private: bool = False


_RL_LR_NOTE = "RL's policy LR is lr_frac x the init model's LRs, decayed linearly to 0; there is no other schedule"


class RLSettings(RunSettings):
    """RL on verifiable rewards (`rl` stage): GRPO-lite or PPO, chosen by `algorithm`."""

    section: ClassVar[str] = "rl"
    removed: ClassVar[dict[str, str]] = {
        **dict.fromkeys(["warmup_steps", "warmdown_ratio", "final_lr_frac", "schedule"], _RL_LR_NOTE),
        **dict.fromkeys(["matrix_lr", "embedding_lr", "unembedding_lr"], _RL_LR_NOTE),
        "momentum_warmup_steps": "RL keeps the init model's optimizer momentum; nothing to warm up",
        "total_batch_size": "a step is prompts_per_step x group_size samples; rows per forward is device_batch_size",
        "grad_clip": "RL never clipped gradients; the PPO ratio cap is max_ratio",
        "eval_tokens": "RL evaluates pass@k: eval_problems x eval_samples",
        "compile": "RL runs eager (generation dominates and changes shape every step)",
    }
    init_dir: str = Field("artifacts/sft", description="model dir to start from (and whose LRs to scale)")
    algorithm: Literal["grpo", "ppo"] = "grpo"
    task: str = Field("tinyworld_arith", description="prompt source: tinyworld_arith | gsm8k | any build_task name")
    reward: str = Field("exact", description="reward function name in chatpipe.rl.rewards")
    task_source: Literal["", "synthetic", "local", "hf"] = Field("", description="'': the task's default")
    num_train_problems: int = Field(512, ge=1)
    keep_tasks: list[MixItem] = Field(
        default_factory=list,
        description="train prompts of other tasks (limit: how many) added to the pool, each rewarded by its "
        "own grader, so RL on `task` does not wear away those skills; held-out pass@k stays on `task`",
    )
    replay: list[MixItem] = Field(
        default_factory=list,
        description="chat-stage conversations trained on (assistant-only LM loss) beside every RL optimizer "
        "step, as InstructGPT's PPO-ptx replays pretraining data, so skills RL does not reward are not "
        "worn away; [] turns it off",
    )
    replay_rows: int = Field(4, ge=1, description="replay rows per rank per optimizer step")
    replay_seq_len: int | None = Field(
        None, ge=8, description="tokens per replay row (conversations packed best-fit); None: the model's sequence_len"
    )
    replay_coef: float = Field(1.0, ge=0, description="weight of the replay loss against the RL loss")
    max_steps: int = Field(30, ge=1)
    weight_decay: float = Field(0.0, ge=0)
    prompts_per_step: int = Field(16, ge=1, description="prompts per step over all ranks")
    group_size: int = Field(16, ge=1, description="samples per prompt")
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(50, ge=0, description="0: no top-k filtering")
    lr_frac: float = Field(0.05, gt=0, description="policy LR = lr_frac x the init model's LRs, linear decay to 0")
    embedding_lr_frac: float | None = Field(
        None,
        ge=0,
        description="the same for the token embedding and lm_head (AdamW) LRs; None: lr_frac. Adam moves every "
        "embedding row RL's samples touch by about its LR each step, whatever the gradient's size, so the "
        "words RL's task shares with other skills drift",
    )
    value_lr_frac: float = Field(1.0, gt=0, description="critic LR = value_lr_frac x the init model's LRs")
    normalize_std: bool = Field(False, description="GRPO: divide advantages by the group's std")
    # PPO
    ppo_epochs: int = Field(2, ge=1)
    num_minibatches: int = Field(2, ge=1, description="minibatches per PPO epoch (each = one optimizer step)")
    clip_eps: float = Field(0.2, gt=0)
    value_clip: float = Field(0.2, gt=0)
    value_coef: float = Field(0.1, ge=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    kl_ctl: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.1, ge=0)
    kl_target: float = Field(6.0, gt=0)
    kl_horizon: int = Field(10000, ge=1)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    whiten: Literal["batch", "group", "none"] = "batch"
    reward_scale: float = Field(1.0, gt=0)
    reward_bias: float = 0.0
    reward_clip: float = Field(20.0, ge=0, description="0: no clipping")
    no_eos: Literal["keep", "zero", "penalty"] = Field("keep", description="score of responses cut at max_new_tokens")
    length_penalty: float = Field(-1.0, description="score for no_eos=penalty and for too-short responses")
    min_response_length: int = Field(0, ge=0)
    max_ratio: float = Field(5.0, ge=0, description="stop an update when an importance ratio exceeds this (0: off)")
    ref_ema: float = Field(0.0, ge=0, le=1, description="reference <- (1-eta) ref + eta policy each step (0: frozen)")
    disable_value: bool = Field(False, description="PPO without a critic: group-mean advantages (GRPO)")
    # eval
    eval_every: int = resume_neutral(10, ge=0, description="pass@k every N steps (0: only before and after)")
    eval_split: Literal["train", "val", "test"] = resume_neutral("val", description="held-out split for pass@k")
    eval_problems: int = resume_neutral(64, ge=1, description="held-out problems for pass@k")
    eval_samples: int = resume_neutral(4, ge=1, description="samples per held-out problem")
    eval_temperature: float = resume_neutral(1.0, ge=0)
    checkpoint_every: int = resume_neutral(10, ge=0)


# --------------------------------------------------------------------------- loading


def parse_cli(args: list[str]) -> dict[str, str]:
    """Turn ``--key=value``, ``--key value`` or ``key=value`` arguments into a dict."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.lstrip("-").partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ParamsError(f"command line: {arg!r} has no value; use --key=value")
            value, i = args[i + 1], i + 1
        out[key.replace("-", "_")] = value
        i += 1
    return out


def _source(cls: type[StageSettings], key: str, overrides: dict[str, Any]) -> str:
    """Where the value of ``key`` came from: the command line, an env var, or the params file."""
    top = key.split(".")[0]
    if top in overrides:
        return f"command line --{top}"
    env = f"CHATPIPE_{cls.section.upper()}__{top.upper()}"
    if any(name.upper() == env for name in os.environ):
        return f"environment variable {env}"
    return str(params_path())


def _format_error(cls: type[StageSettings], err: ValidationError, overrides: dict[str, Any] | None = None) -> str:
    lines = []
    allowed = ", ".join(cls.model_fields)
    sources = set()
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        value = e.get("input")
        source = _source(cls, key, overrides or {})
        sources.add(source)
        where = "" if source == str(params_path()) else f" (from {source})"
        if e["type"] == "extra_forbidden" and key in cls.removed:
            lines.append(f"{cls.section}.{key} = {value!r}{where}: this key was removed: {cls.removed[key]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{cls.section}.{key} = {value!r}{where}: unknown key; allowed keys: {allowed}")
        else:
            lines.append(f"{cls.section}.{key} = {value!r}{where}: {e['msg']}")
    head = sources.pop() if len(sources) == 1 else "settings"
    return f"{head}: invalid settings\n  " + "\n  ".join(lines)


def check_env_sections() -> None:
    """Reject ``CHATPIPE_<SECTION>__<KEY>`` variables whose section does not exist (a typo such as
    ``CHATPIPE_PRETRAINN__DEPTH`` would otherwise be ignored without a word)."""
    for name in os.environ:
        if name.startswith("CHATPIPE_") and "__" in name:
            section = name[len("CHATPIPE_") :].split("__")[0].lower()
            if section not in SECTIONS:
                raise ParamsError(
                    f"environment variable {name}: unknown section {section!r}; "
                    f"allowed: {', '.join(sorted(SECTIONS))} (as CHATPIPE_<SECTION>__<KEY>)"
                )


def _check_env(cls: type[StageSettings]) -> None:
    prefix = f"CHATPIPE_{cls.section.upper()}__"
    for name in os.environ:
        key = name[len(prefix) :].lower() if name.startswith(prefix) else None
        if key and key.split("__")[0] not in cls.model_fields:
            raise ParamsError(
                f"environment {name}: unknown key {cls.section}.{key}; allowed keys: {', '.join(cls.model_fields)}"
            )


def load_section(cls: type[StageSettings], cli: list[str] | dict[str, Any] | None = None) -> StageSettings:
    """Build one section's settings from params.yaml, profile, env and CLI overrides."""
    from pydantic_settings import SettingsError

    overrides = parse_cli(cli) if isinstance(cli, list) else dict(cli or {})
    _check_env(cls)
    try:
        return cls(**overrides)
    except ValidationError as err:
        raise ParamsError(_format_error(cls, err, overrides)) from None
    except SettingsError as err:  # an env value for a list/dict field that is not JSON
        prefix = f"CHATPIPE_{cls.section.upper()}__"
        bad = [f"{n} = {v!r}" for n, v in os.environ.items() if n.upper().startswith(prefix)]
        raise ParamsError(
            f"environment variable {' / '.join(bad) or prefix + '*'}: not valid JSON for a list or mapping "
            f'field (e.g. \'["base", "sft"]\'): {err.__cause__ or err}'
        ) from None


def validate_all(path: Path | None = None) -> dict[str, StageSettings]:
    """Validate every section of params.yaml (used before any stage does work)."""
    path = path or params_path()
    raw = _read_yaml(path)
    check_env_sections()
    top_level_keys = {"profile", "profiles", *SECTIONS}
    unknown = set(raw) - top_level_keys
    if unknown:
        raise ParamsError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(top_level_keys)}")
    for name, overlay in read_profiles(path, raw).items():
        if not isinstance(overlay, dict):
            raise ParamsError(f"{profiles_path(path)}: profile {name!r} must be a mapping of sections")
        bad = set(overlay or {}) - set(SECTIONS) - {"extends"}
        if bad:
            raise ParamsError(
                f"{profiles_path(path)}: {name} has unknown section(s) {sorted(bad)}; allowed: {sorted(SECTIONS)}"
            )
    return {name: load_section(cls) for name, cls in SECTIONS.items()}


OVERLAYS_DIR = Path("profile")


def write_overlays(
    sections: list[str] | None = None, out_dir: Path = OVERLAYS_DIR, path: Path | None = None
) -> list[Path]:
    """Write the active profile's resolved overlay of each section (default: all) to ``out_dir/<section>.yaml``.

    A stage of dvc.yaml depends on its section's file, so DVC re-runs it exactly when the active
    profile's values for that section change (switching profile, or editing that profile or one
    it extends), and not for edits to other profiles. Files are rewritten only when they change.
    """
    path = path or params_path()
    raw = _read_yaml(path)
    chosen = os.environ.get("CHATPIPE_PROFILE") or raw.get("profile", "tiny")
    resolve_params(path, chosen)  # raises if the profile is not defined
    overlay = profile_overlay(read_profiles(path, raw), chosen, profiles_path(path))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    unknown = set(sections or []) - set(SECTIONS)
    if unknown:
        raise ParamsError(f"unknown section(s) {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
    for section in sections or SECTIONS:
        text = f"# generated by `python -m chatpipe.settings` (the dvc.yaml profile stage): {chosen}.{section}\n"
        text += yaml.safe_dump(overlay.get(section) or {}, sort_keys=True)
        target = out_dir / f"{section}.yaml"
        if not target.exists() or target.read_text() != text:
            tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
            tmp.write_text(text)
            os.replace(tmp, target)
        written.append(target)
    return written


if __name__ == "__main__":
    import sys

    try:
        validate_all()
        for p in write_overlays(sys.argv[1:]):  # the sections dvc.yaml's profile stage declares
            print(p)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def snapshot(settings: BaseModel) -> dict[str, Any]:
    """Plain-JSON dict of resolved settings, for checkpoints and MLflow params."""
    return settings.model_dump(mode="json")
