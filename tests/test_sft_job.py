"""The SFT job end to end through the real CLI (`shardwise train --nproc 2`), resume, and
the engine's handling of a non-finite loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from dist.common import (
    FP32,
    TINY_QWEN3,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_cli, run_ranks

REPO = Path(__file__).resolve().parents[1]


def test_train_cli_writes_metrics_checkpoint_export_plot_and_resumes(tmp_path):
    # Also the resume probe of tests/test_faults.py: a resumed run never repeats or loses a
    # step, and the truncation note is reported once.
    run_dir = tmp_path / "run"
    args = ["train", str(REPO / "examples/sft_arithmetic.yaml"), "--nproc", "2", f"run.dir={run_dir}",
            "checkpoint.every_steps=2", "checkpoint.keep_last=3", "train.log_every=1",
            "train.global_batch_size=16", "train.micro_batch_size=4",
            "data.max_length=8"]  # "12+34=" is 7 tokens with <bos>, + answer + <eos>: truncated
    res = run_cli([*args, "train.max_steps=6"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics_lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines = [json.loads(x) for x in metrics_lines if "loss" in json.loads(x)]  # the training steps'
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5, 6]
    for x in lines:
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "peak_memory_bytes"):
            assert isinstance(x[key], (int, float)) and math.isfinite(x[key]), (key, x)
    # no eval.source: the built-in task's held-out examples at the end only, as the accuracy always was
    (held_out,) = [json.loads(x) for x in metrics_lines if "val/loss" in json.loads(x)]
    assert held_out["step"] == 6 and 0 <= held_out["val/accuracy"] <= 1 and held_out["val/loss"] > 0
    samples = [json.loads(x) for x in (run_dir / "samples/step_0000006.jsonl").read_text().splitlines()]
    assert len(samples) == 200 and sum(r["reward"] >= 1 for r in samples) / 200 == held_out["val/accuracy"]
    assert f"held-out accuracy (greedy): {held_out['val/accuracy']:.1%}" in res.stdout
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_00000002", "step_00000004", "step_00000006"]
    assert (run_dir / "checkpoints/step_00000006/COMMITTED").is_file()
    assert (run_dir / "hf/config.json").is_file() and (run_dir / "sft.png").stat().st_size > 1000
    assert "held-out accuracy" in res.stdout and str(run_dir / "hf") in res.stdout
    assert "sft" in res.stderr  # the rank-0 progress bar
    notes = [x for x in res.stderr.splitlines() if "longer than data.max_length=8" in x]
    assert len(notes) == 1 and " of 2048 examples" in notes[0], res.stderr[-3000:]
    assert int(notes[0].split("data: ")[1].split()[0]) > 500  # most two-digit sums are cut

    # As if the job had been killed after step 6 was logged but before step 6 was committed:
    # resume (auto) picks the newest committed checkpoint, step 4 (the progress bar starts
    # there), keeps the metrics of steps 1..4 as they were written, logs 5..6 again (each
    # once) and trains on to 8.
    import shutil

    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    res2 = run_cli([*args, "train.max_steps=8"], timeout=300)
    assert res2.returncode == 0, res2.stderr[-3000:]
    again = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in again] == [1, 2, 3, 4, 5, 6, 7, 8, 8]  # 8 twice: trained, evaluated
    assert again[:4] == metrics_lines[:4]
    assert "4/8 [" in res2.stderr, res2.stderr[-3000:]


def test_train_cli_config_error_exits_2_before_starting_processes(tmp_path):
    res = run_cli(["train", str(REPO / "examples/sft_arithmetic.yaml"), "--nproc", "2",
                   f"run.dir={tmp_path}", "train.global_batch_size=20"], timeout=120)
    assert res.returncode == 2
    assert "train.global_batch_size" in res.stderr and "Traceback" not in res.stderr
    assert not list(tmp_path.iterdir())  # nothing was written: no process started


def _nan_at_step_two(rank: int, world: int) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine, lm_loss_sum

    runtime = init_distributed(timeout_s=60)
    engine = TrainEngine(load_config(None, [TINY_QWEN3, *FP32, "train.max_steps=4"]), runtime)
    out = []
    for step in range(4):
        rows = make_global_batch(step, 4)
        before = [p.detach().to_local().clone() for p in engine.model.parameters()]

        def loss_fn(model, batch, step=step):
            loss = lm_loss_sum(model, batch)
            return loss * float("nan") if step == 1 else loss

        res = engine.train_step(micro_batches_of(rows, rank, world, 2), loss_tokens(rows), loss_fn=loss_fn)
        changed = any(not torch.equal(b, p.detach().to_local()) for b, p in zip(before, engine.model.parameters()))
        out.append({"skipped": res.skipped, "loss": res.loss, "changed": changed})
    teardown()
    return {"steps": out, "skipped_steps": engine.skipped_steps}


def test_non_finite_loss_skips_the_step_and_training_continues():
    for r in run_ranks(_nan_at_step_two, 2, timeout=180):
        steps = r["steps"]
        assert [s["skipped"] for s in steps] == [False, True, False, False]
        assert [s["changed"] for s in steps] == [True, False, True, True]
        assert math.isnan(steps[1]["loss"]) and all(math.isfinite(s["loss"]) for s in steps[2:])
        assert r["skipped_steps"] == 1


def test_cpu_offload_trains_checkpoints_resumes_and_exports(tmp_path):
    """The offload path end to end (parameters, gradients and optimizer state in host memory;
    on CPU the compute device is the host too, but the same code runs as on CUDA): DCP save,
    resume in new processes, HF export, and the exported weights equal the checkpoint's."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "run"
    base = ["train", str(REPO / "examples/sft_arithmetic.yaml"), "--nproc", "2", f"run.dir={run_dir}",
            TINY_QWEN3, "fsdp.offload.enabled=true", "fsdp.offload.pin_memory=false", "train.global_batch_size=8",
            "train.micro_batch_size=4", "data.max_length=16", "checkpoint.every_steps=2", "train.log_every=1"]
    res = run_cli([*base, "train.max_steps=2", "checkpoint.export_hf=false"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    res = run_cli([*base, "train.max_steps=4"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps == [1, 2, 3, 4]  # resumed at 2 (each run's end also evaluated: lines of their own)
    exported = load_file(str(run_dir / "hf" / "model.safetensors"))
    offline = tmp_path / "offline"
    res = run_cli(["export", str(run_dir / "checkpoints" / "step_00000004"), str(offline)], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    again = load_file(str(offline / "model.safetensors"))
    assert exported.keys() == again.keys()
    for k in exported:
        assert torch.equal(exported[k], again[k]), k


def _validation_file(path: Path, rows: int = 13) -> Path:
    """A user's validation file: `rows` two-turn conversations (JSON lines with "messages"),
    an odd count that splits over neither 2 ranks nor the micro-batches evenly."""
    import random

    rng = random.Random(3)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b, c, d = (rng.randrange(100) for _ in range(4))
            turns = [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
                     {"role": "user", "content": f"{c}+{d}="}, {"role": "assistant", "content": str(c + d)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def _unsharded_val_loss(model_dir: Path, tokenizer_dir: Path, val: Path, max_length: int) -> float:
    """The reference: plain transformers on the saved model, one example at a time, the
    examples encoded as training encodes them (conversations: the assistant turns are
    trained); sum of token losses / trained tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.data.encode import encode_records
    from shardwise.data.sources import load_records

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    records = load_records(str(val), "prompt", "response", seed=0, num_builtin=0, messages_key="messages",
                           conversations=True, fmt="auto")
    total, count = 0.0, 0
    for enc in encode_records(tokenizer, records, max_length, "assistant"):
        ids = torch.tensor([enc.ids])
        target = ids[0, 1:]
        trained = torch.tensor(enc.loss_mask[1:], dtype=torch.bool)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].double()
        losses = torch.nn.functional.cross_entropy(logits, target, reduction="none")
        total += float(losses[trained].sum())
        count += int(trained.sum())
    assert count > 50
    return total / count


def test_validation_loss_is_the_unsharded_models_and_the_best_checkpoint_is_kept_and_exported(tmp_path):
    """`eval.source` (a user's conversations file) in a 2-rank packed run: val/loss at step 0
    equals plain transformers' loss of the saved model on the same rows (1e-5 relative:
    fp32, only the order of the sums differs); each evaluation is its own metrics line at
    0, every eval.every_steps and the end. keep_best val/loss with keep_last 1: lr 1.0
    (constant, AdamW: every weight moves by ~1 at the first step, weights of std ~0.02)
    wrecks the model, so step 0 is the best; its checkpoint (saved because the step was
    evaluated) outlives keep_last, and export_from: best exports it: the saved model's
    weights exactly."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(shape).save_pretrained(tmp_path / "model")
    val = _validation_file(tmp_path / "val.jsonl")
    run_dir = tmp_path / "run"
    res = run_cli(["train", str(REPO / "examples/sft_arithmetic.yaml"), "--nproc", "2", f"run.dir={run_dir}",
                   "model.config=null", f"model.path={tmp_path / 'model'}", "train.global_batch_size=8",
                   "train.micro_batch_size=2", "data.max_length=24", "data.packing=true", "train.max_steps=3",
                   "train.log_every=1", "checkpoint.every_steps=0", "checkpoint.async=false", "checkpoint.keep_last=1",
                   "checkpoint.keep_best=val/loss", "checkpoint.export_from=best", f"eval.source={val}",
                   "eval.every_steps=2", "train.optimizer={lr: 1.0, weight_decay: 0.0}",
                   "train.scheduler={name: constant, warmup_steps: 0}"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3]
    evals = [x for x in lines if "val/loss" in x]
    assert [x["step"] for x in evals] == [0, 2, 3]
    for x in evals:
        assert set(x) == {"step", "val/loss", "val/ppl", "time/eval", "time"}, x
        assert math.isclose(x["val/ppl"], math.exp(x["val/loss"]), rel_tol=1e-12)
    want = _unsharded_val_loss(tmp_path / "model", run_dir / "tokenizer", val, 24)
    print(f"\nval/loss at step 0: {evals[0]['val/loss']!r}, unsharded {want!r}, relative "
          f"{abs(evals[0]['val/loss'] - want) / want:.1e}")
    assert math.isclose(evals[0]["val/loss"], want, rel_tol=1e-5), (evals[0]["val/loss"], want)
    assert min(x["val/loss"] for x in evals[1:]) > evals[0]["val/loss"] + 1.0  # lr 1.0 wrecked it
    best = json.loads((run_dir / "checkpoints/best.json").read_text())
    assert (best["metric"], best["mode"], best["step"]) == ("val/loss", "min", 0)
    assert [h[0] for h in best["history"]] == [0, 2, 3]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == \
        ["best.json", "step_00000000", "step_00000003"]  # keep_last 1, and the best
    assert "exported the best checkpoint by val/loss: step 0" in res.stdout, res.stdout
    assert "eval" in res.stderr and "val" not in res.stdout.split("eval", 1)[0]  # the eval bar; the table after
    exported = load_file(str(run_dir / "hf" / "model.safetensors"))
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert exported.keys() == saved.keys()
    for k in saved:
        assert torch.equal(exported[k], saved[k]), k
