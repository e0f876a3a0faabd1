"""The multi-turn rollout (`shardwise.agents.loop`): token-in, token-out trajectories over a
real generation engine, a real ToolRunner (tool processes) and the real chat template.

A random tiny model never writes a tool call, so the layout tests use `ScriptedEngine`: a
`GenerationEngine` whose turns are fixed texts, teacher-forced through a real model for
their log-probs (what an engine that sampled those tokens would report). One test runs the
HF engine itself (sampling) and checks the invariants that must hold whatever it writes.
"""

from __future__ import annotations

import json
import textwrap
import time

import numpy as np
import pytest
import torch
from dist.launcher import REPO_ROOT, run_cli, run_ranks
from tool_model import TOOL, build_tool_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from shardwise.agents.execute import ToolRunner
from shardwise.agents.loop import agent_prompt_batch, run_multi_turn, tool_turn_ids, turn_seed
from shardwise.agents.tools import all_schemas, load_tools
from shardwise.config.schema import MultiTurnConfig, RolloutConfig
from shardwise.data.batch import Batch
from shardwise.data.tokenizer import BUILTIN_TOOLS_VOCAB_SIZE, build_char_tokenizer
from shardwise.distributed.runtime import Runtime
from shardwise.engine.generate import GenerationEngine, HFGenerator, assemble_sequences, sampling_call
from shardwise.engine.infer import compute_log_probs

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
"""A call as the tools template renders it (tojson's separators)."""

TOOLS = '''
def add(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return str(a + b)


def stamp(name: str) -> str:
    """Leave a file behind.

    Args:
        name: the file's name
    """
    import pathlib

    pathlib.Path(name).write_text("started")
    return "stamped"


def shout(text: str) -> str:
    """A long answer.

    Args:
        text: what to repeat
    """
    return text * 50
'''


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tok"), tools=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    shape = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=BUILTIN_TOOLS_VOCAB_SIZE + 5,
                        max_position_embeddings=512, tie_word_embeddings=False)
    return Qwen3ForCausalLM(shape).eval()


@pytest.fixture
def tools(tmp_path, monkeypatch):
    (tmp_path / "loop_tools.py").write_text(textwrap.dedent(TOOLS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    specs = load_tools(["loop_tools:add", "loop_tools:shout", "loop_tools:stamp"])
    with ToolRunner(specs, None, timeout_s=20, workers=2) as runner:
        yield runner, all_schemas(specs, None)


class ScriptedEngine(GenerationEngine):
    """Turn k of every row (k: the assistant markers in its text, minus one) is `turns[k]`
    and EOS, cut to ``max_new_tokens``; the log-probs are the model's for those tokens.
    A dict `turns[k]` gives the turn of a row by the first of its keys in the row's text."""

    shares_model_parameters = True

    def __init__(self, model, tok, turns: list[str], marker: str = "<|assistant|>"):
        self.model, self.tok, self.turns, self.marker = model, tok, turns, marker
        self.calls: list[int] = []

    def sync_weights(self, named_tensors):
        del named_tensors

    @torch.no_grad()
    def generate_sequences(self, prompts: Batch) -> Batch:
        call = sampling_call(prompts, RolloutConfig(temperature=0))
        ids, mask, r = call.ids, call.mask, call.max_new_tokens
        self.calls.append(len(ids))
        responses = torch.zeros((len(ids), r), dtype=torch.long)
        lps = torch.zeros((len(ids), r))
        produced = torch.zeros((len(ids), r), dtype=torch.bool)
        for i in range(len(ids)):
            real = ids[i][mask[i].bool()].tolist()
            text = self.tok.decode(real)
            turn = self.turns[text.count(self.marker) - 1]
            if isinstance(turn, dict):
                turn = next(v for key, v in turn.items() if key in text)
            gen = (self.tok(turn, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])[:r]
            full = torch.tensor([real + gen])
            lp = compute_log_probs(self.model, full, torch.ones_like(full))["log_probs"][0, len(real):]
            responses[i, :len(gen)] = torch.tensor(gen)
            lps[i, :len(gen)] = lp
            produced[i, :len(gen)] = True
        return assemble_sequences(prompts, ids, mask, responses, lps, produced, self.tok.pad_token_id,
                                  self.tok.eos_token_id)


def _prompts(tok, schemas, n=2, seed=0, max_length=64, **meta) -> Batch:
    records = [{"prompt": f"{2 + i}+3=", "response": str(5 + i)} for i in range(n)]
    batch = agent_prompt_batch(tok, records, max_length, [f"u{i}" for i in range(n)], schemas)
    batch.meta.update(seed=seed, **meta)
    return batch


def _recomputed(model, out: Batch, layout: str = "padded") -> torch.Tensor:
    t = out.tensors
    return compute_log_probs(model, t["input_ids"], t["attention_mask"], t["position_ids"], layout=layout)["log_probs"]


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_tool_turn_ids_are_the_template_delta(tok):
    """The ids after a generated turn are what the template adds for the tool turn and the
    next generation prompt: prompt + generated + delta == the rendering of it all."""
    conv = [{"role": "user", "content": "2+3="},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}]
    tool = [{"role": "tool", "name": "add", "content": "5"}]
    delta, prefix = tool_turn_ids(tok, conv, tool, None, tok.eos_token_id)
    assert prefix
    assert tok.decode(delta) == "<|user|>tool: 5\n<|assistant|>"
    prompt = tok.apply_chat_template(conv[:1], add_generation_prompt=True, tokenize=False)
    generated = _ids(tok, CALL) + [tok.eos_token_id]
    whole = tok.apply_chat_template(conv + tool, add_generation_prompt=True, tokenize=False)
    assert _ids(tok, prompt) + generated + delta == _ids(tok, whole)


def test_a_trajectory_with_a_call_is_token_in_token_out(tok, model, tools):
    runner, schemas = tools
    engine = ScriptedEngine(model, tok, [CALL, "5"])
    cfg = MultiTurnConfig(enabled=True, max_response_tokens=96)
    out = run_multi_turn(engine, _prompts(tok, schemas, max_new_tokens=64), tok, runner, cfg, schemas)
    assert engine.calls == [2, 2]  # every row in one call per turn
    t, a = out.tensors, out.arrays
    p = t["prompt_ids"].shape[1]
    eos = tok.eos_token_id
    longest = len(_ids(tok, CALL)) + 1 + len(_ids(tok, "<|user|>tool: 5\n<|assistant|>")) + 2
    assert t["input_ids"].shape == (2, p + longest) and t["responses"].shape == (2, longest)  # the longest row
    for row in range(2):
        turn1, turn2 = _ids(tok, CALL) + [eos], _ids(tok, "5") + [eos]
        tool_ids = _ids(tok, "<|user|>tool: 5\n<|assistant|>")
        expected = turn1 + tool_ids + turn2
        n = len(expected)
        assert t["responses"][row, :n].tolist() == expected
        assert t["response_mask"][row, p:p + n].tolist() == [1] * len(turn1) + [0] * len(tool_ids) + [1] * len(turn2)
        assert t["response_mask"][row, :p].sum() == 0 and t["response_mask"][row, p + n:].sum() == 0
        assert t["attention_mask"][row, p:].tolist() == [1] * n
        assert a["final_answer"][row] == "5" and a["num_turns"][row] == 2 and a["tool_calls"][row] == 1
        assert not a["truncated"][row] and not a["retokenize_mismatch"][row] and a["env_reward"][row] is None
        assert [m["role"] for m in a["messages"][row]] == ["user", "assistant", "tool", "assistant"]
        assert a["messages"][row][2]["content"] == "5"
    # the log-probs are those of the trained ids, where the actor will recompute them
    mask = t["response_mask"].bool()
    torch.testing.assert_close(t["rollout_log_probs"][mask], _recomputed(model, out)[mask], atol=1e-5, rtol=0)
    # rl.packing's layout takes the same rows as they are (tool turns are real tokens, mask 0)
    torch.testing.assert_close(t["rollout_log_probs"][mask], _recomputed(model, out, "packed")[mask], atol=1e-5,
                               rtol=0)
    assert (t["rollout_log_probs"][~mask] == 0).all()
    m = out.meta["metrics"]
    assert m["multi_turn/turns_mean"] == 2 and m["tools/calls_per_trajectory"] == 1 and m["tools/errors"] == 0
    assert m["multi_turn/truncated"] == 0 and m["multi_turn/retokenize_mismatch"] == 0 and m["time/tools"] > 0
    Batch.from_bytes(out.to_bytes())  # everything it carries crosses processes


def test_hf_engine_reports_each_row_as_it_ends(tok, model):
    """`RowEnds`: the HF engine tells of each row from inside ``generate`` as it writes its
    EOS (so the shorter rows first), with the row's ids through that EOS exactly as the call
    returns them; a row cut by max_new_tokens is not reported; the output is the same as
    without the hook (it stops and changes nothing)."""
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    engine = HFGenerator(model, RolloutConfig(temperature=1.0), runtime, pad_id=0, eos_id=tok.eos_token_id)
    batch = agent_prompt_batch(tok, [{"prompt": f"{i}+3="} for i in range(8)], 32, [str(i) for i in range(8)], [])
    batch.meta.update(seed=1, max_new_tokens=48)
    reported: list[tuple[int, list[int]]] = []
    out = engine.generate_sequences(batch, on_row_end=lambda i, ids: reported.append((i, ids)))
    plain = engine.generate_sequences(batch)
    assert all(torch.equal(out.tensors[k], plain.tensors[k]) for k in plain.tensors)
    p, eos = batch.tensors["prompt_ids"].shape[1], tok.eos_token_id
    ended = [i for i in range(8) if eos in out.tensors["responses"][i].tolist()]
    assert sorted(i for i, _ in reported) == ended and 2 <= len(ended) < 8  # some end early, some are cut
    for i, ids in reported:
        n = int(out.tensors["response_mask"][i].sum())
        assert ids == out.tensors["input_ids"][i, p:p + n].tolist() and ids[-1] == eos
    lengths = [len(ids) for _, ids in reported]
    assert lengths == sorted(lengths) and lengths[0] < lengths[-1]


class EndingEngine(ScriptedEngine):
    """`ScriptedEngine` that reports its rows as they end (`reports_ended_rows`), shortest
    first, like a real engine decoding them together; after reporting the first it waits
    (20 s at most) for the file `stamped` to appear and notes whether it did, before going
    on: a tool called by that row ran while the call was still generating the others."""

    reports_ended_rows = True

    def __init__(self, model, tok, turns, stamped):
        super().__init__(model, tok, turns)
        self.stamped = stamped
        self.seen: list[bool] = []

    def generate_sequences(self, prompts: Batch, on_row_end=None) -> Batch:
        out = super().generate_sequences(prompts)
        if on_row_end is None:
            return out
        p = prompts.tensors["prompt_ids"].shape[1]
        lengths = out.tensors["response_mask"].sum(1).tolist()
        for k, i in enumerate(sorted(range(len(out)), key=lambda i: lengths[i])):
            on_row_end(i, out.tensors["input_ids"][i, p:p + lengths[i]].tolist())
            if k == 0:
                deadline = time.monotonic() + 20
                while not self.stamped.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                self.seen.append(self.stamped.exists())
        return out


def test_tool_calls_run_while_the_other_rows_generate(tok, model, tools, tmp_path):
    """A row's calls go to the tool runner as soon as the engine reports the row ended,
    while the engine still generates the others: the short row's stamp tool has run before
    the turn's generate returns. The trajectories are exactly those of the engine that
    reports nothing (calls sent after generate): ids, masks, log-probs, messages, counts,
    the max_tool_calls refusal, the order of the results."""
    runner, schemas = tools
    stamp = '<tool_call>{"name": "stamp", "arguments": {"name": "a"}}</tool_call>'
    long = CALL + ' and ' + '<tool_call>{"name": "shout", "arguments": {"text": "ab"}}</tool_call>' + CALL
    turns = [{"2+3=": stamp, "3+3=": long}, {"2+3=": "5", "3+3=": "6"}]
    cfg = MultiTurnConfig(enabled=True, max_tool_calls=2, max_response_tokens=300, max_tool_response_tokens=8)
    engine = EndingEngine(model, tok, turns, tmp_path / "a")
    out = run_multi_turn(engine, _prompts(tok, schemas, max_new_tokens=200), tok, runner, cfg, schemas)
    assert engine.seen[0]  # turn 0: row 0's call ran while row 1 was being generated
    (tmp_path / "a").unlink()
    after = EndingEngine(model, tok, turns, tmp_path / "a")
    after.reports_ended_rows = False
    ref = run_multi_turn(after, _prompts(tok, schemas, max_new_tokens=200), tok, runner, cfg, schemas)
    assert after.seen == [] and (tmp_path / "a").exists()
    for k in ref.tensors:
        assert torch.equal(out.tensors[k], ref.tensors[k]), k
    for k in ("messages", "final_answer", "num_turns", "tool_calls", "tool_errors", "tool_timeouts", "truncated"):
        assert list(out.arrays[k]) == list(ref.arrays[k]), k
    assert {k: v for k, v in out.meta["metrics"].items() if k != "time/tools"} == \
        {k: v for k, v in ref.meta["metrics"].items() if k != "time/tools"}
    tool_turns = [[m["content"] for m in msgs if m["role"] == "tool"] for msgs in out.arrays["messages"]]
    assert tool_turns[0] == ["stamped"] and tool_turns[1][0] == "5" and tool_turns[1][2].startswith("error: m")
    assert list(out.arrays["tool_calls"]) == [1, 3] and list(out.arrays["tool_errors"]) == [0, 1]


def test_turns_budget_and_call_limits_truncate(tok, model, tools):
    runner, schemas = tools
    eos = tok.eos_token_id
    # calls in the last allowed turn: they run, the trajectory is truncated
    out = run_multi_turn(ScriptedEngine(model, tok, [CALL, "5"]), _prompts(tok, schemas, n=1, max_new_tokens=64),
                         tok, runner, MultiTurnConfig(enabled=True, max_turns=1, max_response_tokens=96), schemas)
    assert out.arrays["truncated"][0] and out.arrays["num_turns"][0] == 1 and out.arrays["tool_calls"][0] == 1
    # a budget that cuts the first turn: no EOS, nothing past the budget
    out = run_multi_turn(ScriptedEngine(model, tok, [CALL]), _prompts(tok, schemas, n=1, max_new_tokens=64),
                         tok, runner, MultiTurnConfig(enabled=True, max_response_tokens=20,
                                                      max_tool_response_tokens=8), schemas)
    p = out.tensors["prompt_ids"].shape[1]
    assert out.tensors["response_mask"][0, p:].tolist() == [1] * 20
    assert out.arrays["truncated"][0] and out.arrays["tool_calls"][0] == 0  # an unclosed call is not run
    # two calls in one turn, one allowed: the second is answered with an error, not run;
    # a long result is cut to its first max_tool_response_tokens tokens
    two = CALL + '<tool_call>{"name": "shout", "arguments": {"text": "ab"}}</tool_call>'
    cfg = MultiTurnConfig(enabled=True, max_tool_calls=1, max_response_tokens=200, max_tool_response_tokens=8)
    out = run_multi_turn(ScriptedEngine(model, tok, [two, "5"]), _prompts(tok, schemas, n=1, max_new_tokens=128),
                         tok, runner, cfg, schemas)
    msgs = out.arrays["messages"][0]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "tool", "assistant"]
    assert msgs[2]["content"] == "5" and msgs[3]["content"] == "error: m"  # 8 tokens of the refusal
    assert out.arrays["tool_errors"][0] == 1 and out.meta["metrics"]["tools/errors"] == 1
    assert out.tensors["responses"][0].tolist().count(eos) == 2
    assert not out.arrays["truncated"][0]


def test_sampled_hf_trajectories_keep_the_invariants(tok, model, tools):
    """The HF engine on a random model (it writes whatever it writes): masks, widths and
    log-probs hold, and a fixed seed gives the same trajectories."""
    runner, schemas = tools
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    engine = HFGenerator(model, RolloutConfig(temperature=1.0), runtime, pad_id=0, eos_id=tok.eos_token_id)
    cfg = MultiTurnConfig(enabled=True, max_response_tokens=40, max_tool_response_tokens=8)
    out = run_multi_turn(engine, _prompts(tok, schemas, n=4, seed=3, max_new_tokens=16), tok, runner, cfg, schemas)
    again = run_multi_turn(engine, _prompts(tok, schemas, n=4, seed=3, max_new_tokens=16), tok, runner, cfg, schemas)
    t = out.tensors
    assert torch.equal(t["input_ids"], again.tensors["input_ids"])
    mask = t["response_mask"].bool()
    assert (t["attention_mask"].bool() | ~mask).all() and mask.any()
    torch.testing.assert_close(t["rollout_log_probs"][mask], _recomputed(model, out)[mask], atol=1e-4, rtol=0)
    for row in range(4):
        used = int(t["attention_mask"][row, t["prompt_ids"].shape[1]:].sum())
        assert used <= 40 and int(mask[row].sum()) >= 1
        if tok.eos_token_id not in t["responses"][row].tolist():  # never finished a turn
            assert out.arrays["truncated"][row]
    assert turn_seed(3, 0) == 3 and turn_seed(3, 1) != turn_seed(3, 2)


def test_sample_keys_seed_each_trajectory_whatever_shares_its_turns(tok, model, tools):
    """With arrays["sample_key"] every turn's call carries the keys of the trajectories still
    going: a trajectory's tokens are the same in a batch of 4, in reverse order and with only
    2 of the 4 rows (other rows, other turns still going beside it)."""
    runner, schemas = tools
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    engine = HFGenerator(model, RolloutConfig(temperature=1.0), runtime, pad_id=0, eos_id=tok.eos_token_id)
    cfg = MultiTurnConfig(enabled=True, max_response_tokens=40, max_tool_response_tokens=8)
    prompts = _prompts(tok, schemas, n=4, seed=3, max_new_tokens=16)
    prompts.arrays["sample_key"] = np.array([f"u{i}/0" for i in range(4)], dtype=object)

    def tokens(batch: Batch) -> dict[str, list[int]]:
        out = run_multi_turn(engine, batch, tok, runner, cfg, schemas)
        t = out.tensors
        return {k: t["input_ids"][i][t["attention_mask"][i].bool()].tolist()
                for i, k in enumerate(out.arrays["sample_key"])}

    whole = tokens(prompts)
    assert tokens(prompts.reorder([3, 2, 1, 0])) == whole
    assert tokens(prompts[[1, 3]]) == {k: whole[k] for k in ("u1/0", "u3/0")}


def test_later_turns_continue_from_the_rows_kept_cache(tmp_path):
    """Inside a session the HF engine forwards only what a row's next turn adds after what it
    kept (the module docstring of `shardwise.engine.generate`): the tool model (every turn
    calls the calculator), sampled with per-row keys and greedy without them (rows kept by
    the loop's ``row_key``), writes the same trajectories as with nothing kept, its rollout
    log-probs equal up to fp32 rounding of the attention's sums over other shapes (far below
    1e-5 on log-probs of a few units), and nothing is kept once the session ends."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tool_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    specs = load_tools([TOOL])
    schemas = all_schemas(specs, None)
    runtime = Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    cfg = MultiTurnConfig(enabled=True, max_turns=3, max_response_tokens=60, max_tool_response_tokens=8)

    def rollout(keep: bool, sampled: bool) -> tuple[Batch, HFGenerator]:
        engine = HFGenerator(model, RolloutConfig(temperature=0.5), runtime, pad_id=0, eos_id=tok.eos_token_id)
        engine.keep_rows = keep
        records = [{"prompt": f"{2 + i}*3=", "response": str(6 + 3 * i)} for i in range(5)]
        prompts = agent_prompt_batch(tok, records, 64, [f"u{i}" for i in range(5)], schemas)
        prompts.meta.update(seed=5, max_new_tokens=20, greedy=not sampled)
        if sampled:
            prompts.arrays["sample_key"] = np.array([f"u{i}/0" for i in range(5)], dtype=object)
        with ToolRunner(specs, None, timeout_s=20, workers=2) as runner:
            return run_multi_turn(engine, prompts, tok, runner, cfg, schemas, barrier=True), engine

    for sampled in (True, False):
        kept, engine = rollout(True, sampled)
        fresh, plain = rollout(False, sampled)
        assert engine.reused_tokens > 0 and plain.reused_tokens == 0 and engine._kept is None
        assert (kept.arrays["num_turns"] == 3).all()
        for key in ("input_ids", "attention_mask", "response_mask"):
            assert torch.equal(kept.tensors[key], fresh.tensors[key]), key
        torch.testing.assert_close(kept.tensors["rollout_log_probs"], fresh.tensors["rollout_log_probs"],
                                   atol=1e-5, rtol=0)

    # a row whose conversation ends leaves nothing behind: with one turn, every row's call is
    # its last act (inspected inside an enclosing session, which the loop's joins)
    engine = HFGenerator(model, RolloutConfig(temperature=0.5), runtime, pad_id=0, eos_id=tok.eos_token_id)
    prompts = agent_prompt_batch(tok, [{"prompt": "2*3=", "response": "6"}], 64, ["u0"], schemas)
    prompts.meta.update(seed=5, max_new_tokens=20, greedy=True)
    with ToolRunner(specs, None, timeout_s=20, workers=2) as runner, engine.rollout_session():
        run_multi_turn(engine, prompts, tok, runner, cfg.model_copy(update={"max_turns": 1}), schemas, barrier=True)
        assert engine._kept == {}


TINY = ("model.config={model_type: qwen3, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
        "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, vocab_size: 72, "
        "max_position_embeddings: 256, tie_word_embeddings: false}")


@pytest.mark.parametrize(("overrides", "message"), [
    (["rl.multi_turn.enabled=true"], "rl.multi_turn.enabled': multi-turn rollouts need tools"),
    (["rl.tools=[m:f]", "rl.multi_turn.max_tool_response_tokens=600"], "max_tool_response_tokens': 600 tokens"),
    (["rl.tools=[m:f]", "rl.multi_turn.tool_parser=hermez"], "did you mean hermes"),
    (["rl.tools=[m:f]", "rl.multi_turn.enabled=true", "rl.reward.function=null"], None),
])
def test_multi_turn_config_checks(overrides, message):
    from shardwise.config import load_config
    from shardwise.errors import ConfigError

    if message is None:  # an environment's reward may stand in: checked by the job with the environment
        with pytest.raises(ConfigError, match="no reward"):
            load_config(None, overrides)
        assert load_config(None, [*overrides, "rl.environment=m:Env"]).rl.environment == "m:Env"
        return
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_rl_cli_runs_multi_turn_rollouts(tmp_path):
    """`shardwise rl` with rl.multi_turn on builtin:calc (2 processes, 2 steps): exits 0 and
    logs the multi-turn and tool metrics each step; the evaluation (4 held-out prompts,
    greedy + 2 samples, at steps 0 and 2) rolls out trajectories with the tools too; a tool
    that cannot be imported is one config line, exit 2, before anything starts."""
    common = ["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "--nproc", "2", "model.path=null", TINY,
              "data.source=builtin:calc", "data.max_length=32", "train.global_batch_size=2",
              "train.micro_batch_size=4", "train.max_steps=2", "rl.rollout.n=2", "rl.rollout.max_new_tokens=12",
              "rl.multi_turn.enabled=true", "rl.multi_turn.max_response_tokens=40",
              "rl.multi_turn.max_tool_response_tokens=16", "rl.multi_turn.tool_workers=2",
              "rl.reward.function=builtin:calc",
              "rl.heldout_eval=false", "rl.reference.enabled=false", "rl.actor.kl_loss.enabled=false",
              "checkpoint.every_steps=0", "checkpoint.export_hf=false",
              "checkpoint.async=false", "eval.source=builtin:calc", "eval.num_prompts=4", "eval.n=2"]
    bad = run_cli([*common, f"run.dir={tmp_path / 'bad'}", "rl.tools=[no_such_module:calculator]"], timeout=120,
                  cwd=tmp_path)
    assert bad.returncode == 2 and "rl.tools[0]" in bad.stderr and not (tmp_path / "bad").exists()
    # the tool a module of the working directory: the Ray workers import it too
    (tmp_path / "my_calc.py").write_text("from shardwise.agents.builtin import calculator  # noqa: F401\n")
    run = tmp_path / "run"
    res = run_cli([*common, f"run.dir={run}", "rl.tools=[my_calc:calculator]"], timeout=300, cwd=tmp_path)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in lines if "time/eval" in m]
    lines = [m for m in lines if "time/eval" not in m]
    assert [m["step"] for m in lines] == [1, 2] and [m["step"] for m in evals] == [0, 2]
    assert all("val/accuracy" in m and "val/pass@2" in m for m in evals)
    rows = [json.loads(x) for x in (run / "samples" / "step_0000002.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 3 and all(r["ground_truth"] and r["prompt"] for r in rows)
    assert "held-out trajectories calling a tool: greedy" in res.stdout, res.stdout  # how they were answered
    for m in lines:
        for key in ("multi_turn/turns_mean", "tools/calls_per_trajectory", "tools/errors", "tools/timeouts",
                    "multi_turn/truncated", "multi_turn/retokenize_mismatch", "time/tools"):
            assert isinstance(m[key], (int, float)), key
        assert 1 <= m["multi_turn/turns_mean"] <= 4
        # the actor's packed forward scores the trained (non-contiguous) tokens as the rollout did
        assert m["rollout/log_prob_diff_abs_max"] < 1e-4
    assert (run / "logs" / "tools-rank0.log").exists()


def test_qwen_template_glue_and_the_retokenize_check(qwen_tool_tokenizer, tools):
    """A Qwen2.5-style template writes "\n" after the assistant's <|im_end|>: the tool turn's
    ids start with it, and the trajectory equals the template's rendering of the whole
    conversation (schemas in the system turn) token for token; a call written in other
    whitespace than the template's is counted as a mismatch, its ids kept as generated."""
    tok, _ = qwen_tool_tokenizer
    runner, schemas = tools
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         vocab_size=len(tok), max_position_embeddings=2048)).eval()
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    cfg = MultiTurnConfig(enabled=True, max_response_tokens=96)
    out = run_multi_turn(ScriptedEngine(model, tok, [call, "5"], "<|im_start|>assistant"),
                         _prompts(tok, schemas, n=1, max_length=1024, max_new_tokens=64), tok, runner, cfg, schemas)
    t, a = out.tensors, out.arrays
    mask = t["response_mask"][0].bool()
    tool_part = t["input_ids"][0][~mask & t["attention_mask"][0].bool()][t["prompt_mask"][0].sum():]
    assert tok.decode(tool_part) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                                     "<|im_start|>assistant\n")
    real = t["input_ids"][0][t["attention_mask"][0].bool()].tolist()
    whole = tok.apply_chat_template(a["messages"][0], tools=schemas, tokenize=False)
    assert real == _ids(tok, whole)[:len(real)] and _ids(tok, whole)[len(real):] == _ids(tok, "\n")
    assert not a["retokenize_mismatch"][0] and a["final_answer"][0] == "5"
    torch.testing.assert_close(t["rollout_log_probs"][0][mask], _recomputed(model, out)[0][mask], atol=1e-5, rtol=0)
    # the same call with a space after the JSON: run and answered, but not the template's text
    odd = call.replace("}}\n", "}} \n")
    out = run_multi_turn(ScriptedEngine(model, tok, [odd, "5"], "<|im_start|>assistant"),
                         _prompts(tok, schemas, n=1, max_length=1024, max_new_tokens=64), tok, runner, cfg, schemas)
    assert out.arrays["tool_calls"][0] == 1 and out.arrays["retokenize_mismatch"][0]
    assert out.meta["metrics"]["multi_turn/retokenize_mismatch"] == 1.0
    assert _ids(tok, odd) == out.tensors["responses"][0][:len(_ids(tok, odd))].tolist()


def test_controller_scores_trajectories_at_their_last_model_token(tmp_path, tok):
    """The outcome reward sits on a trajectory's LAST GENERATED token (tool turns after it
    are outside the mask); an environment's reward stands in for the function's, and
    rl.multi_turn.truncated_reward scores truncated rows."""
    from shardwise.config import load_config
    from shardwise.rl.trainer import Controller

    cfg = load_config(None, [f"run.dir={tmp_path}", "rl.tools=[m:f]", "rl.multi_turn.enabled=true",
                             "rl.environment=m:Env", "rl.reward.function=null", "rl.multi_turn.truncated_reward=-1",
                             "train.global_batch_size=1"])
    ctl = Controller(cfg, 1, [{"prompt": "1+1=", "response": "2"}], tok, str(tmp_path), None, schemas=[])
    p, r = 2, 6
    model_tokens = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    real = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    batch = Batch.from_dict(
        {"input_ids": torch.ones((3, p + r), dtype=torch.long),
         "response_mask": torch.cat([torch.zeros((3, p), dtype=torch.long), model_tokens], 1),
         "attention_mask": torch.cat([torch.ones((3, p), dtype=torch.long), real], 1)},
        {"env_reward": [1.0, None, 0.5], "truncated": [False, False, True], "prompt": ["", "", ""],
         "ground_truth": ["", "", ""], "final_answer": ["", "", ""], "messages": [[], [], []],
         "num_turns": [1, 1, 1], "tool_calls": [0, 0, 0]})
    scored, metrics = ctl.score(batch)
    s = scored.tensors["token_level_scores"]
    assert s[0, p + 4] == 1.0 and s[1].abs().sum() == 0 and s[2, p] == -1.0
    assert (s != 0).sum() == 2 and metrics["reward/mean"] == 0.0 and metrics["accuracy"] == pytest.approx(1 / 3)


def test_an_environment_observes_plays_and_rewards(tok, model):
    """GuessNumber: its first observation is a user turn after the prompt (the prompt
    rendered again with it), its method is a tool with state, its reward() is env_reward."""
    from shardwise.agents.tools import load_environment

    env = load_environment("shardwise.agents.builtin:GuessNumber")
    schemas = all_schemas([], env)
    records = [{"prompt": "guess my number.", "response": "8"}, {"prompt": "guess my number.", "response": "3"}]
    prompts = agent_prompt_batch(tok, records, 64, ["a", "b"], schemas)
    prompts.meta.update(seed=0, max_new_tokens=64)
    play = '<tool_call>{"name": "guess", "arguments": {"number": 8}}</tool_call>'
    with ToolRunner([], env, timeout_s=20, workers=1) as runner:
        out = run_multi_turn(ScriptedEngine(model, tok, [play, "8"]), prompts, tok, runner,
                             MultiTurnConfig(enabled=True, max_response_tokens=96), schemas)
    a, t = out.arrays, out.tensors
    assert list(a["env_reward"]) == [1.0, 0.0]
    first = a["messages"][0][:2]
    assert first[0] == {"role": "user", "content": "guess my number."} and first[1]["role"] == "user"
    assert "you have" in first[1]["content"]
    prompt = t["prompt_ids"][0][t["prompt_mask"][0].bool()].tolist()
    assert prompt == _ids(tok, tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False))
    assert [m["content"] for m in a["messages"][1] if m["role"] == "tool"] == ["lower"]
    assert not a["retokenize_mismatch"].any() and not a["truncated"].any()


class OverScripted(ScriptedEngine):
    """A scripted engine over a collective one: every call goes through the HF engine on the
    sharded model (its all-gather must be matched by every rank), then the rows' turns are
    the script's (log-prob 0)."""

    def __init__(self, inner, tok, turns):
        super().__init__(None, tok, turns)
        self.inner = inner

    def generate_sequences(self, prompts: Batch) -> Batch:
        self.inner.generate_sequences(prompts)
        call = sampling_call(prompts, RolloutConfig(temperature=0))
        ids, mask, r = call.ids, call.mask, call.max_new_tokens
        self.calls.append(len(ids))
        responses = torch.zeros((len(ids), r), dtype=torch.long)
        produced = torch.zeros((len(ids), r), dtype=torch.bool)
        for i in range(len(ids)):
            k = self.tok.decode(ids[i][mask[i].bool()].tolist()).count(self.marker) - 1
            gen = (_ids(self.tok, self.turns[k]) + [self.tok.eos_token_id])[:r]
            responses[i, :len(gen)], produced[i, :len(gen)] = torch.tensor(gen), True
        return assemble_sequences(prompts, ids, mask, responses, torch.zeros((len(ids), r)), produced, 0,
                                  self.tok.eos_token_id)


def _uneven_turns_body(rank: int, world: int, folder: str) -> dict:
    import os
    import sys

    from shardwise.config import load_config
    from shardwise.data.tokenizer import load_tokenizer
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine

    os.chdir(folder)
    sys.path.insert(0, folder)
    runtime = init_distributed(timeout_s=30)  # a rank left waiting in a collective fails in seconds
    cfg = load_config(None, [TINY, "fsdp.mixed_precision.param_dtype=fp32"])
    tok = load_tokenizer(f"{folder}/tok")
    inner = HFGenerator(TrainEngine(cfg, runtime).model, RolloutConfig(temperature=0), runtime, 0, tok.eos_token_id)
    engine = OverScripted(inner, tok, ["5"] if rank == 0 else [CALL, "5"])  # rank 0 is done after one turn
    specs = load_tools(["loop_tools:add"])
    schemas = all_schemas(specs, None)
    with ToolRunner(specs, None, timeout_s=20, workers=1) as runner:
        out = run_multi_turn(engine, _prompts(tok, schemas, n=1, max_new_tokens=64), tok, runner,
                             MultiTurnConfig(enabled=True, max_response_tokens=96), schemas)
    teardown()
    return {"calls": engine.calls, "turns": [int(x) for x in out.arrays["num_turns"]],
            "width": list(out.tensors["input_ids"].shape[1:])}


def test_ranks_with_uneven_turns_make_the_same_generate_calls(tmp_path):
    """The HF engine's call is collective (one all-gather of the sharded model): a rank
    whose trajectories are done keeps calling with 0 rows while another rank's go on."""
    (tmp_path / "loop_tools.py").write_text(textwrap.dedent(TOOLS))
    build_char_tokenizer(tmp_path / "tok", tools=True)
    r0, r1 = run_ranks(_uneven_turns_body, 2, str(tmp_path), timeout=120)
    assert r0["calls"] == [1, 0] and r1["calls"] == [1, 1]
    assert r0["turns"] == [1] and r1["turns"] == [2] and r0["width"] == r1["width"]  # the batches concatenate


def test_per_row_tool_arguments_come_from_the_data(tok, model, tools):
    """rl.multi_turn.tools_kwargs_key: a row's {tool: {argument: value}} is given to its calls."""
    runner, schemas = tools
    records = [{"prompt": "2+3=", "response": "5", "extra_info": {"tools_kwargs": {"add": {"b": 10}}}},
               {"prompt": "2+3=", "response": "5"}]
    prompts = agent_prompt_batch(tok, records, 64, ["a", "b"], schemas)
    prompts.meta.update(seed=0, max_new_tokens=64)
    out = run_multi_turn(ScriptedEngine(model, tok, [CALL, "5"]), prompts, tok, runner,
                         MultiTurnConfig(enabled=True, max_response_tokens=96), schemas)
    assert [m[2]["content"] for m in out.arrays["messages"]] == ["12", "5"]
