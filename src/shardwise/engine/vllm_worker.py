"""What runs on vLLM's worker (``LLM.collective_rpc``, in this process with the external
launcher) for `shardwise.engine.vllm_engine.VLLMGenerator`: reading the engine's weights back
(`local_weights`, joined over the TP ranks by `full_weights`), copying pushed weights into
plain parameters (`plain_weights`, `load_in_place`), re-processing tied LM heads after a
reload (`refresh_tied_heads`), and putting a LoRA adapter built from tensors in memory in
place (`add_adapter`). These reach into vLLM's worker, checked on vLLM 0.32 (CPU build);
vLLM is imported inside each function (it is optional).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["add_adapter", "full_weights", "load_in_place", "local_weights", "plain_weights", "refresh_tied_heads"]


def local_weights(worker) -> dict[str, Any]:
    """Run on the vLLM worker (``collective_rpc``): this TP rank's parameters with how each
    one is split, for `VLLMGenerator.read_weights`.

    On CPU vLLM packs each linear layer's weight for its GEMM kernel and leaves the
    parameter empty; that weight is read back through the layer's own kernel applied to an
    identity matrix (``I @ W.T``: every output is one product by 1 plus exact zeros, so the
    weight comes back bit for bit)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    model = worker.model_runner.get_model()
    out = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, pname = name.rpartition(".")
            module = model.get_submodule(module_name)
            t = param.detach()
            kind, meta = "replicated", None
            if isinstance(module, LinearBase):
                if pname == "weight" and t.numel() == 0:
                    eye = torch.eye(module.input_size_per_partition, dtype=param.dtype, device=param.device)
                    t = module.quant_method.apply(module, eye, None).t()
                if isinstance(module, QKVParallelLinear):
                    if module.num_kv_head_replicas != 1:
                        raise NotImplementedError("read_weights: KV heads replicated over TP ranks")
                    kind, meta = "split0", [module.num_heads * module.head_size,
                                            module.num_kv_heads * module.head_size,
                                            module.num_kv_heads * module.v_head_size]
                elif isinstance(module, MergedColumnParallelLinear):
                    kind, meta = "split0", [s // module.tp_size for s in module.output_sizes]
                elif isinstance(module, ColumnParallelLinear):
                    kind = "cat0"
                elif isinstance(module, RowParallelLinear) and pname == "weight":
                    kind = "cat1"
            elif isinstance(module, VocabParallelEmbedding) and pname == "weight":
                t = t[:module.shard_indices.num_org_elements]
                kind = "cat0"
            out.append((name, kind, meta, t.to("cpu", copy=True)))
        # The LM head as the logits see it: through its GEMM kernel (on CPU a packed copy of
        # the weight, which a tied head shares with no one), also when tied to the embedding.
        entries = {e[0]: i for i, e in enumerate(out)}
        for mname, module in model.named_modules():
            if isinstance(module, ParallelLMHead):
                hidden = module.weight.shape[1]
                eye = torch.eye(hidden, dtype=module.weight.dtype, device=module.weight.device)
                t = module.quant_method.apply(module, eye, None).t()[:module.shard_indices.num_org_elements]
                entry = (f"{mname}.weight", "cat0", None, t.to("cpu", copy=True))
                if entry[0] in entries:
                    out[entries[entry[0]]] = entry
                else:
                    out.append(entry)
    return {"params": out, "packed": dict(getattr(model, "packed_modules_mapping", {}) or {})}


def plain_weights(worker) -> bool:
    """Run on the vLLM worker: every linear layer keeps a weight parameter (the engine was
    built under `plain_cpu_gemm`), so `load_in_place` can copy into them."""
    from vllm.model_executor.layers.linear import LinearBase

    layers = [m for m in worker.model_runner.get_model().modules() if isinstance(m, LinearBase)]
    return bool(layers) and all(m.weight.numel() > 0 for m in layers)


def load_in_place(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Run on the vLLM worker: copy HF-named full tensors into the model's parameters with
    the model's own ``load_weights`` (fused q/k/v and gate/up pieces and each TP rank's
    slice placed by vLLM's weight loaders), then drop the encoder and multimodal caches (they
    hold outputs of the old weights). Only for plain parameters (`plain_weights`): no
    post-processing follows. Raises when a parameter got nothing (a tensor the actor does not
    have); a tied LM head counts as loaded through its embedding. Returns the number loaded."""
    model = worker.model_runner.get_model()
    with torch.no_grad():
        loaded = set(model.load_weights(weights) or ())
    params = dict(model.named_parameters())
    filled = {params[n].data_ptr() for n in loaded if n in params}
    missing = sorted(n for n, p in params.items() if n not in loaded and p.data_ptr() not in filled)
    if missing:
        raise RuntimeError(f"vllm: the push left {len(missing)} parameter(s) without weights, e.g. {missing[:3]}")
    runner = worker.model_runner
    for reset in ("reset_encoder_cache", "reset_mm_cache"):
        if callable(getattr(runner, reset, None)):
            getattr(runner, reset)()
    return len(loaded)


def refresh_tied_heads(worker) -> int:
    """Run on the vLLM worker after ``reload_weights``: re-process every LM head whose weight
    is the embedding's (tied). vLLM 0.32 reloads layer by layer and post-processes only the
    layers that received weights; on CPU an LM head's post-processing packs its weight into
    a GEMM kernel, so a tied head (which receives nothing: the checkpoint has no
    lm_head.weight) would keep computing logits with the weights of the first load.
    Returns the number of heads re-processed."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    model = worker.model_runner.get_model()
    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    done = 0
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ParallelLMHead) and id(module.weight) in embeddings:
                module.quant_method.process_weights_after_loading(module)
                done += 1
    return done


def full_weights(parts: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """HF-named full tensors from every TP rank's `local_weights` (in TP-rank order)."""
    packed = parts[0]["packed"]
    full: dict[str, torch.Tensor] = {}
    for i, (name, kind, meta, _) in enumerate(parts[0]["params"]):
        shards = [p["params"][i][3] for p in parts]
        if kind == "replicated":
            full[name] = shards[0]
        elif kind == "cat0":
            full[name] = torch.cat(shards, 0)
        elif kind == "cat1":
            full[name] = torch.cat(shards, 1)
        else:  # split0: a fused module (qkv, gate_up): one HF tensor per piece, each TP-split on dim 0
            module_name, _, pname = name.rpartition(".")
            parent, _, fused = module_name.rpartition(".")
            pieces = packed.get(fused)
            if pieces is None or len(pieces) != len(meta):
                raise NotImplementedError(f"read_weights: cannot unfuse {name} (packed modules {packed})")
            split = [s.split(meta, 0) for s in shards]
            for j, piece in enumerate(pieces):
                full[f"{parent}.{piece}.{pname}"] = torch.cat([s[j] for s in split], 0)
    return full


def add_adapter(worker, adapter_id: int, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]) -> int:
    """Run on the vLLM worker (``collective_rpc``): build a LoRA model from `tensors` (PEFT
    adapter-file names) and `peft_config` (an adapter_config.json's dict) as vLLM's own
    loader would from a folder, and put it in place of adapter `adapter_id`. Returns the
    number of adapted modules."""
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": None})
    helper.validate_legal(manager.lora_config)
    adapters = manager._adapter_manager
    mapper = getattr(adapters.model, "hf_to_vllm_mapper", None)
    lora_model = manager._lora_model_cls.from_lora_tensors(
        adapter_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper else None)
    adapters.remove_adapter(adapter_id)
    adapters.add_adapter(lora_model)
    return len(lora_model.loras)
