"""The sections that are not training: data prep, eval/report/export, launch and tracking, chat and serve."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from chatpipe.settings.base import MAX_SEED, MODEL_STAGES, ModelStage, StageSettings


class DataSettings(StageSettings):
    """Where pretraining text comes from (`data` stage)."""

    section: ClassVar[str] = "data"
    removed: ClassVar[dict[str, str]] = {
        "chat_examples": "nothing read it; chat examples per task are each mixture item's `limit` in midtrain/sft"
    }
    source: Literal["synthetic", "hf", "local"] = "synthetic"
    seed: int = Field(42, ge=0, le=MAX_SEED)
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
    roundtrip_docs: int = Field(
        1000, ge=0, description="train documents checked for decode(encode(text)) == text (0: none)"
    )


class EvalSettings(StageSettings):
    """Evaluate every model stage that exists: bpb, CORE, ChatCORE (`eval` stage)."""

    section: ClassVar[str] = "eval"
    removed: ClassVar[dict[str, str]] = {
        "bpb_tokens": "renamed to eval_tokens, as in the training sections",
        "stages": "renamed to model_dirs (the artifacts/<dir> models to evaluate)",
    }
    model_dirs: list[ModelStage] = Field(
        list(MODEL_STAGES), description="models to evaluate, as artifacts/<dir>; those not made yet are skipped"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    max_per_task: int = Field(50, ge=0, description="items per CORE/ChatCORE task (0: all)")
    generative_max_per_task: int = Field(0, ge=0, description="generative ChatCORE tasks (0: max_per_task)")
    eval_tokens: int = Field(32768, ge=1, description="val tokens for bits per byte")
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
    seed: int = Field(0, ge=0, le=MAX_SEED)

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


class LaunchSettings(StageSettings):
    """How torchx starts stage workers: scheduler and topology."""

    section: ClassVar[str] = "launch"
    scheduler: Literal["local_cwd", "slurm", "kubernetes"] = "local_cwd"
    nnodes: int = Field(1, ge=1)
    nproc_per_node: int = Field(1, ge=1)
    gpus_per_node: int = Field(0, ge=0)
    cpus_per_node: int = Field(2, ge=1)
    threads: int = Field(0, ge=0, description="intra-op threads per process; 0: its share of the cores")
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
    seed: int = Field(42, ge=0, le=MAX_SEED)


class ServeSettings(ChatSettings):
    """The web UI and JSON API (`chatpipe serve`): sampling defaults plus the server's limits."""

    section: ClassVar[str] = "serve"
    host: str = Field("127.0.0.1", description="0.0.0.0 exposes the server to the network")
    port: int = Field(8000, ge=0, le=65535)
    max_queue: int = Field(32, ge=0, description="requests waiting for batch rows before 503s")
    batch_rows: int = Field(16, ge=1, le=1024, description="rows of the running batch (replies decoded together)")
    batch_context: int = Field(
        0, ge=0, description="KV positions per batch row (prompt + reply); 0 = sequence_len + max_tokens_limit"
    )
    kv_cache_tokens: int = Field(
        0, ge=0, description="the KV pool in positions (prefix cache included); 0 = batch_rows x batch_context"
    )
    kv_block_size: int = Field(16, ge=1, le=1024, description="positions per KV block (the prefix cache's unit)")
    max_batch_tokens: int = Field(
        512, ge=2, le=1_000_000, description="tokens one decode step may compute: decoding rows plus prefill chunks"
    )
    max_message_chars: int = Field(4000, ge=1)
    max_turns: int = Field(32, ge=1, description="messages in one conversation")
    max_tokens_limit: int = Field(1024, ge=1, description="the most max_tokens a request may ask for")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="largest request body; bigger ones get 413")
    max_stops: int = Field(4, ge=0, le=64, description="stop strings one request may send")
    max_stop_chars: int = Field(1000, ge=1, le=1_000_000, description="longest stop string a request may send")
    max_request_tokens: int = Field(
        8192, ge=1, description="work one request may ask for: prompts x n x max_tokens generated tokens"
    )
    request_timeout_s: float = Field(
        600.0, gt=0, le=86_400, description="the longest a request may take; then it is cancelled and answered 504"
    )

    @model_validator(mode="after")
    def _step_budget_holds_the_rows(self) -> ServeSettings:
        if self.max_batch_tokens <= self.batch_rows:
            raise ValueError(
                f"max_batch_tokens = {self.max_batch_tokens} must be above batch_rows = {self.batch_rows}: "
                "every decoding row takes a token of a step's budget, and prefill needs the rest"
            )
        return self
