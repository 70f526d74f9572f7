"""Typed settings: one pydantic-settings model per section of params.yaml.

Resolution order, lowest to highest priority:

1. the section in ``params.yaml`` (path from ``CHATPIPE_PARAMS``, default ``./params.yaml``),
2. the active profile's overlay ``profiles.<profile>.<section>`` (profile from
   ``CHATPIPE_PROFILE`` or the file's top-level ``profile`` key),
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
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


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


def resolve_params(path: Path | None = None, profile: str | None = None) -> dict[str, Any]:
    """Return params.yaml with the active profile's overlay applied (no env/CLI)."""
    path = path or params_path()
    raw = _read_yaml(path)
    profiles = raw.pop("profiles", {}) or {}
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
    chat_examples: int = Field(2000, ge=0, description="synthetic chat conversations per split")


class TokenizerSettings(StageSettings):
    """Byte-level BPE training (`tokenizer` stage)."""

    section: ClassVar[str] = "tokenizer"
    vocab_size: int = Field(2048, ge=256 + 9, le=1 << 20)
    max_chars: int = Field(2_000_000, ge=1000, description="train on the first N chars of the train split")
    eval_chars: int = Field(200_000, ge=100, description="held-out chars for the compression report")


class TrainSettings(StageSettings):
    """Settings shared by every training stage: batch, optimizer, schedule, checkpoints."""

    seed: int = Field(1337, ge=0)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    compile: bool = False
    device_batch_size: int = Field(16, ge=1)
    total_batch_size: int = Field(4096, ge=1, description="tokens per optimizer step, all ranks")
    max_steps: int = Field(200, ge=-1, description="-1: derive from target_param_data_ratio")
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
    eval_every: int = Field(50, ge=0, description="val bpb every N steps (0: only at the end)")
    eval_tokens: int = Field(32768, ge=1)
    checkpoint_every: int = Field(50, ge=0, description="0: only at the end")
    keep_checkpoints: int = Field(2, ge=1)
    log_every: int = Field(10, ge=1)


class PretrainSettings(TrainSettings):
    """Base-model pretraining (`pretrain` stage); `depth` derives the model shape."""

    section: ClassVar[str] = "pretrain"
    depth: int = Field(4, ge=1, le=128)
    head_dim: int = Field(64, ge=8)
    n_kv_head: int = Field(0, ge=0, description="0: same as n_head (no GQA)")
    window_pattern: str = Field("L", pattern=r"^[SL]+$")
    sequence_len: int = Field(256, ge=8)
    target_param_data_ratio: float = Field(20.0, gt=0)
    sample_every: int = Field(100, ge=0)
    embedding_lr: float = Field(0.2, gt=0)


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
    eval_prompts: int = Field(100, ge=0, description="held-out tiny-world prompts sampled for the end-token rate")
    eval_arith: int = Field(100, ge=0, description="held-out tiny-world arithmetic problems (exact match)")
    eval_max_tokens: int = Field(64, ge=1)
    eval_temperature: float = Field(0.7, ge=0, description="sampling temperature for the end-token rate")
    eval_baseline: bool = Field(True, description="also score artifacts/base on the arithmetic, for comparison")


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
    stages: list[Literal["base", "mid", "sft", "rl"]] = ["base", "mid", "sft", "rl"]
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_per_task: int = Field(50, ge=0, description="items per CORE/ChatCORE task (0: all)")
    generative_max_per_task: int = Field(0, ge=0, description="generative ChatCORE tasks (0: max_per_task)")
    bpb_tokens: int = Field(32768, ge=1, description="val tokens for bits per byte")
    device_batch_size: int = Field(16, ge=1)
    core_stages: list[Literal["base", "mid", "sft", "rl"]] = ["base"]
    core_config: str = Field("", description="CORE task YAML ('' = chatpipe/evals/core_tasks.yaml)")
    core_bundle_dir: str = Field("", description="dir with the CORE jsonl files ('' = no real tasks)")
    core_bundle_url: str = Field("", description="zip fetched into core_bundle_dir when that dir is missing")
    core_tasks: list[str] = Field([], description="labels to run from core_config ([] = all found)")
    core_tinyworld: bool = Field(True, description="also run the synthetic tiny-world CORE tasks")
    tinyworld_examples: int = Field(200, ge=10)
    chatcore_stages: list[Literal["base", "mid", "sft", "rl"]] = ["mid", "sft", "rl"]
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


class RLSettings(TrainSettings):
    """RL on verifiable rewards (`rl` stage, SPEC §8): GRPO-lite or PPO, chosen by `algorithm`."""

    section: ClassVar[str] = "rl"
    init_dir: str = Field("artifacts/sft", description="model dir to start from (and whose LRs to scale)")
    algorithm: Literal["grpo", "ppo"] = "grpo"
    task: str = Field("tinyworld_arith", description="prompt source: tinyworld_arith | gsm8k | any build_task name")
    reward: str = Field("exact", description="reward function name in chatpipe.rl.rewards")
    task_source: Literal["", "synthetic", "local", "hf"] = Field("", description="'': the task's default")
    num_train_problems: int = Field(512, ge=1)
    max_steps: int = Field(30, ge=1)
    prompts_per_step: int = Field(16, ge=1, description="prompts per step over all ranks")
    group_size: int = Field(16, ge=1, description="samples per prompt")
    max_new_tokens: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(50, ge=0, description="0: no top-k filtering")
    lr_frac: float = Field(0.05, gt=0, description="policy LR = lr_frac x the init model's LRs, linear decay to 0")
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
    eval_every: int = Field(10, ge=0, description="pass@k every N steps (0: only before and after)")
    eval_split: Literal["train", "val", "test"] = Field("val", description="held-out split for pass@k")
    eval_problems: int = Field(64, ge=1, description="held-out problems for pass@k")
    eval_samples: int = Field(4, ge=1, description="samples per held-out problem")
    eval_temperature: float = Field(1.0, ge=0)
    checkpoint_every: int = Field(10, ge=0)


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
        if e["type"] == "extra_forbidden":
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
    for name, overlay in (raw.get("profiles") or {}).items():
        bad = set(overlay or {}) - set(SECTIONS) - {"extends"}
        if bad:
            raise ParamsError(
                f"{path}: profiles.{name} has unknown section(s) {sorted(bad)}; allowed: {sorted(SECTIONS)}"
            )
    return {name: load_section(cls) for name, cls in SECTIONS.items()}


def snapshot(settings: BaseModel) -> dict[str, Any]:
    """Plain-JSON dict of resolved settings, for checkpoints and MLflow params."""
    return settings.model_dump(mode="json")
