"""Usage (from this checkout's root, src and the root on PYTHONPATH, for the sleep tool):
    python benchmarks/probes/rollout_tools_vllm.py ROLLOUTS SFT_MODEL_FOLDER [TOOL]

A/B of the multi-turn rollout on vLLM, turn by turn (``barrier=True``) against without a
turn barrier (the default), interleaved in one process on one engine: run_multi_turn alone
(no training), the SFT tool model, 64 rows (one rank's share of a benchmark step: 8 prompts
x 8 samples, sampled, keyed), up to 32 tool processes, the 50 ms tool by default. Prints
per rollout its seconds, time/tools, calls, and a digest of the trajectories (ids, masks,
messages): both ways must give the same digest. What it showed:
results/agentic_rollout/rollout_tools_vllm.txt."""
import hashlib
import json
import os
import random
import sys
import time

import numpy as np

from shardwise.agents.execute import ToolRunner
from shardwise.agents.loop import agent_prompt_batch, run_multi_turn
from shardwise.agents.tools import all_schemas, load_tools
from shardwise.config import load_config
from shardwise.config.schema import MultiTurnConfig
from shardwise.data.tokenizer import load_tokenizer
from shardwise.distributed.runtime import init_distributed, teardown
from shardwise.engine.generate import build_generator
from shardwise.engine.infer import InferEngine
from shardwise.engine.weight_sync import WeightSync

reps, folder = int(sys.argv[1]), sys.argv[2]
tool = sys.argv[3] if len(sys.argv) > 3 else "benchmarks._agentic_tools:calculator"
for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "WORLD_SIZE": "1",
             "LOCAL_RANK": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
    os.environ.setdefault(k, v)
runtime = init_distributed(timeout_s=120)
cfg = load_config(None, [f"model.path={folder}", "model.dtype=fp32", "fsdp.mixed_precision.param_dtype=fp32",
                         "infer.vllm.dtype=fp32", "infer.temperature=1.0", "infer.max_new_tokens=112"])
tok = load_tokenizer(folder)
engine = InferEngine(cfg, runtime)
gen = build_generator("vllm", engine.model, cfg.infer, runtime, tok.pad_token_id, tok.eos_token_id)
WeightSync(engine.model, gen).sync()
specs = load_tools([tool])
schemas = all_schemas(specs, None)
mt = MultiTurnConfig(enabled=True, max_turns=3, max_response_tokens=112, max_tool_response_tokens=16)
with ToolRunner(specs, None, timeout_s=10, workers=32) as runner:
    for rep in range(reps + 1):  # rollout 0 warms up (tool processes, vLLM's first steps)
        for way, barrier in (("turns", True), ("free", None)) if rep % 2 else (("free", None), ("turns", True)):
            rng = random.Random(rep)
            recs = []
            for _i in range(8):
                a, b = rng.randint(100, 999), rng.randint(100, 999)
                recs += [{"prompt": f"{a}*{b}=", "response": str(a * b)}] * 8
            batch = agent_prompt_batch(tok, recs, 16, [str(i // 8) for i in range(64)], schemas)
            batch.meta.update(seed=rep, max_new_tokens=112)
            batch.arrays["sample_key"] = np.array([f"{i // 8}/{i % 8}" for i in range(64)], dtype=object)
            t0 = time.perf_counter()
            out = run_multi_turn(gen, batch, tok, runner, mt, schemas, barrier=barrier)
            total = time.perf_counter() - t0
            h = hashlib.sha256()
            for k in ("input_ids", "response_mask", "attention_mask"):
                h.update(out.tensors[k].numpy().tobytes())
            h.update(json.dumps([list(m) for m in out.arrays["messages"]], default=str).encode())
            print(json.dumps({"rep": rep, "way": way, "rollout_s": round(total, 4),
                              "tools_s": round(out.meta["metrics"]["time/tools"], 4),
                              "calls": int(sum(int(x) for x in out.arrays["tool_calls"])),
                              "processes": runner.processes, "digest": h.hexdigest()[:16]}), flush=True)
gen.shutdown()
teardown()
