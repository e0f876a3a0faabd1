"""The typed config: one pydantic model per section; the field docs are the user docs.

Every section forbids unknown keys. Cross-field checks that need only the config live in
model validators next to the fields they join; checks that need the world size live in
`shardwise.config.validate.check_world`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from shardwise.config.dtypes import canonical_dtype
from shardwise.errors import ConfigError

DType = Annotated[str, BeforeValidator(canonical_dtype)]
"""A dtype name (fp32/float32, bf16/bfloat16, fp16/float16/half, torch names), stored canonical."""

NonNeg = Annotated[int, Field(ge=0, strict=True)]
Pos = Annotated[int, Field(ge=1, strict=True)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True)


class RunConfig(Section):
    dir: str = "runs/demo"
    """Everything a run writes: metrics.jsonl, checkpoints/, hf/, plots."""
    seed: int = 0
    """Seed of model init, data order and sampling."""


class ModelConfig(Section):
    path: str | None = None
    """A local HF folder (config.json + safetensors [+ tokenizer])."""
    config: dict[str, Any] | None = None
    """Or an inline HF config for random init, e.g. {model_type: qwen3, hidden_size: 64, ...}."""
    tokenizer: str | None = None
    """Local tokenizer folder; default: model.path, or the task's own."""
    dtype: DType = "fp32"
    """dtype of the sharded master weights."""
    freeze: list[str] = []
    """Module path patterns whose parameters are not trained."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    trust_remote_code: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> "ModelConfig":
        if self.path is not None and self.config is not None:
            raise ConfigError("model.config", "model.path and model.config are both set", "keep one")
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError("model.config.model_type", "missing", "e.g. model_type: qwen3")
        return self


class ParallelConfig(Section):
    fsdp_size: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"
    """Shard group size. auto, or >= world size: one FSDP group over all ranks.
    1 < n < world: HSDP, world/n replicas of n shards."""
    ulysses_size: Pos = 1
    """Sequence-parallel degree."""
    sharding_strategy: Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"] = "full_shard"


class WrapConfig(Section):
    classes: list[str] = []
    """Layer class names; empty (and no `modules`): the model's _no_split_modules."""
    modules: list[str] = []
    """Module path patterns, e.g. model.layers.{*}."""
    embeddings: bool = False
    """Input embeddings as their own unit."""
    lm_head: bool = False
    """Output head as its own unit."""
    moe_experts: list[str] = []
    """Expert class names or path patterns, each match its own unit."""


class MixedPrecisionConfig(Section):
    param_dtype: DType = "bf16"
    """Compute dtype of gathered parameters."""
    reduce_dtype: DType = "fp32"
    """Gradient reduce-scatter dtype."""
    output_dtype: DType | None = None
    cast_forward_inputs: bool = True


class PrecisionOverride(Section):
    """Layered precision for one module (seed 000)."""

    param_dtype: DType
    reduce_dtype: DType | None = None
    """Default: fp32 when param_dtype is fp32, else the global reduce_dtype."""
    output_dtype: DType | None = None
    """Default: the surrounding compute dtype, so the rest of the model sees its own dtype."""
    cast_forward_inputs: bool = True


class OffloadConfig(Section):
    enabled: bool = False
    pin_memory: bool = True
    """Pinned host memory; ignored (with a warning) where no accelerator exists."""


class PrefetchConfig(Section):
    forward: NonNeg = 0
    """How many following units to all-gather ahead in forward."""
    backward: NonNeg = 1
    """How many preceding units to all-gather ahead in backward."""


class RecomputeConfig(Section):
    modules: list[str] = []
    """Activation checkpointing by module path pattern or class name."""
    use_reentrant: bool = False


class TiledMLPConfig(Section):
    enabled: bool = False
    """Run each MLP over slices of the sequence, keeping only its input for backward."""
    shards: Pos = 4
    """Slices of the sequence (seed 001's tiled_num_shards)."""
    modules: list[str] = []
    """Position-wise modules to tile (patterns or class names); empty: every module whose
    class name ends in MLP."""


class FsdpConfig(Section):
    wrap: WrapConfig = WrapConfig()
    ignored_modules: list[str] = []
    """Patterns; parameters left out of FSDP entirely."""
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    module_precision: dict[str, Union[DType, PrecisionOverride]] = {}
    """Layered precision: {pattern: dtype} or {pattern: {param_dtype, ...}}."""
    reshard_after_forward: Union[bool, Annotated[int, Field(ge=1)]] = True
    """true (ZeRO-3) | false (ZeRO-2) | int (reshard to that group size; must divide it)."""
    offload: OffloadConfig = OffloadConfig()
    prefetch: PrefetchConfig = PrefetchConfig()
    recompute: RecomputeConfig = RecomputeConfig()
    moe_expert_patch: bool = False
    tiled_mlp: TiledMLPConfig = TiledMLPConfig()


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 1.0e-4
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: Annotated[float, Field(gt=0)] = 1.0e-8


class SchedulerConfig(Section):
    name: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: NonNeg = 10
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1


class TrainConfig(Section):
    micro_batch_size: Pos = 4
    """Rows per rank, per forward."""
    global_batch_size: Pos = 16
    """SFT: examples per optimizer step = micro x grad accumulation x data-parallel size
    (checked by `shardwise.engine.batching.check_batch_sizes`). RL: prompts per step, each
    sampled rl.rollout.n times."""
    max_steps: Pos = 100
    """Optimizer steps."""
    optimizer: OptimizerConfig = OptimizerConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    grad_clip: Annotated[float, Field(gt=0)] | None = 1.0
    """Global-norm clip; null disables."""
    log_every: Pos = 1


class DataConfig(Section):
    source: str = "builtin:arithmetic"
    """builtin:NAME, or a local .jsonl / .json / .parquet file."""
    prompt_key: str = "prompt"
    response_key: str = "response"
    max_length: Pos = 128
    packing: bool = False
    """Pack several examples per row (block-diagonal attention) instead of padding."""


class CheckpointConfig(Section):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    every_steps: NonNeg = 50
    """0 disables periodic saves (the final step is still saved)."""
    async_save: bool = Field(True, alias="async")
    """Save on a separate gloo group while training goes on."""
    keep_last: Pos = 2
    resume: str = "auto"
    """auto (latest complete in run.dir) | never | a checkpoint path."""
    export_hf: bool = True
    """Write an HF folder (safetensors) at the end."""


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    n: Pos = 4
    max_new_tokens: Pos = 16
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0


KLKind = Literal["kl", "k1", "mse", "k2", "low_var_kl", "k3"]
"""KL estimators: k1 (alias kl), k2 (mse), k3 (low_var_kl); see shardwise.rl.algorithms.kl_penalty."""


class KLLossConfig(Section):
    enabled: bool = False
    type: KLKind = "low_var_kl"
    coef: Annotated[float, Field(ge=0)] = 0.001


class ActorConfig(Section):
    ppo_epochs: Pos = 1
    """Passes over each rollout batch (actor and critic)."""
    ppo_mini_batches: Pos = 1
    """Optimizer steps per pass: the rollout batch is split into this many mini-batches."""
    clip_ratio: Annotated[float, Field(gt=0)] = 0.2
    clip_ratio_low: Annotated[float, Field(gt=0)] | None = None
    clip_ratio_high: Annotated[float, Field(gt=0)] | None = None
    clip_ratio_c: Annotated[float, Field(gt=1)] = 3.0
    entropy_coef: float = 0.0
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    kl_loss: KLLossConfig = KLLossConfig()


class CriticConfig(Section):
    enabled: bool = False
    lr: Annotated[float, Field(gt=0)] = 1.0e-5
    cliprange_value: Annotated[float, Field(gt=0)] = 0.5
    colocated: bool = True
    """true: the critic lives in the actor's worker processes; false: a worker group of
    its own (as many processes again, its own process group)."""


class ReferenceConfig(Section):
    enabled: bool = True


class RewardConfig(Section):
    function: str | None = "builtin:arithmetic"
    """Rule-based reward: builtin:NAME or module:function, called as
    fn(prompt, response, ground_truth) -> float on decoded text."""
    model: str | None = None
    """A sequence-classification model folder; its score at the last token is added."""
    colocated: bool = True
    """Reward model in the actor's worker processes (true) or a worker group of its own."""


class KLInRewardConfig(Section):
    enabled: bool = False
    type: KLKind = "kl"
    coef: Annotated[float, Field(ge=0)] = 0.001


class RLConfig(Section):
    algorithm: Literal["grpo", "ppo"] = "grpo"
    advantage: Literal["grpo", "gae", "rloo", "reinforce_plus_plus"] = "grpo"
    rollout: RolloutConfig = RolloutConfig()
    actor: ActorConfig = ActorConfig()
    critic: CriticConfig = CriticConfig()
    reference: ReferenceConfig = ReferenceConfig()
    reward: RewardConfig = RewardConfig()
    kl_in_reward: KLInRewardConfig = KLInRewardConfig()
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95

    @model_validator(mode="after")
    def _critic_for_gae(self) -> "RLConfig":
        if self.advantage == "gae" and not self.critic.enabled:
            raise ConfigError("rl.critic.enabled", "rl.advantage=gae needs a critic", "set rl.critic.enabled=true")
        return self


class InferConfig(Section):
    """Read by `shardwise infer` only: generation with the FSDP2 infer engine."""

    max_new_tokens: Pos = 16
    temperature: Annotated[float, Field(ge=0)] = 0.0
    """0: greedy decoding; > 0: sampling at this temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    n: Pos = 1
    """Responses per prompt (sampling; with temperature 0 they are all the same)."""
    batch_size: Pos = 64
    """Prompts per rank in one generate call."""
    num_prompts: Pos | None = None
    """The first N records of data.source; built-in tasks: N held-out prompts (default 200)."""
    reward: str | None = None
    """Score responses against data.response_key with builtin:NAME or module:function;
    default: a built-in task's own scorer, no scoring for files."""
    output: str | None = None
    """The JSONL file of generations; default run.dir/generations.jsonl."""


class Config(Section):
    """The whole run."""

    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    fsdp: FsdpConfig = FsdpConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    rl: RLConfig = RLConfig()
    infer: InferConfig = InferConfig()

    @model_validator(mode="after")
    def _strategy_agrees(self) -> "Config":
        strategy = self.parallel.sharding_strategy
        raf_set = "reshard_after_forward" in self.fsdp.model_fields_set
        if strategy == "shard_grad_op" and raf_set and self.fsdp.reshard_after_forward is not False:
            raise ConfigError(
                "fsdp.reshard_after_forward",
                "parallel.sharding_strategy=shard_grad_op keeps parameters after forward",
                "drop fsdp.reshard_after_forward or set it to false",
            )
        if strategy == "no_shard" and self.parallel.fsdp_size not in ("auto", 1):
            raise ConfigError(
                "parallel.fsdp_size",
                f"{self.parallel.fsdp_size} conflicts with sharding_strategy=no_shard, which replicates every parameter",
                "set fsdp_size to auto or 1",
            )
        if strategy == "hybrid_shard" and self.parallel.fsdp_size == "auto":
            raise ConfigError(
                "parallel.fsdp_size",
                "sharding_strategy=hybrid_shard needs the shard group size",
                "set an integer that divides the world size, e.g. fsdp_size=2",
            )
        return self
