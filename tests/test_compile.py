"""Per-unit torch.compile (`train.compile: true`): compiled FSDP2 runs equal eager ones.

Each test spawns 2 gloo ranks that build the same engine twice from the same seeded init,
eager first, then with `train.compile=true` (inductor, C++ kernels built with gcc), and
run both on the same data. The dynamo counters are process-wide and start at zero, so the
eager run must leave them at zero and the compiled run must show frames compiled with no
graph break: a test fails if compilation were silently skipped.

Tolerances (fp32 on both sides; the only difference is inductor's code for the layers):
inductor fuses elementwise ops and may reorder the reductions inside them (RMSNorm's mean,
the softmax of attention; the matmuls stay the same aten kernels), so each fused op may
round differently by a few ulps (2^-24 ~ 6e-8 relative each). A decoder layer is ~20 such
ops and the model 2 layers: at worst ~40 x few ulps ~ 1e-6 relative on the activations,
the logits and hence the loss (a mean of log-softmax terms of O(1) logits). Losses:
rtol 1e-5, ten times that bound (observed: bitwise equal, 2e-8 with the default kernels).
Log-probs and entropies (forward only): atol 1e-5 on values of size ~4 (observed <= 1e-6).
Parameters after AdamW steps: the
gradients differ by the same relative rounding, exactly the situation of sharded vs
unsharded parity, so `assert_trained_params_close` (tests/dist/common.py, which writes the
argument out) applies unchanged (observed: max 2.1e-7, |diff| / |update| <= 1e-6).
Observed under the native (AVX-512), ATEN_CPU_CAPABILITY=avx2 and =default kernels.

Compile time dominates: ~25-90 s for both tests on 2 busy cores with a cold inductor cache,
less when `_inductor_env`'s cache holds the kernels from an earlier run.
"""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import torch
from dist.common import (
    FP32,
    TINY_LLAMA,
    TINY_QWEN3,
    assert_trained_params_close,
    full_params,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks

LR = 1e-3
SEQS = (12, 9, 14)  # one step each: SFT pads every batch to its own length
TRAIN = [TINY_QWEN3, *FP32, f"train.optimizer.lr={LR}", "train.scheduler.warmup_steps=1",
         f"train.max_steps={len(SEQS)}", "train.grad_clip=1.0",
         # compile wraps the recompute wrapper (torchtitan's order): dynamo traces the checkpoint
         "fsdp.recompute.modules=[Qwen3DecoderLayer]"]
R = 6  # max_new_tokens
INFER = [TINY_LLAMA, *FP32, f"rl.rollout.max_new_tokens={R}"]
PAD = 0
LOSS_RTOL = 1e-5
LOG_PROB_ATOL = 1e-5


def _inductor_env() -> dict[str, str]:
    """The ranks' inductor cache, one per ATEN_CPU_CAPABILITY: torch 2.13's FX-graph cache key
    leaves out the vector ISA that variable selects, so kernels generated for one ISA were
    served to a run under another (seen on one shared cache: NaN losses under avx2 from
    AVX-512 code, a C++ compile error under default, a rank spinning for minutes)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    cache = Path(tempfile.gettempdir()) / f"shardwise-inductor-{getpass.getuser()}-{cap}"
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache)}


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"],
            "graph_breaks": sum(counters["graph_break"].values())}


def _compiled_modules(model) -> list[str]:
    """Paths of the modules whose forward is apply_compile's wrapper."""
    return [n for n, m in model.named_modules() if hasattr(m.forward, "compiled_forward")]


# ---------------------------------------------------------------- training


def _train_body(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    out: dict = {}
    for compile_ in (False, True):
        engine = TrainEngine(load_config(None, [*overrides, f"train.compile={compile_}"]), runtime)
        run = {"plan_compiled": engine.plan.compiled, "wrapped": _compiled_modules(engine.model),
               "init": full_params(engine.model), "losses": [], "counts": []}
        for step, seq in enumerate(SEQS):
            rows = make_global_batch(step, 8, seq=seq)
            res = engine.train_step(micro_batches_of(rows, engine.dp_rank, engine.dp_size, 2), loss_tokens(rows))
            run["losses"].append(res.loss)
            run["counts"].append(_dynamo_counts())
        run["params"] = full_params(engine.model)
        out["compiled" if compile_ else "eager"] = run
    teardown()
    return out


def test_compiled_training_equals_eager():
    ranks = run_ranks(_train_body, 2, TRAIN, timeout=420, env=_inductor_env())
    for r in ranks:
        eager, comp = r["eager"], r["compiled"]
        assert eager["plan_compiled"] == eager["wrapped"] == []
        assert comp["plan_compiled"] == comp["wrapped"] == ["model.layers.0", "model.layers.1"]
        assert all(c == {"graphs": 0, "frames_ok": 0, "graph_breaks": 0} for c in eager["counts"])
        # One graph for the first length (both layers share it), one with the sequence length
        # symbolic at the second; the third length reuses it. No graph break: each layer,
        # checkpoint included, is one graph.
        assert [c["graphs"] for c in comp["counts"]] == [1, 2, 2], comp["counts"]
        assert comp["counts"][-1]["graph_breaks"] == 0 and comp["counts"][-1]["frames_ok"] == 2
        torch.testing.assert_close(torch.tensor(comp["losses"], dtype=torch.float64),
                                   torch.tensor(eager["losses"], dtype=torch.float64), rtol=LOSS_RTOL, atol=0)
    assert ranks[0]["compiled"]["losses"] == ranks[1]["compiled"]["losses"]
    r0 = ranks[0]
    for k in r0["eager"]["init"]:
        assert torch.equal(r0["compiled"]["init"][k], r0["eager"]["init"][k]), k
    assert_trained_params_close(r0["compiled"]["params"], r0["eager"]["params"], r0["eager"]["init"], LR, len(SEQS))


# ---------------------------------------------------------------- inference and generation


def _score_batch() -> dict[str, torch.Tensor]:
    """Rows ``[pad* prompt response pad*]`` of width 10."""
    g = torch.Generator().manual_seed(3)
    layout = [(0, 3, 7), (2, 2, 5), (1, 4, 3), (0, 5, 5)]  # (left pad, prompt, response)
    ids = torch.full((len(layout), 10), PAD, dtype=torch.long)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (left, prompt, response) in enumerate(layout):
        n = prompt + response
        ids[i, left:left + n] = torch.randint(1, 64, (n,), generator=g)
        attn[i, left:left + n] = 1
        resp[i, left + prompt:left + n] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}


def _prompts(rank: int):
    from shardwise.data.batch import Batch

    g = torch.Generator().manual_seed(50 + rank)
    ids = torch.randint(1, 63, (2, 5), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = PAD, 0  # left-padded second row
    return Batch.from_dict(tensors={"prompt_ids": ids, "prompt_mask": mask},
                           arrays={"prompt": ["a", "b"], "ground_truth": ["0", "1"], "uid": ["a", "b"]},
                           meta={"seed": 0, "greedy": True})


def _infer_body(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.generate import HFGenerator
    from shardwise.engine.infer import InferEngine

    runtime = init_distributed(timeout_s=60)
    b = _score_batch()
    mine = {k: v[rank * 2:(rank + 1) * 2] for k, v in b.items()}
    out: dict = {}
    for compile_ in (False, True):
        cfg = load_config(None, [*overrides, f"train.compile={compile_}"])
        engine = InferEngine(cfg, runtime)
        run = {"wrapped": _compiled_modules(engine.model)}
        run["log_probs"] = engine.log_probs(**mine, with_entropy=True)
        run["micro_log_probs"] = engine.log_probs(**mine, micro_batch_size=1)["log_probs"]  # another batch size
        run["packed_log_probs"] = engine.log_probs(**mine, layout="packed")["log_probs"]  # rl.packing's rows
        run["counts_scored"] = _dynamo_counts()
        gen = HFGenerator(engine.model, cfg.rl.rollout, runtime, pad_id=PAD, eos_id=63)
        seqs = gen.generate_sequences(_prompts(rank))
        run["sequences"] = seqs.tensors["input_ids"]
        run["rollout_log_probs"] = seqs.tensors["rollout_log_probs"]
        run["counts_generated"] = _dynamo_counts()
        out["compiled" if compile_ else "eager"] = run
    teardown()
    return out


def test_compiled_infer_engine_equals_eager_and_generates():
    ranks = run_ranks(_infer_body, 2, INFER, timeout=420, env=_inductor_env())
    for r in ranks:
        eager, comp = r["eager"], r["compiled"]
        assert eager["wrapped"] == [] and comp["wrapped"] == ["model.layers.0", "model.layers.1"]
        assert eager["counts_generated"] == {"graphs": 0, "frames_ok": 0, "graph_breaks": 0}
        assert comp["counts_scored"]["graphs"] >= 1 and comp["counts_scored"]["graph_breaks"] == 0
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(comp["log_probs"][key], eager["log_probs"][key], rtol=0, atol=LOG_PROB_ATOL)
        for key in ("micro_log_probs", "packed_log_probs"):
            torch.testing.assert_close(comp[key], eager["log_probs"]["log_probs"], rtol=0, atol=LOG_PROB_ATOL)
        torch.testing.assert_close(eager["packed_log_probs"], eager["log_probs"]["log_probs"], rtol=0, atol=1e-5)
        assert comp["log_probs"]["log_probs"].abs().sum() > 1.0  # the comparison was over real values
        # KV-cached decoding runs the layers' eager forward (apply_compile): the same tokens and
        # log-probs as the eager model, and not one graph compiled for it.
        assert torch.equal(comp["sequences"], eager["sequences"])
        assert torch.equal(comp["rollout_log_probs"], eager["rollout_log_probs"])
        assert comp["sequences"].shape == (2, 5 + R)
        assert comp["counts_generated"] == comp["counts_scored"]
