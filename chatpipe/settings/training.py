"""The training sections: pretrain, midtrain, sft (gradient descent) and rl, over their shared bases."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from chatpipe.settings.base import MAX_SEED, StageSettings, StrictScalars, Subsection, resume_neutral


class RunSettings(StageSettings):
    """What every training-like stage reads: seed, device, batch rows, length, checkpoint and log cadence."""

    seed: int = Field(1337, ge=0, le=MAX_SEED)
    device: Literal["auto", "cpu", "cuda"] = resume_neutral("auto")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="auto: bfloat16 autocast on GPU and on CPUs with bf16 dot products (AVX512-BF16, AMX: the "
        "tiny step ~1.6x faster), float32 elsewhere",
    )
    device_batch_size: int = Field(16, ge=1)
    max_steps: int = Field(200, ge=-1, description="optimizer steps; -1: the stage derives them (its section says how)")
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
    max_steps: int = Field(
        200, ge=-1, description="-1: derive from target_flops, else from target_param_data_ratio (chatpipe.horizon)"
    )
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
    total_batch_size: int = Field(
        4096, ge=-1, description="tokens per optimizer step, all ranks; -1: automatic from the tokens to train"
    )
    compile: bool | Literal["auto"] = resume_neutral(
        "auto", description="torch.compile the model; auto: when the run has enough steps to amortise compiling"
    )
    device_batch_size: int | Literal["auto"] = Field(
        16,
        description="rows per rank per forward; auto: the largest that divides the rows each rank takes per step "
        "and whose planned peak memory fits memory_gib (chatpipe.train.pretrain_plan.choose_device_batch)",
    )
    memory_gib: float = resume_neutral(
        0.0,
        ge=0,
        description="device_batch_size: auto plans for this many GiB per device; 0: the GPU's own memory "
        "(on CPU, auto then stops and asks for a budget)",
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
    optimizer: Literal["muon_newton_schulz", "normuon_polar_express"] = Field(
        "muon_newton_schulz",
        description="muon_newton_schulz: torch's AdamW + Muon (Newton-Schulz), nanochat's 2025 recipe; "
        "normuon_polar_express: nanochat's 2026 MuonAdamW (NorMuon, Polar Express, cautious weight decay)",
    )
    scalar_lr: float = Field(0.5, gt=0, description="lr of the x0 lambdas (resid lambdas: x0.01)")
    polar_express: Literal["direct", "gram"] = Field(
        "direct",
        description="normuon_polar_express: 'direct' is nanochat's Polar Express; 'gram' computes the same "
        "polynomial of matrices at least 2:1 in their small side's Gram space, 33% fewer FLOPs at the MLP's 4:1, "
        "rounded differently",
    )
    polar_express_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="normuon_polar_express: precision of Polar Express's matmuls; auto: bfloat16 where the run "
        "trains in bfloat16 (nanochat) or the CPU has bfloat16 dot products (AVX512-BF16, AMX), else float32",
    )
    fp8: bool = Field(
        False,
        description="FP8 matmuls of the block matrices via torchao (pip install -e '.[gpu]'); needs CUDA with compute "
        "capability >= 8.9. Tests only: CHATPIPE_TEST_FP8_ON_CPU=1 emulates it on CPU (chatpipe.model.fp8)",
    )

    @field_validator("device_batch_size", mode="wrap")
    @classmethod
    def _auto_or_positive(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> int | str:
        try:
            checked = handler(value)
        except (ValueError, ValidationError):  # the union's two refusals, replaced by one that says both
            checked = None
        if checked != "auto" and (type(checked) is not int or checked < 1):
            raise ValueError("allowed: 'auto' or an integer >= 1")
        return checked

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


class MixItem(StrictScalars):
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


_RL_LR_NOTE = "RL's policy LR is lr_frac x the init model's LRs, decayed linearly to 0; there is no other schedule"


# asynchronous RL's second role (rl.rollout.role), set by chatpipe.launch: which role a stages.rl
# process is, both roles' shared dir (chatpipe.rl.exchange.launch_dir: fresh per launch, so no file of
# an earlier launch is ever read), and the trainer's threads once the role is done
RL_ROLE_ENV, RL_EXCHANGE_ENV = "CHATPIPE_RL_ROLE", "CHATPIPE_RL_LAUNCH_DIR"
RL_THREADS_AFTER_ENV = "CHATPIPE_RL_THREADS_AFTER_ROLE"
# several rollout workers (rl.rollout.workers > 1), set by chatpipe.launch: a worker's replica id, and
# where the trainer's TCPStore listens, "<name of the variable holding its host>:<port>" (the host is
# only known on the node: torchx's rank0_env, e.g. Slurm's SLURM_JOB_NODELIST_HET_GROUP_0)
RL_WORKER_ENV, RL_STORE_ENV = "CHATPIPE_RL_WORKER", "CHATPIPE_RL_STORE"
RL_WORKER_OFFSET_ENV = "CHATPIPE_RL_WORKER_OFFSET"  # added to the replica id (on Slurm worker 0 is the trainer's)


class FormerlyOneKey(Subsection):
    """An ``rl`` section that took the place of one flat key of its name (``guard: warn``, ``reward:
    exact``): a plain value there is told which key of the section it now sets."""

    name: ClassVar[str]
    value_key: ClassVar[str]

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, v: Any) -> Any:
        if isinstance(v, str):
            keys = ", ".join(f"{cls.name}.{k}" for k in cls.model_fields)
            raise ValueError(f"rl.{cls.name} is a section now: set {cls.name}.{cls.value_key}: {v} (its keys: {keys})")
        return v


class GuardSettings(FormerlyOneKey):
    """``rl.guard``: the reward-hacking guard (reward.source model|both), windows of rollouts scored by both
    the reward model and the verifier."""

    name, value_key = "guard", "mode"

    mode: Literal["off", "warn", "stop"] = Field(
        "warn",
        description="when the reward model's mean score rises while the verifier's falls by `drop` or more "
        "since the first window: log a warning, or stop the run with an error",
    )
    every: int = Field(10, ge=1, description="guard window, in steps")
    drop: float = Field(0.1, gt=0, description="verifier mean fall since the first window that trips the guard")
    min_accuracy: float = Field(
        0.0,
        ge=0,
        le=1,
        description="also trip when the reward model ranks fewer than this share of a window's verifier-ranked "
        "pairs right (0: off)",
    )


PPO_MOVED = (
    "critic_init_dir",
    "value_lr_frac",
    "num_minibatches",
    "clip_eps",
    "value_clip",
    "value_coef",
    "gamma",
    "lam",
    "kl_ctl",
    "kl_coef",
    "kl_target",
    "kl_horizon",
    "kl_estimator",
    "whiten",
    "max_ratio",
    "max_token_ratio",
    "ref_ema",
    "disable_value",
    "value_norm",
    "value_norm_beta",
    "bootstrap",
)  # fmt: skip  (the flat rl.<key> before the ppo section; a file that sets one is told where it went)


class PPOSettings(Subsection):
    """``rl.ppo``: the keys only PPO reads (the critic, GAE, the KL to the reference in the rewards, the
    clipped epochs x minibatches); under ``algorithm: grpo`` a key set off its default is an error."""

    critic_init_dir: str = Field(
        "",
        description="PPO critic's start: a reward model dir (trunk and head) or a GPT dir (zero head); '': "
        "reward.model_dir when reward.source is model|both, else init_dir",
    )
    value_lr_frac: float = Field(1.0, gt=0, description="critic LR = value_lr_frac x the init model's LRs")
    epochs: int = Field(2, ge=1, description="passes over each step's rows")
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
    max_ratio: float = Field(
        5.0, ge=0, description="skip a PPO minibatch whose mean importance ratio exceeds this (0: off)"
    )
    max_token_ratio: float = Field(
        0.0, ge=0, description="stop the whole PPO update when one token's importance ratio exceeds this (0: off)"
    )
    ref_ema: float = Field(0.0, ge=0, le=1, description="reference <- (1-eta) ref + eta policy each step (0: frozen)")
    disable_value: bool = Field(False, description="PPO without a critic: group-mean advantages (GRPO)")
    value_norm: bool = Field(False, description="critic predicts returns normalised by their running mean and std")
    value_norm_beta: float = Field(0.99995, gt=0, lt=1, description="EMA decay of value_norm's running moments")
    bootstrap: bool = Field(
        False, description="a response cut at max_new_tokens ends on the critic's value of its last state, not 0"
    )

    @model_validator(mode="after")
    def _critic_keys_need_the_critic(self) -> PPOSettings:
        for key in ("value_norm", "bootstrap"):
            if getattr(self, key) and self.disable_value:
                raise ValueError(f"ppo.{key} needs the critic; it cannot be on with ppo.disable_value: true")
        return self


class GRPOSettings(Subsection):
    """``rl.grpo``: the keys only GRPO-lite reads; under ``algorithm: ppo`` one set off its default is an error."""

    kl_loss_coef: float = Field(
        0.0,
        ge=0,
        description="GRPO: weight of a KL(policy || reference) loss term (k3 estimator, per action token), as "
        "verl's use_kl_loss; PPO puts the KL in its rewards instead (kl_coef)",
    )


ROLLOUT_MOVED = {
    "rollout_dtype": "dtype",
    "rollout_role": "role",
    "rollout_threads": "threads",
    "rollout_workers": "workers",
    "max_staleness": "max_staleness",
    "behav_weight_cap": "behav_weight_cap",
    "exchange_dir": "exchange_dir",
    "rollout_timeout_s": "timeout_s",
    "heartbeat_timeout_s": "heartbeat_timeout_s",
}  # the flat rl.<key> before the rollout section -> its key there


class RolloutSettings(Subsection):
    """``rl.rollout``: who samples the rollouts and in what precision. The trainer itself by default;
    with ``role: true`` a second torchx role (``workers`` replicas of it) samples up to ``max_staleness``
    weight versions ahead of the trainer (asynchronous RL, docs/async-rl.md)."""

    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="precision of the rollouts' linear layers (the attention, norms and held-out pass@k stay float32): "
        "auto is the dtype the stage trains in, bfloat16 where the CPU multiplies bf16 natively and on GPU, else "
        "float32",
    )
    role: bool = Field(
        False,
        description="sample rollouts in a second torchx role (its own process and cores) that runs ahead of the "
        "trainer by up to max_staleness weight versions; false: the trainer samples each step itself",
    )
    threads: int = Field(
        1, ge=1, description="intra-op threads (cores) of each rollout worker; the trainer gets the rest"
    )
    workers: int = Field(
        1,
        ge=1,
        description="replicas of the rollout role; worker w samples the steps s with s % workers == w. "
        "1: weights reach the role through exchange_dir; more: over torch.distributed, in memory",
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="how many weight versions older than the step it trains a rollout may be (AReaL's "
        "max_head_offpolicyness); 0: synchronous, each step's rollouts come from the weights it updates",
    )
    behav_weight_cap: float = Field(
        5.0,
        gt=0,
        description="truncate each token's pi_proximal / pi_behaviour weight here: stale rollouts, and every "
        "rollout not sampled by the trainer's own float32 numerics (bf16 training or rollouts, the rollout role: "
        "the sampler-trainer gap; TRL and verl cap at 2)",
    )
    exchange_dir: str = Field(
        "", description="the roles' shared dir (heartbeats, rollouts); '': shared memory on one host (/dev/shm)"
    )
    lend_cores: bool = Field(
        True,
        description="one rollout worker on the trainer's host: while it waits for weights (it sampled all the bound "
        "allows), the trainer computes on its cores too (chatpipe/rl/core_loan.py)",
    )
    timeout_s: float = Field(600.0, gt=0, description="a role waiting this long for the other one fails")
    heartbeat_timeout_s: float = Field(
        30.0,
        gt=0,
        description="a role whose heartbeat (one a second) stops this long is taken for dead: the other fails",
    )

    @field_validator("max_staleness", "workers")
    @classmethod
    def _ahead_and_replicas_need_the_role(cls, v: int, info: ValidationInfo) -> int:
        alone = {"max_staleness": 0, "workers": 1}[info.field_name]
        if v != alone and not info.data.get("role"):
            raise ValueError(
                f"rollout.{info.field_name} = {v} needs rollout.role: true; without the role the trainer samples "
                f"every step itself, with its own weights, so leave it at {alone}"
            )
        return v


REWARD_MOVED = {
    "reward_source": "source",
    "reward_model_dir": "model_dir",
    "reward_model_scores": "model_scores",
    "reward_model_ensemble": "model_ensemble",
    "reward_model_lr_frac": "model_lr_frac",
    "verifier_file": "verifier_file",
    "verifier_function": "verifier_function",
    "verifier_sandbox": "verifier_sandbox",
    "verifier_timeout_s": "verifier_timeout_s",
    "reward_scale": "scale",
    "reward_bias": "bias",
    "reward_clip": "clip",
    "no_eos": "no_eos",
    "length_penalty": "length_penalty",
    "min_response_length": "min_response_length",
}  # the flat rl.<key> before the reward section -> its key there (the flat `reward: <name>` is reward.verifier)


class RewardSettings(FormerlyOneKey):
    """``rl.reward``: what scores a rollout and how the score is shaped. The verifier (``verifier``, or
    your own file), a learned reward model (``source: model``), or their sum; held-out pass@k is always
    the verifier's."""

    name, value_key = "reward", "verifier"
    source: Literal["verifier", "model", "both"] = Field(
        "verifier",
        description="what trains the policy: the verifier, the reward model at model_dir (its scores read as "
        "model_scores), or their sum",
    )
    verifier: str = Field(
        "exact",
        description="the verifier: a reward function name in chatpipe.rl.rewards, or custom: the function "
        "verifier_function of your own file verifier_file (docs/own-data.md)",
    )
    # verifier: custom. The file is a DVC dependency of `rl` (dvc.yaml), so editing it makes `rl` stale;
    # the default names the shipped example, which scores like verifier: exact.
    verifier_file: str = Field(
        "verifiers/exact_answer.py", description="verifier custom: your Python file defining the verifier"
    )
    verifier_function: str = Field(
        "score", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="its function: (reply: str, problem) -> [0, 1]"
    )
    verifier_sandbox: bool = Field(
        False, description="run every call under chatpipe.sandbox (bubblewrap; standard library only)"
    )
    verifier_timeout_s: float = Field(5.0, gt=0, description="a call running longer fails (reported, never a score)")
    model_dir: str = Field(
        "artifacts/reward_model", description="reward model dir (reward_model stage) for source model|both"
    )
    model_scores: Literal["normalized", "win_rate"] = Field(
        "win_rate",
        description="how source model|both reads the reward model: its normalised scores, or each reply's "
        "Bradley-Terry win rate against the other replies of its group (in [0, 1], as the verifier)",
    )
    model_ensemble: list[str] = Field(
        default_factory=list,
        description="more reward model dirs beside model_dir (source model|both): each reply's reward is the mean "
        "over the models of their normalised scores or win rates, so one model's misrankings count for less",
    )
    model_lr_frac: float = Field(
        0.0,
        ge=0,
        description="iterated RLHF (source model|both): after each step's scoring, one optimizer step of the "
        "reward model's Bradley-Terry loss on the step's pairs the verifier ranks (a right and a wrong reply to one "
        "prompt), at this fraction of the init model's LRs; the policy still reads the model's scores alone, but "
        "they then carry the verifier's verdicts (not verifier-free: a warning, and reward_carries_verifier in the "
        "summary). 0: the reward model stays frozen",
    )
    scale: float = Field(1.0, gt=0, description="scores x scale + bias, then clipped to +-clip")
    bias: float = 0.0
    clip: float = Field(20.0, ge=0, description="0: no clipping")
    no_eos: Literal["keep", "zero", "penalty"] = Field("keep", description="score of responses cut at max_new_tokens")
    length_penalty: float = Field(-1.0, description="score for no_eos=penalty and for too-short responses")
    min_response_length: int = Field(0, ge=0)

    @field_validator("model_ensemble")
    @classmethod
    def _ensemble_needs_the_reward_model(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if v and info.data.get("source") == "verifier":
            raise ValueError(
                f"reward.model_ensemble = {v} is read only with reward.source: model|both; set reward.source, "
                "or leave it empty"
            )
        return v

    @field_validator("model_lr_frac")
    @classmethod
    def _refresh_needs_the_reward_model(cls, v: float, info: ValidationInfo) -> float:
        if v and info.data.get("source") == "verifier":
            raise ValueError(
                "reward.model_lr_frac trains the reward model, which only reward.source: model|both reads; "
                "set reward.source, or leave it at 0"
            )
        if v and info.data.get("model_ensemble"):
            raise ValueError(
                "reward.model_lr_frac refreshes one reward model, not an ensemble: leave reward.model_ensemble "
                "empty, or reward.model_lr_frac at 0"
            )
        return v


class RLSettings(RunSettings):
    """RL on verifiable rewards (`rl` stage): GRPO-lite or PPO, chosen by `algorithm`."""

    section: ClassVar[str] = "rl"
    removed: ClassVar[dict[str, str]] = {
        **dict.fromkeys(["warmup_steps", "warmdown_ratio", "final_lr_frac", "schedule"], _RL_LR_NOTE),
        **dict.fromkeys(["matrix_lr", "embedding_lr", "unembedding_lr"], _RL_LR_NOTE),
        "momentum_warmup_steps": "RL keeps the init model's optimizer momentum; nothing to warm up",
        "total_batch_size": "a step is prompts_per_step x group_size samples; rows per forward is device_batch_size",
        "eval_tokens": "RL evaluates pass@k: eval_problems x eval_samples",
        "compile": "RL runs eager (generation dominates and changes shape every step)",
        **{f"guard_{k}": f"moved to rl.guard.{k}" for k in ("every", "drop", "min_accuracy")},
        **{k: f"moved to rl.ppo.{k}" for k in PPO_MOVED},
        "ppo_epochs": "moved to rl.ppo.epochs",
        "kl_loss_coef": "moved to rl.grpo.kl_loss_coef",
        **{k: f"moved to rl.rollout.{v}" for k, v in ROLLOUT_MOVED.items()},
        **{k: f"moved to rl.reward.{v}" for k, v in REWARD_MOVED.items()},
    }
    init_dir: str = Field("artifacts/sft", description="model dir to start from (and whose LRs to scale)")
    algorithm: Literal["grpo", "ppo"] = "grpo"
    task: str = Field("tinyworld_arith", description="prompt source: tinyworld_arith | gsm8k | any build_task name")
    reward: RewardSettings = Field(
        default_factory=lambda: RewardSettings(),
        description="what scores a rollout: the verifier, the reward model, or both, and how scores are shaped",
    )
    ref_dir: str = Field("", description="frozen reference policy's model dir ('': a copy of init_dir)")
    task_source: Literal["", "synthetic", "local", "hf"] = Field("", description="'': the task's default")
    task_path: str = Field("", description="the task's own file or dir, e.g. task customjson: a problems JSONL")
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
    normalize_std: bool = Field(False, description="GRPO: divide advantages by the group's std")
    # both algorithms
    mask_too_long: bool = Field(False, description="responses cut at max_new_tokens leave the loss (scores kept)")
    generation_size: int = Field(
        0, ge=0, description="samples per prompt, of which the group_size best-scored are trained on (0: group_size)"
    )
    filter_solved: float = Field(
        0.0, ge=0, le=1, description="drop from the pool a prompt a step's group solved at this rate or more (0: off)"
    )
    grad_clip: float = Field(0.0, ge=0, description="clip the policy's (and critic's) gradient norm (0: off)")
    solved_score: float = Field(
        1.0,
        description="with reward.source model: a response counts as solved (filter_solved) when its normalised "
        "reward-model score is at least this (also under win_rate, whose rates average 0.5 in a group); "
        "verifier runs count the verifier's verdict",
    )
    grpo: GRPOSettings = Field(default_factory=lambda: GRPOSettings(), description="GRPO-lite's own keys")
    ppo: PPOSettings = Field(default_factory=lambda: PPOSettings(), description="PPO's own keys (critic, GAE, KL)")
    guard: GuardSettings = Field(
        default_factory=lambda: GuardSettings(),
        description="the reward-hacking guard (reward.source model|both): mode, every, drop, min_accuracy",
    )
    rollout: RolloutSettings = Field(
        default_factory=lambda: RolloutSettings(),
        description="where and in what precision rollouts are sampled: the trainer itself, or the rollout role's "
        "workers ahead of it (asynchronous RL)",
    )
    # eval
    eval_every: int = resume_neutral(10, ge=0, description="pass@k every N steps (0: only before and after)")
    eval_split: Literal["train", "val", "test"] = resume_neutral(
        "val", description="the tuning split: pass@k that settings may be chosen on"
    )
    test_split: Literal["val", "test", "none"] = resume_neutral(
        "test",
        description="the held-out split: pass@k at the same points as eval_split's, on a split nothing was tuned "
        "on (the figure to report); none, or eval_split's own: no second evaluation",
    )
    eval_problems: int = resume_neutral(64, ge=1, description="held-out problems for pass@k")
    eval_samples: int = resume_neutral(4, ge=1, description="samples per held-out problem")
    eval_temperature: float = resume_neutral(1.0, ge=0)
    checkpoint_every: int = resume_neutral(10, ge=0)

    @model_validator(mode="after")
    def _the_other_algorithms_keys_stay_default(self) -> RLSettings:
        """A key of the algorithm not chosen does nothing, so one that differs from its default is an
        error (params.yaml lists every key at its default, so being present in the file cannot count)."""
        other = {"grpo": "ppo", "ppo": "grpo"}[self.algorithm]
        section = getattr(self, other)
        changed = [k for k, f in type(section).model_fields.items() if getattr(section, k) != f.default]
        if changed:
            key = changed[0]
            raise ValueError(
                f"rl.{other}.{key} = {getattr(section, key)!r}: {other}.{key} is {other.upper()}-only: under "
                f"algorithm: {self.algorithm} it would do nothing; set algorithm: {other}, or leave it at its "
                f"default {type(section).model_fields[key].default!r}"
            )
        return self

    @model_validator(mode="after")
    def _rows_split_into_minibatches(self) -> RLSettings:
        rows, n = self.prompts_per_step * self.group_size, self.ppo.num_minibatches
        if self.algorithm == "ppo" and rows % n:
            raise ValueError(
                f"rl.ppo.num_minibatches = {n}: prompts_per_step x group_size = {self.prompts_per_step} x "
                f"{self.group_size} = {rows} rows per step do not split into {n} minibatches; pick a divisor of {rows}"
            )
        return self

    @field_validator("generation_size")
    @classmethod
    def _best_of_n_keeps_a_group(cls, v: int, info: ValidationInfo) -> int:
        group = info.data.get("group_size")
        if v and group and v < group:
            raise ValueError(f"best-of-n keeps group_size = {group} of generation_size samples; set >= {group}, or 0")
        return v

    @field_validator("rollout")
    @classmethod
    def _role_samples_fixed_prompts(cls, v: RolloutSettings, info: ValidationInfo) -> RolloutSettings:
        if v.role and info.data.get("filter_solved"):
            raise ValueError(
                "rollout.role samples each step's prompts ahead of the trainer, but filter_solved changes the pool "
                "from the trainer's scores; set filter_solved: 0, or rollout.role: false"
            )
        return v


class RewardModelSettings(RunSettings):
    """Reward model on preference pairs (`reward_model` stage): a scalar head on the init model's trunk,
    Bradley-Terry loss; held-out pair accuracy and score margins at the end."""

    section: ClassVar[str] = "reward_model"
    train_when: Literal["read", "always"] = Field(
        "read",
        description="read: the stage (dvc.yaml's `--if-read`) trains only when RL reads a reward model "
        "(rl.reward.source model|both), else writes artifacts/reward_model/not_read.json saying why; always: "
        "it trains whatever RL reads (a model for later runs)",
    )
    init_dir: str = Field("artifacts/sft", description="model dir whose trunk (and LRs) the reward model starts from")
    source: Literal["tiny", "local", "hf"] = Field(
        "tiny",
        description="tiny: pairs made offline from tiny-world arithmetic (the init model's own samples ranked by "
        "the verifier, plus synthetic contrasts); local: a {prompt, chosen, rejected} JSONL file (`path`); hf: "
        "a hub dataset in the chosen/rejected format (`hf_repo`)",
    )
    path: str = Field("", description="local: the train pairs' JSONL file")
    val_path: str = Field("", description="local: held-out pairs' JSONL file ('': val_pairs drawn from `path`)")
    hf_repo: str = "HuggingFaceH4/ultrafeedback_binarized"
    hf_config: str = Field("", description="hub dataset config ('': the default)")
    hf_split: str = "train_prefs"
    hf_val_split: str = Field("test_prefs", description="held-out split ('': val_pairs drawn from hf_split)")
    limit: int = Field(0, ge=0, description="train pairs read at most (0: all)")
    val_pairs: int = Field(
        600, ge=1, description="held-out pairs evaluated (drawn from the train pairs where no split)"
    )
    max_seq_len: int = Field(256, ge=8, description="longest conversation of a pair, in tokens; longer fails")
    skip_too_long: bool = Field(
        False, description="local/hf: leave out pairs over max_seq_len instead of failing (tiny always leaves them out)"
    )
    tiny_prompts: int = Field(
        4096,
        ge=1,
        description="tiny: train arithmetic problems, from the train split's `preferences` part that no other "
        "stage reads",
    )
    tiny_samples: int = Field(8, ge=0, description="tiny: init-model samples per problem ranked by the verifier")
    tiny_sample_prompts: int = Field(
        4096,
        ge=0,
        description="tiny: the init model is sampled on the first N train problems only (0: none); every "
        "problem gets contrasts",
    )
    tiny_val_problems: int = Field(
        600,
        ge=1,
        description="tiny: held-out problems (the train split's `preferences` part, none of the train ones "
        "and none RL evaluates on), each sampled: all their sampled pairs are held out, then their contrasts "
        "up to val_pairs",
    )
    pool: Literal["last", "mean"] = Field(
        "mean",
        description="a reply's score: the head at its last token, or the mean of the head over its tokens "
        "(a mistake is scored where it is made)",
    )
    margin: float = Field(
        0.0, ge=0, description="Bradley-Terry margin: -log sigmoid(r_chosen - r_rejected - margin) (0: plain)"
    )
    tiny_max_new_tokens: int = Field(48, ge=1)
    tiny_temperature: float = Field(1.0, gt=0)
    max_steps: int = Field(1400, ge=1, description="optimizer steps of device_batch_size pairs (x world size)")
    device_batch_size: int = Field(24, ge=1, description="pairs per rank per step")
    lr_frac: float = Field(0.2, gt=0, description="LRs = lr_frac x the init model's LRs, linear decay to 0")
    head_lr: float = Field(0.01, gt=0, description="AdamW LR of the scalar head (starts at zero)")
    weight_decay: float = Field(0.0, ge=0)
    eval_every: int = resume_neutral(200, ge=0, description="held-out pair accuracy every N steps (0: only at the end)")
    checkpoint_every: int = resume_neutral(100, ge=0)
