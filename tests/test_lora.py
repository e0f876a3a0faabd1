"""LoRA under FSDP2 (issue 19): peft's adapters injected before sharding.

- SFT with LoRA on 2 ranks equals peft's own unsharded model (``get_peft_model``) trained on
  the same global batches from the same initial adapters: losses within 1e-5, adapters
  within the parity tolerances (tests/dist/common.py:assert_trained_params_close), the
  base weights bitwise unchanged, the trainable count r x (in + out) per target;
- the job's exports: a PEFT adapter folder that ``PeftModel.from_pretrained`` loads on the
  base folder, and the merged model, with the same logits as each other and as peft's
  ``merge_and_unload``; the checkpoint holds the adapters and their optimizer state only,
  and resume is exact.
"""

from __future__ import annotations

import json

import pytest
import torch
from dist.common import FP32, TINY_QWEN3, assert_trained_params_close, make_global_batch, micro_batches_of, sharded_run
from dist.launcher import REPO_ROOT, at_once, run_cli, run_ranks

from shardwise.config import load_config
from shardwise.errors import ConfigError, PatternError

peft = pytest.importorskip("peft")

STEPS, GLOBAL_BATCH, MICRO, LR = 4, 8, 2, 1e-2
LORA = ["model.lora.enabled=true", "model.lora.r=4", "model.lora.alpha=8",
        "model.lora.target_modules=[model.layers.{*}.self_attn.{q,v}_proj, down_proj]",
        "model.lora.modules_to_save=[lm_head]"]
BASE = [TINY_QWEN3, *FP32, *LORA, f"train.optimizer.lr={LR}", "train.scheduler.warmup_steps=1",
        f"train.max_steps={STEPS}", "train.grad_clip=1.0"]


def peft_reference(overrides: list[str], steps: int) -> dict:
    """peft's unsharded LoRA model: the same base weights, the same initial adapters (those
    shardwise's rank 0 makes), trained on the same global batches with AdamW."""
    from peft import LoraConfig, get_peft_model

    from shardwise.engine.optim import build_optimizer, build_scheduler
    from shardwise.engine.train import lm_loss_sum
    from shardwise.fsdp.build import build_full
    from shardwise.models.loading import build_full_model

    cfg = load_config(None, overrides)
    ours = build_full(cfg)
    init = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    mine = ours.peft_config["default"]
    base = build_full_model(cfg.model, cfg.run.seed)
    model = get_peft_model(base, LoraConfig(r=mine.r, lora_alpha=mine.lora_alpha, lora_dropout=0.0,
                                            target_modules=sorted(mine.target_modules),
                                            modules_to_save=list(mine.modules_to_save)))
    ref_names = {}
    for name, p in model.named_parameters():
        ours_name = name.removeprefix("base_model.model.").replace("modules_to_save.default.", "")
        if p.requires_grad:
            ref_names[ours_name] = name
            with torch.no_grad():
                p.copy_(init[ours_name])
    opt = build_optimizer(model, cfg.train.optimizer)
    sched = build_scheduler(opt, cfg.train.scheduler, cfg.train.max_steps)
    losses = []
    for step in range(steps):
        rows = make_global_batch(step, GLOBAL_BATCH)
        total = sum(int((r["labels"][1:] != -100).sum()) for r in rows)
        acc = 0.0
        for mb in micro_batches_of(rows, 0, 1, MICRO):
            loss_sum = lm_loss_sum(model, mb)
            (loss_sum / total).backward()
            acc += float(loss_sum.detach())
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(acc / total)
    params = dict(model.named_parameters())
    trained = {k: params[v].detach().float().clone() for k, v in ref_names.items()}
    return {"losses": losses, "trained": trained, "init": init, "count": sum(p.numel() for p in params.values()
                                                                             if p.requires_grad)}


def test_lora_sft_on_two_ranks_equals_peft_unsharded():
    ref = peft_reference(BASE, STEPS)
    ranks = run_ranks(sharded_run, 2, BASE, STEPS, GLOBAL_BATCH, MICRO, timeout=240)
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"], dtype=torch.float64),
                               torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
    params, init = ranks[0]["params"], ref["init"]
    trained = {k: params[k] for k in ref["trained"]}
    assert_trained_params_close(trained, ref["trained"], {k: init[k].float() for k in trained}, LR, STEPS)
    frozen = [k for k in params if k not in trained]
    assert frozen and all(torch.equal(params[k], init[k].float()) for k in frozen)  # the base, bitwise
    assert any(".base_layer." in k for k in frozen)
    # by hand: q_proj 32 -> 32, v_proj 32 -> 16 (2 kv heads x 8), down_proj 64 -> 32, per layer; lm_head 32 x 64
    r = 4
    by_hand = 2 * (r * (32 + 32) + r * (32 + 16) + r * (64 + 32)) + 32 * 64
    assert ref["count"] == by_hand == sum(t.numel() for t in trained.values())


def test_lora_settings_and_targets_are_checked_before_anything_runs():
    from shardwise.config.validate import mesh_spec
    from shardwise.fsdp.build import plan_for

    def plan(*extra):
        cfg = load_config(None, [TINY_QWEN3, *FP32, "model.lora.enabled=true", *extra])
        return plan_for(cfg, mesh_spec(cfg.parallel, 2))

    with pytest.raises(PatternError, match="no module is named 'q_prj'.*q_proj"):
        plan("model.lora.target_modules=[q_prj]")
    with pytest.raises(PatternError, match=r"matches no module"):
        plan("model.lora.target_modules=[model.layers.{*}.self_attn.{q,x}_proj]")
    with pytest.raises(ConfigError, match=r"Linear modules only, not model.embed_tokens \(Embedding\)"):
        plan("model.lora.target_modules=[model.embed_tokens]")
    for bad, key in (("model.lora.r=0", "model.lora.r"), ("model.lora.alpha=0", "model.lora.alpha"),
                     ("model.lora.dropout=1.0", "model.lora.dropout")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [TINY_QWEN3, bad])
    model, p = plan("model.lora.target_modules=[all-linear]", "model.lora.exclude_modules=[o_proj]")
    targets = model.peft_config["default"].target_modules
    assert "model.layers.0.mlp.gate_proj" in targets and not any(t.endswith("o_proj") for t in targets)
    assert "lm_head" not in targets


def _save_base(folder):
    from shardwise.data.tokenizer import build_char_tokenizer
    from shardwise.models.loading import build_full_model

    build_full_model(load_config(None, [TINY_QWEN3, *FP32]).model, seed=3).save_pretrained(folder)
    build_char_tokenizer(folder)


def test_lora_exports_load_with_peft_checkpoint_holds_adapters_only_and_resume_is_exact(tmp_path):
    from peft import PeftModel
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    _save_base(base)
    args = ["train", str(REPO_ROOT / "examples/sft_arithmetic.yaml"), "--nproc", "2", "model.config=null", f"model.path={base}", *FP32,
            *LORA, "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_every=1",
            "checkpoint.every_steps=2", "checkpoint.export_merged=true", "data.max_length=16"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    a, b = at_once(lambda: run_cli([*args, f"run.dir={whole}", "train.max_steps=4"], timeout=300),
                   lambda: run_cli([*args, f"run.dir={parts}", "train.max_steps=2"], timeout=300))
    assert a.returncode == 0 and b.returncode == 0, (a.stderr[-3000:], b.stderr[-3000:])
    assert "adapter" in a.stdout and str(whole / "adapter") in a.stdout
    b = run_cli([*args, f"run.dir={parts}", "train.max_steps=4"], timeout=300)
    assert b.returncode == 0, b.stderr[-3000:]
    m1 = (whole / "metrics.jsonl").read_text().splitlines()
    m2 = (parts / "metrics.jsonl").read_text().splitlines()
    # the training lines (the run stopped at 2 also evaluated its model there)
    strip = [{k: v for k, v in json.loads(x).items() if k in ("step", "loss", "grad_norm", "lr")} for x in m1
             if "loss" in json.loads(x)]
    assert strip == [{k: v for k, v in json.loads(x).items() if k in ("step", "loss", "grad_norm", "lr")}
                     for x in m2 if "loss" in json.loads(x)]

    keys = set(FileSystemReader(str(whole / "checkpoints/step_00000004")).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(".lora_" in k or k.startswith("model.lm_head.") for k in model_keys), model_keys

    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 17]])
    merged = AutoModelForCausalLM.from_pretrained(whole / "hf").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), whole / "adapter").eval()
    with torch.no_grad():
        want = merged(ids).logits
        got = adapted(ids).logits
        folded = adapted.merge_and_unload()(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(folded, want, rtol=1e-5, atol=1e-5)
    # `shardwise export` of the last checkpoint (adapters only) writes the same two folders
    from safetensors.torch import load_file

    from shardwise.cli import main

    ckpt = whole / "checkpoints/step_00000004"
    assert main(["export", str(ckpt), str(tmp_path / "off_adapter")]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "off_hf"), "--merged"]) == 0
    for live, offline in (("adapter/adapter_model.safetensors", "off_adapter/adapter_model.safetensors"),
                          ("hf/model.safetensors", "off_hf/model.safetensors")):
        x, y = load_file(whole / live), load_file(tmp_path / offline)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), live
    plain = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        assert not torch.allclose(plain(ids).logits, want, atol=1e-4)  # the adapters did change the model


def test_grpo_with_lora_starts_at_its_reference_and_raises_heldout_accuracy(sft_demo_model, tmp_path):
    """examples/grpo_reverse_lora.yaml from the SFT demo's model, shortened. Measured over 30
    steps: held-out greedy 22.5% -> 95.5%, reward 0.34 -> 0.87 by step 7."""
    import re

    run_dir = tmp_path / "run"
    res = run_cli(["rl", str(REPO_ROOT / "examples/grpo_reverse_lora.yaml"), "--nproc", "2", f"run.dir={run_dir}",
                   f"model.path={sft_demo_model}", "train.max_steps=12", "checkpoint.every_steps=6"], timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    steps = [m for m in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
             if "time/eval" not in m]  # the evaluations' own lines (steps 0 and 12) left out
    assert steps[0]["kl"] == 0.0  # B starts at 0: the actor is exactly its reference (the base) at step 1
    assert steps[-1]["kl"] > 0.0
    assert "the reference is the actor with its adapters disabled" in res.stderr
    m = re.search(r"held-out accuracy \(greedy\): before RL ([\d.]+)%, after RL ([\d.]+)%", res.stdout)
    assert m and float(m.group(2)) >= float(m.group(1)) + 20, res.stdout
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file() and (run_dir / "hf" / "config.json").is_file()


def test_an_adapter_folder_is_checked_against_the_base_before_launch(tmp_path, capsys):
    """model.lora.path: not a PEFT folder, or made for another base (a tensor's shape): one
    line, exit 2, nothing started (the meta model is checked in the launching process)."""
    from peft import LoraConfig, get_peft_model

    from shardwise.cli import main
    from shardwise.models.loading import build_full_model

    other = load_config(None, [TINY_QWEN3.replace("hidden_size: 32", "hidden_size: 64")]).model
    peft_model = get_peft_model(build_full_model(other, seed=0), LoraConfig(r=4, target_modules=["q_proj"]))
    peft_model.save_pretrained(tmp_path / "other")
    (tmp_path / "empty").mkdir()
    for folder, fragment in (("empty", "is not a PEFT adapter folder"),
                             ("other", "has shape (4, 64), this base model's is (4, 32)")):
        code = main(["train", str(REPO_ROOT / "examples/sft_arithmetic.yaml"), "--nproc", "2", TINY_QWEN3,
                     "model.lora.enabled=true", f"model.lora.path={tmp_path / folder}", f"run.dir={tmp_path / 'run'}"])
        err = capsys.readouterr().err
        assert code == 2 and fragment in err and "model.lora.path" in err, err
        assert not (tmp_path / "run").exists()
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "shardwise.cli", "plan", str(REPO_ROOT / "examples/sft_arithmetic.yaml"),
                          TINY_QWEN3, "model.lora.enabled=true", f"model.lora.path={tmp_path / 'other'}"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "model.lora.path" in res.stderr and "(4, 64)" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_plan_of_an_rl_config_says_the_reference_costs_no_memory(capsys, tmp_path):
    from shardwise.cli import main

    assert main(["plan", str(REPO_ROOT / "examples/grpo_reverse_lora.yaml"), "--rl", "--world-size", "8",
                 "model.path=null", TINY_QWEN3]) == 0
    out = capsys.readouterr().out
    assert "LoRA (r=16" in out and "the reference policy is the actor with its LoRA adapters disabled" in out
