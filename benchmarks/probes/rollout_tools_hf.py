"""Usage (from a checkout's root, its src on PYTHONPATH with the root, for the sleep tool):
    python benchmarks/probes/rollout_tools_hf.py LABEL TOOL_WORKERS ROLLOUTS SFT_MODEL_FOLDER

A/B of the rollout's wait on the 50 ms tool: run_multi_turn alone (no training), one
process, the SFT tool model, 64 rows (one rank's share of a benchmark step: 8 prompts x 8
samples, sampled, keyed), HF engine, `workers` tool processes; prints per rollout the
rollout's seconds, time/tools, calls, the seconds of each turn's generate call, and a digest of the trajectories (ids + masks +
messages), so before/after can be compared for identity too. What it showed:
results/agentic_rollout/rollout_tools_hf.txt."""
import hashlib
import json
import random
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from shardwise.agents.execute import ToolRunner
from shardwise.agents.loop import agent_prompt_batch, run_multi_turn
from shardwise.agents.tools import all_schemas, load_tools
from shardwise.config.schema import MultiTurnConfig, RolloutConfig
from shardwise.data.tokenizer import load_tokenizer
from shardwise.distributed.runtime import Runtime
from shardwise.engine.generate import HFGenerator

label, workers, reps, folder = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tok = load_tokenizer(folder)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
rt = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
eng = HFGenerator(model, RolloutConfig(temperature=1.0, max_new_tokens=112), rt, tok.pad_token_id, tok.eos_token_id)
specs = load_tools(["benchmarks._agentic_tools:calculator"])
schemas = all_schemas(specs, None)
cfg = MultiTurnConfig(enabled=True, max_turns=3, max_response_tokens=112, max_tool_response_tokens=16)
GEN = []
_orig = eng.generate_sequences
def _timed(call, **kw):
    t = time.perf_counter()
    try:
        return _orig(call, **kw)
    finally:
        GEN.append(time.perf_counter() - t)
eng.generate_sequences = _timed
with ToolRunner(specs, None, timeout_s=10, workers=workers) as runner:
    for rep in range(reps + 1):  # rollout 0 warms the tool processes up (their first import)
        rng = random.Random(rep)
        recs = []
        for _i in range(8):
            a, b = rng.randint(100, 999), rng.randint(100, 999)
            recs += [{"prompt": f"{a}*{b}=", "response": str(a * b)}] * 8
        batch = agent_prompt_batch(tok, recs, 16, [str(i // 8) for i in range(64)], schemas)
        batch.meta.update(seed=rep, max_new_tokens=112)
        batch.arrays["sample_key"] = np.array([f"{i // 8}/{i % 8}" for i in range(64)], dtype=object)
        GEN.clear()
        t0 = time.perf_counter()
        out = run_multi_turn(eng, batch, tok, runner, cfg, schemas)
        total = time.perf_counter() - t0
        h = hashlib.sha256()
        for k in ("input_ids", "response_mask", "attention_mask"):
            h.update(out.tensors[k].numpy().tobytes())
        h.update(out.tensors["rollout_log_probs"].numpy().tobytes())
        h.update(json.dumps([list(m) for m in out.arrays["messages"]], sort_keys=True).encode())
        if rep:
            print(json.dumps({"label": label, "workers": workers, "rep": rep, "rollout_s": round(total, 3),
                              "time/tools": round(out.meta["metrics"]["time/tools"], 3),
                              "calls": int(sum(out.arrays["tool_calls"])), "gen": [round(g, 3) for g in GEN], "digest": h.hexdigest()[:16]}), flush=True)
