"""HF export: folders written from a live 2-rank sharded model (`export_model`) and from a
DCP checkpoint (`export_checkpoint`) load with plain transformers, in a fresh process that
never imports shardwise, and reproduce the sharded model's logits.

One 2-process run trains each tiny model one step (so the weights are no longer the seeded
init), exports it three ways, records its logits and writes a DCP checkpoint in the
checkpoint manager's layout. The offline export then runs here, without a process group,
and one fresh subprocess loads every folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist.common import (
    FP32,
    TINY_LLAMA,
    TINY_QWEN3,
    TINY_QWEN3_MOE,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks

MODELS = {
    "qwen3_untied": [TINY_QWEN3],
    "llama_tied": [TINY_LLAMA],
    # 2-D (replicate, shard) mesh of shape (2, 1): every rank holds whole parameters.
    "qwen3_no_shard": [TINY_QWEN3, "parallel.sharding_strategy=no_shard"],
    # fused experts split per expert (each its own unit): written in the original checkpoint
    # layout (experts.{e}.gate_proj.weight), which transformers 5 fuses again on load.
    # fused experts, as transformers 5 builds them (the layer is the unit): cut per expert on
    # export, like save_pretrained
    "qwen3_moe_fused": [TINY_QWEN3_MOE],
    "qwen3_moe_per_expert": [TINY_QWEN3_MOE, "fsdp.moe_expert_patch=true", "fsdp.wrap.moe_experts=[Qwen3MoeMLP]"],
}
"""Named configurations, each run on 2 ranks and exported; a new feature is a new row."""
COMMON = [*FP32, "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
          "train.optimizer.lr=0.01"]
SMALL_SHARD = 20_000
"""Bytes: larger than any single tensor of the tiny models (8 KiB), smaller than the model."""
TOL = 1e-5
CKPT = "run/checkpoints/step_00000001"


def fixed_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (3, 10), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def overrides(name: str) -> list[str]:
    return [*MODELS[name], *COMMON]


# ---------------------------------------------------------------- rank body


def _export_body(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from shardwise.checkpoint.hf_export import export_model
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine
    from shardwise.models.loading import load_hf_config

    runtime = init_distributed(timeout_s=60)
    results = {}
    for name in MODELS:
        base = Path(root) / name
        cfg = load_config(None, overrides(name))
        engine = TrainEngine(cfg, runtime)
        rows = make_global_batch(0, 4)
        engine.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows))
        hf_config = load_hf_config(cfg.model)
        reports = {
            "hf": export_model(engine.model, base / "hf", hf_config, tokenizer_dir=base / "run" / "tokenizer"),
            "hf_sharded": export_model(engine.model, base / "hf_sharded", hf_config, max_shard_bytes=SMALL_SHARD),
            "hf_bf16": export_model(engine.model, base / "hf_bf16", hf_config, dtype="bf16"),
        }
        engine.model.eval()
        with torch.no_grad():
            logits = engine.model(**fixed_batch(), use_cache=False).logits.float()
        msd, osd = get_state_dict(engine.model, engine.optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(base / CKPT))
        if rank == 0:
            meta = {"step": 1, "world_size": world, "config": cfg.model_dump(mode="json", by_alias=True)}
            (base / CKPT / "meta.json").write_text(json.dumps(meta))
            (base / CKPT / "COMMITTED").write_text("")
        dist.barrier()
        head, emb = engine.model.get_output_embeddings(), engine.model.get_input_embeddings()
        results[name] = {
            "logits": logits,
            "live_tied": head.weight is emb.weight,
            "reports": {k: {"files": r.files, "num_tensors": r.num_tensors, "total_bytes": r.total_bytes,
                            "max_buffered_bytes": r.max_buffered_bytes} for k, r in reports.items()},
        }
    teardown()
    return results


# A fresh interpreter: plain transformers only.
_LOADER = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    job = json.load(open(sys.argv[1]))
    batch = torch.load(job["batch"])
    out = {}
    for folder in job["folders"]:
        model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                           output_loading_info=True)
        model.eval()
        with torch.no_grad():
            logits = model(**batch, use_cache=False).logits.float()
        head, emb = model.get_output_embeddings().weight, model.get_input_embeddings().weight
        res = {"logits": logits, "tied": head is emb or head.data_ptr() == emb.data_ptr(),
               "param_dtype": str(next(model.parameters()).dtype),
               "loading_problems": {k: sorted(map(str, v)) for k, v in info.items() if v}}
        if job["tokenizer"].get(folder):
            tok = AutoTokenizer.from_pretrained(folder)
            res["token_ids"] = tok(job["tokenizer"][folder])["input_ids"]
            res["decoded"] = tok.decode(res["token_ids"])
        out[folder] = res
    out["shardwise_imported"] = any(m == "shardwise" or m.startswith("shardwise.") for m in sys.modules)
    torch.save(out, job["result"])
""")
TOKENIZER_TEXT = "12+30=42, ok!"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    import torch.distributed as dist

    from shardwise.checkpoint.hf_export import export_checkpoint
    from shardwise.data.tokenizer import build_char_tokenizer

    root = tmp_path_factory.mktemp("export")
    for name in MODELS:
        build_char_tokenizer(root / name / "run" / "tokenizer")
    live = run_ranks(_export_body, 2, str(root), timeout=240)

    offline = {}
    for name in MODELS:
        offline[name] = export_checkpoint(root / name / CKPT, root / name / "hf_offline")
    assert not dist.is_initialized(), "export_checkpoint must not create a process group"

    folders = [str(root / name / sub) for name in MODELS
               for sub in ("hf", "hf_sharded", "hf_offline", "hf_bf16")]
    torch.save(fixed_batch(), root / "batch.pt")
    job = {"batch": str(root / "batch.pt"), "folders": folders, "result": str(root / "loaded.pt"),
           "tokenizer": {str(root / n / s): TOKENIZER_TEXT for n in MODELS for s in ("hf", "hf_offline")}}
    (root / "job.json").write_text(json.dumps(job))
    (root / "load_plain.py").write_text(_LOADER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(root / "load_plain.py"), str(root / "job.json")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    loaded = torch.load(root / "loaded.pt", weights_only=True)
    return {"root": root, "live": live, "offline": offline, "loaded": loaded}


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        part = load_file(f)
        assert not out.keys() & part.keys(), f"{f.name} repeats a tensor"
        out.update(part)
    return out


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("sub", ["hf", "hf_sharded", "hf_offline"])
def test_plain_transformers_reproduces_sharded_logits(exported, name, sub):
    loaded = exported["loaded"]
    # (shardwise may be importable — `make test` installs it — but the loader must not need it)
    assert loaded["shardwise_imported"] is False
    folder = str(exported["root"] / name / sub)
    assert loaded[folder]["param_dtype"] == "torch.float32"
    assert loaded[folder]["loading_problems"] == {}  # no missing, unexpected or mismatched keys
    for rank in (0, 1):  # both ranks' sharded forwards saw the same weights
        torch.testing.assert_close(loaded[folder]["logits"], exported["live"][rank][name]["logits"],
                                   atol=TOL, rtol=0)


def test_export_holds_trained_weights_not_the_seeded_init(exported):
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model
    from shardwise.models.patches.moe import fused_experts_modules, split_moe_experts

    for name in MODELS:
        model = build_full_model(load_config(None, overrides(name)).model, 0)
        if fused_experts_modules(model):  # the init under the names an export writes
            split_moe_experts(model)
        init = model.state_dict()
        written = _tensors(exported["root"] / name / "hf")
        moved = [k for k in written if not torch.equal(written[k], init[k])]
        assert len(moved) == len(written), f"{name}: not updated by the training step: {set(written) - set(moved)}"


def test_tied_llama_written_once_and_retied_on_load(exported):
    root, loaded = exported["root"], exported["loaded"]
    assert exported["live"][0]["llama_tied"]["live_tied"] is True
    for sub in ("hf", "hf_sharded", "hf_offline"):
        keys = set(_tensors(root / "llama_tied" / sub))
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys, sub
        assert loaded[str(root / "llama_tied" / sub)]["tied"] is True
    untied = _tensors(root / "qwen3_untied" / "hf")
    assert not torch.equal(untied["lm_head.weight"], untied["model.embed_tokens.weight"])
    assert loaded[str(root / "qwen3_untied" / "hf")]["tied"] is False


@pytest.mark.parametrize("name", list(MODELS))
def test_same_tensor_names_as_save_pretrained(exported, tmp_path, name):
    """Ties and non-persistent buffers handled as transformers itself does: the key set
    equals that of `save_pretrained` on the unsharded model."""
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    build_full_model(load_config(None, overrides(name)).model, 0).save_pretrained(tmp_path)
    expected = set(_tensors(tmp_path))
    for sub in ("hf", "hf_sharded", "hf_offline"):
        keys = set(_tensors(exported["root"] / name / sub))
        assert keys == expected, (sub, keys ^ expected)
        assert not any("inv_freq" in k for k in keys)
    config = json.loads((exported["root"] / name / "hf" / "config.json").read_text())
    assert config["architectures"] == json.loads((tmp_path / "config.json").read_text())["architectures"]
    assert config["dtype"] == "float32"


def test_tokenizer_copied_and_loads_with_autotokenizer(exported):
    from shardwise.data.tokenizer import build_char_tokenizer

    root, loaded = exported["root"], exported["loaded"]
    reference = build_char_tokenizer(root / "reference_tokenizer")
    expected = reference(TOKENIZER_TEXT)["input_ids"]
    for name in MODELS:
        # hf: tokenizer_dir passed; hf_offline: found as <checkpoint>/../../tokenizer.
        assert exported["offline"][name].tokenizer_dir == (root / name / "run" / "tokenizer").resolve()
        for sub in ("hf", "hf_offline"):
            folder = root / name / sub
            assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
            assert loaded[str(folder)]["token_ids"] == expected
            assert loaded[str(folder)]["decoded"] == TOKENIZER_TEXT
        assert not (root / name / "hf_sharded" / "tokenizer.json").exists()


@pytest.mark.parametrize("name", list(MODELS))
def test_small_shards_give_a_valid_index(exported, name):
    folder = exported["root"] / name / "hf_sharded"
    report = exported["live"][0][name]["reports"]["hf_sharded"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    n = len(files)
    assert n > 1 and files == report["files"]
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{n:05d}\.safetensors", f) for f in files)
    assert not (folder / "model.safetensors").exists()
    from safetensors.torch import load_file

    seen = {}
    for f in files:
        part = load_file(folder / f)
        seen.update({k: f for k in part})
        assert sum(t.numel() * t.element_size() for t in part.values()) <= SMALL_SHARD
    assert index["weight_map"] == seen
    total = sum(t.numel() * t.element_size() for t in _tensors(folder).values())
    assert index["metadata"]["total_size"] == total == report["total_bytes"]
    # Rank 0 never buffered more than one shard; rank 1 buffered nothing and wrote nothing.
    assert 0 < report["max_buffered_bytes"] <= SMALL_SHARD
    assert exported["live"][1][name]["reports"]["hf_sharded"] == {
        "files": [], "num_tensors": 0, "total_bytes": 0, "max_buffered_bytes": 0}
    single = _tensors(exported["root"] / name / "hf")
    sharded = _tensors(folder)
    assert single.keys() == sharded.keys() and all(torch.equal(single[k], sharded[k]) for k in single)


@pytest.mark.parametrize("name", list(MODELS))
def test_checkpoint_export_equals_live_export(exported, name):
    live = _tensors(exported["root"] / name / "hf")
    offline = _tensors(exported["root"] / name / "hf_offline")
    assert live.keys() == offline.keys()
    for k in live:
        assert live[k].dtype == offline[k].dtype and torch.equal(live[k], offline[k]), k
    assert (exported["root"] / name / "hf_offline" / "model.safetensors").is_file()
    report = exported["offline"][name]
    assert report.num_tensors == len(live) and Path(report) == exported["root"] / name / "hf_offline"


def test_dtype_cast_on_export(exported):
    folder = exported["root"] / "qwen3_untied" / "hf_bf16"
    bf16 = _tensors(folder)
    fp32 = _tensors(exported["root"] / "qwen3_untied" / "hf")
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert all(torch.equal(bf16[k], fp32[k].to(torch.bfloat16)) for k in fp32)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    assert exported["loaded"][str(folder)]["param_dtype"] == "torch.float32"  # loaded as asked


def test_checkpoint_dir_without_meta_is_a_user_error(tmp_path):
    from shardwise.checkpoint.hf_export import ExportError, export_checkpoint

    with pytest.raises(ExportError, match="meta.json"):
        export_checkpoint(tmp_path, tmp_path / "out")
    (tmp_path / "meta.json").write_text("{}")
    with pytest.raises(ExportError, match="did not finish"):
        export_checkpoint(tmp_path, tmp_path / "out")


@pytest.mark.parametrize("sizes, limit, expected", [
    ([4, 4, 4], 8, [[4, 4], [4]]),
    ([4, 4, 4], 100, [[4, 4, 4]]),
    ([12, 4], 8, [[12], [4]]),       # a tensor above the limit gets a file of its own
    ([4, 12, 4], 8, [[4], [12], [4]]),
    ([], 8, [[]]),                   # nothing to write: still one (empty) file
])
def test_plan_shards(sizes, limit, expected):
    from shardwise.checkpoint.hf_export import plan_shards
    from shardwise.models.layout import TensorEntry

    entries = [TensorEntry(f"w{i}", f"w{i}", (s,), torch.uint8) for i, s in enumerate(sizes)]
    got = plan_shards(entries, limit)
    assert [[e.nbytes for e in shard] for shard in got] == expected


def test_shard_file_names():
    from shardwise.checkpoint.hf_export import shard_file_names

    assert shard_file_names(1) == ["model.safetensors"]
    assert shard_file_names(3) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
