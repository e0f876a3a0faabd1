"""The multi-turn rollout: a generation engine, a tool runner and the chat template, turn by turn.

`run_multi_turn` takes a prompt batch (the layout of `shardwise.engine.generate`, plus the
conversation each prompt starts: array ``raw_prompt``, see `agent_prompt_batch`) and returns
the engine's sequence layout, where the response part holds the model's turns AND the tool
turns of each trajectory:

- **Token-in, token-out.** Each turn, every trajectory still going is one row of ONE
  ``generate_sequences`` call whose prompt is the trajectory's ids so far; the turn's
  generated ids (up to and including EOS) and the engine's log-probs of them are appended
  as they came (mask 1). Decoded text is only read (to parse calls), never tokenized back.
  A tool turn's ids are the template's own delta (`tool_turn_ids`): the tokens of the
  conversation rendered with the tool messages and the generation prompt, after the tokens
  of the conversation without them, preceded by the glue the template writes after the
  assistant's EOS (Qwen's ``"\\n"`` after ``<|im_end|>``), which the generated ids lack.
  Where the rendering without the new turn is not a token prefix of the rendering with it
  (a template that rewrites earlier turns), the ids after the longest common prefix are
  used and the row counted in ``multi_turn/prefix_fallbacks``.
- **The check.** At the end each trajectory's ids are compared with the tokens of the
  template's rendering of its whole conversation (``messages``): a row whose ids are not a
  prefix of that rendering (the model wrote a call in other whitespace than the template
  renders it, a BPE merge across a turn boundary, a prompt cut by ``data.max_length``)
  counts in ``multi_turn/retokenize_mismatch``. The trained ids stay the generated ones.
- **Masks.** ``response_mask`` is 1 on generated tokens only (the calls included), 0 on
  tool turns and glue; ``rollout_log_probs`` 0 where the mask is 0; ``attention_mask`` 1
  on every real token.
- **Budgets.** ``rl.multi_turn.max_response_tokens`` bounds every token after the prompt
  (model's and tools' together): a turn generates at most what is left (and at most
  ``meta["max_new_tokens"]``, `rl.rollout.max_new_tokens`, per turn). A turn cut before its
  EOS, a tool turn that does not fit, or calls still made in the ``max_turns``-th turn end
  the trajectory as ``truncated``. A tool result is cut to ``max_tool_response_tokens``
  tokens, keeping its head (the start of an output says what it is; an error's first line
  says what failed). Calls beyond ``max_tool_calls`` in a trajectory are answered with an
  error message without running.
- **Environments.** ``ToolRunner.reset`` gives each trajectory its first observation (or
  None); an observation is asked as a user turn after the prompt: those rows' prompts are
  rendered again with it (not cut by ``data.max_length``). At the end ``ToolRunner.reward`` gives
  ``env_reward`` and ``ToolRunner.end`` forgets the environments.
- **Seeds.** Turn t samples with `turn_seed` (the batch's ``meta["seed"]`` for turn 0, a
  mix of it and t after). With the array ``sample_key`` (the RL controller's) each turn's
  call carries the key of every trajectory still going, so the engine seeds the row by its
  key (`shardwise.engine.generate.row_seed`): a trajectory's samples depend neither on its
  rank nor on which other trajectories are still going. Without it a row is seeded by its
  rank and position in the turn's call, as in a single-turn rollout.
- **Tools while generating.** A row's calls go to the `ToolRunner` as soon as its turn
  ends: with an engine that `reports_ended_rows` (HF, vLLM), from inside the turn's
  ``generate_sequences``, when the engine reports the row's EOS (``on_row_end``), while the
  longer rows still decode; otherwise after the call. Each row's calls are sent once, from
  the same ids, counted against ``max_tool_calls`` in the same order, and the results are
  appended after the call returned, in row order, each row's in its calls' order: the
  trajectories are the same whichever way the calls went out; only the time differs. (What
  can differ is which calls share a tool process at once, which matters only when one of
  them times out or crashes and an environment kept in that process is lost.)
- **Without a turn barrier** (vLLM with TP 1: an engine with a ``request_session``,
  `shardwise.engine.vllm_engine.RequestSession`). Turn by turn, the next turn waits for the
  slowest call of the turn before it; here every trajectory is a request of its own in one
  stepping loop of the engine: when a request ends its calls are sent, and when their
  results are back its next turn is queued at once (prompt: its ids so far; the same seed
  as turn by turn: `turn_seed`, then its ``sample_key``; without one, this rank and the
  row's index in the batch, not its position among the turn's rows), while the others
  still generate. Every rule above holds per trajectory, so the trajectories are those of
  the turn-synchronous loop (tests/test_vllm_agents.py: greedy and seeded sampling); the
  ranks never wait for each other between the two all-reduces of the widths.
- **Collective.** Turn by turn, the engines' ``generate_sequences`` is collective (the HF
  engine gathers the sharded model once per call; vLLM with TP > 1 gathers its TP group's
  prompts), so every rank makes the same number of calls: a rank whose trajectories are
  all done calls with 0 rows until no rank has one going (one all-reduce of a flag per turn
  over the default process group); without a barrier there is no per-turn collective (each
  rank's vLLM engine steps its own requests). The output of every
  rank has the same width (prompts left-padded to the widest of all ranks, responses
  right-padded to the longest of all ranks), so the ranks' batches concatenate.

Per-row arrays added: ``final_answer`` (str), ``messages`` (the conversation, OpenAI
format), ``num_turns``, ``tool_calls``, ``tool_errors``, ``tool_timeouts`` (int),
``truncated``, ``retokenize_mismatch`` (bool), ``env_reward`` (float or None); and
``meta["metrics"]`` (`trajectory_metrics`, plus ``time/tools``: the seconds of wall time
this rank's rollout spent blocked in the tool runner, waiting for it, outside generation:
the environments' reset, reward and end, sending the calls of rows the engine did not
report, and collecting each turn's results after its generate call returned; without a
barrier, the waits while the engine had no request left to step. It is not the tools' own
run time: calls that were answered while the engine was still generating cost nothing
here, and sending a reported row's calls counts in the generate call).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from shardwise.agents.execute import Submitted, ToolResult, ToolRunner
from shardwise.agents.parsers import TOOL_PARSERS, ToolCall, tool_call_message
from shardwise.config.schema import MultiTurnConfig
from shardwise.data import chat
from shardwise.data.batch import Batch
from shardwise.data.tokenizer import pad_token_id
from shardwise.engine.generate import GenerationEngine, common_prefix, left_pad, prompt_batch
from shardwise.engine.infer import default_position_ids

__all__ = ["Trajectory", "agent_prompt_batch", "as_messages", "run_multi_turn", "tool_turn_ids",
           "trajectory_metrics", "turn_seed"]

_WHERE = "rl.multi_turn"
"""What a template error names."""


# ---------------------------------------------------------------- prompts


def as_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A record's prompt as the conversation it starts: chat messages as they are, a text
    prompt as one user turn (tool turns need the chat template)."""
    return [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]


def agent_prompt_batch(tokenizer, records: list[dict[str, Any]], max_length: int, uids: list[str],
                       schemas: list[dict]) -> Batch:
    """The prompt batch of a multi-turn rollout: `shardwise.engine.generate.prompt_batch`'s
    layout (left-padded ``prompt_ids`` / ``prompt_mask``, arrays ``prompt``, ``ground_truth``,
    ``data_source``, ``extra_info``, ``uid``), every prompt a chat (`as_messages`) rendered
    with the tool `schemas` (the template's ``tools``) and cut to its last `max_length`
    tokens; plus arrays ``raw_prompt`` (the messages) and ``row`` (the record: what an
    environment's ``reset(**row)`` and ``rl.multi_turn.tools_kwargs_key`` read)."""
    convs = [as_messages(r["prompt"]) for r in records]
    batch = prompt_batch(tokenizer, [{**r, "prompt": c} for r, c in zip(records, convs)], max_length, uids,
                         tools=schemas or None)
    batch.arrays.update(Batch.from_dict(arrays={"raw_prompt": convs,
                                                "row": [_json_row(r) for r in records]}).arrays)
    return batch


def _json_row(record: dict[str, Any]) -> dict[str, Any]:
    """The record's JSON-able fields, as JSON gives them back (what a batch carries between
    processes); others are left out."""
    out = {}
    for k, v in record.items():
        try:
            out[str(k)] = json.loads(json.dumps(v, allow_nan=True))
        except (TypeError, ValueError):
            continue
    return out



# ---------------------------------------------------------------- the template's ids


def _render_ids(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> list[int]:
    text = chat.render(tokenizer, messages, add_generation_prompt, _WHERE, tools=tools).text
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tool_turn_ids(tokenizer, messages: list[dict], new: list[dict], tools: list[dict] | None,
                  eos_id: int | None) -> tuple[list[int], bool]:
    """The ids that follow a generated assistant turn (the last of `messages`, ending in
    EOS) when the messages `new` (tool results, or a user turn) join the conversation and
    the model is asked again: the template's glue after the assistant's EOS, then the new
    turns and the generation prompt, as the template renders them. Returns ``(ids, prefix)``:
    `prefix` is False when the rendering without `new` is not a token prefix of the one
    with it (then the ids after their longest common prefix are taken)."""
    base = _render_ids(tokenizer, messages, False, tools)
    full = _render_ids(tokenizer, messages + new, True, tools)
    # The glue: what the template writes after the last assistant turn's EOS (the
    # generated ids end at the EOS).
    glue: list[int] = []
    if eos_id is not None and eos_id in base:
        last = len(base) - 1 - base[::-1].index(eos_id)
        glue = base[last + 1:]
    if full[:len(base)] == base:
        return glue + full[len(base):], True
    n = common_prefix(base, full)
    return glue + full[n:], False


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of turn `turn` of a call seeded `seed`: `seed` itself for turn 0
    (a trajectory's first turn samples what a single-turn rollout would), then a fixed,
    well-mixed function of both."""
    if turn == 0:
        return int(seed)
    state = np.random.SeedSequence([int(seed) % 2**64, turn, 0x6167656E]).generate_state(1, np.uint64)[0]
    return int(state) % 2**62


# ---------------------------------------------------------------- one trajectory


@dataclass
class Trajectory:
    """One row of a multi-turn rollout as it grows."""

    prompt: list[int]
    """The prompt's real ids (the batch's, or re-rendered with an environment's observation)."""
    messages: list[dict]
    """The conversation so far (OpenAI format)."""
    row: dict[str, Any]
    """The data record (environment reset, per-row tool arguments)."""
    traj_id: str
    sample_key: str | None = None
    """The row's ``sample_key`` (its sampling seed in every turn), when the prompts carry one."""
    ids: list[int] = field(default_factory=list)
    """Response ids so far: model turns and tool turns."""
    mask: list[int] = field(default_factory=list)
    """1 on generated ids, 0 on tool turns and glue."""
    log_probs: list[float] = field(default_factory=list)
    """The engine's log-prob of each generated id, 0 elsewhere."""
    done: bool = False
    truncated: bool = False
    final_answer: str = ""
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    prefix_fallbacks: int = 0
    env_reward: float | None = None

    def append(self, ids: Sequence[int], generated: bool, log_probs: Sequence[float] | None = None) -> None:
        self.ids.extend(int(i) for i in ids)
        self.mask.extend([int(generated)] * len(ids))
        self.log_probs.extend([float(x) for x in log_probs] if log_probs is not None else [0.0] * len(ids))

    def finish(self, truncated: bool) -> None:
        self.done, self.truncated = True, truncated


def _dotted(row: dict[str, Any], key: str) -> Any:
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


# ---------------------------------------------------------------- the loop


def run_multi_turn(engine: GenerationEngine, prompts: Batch, tokenizer, runner: ToolRunner,
                   cfg: MultiTurnConfig, schemas: list[dict], *, barrier: bool | None = None) -> Batch:
    """Multi-turn trajectories for this rank's `prompts` (see the module docstring).

    `prompts`: the engine's prompt layout with arrays ``raw_prompt`` (each row's
    conversation; `agent_prompt_batch`) and optionally ``row`` (the record), meta ``seed``,
    ``greedy`` and ``max_new_tokens`` (most tokens per assistant turn; default
    ``cfg.max_response_tokens``). `schemas`: the tools' schemas, passed to the template.
    Returns the sequence layout with R response columns, R the longest trajectory's
    response on any rank (at most ``cfg.max_response_tokens``; every rank's batch is as
    wide, so the workers' batches concatenate). Collective like ``engine.generate_sequences``.

    `barrier`: None runs without a turn barrier where the engine has a ``request_session``
    (vLLM with TP 1), turn by turn elsewhere; True: turn by turn on any engine (the
    reference the barrier-free loop is tested against); False: without a barrier, a
    ValueError on an engine that cannot.
    """
    tools = schemas or None
    pad = pad_token_id(tokenizer)
    per_turn = int(prompts.meta.get("max_new_tokens", cfg.max_response_tokens))
    seed = int(prompts.meta.get("seed", 0))
    tool_seconds = 0.0

    trajs = _start(prompts, tokenizer, tools)
    ids = [t.traj_id for t in trajs]
    clock = time.perf_counter()
    observations = runner.reset(ids, [t.row for t in trajs]) if trajs else []
    tool_seconds += time.perf_counter() - clock
    for t, obs in zip(trajs, observations):
        if obs is not None:  # a user turn after the prompt, rendered with it
            t.messages.append({"role": "user", "content": str(obs)})
            t.prompt = _render_ids(tokenizer, t.messages, True, tools)
    prompt_width = _reduce_max(max([len(t.prompt) for t in trajs] + [prompts.tensors["prompt_ids"].shape[1]]))

    requests = None
    if barrier is not True:
        requests = engine.request_session(greedy=bool(prompts.meta.get("greedy", False)))
    if barrier is False and requests is None:
        raise ValueError(f"run_multi_turn: {type(engine).__name__} cannot run without a turn barrier "
                         "(no request_session; vLLM with tensor_parallel_size 1 can)")
    if requests is not None:
        if trajs:  # a rank with no rows has nothing to step (and no collective to join)
            tool_seconds += _run_without_barrier(requests, trajs, tokenizer, runner, cfg, tools, seed, per_turn)
    else:
        tool_seconds += _run_turns(engine, prompts, trajs, tokenizer, runner, cfg, tools, seed, per_turn)

    for t in trajs:
        if not t.done:
            t.finish(truncated=True)
    clock = time.perf_counter()
    if trajs:
        for t, r in zip(trajs, runner.reward(ids)):
            t.env_reward = None if r is None else float(r)
        runner.end(ids)
    tool_seconds += time.perf_counter() - clock
    # every rank's rows as wide (the workers' batches are concatenated): the longest row of all
    width = _reduce_max(max([len(t.ids) for t in trajs] + [1]))
    return _assemble(prompts, trajs, tokenizer, tools, pad, width, prompt_width, tool_seconds)


def _run_turns(engine: GenerationEngine, prompts: Batch, trajs: list[Trajectory], tokenizer, runner: ToolRunner,
               cfg: MultiTurnConfig, tools: list[dict] | None, seed: int, per_turn: int) -> float:
    """The turn-synchronous loop: each turn, every trajectory still going is a row of one
    ``engine.generate_sequences`` call (collective: every rank makes the same calls), its calls
    sent as its row ends, the results appended after the call. Returns the seconds blocked on
    the tool runner (see the module docstring)."""
    parse = TOOL_PARSERS[cfg.tool_parser]
    eos = tokenizer.eos_token_id
    pad = pad_token_id(tokenizer)
    budget = cfg.max_response_tokens
    tool_seconds = 0.0
    # one engine session for every turn (HF: the units gathered once, not per turn)
    session = getattr(engine, "rollout_session", None)
    with session() if session is not None else contextlib.nullcontext():
        for turn in range(cfg.max_turns):
            for t in trajs:
                if not t.done and len(t.ids) >= budget:
                    t.finish(truncated=True)
            active = [t for t in trajs if not t.done]
            if not _any_over_ranks(bool(active)):
                break
            room = max([budget - len(t.ids) for t in active], default=1)
            rows = [t.prompt + t.ids for t in active]
            turn_ids, turn_mask = left_pad(rows, pad)
            keyed = {"sample_key": [t.sample_key for t in active]} if "sample_key" in prompts.arrays else {}
            # each trajectory's identity over the turns: an engine that keeps a row's cache
            # continues it from there (the HF engine inside its session)
            keyed["row_key"] = [t.traj_id for t in active]
            call = Batch.from_dict({"prompt_ids": turn_ids, "prompt_mask": turn_mask}, keyed,
                                   meta={"seed": turn_seed(seed, turn), "max_new_tokens": max(1, min(per_turn, room)),
                                         **({"greedy": prompts.meta["greedy"]} if "greedy" in prompts.meta else {})})
            # Calls go out as soon as their row's turn ends: from inside the engine's call
            # (an engine that reports rows as they end) while the other rows still generate,
            # else after it. Either way the same calls with the same arguments, sent once.
            sent: dict[int, _Sent] = {}

            def row_ended(i: int, tokens: list[int], active=active, sent=sent, turn=turn) -> bool:
                """Send row i's calls; whether its trajectory goes on (the engine keeps its
                cache only then)."""
                if i not in sent:
                    gen, ended, parsed = _read_turn(active[i], tokens, budget, eos, parse, tokenizer)
                    if ended and parsed.calls:
                        sent[i] = _send_calls(active[i], parsed.calls, gen, runner, cfg)
                return i in sent and turn < cfg.max_turns - 1

            if getattr(engine, "reports_ended_rows", False):
                out = engine.generate_sequences(call, on_row_end=row_ended)
            else:
                out = engine.generate_sequences(call)
            width = turn_ids.shape[1]
            waiting: list[_Sent] = []
            for i, t in enumerate(active):
                n = int(out.tensors["response_mask"][i, width:].sum())
                gen, ended, parsed = _read_turn(t, out.tensors["input_ids"][i, width:width + n].tolist(), budget, eos,
                                                parse, tokenizer)
                lps = out.tensors["rollout_log_probs"][i, width:width + len(gen)].tolist()
                if ended and parsed.calls and i not in sent:  # not reported by the engine: sent now
                    clock = time.perf_counter()
                    sent[i] = _send_calls(t, parsed.calls, gen, runner, cfg)
                    tool_seconds += time.perf_counter() - clock
                if _record_turn(t, gen, lps, ended, parsed, tokenizer, turn == cfg.max_turns - 1):
                    assert sent[i].tokens == gen, "the engine reported a row's turn other than it returned"
                    waiting.append(sent[i])
            assert len(waiting) == len(sent), "calls were sent for a row whose returned turn has none"
            for s in waiting:  # results appended in row order, each row's in its calls' order
                clock = time.perf_counter()
                results = runner.collect(s.submitted)  # at once for calls already answered
                tool_seconds += time.perf_counter() - clock
                _append_results(s, results, tokenizer, cfg, tools, eos, budget)

    return tool_seconds


def _read_turn(t: Trajectory, tokens: Sequence[int], budget: int, eos: int | None, parse: Any,
               tokenizer) -> tuple[list[int], bool, Any]:
    """One generated turn of `t` as the loop reads it: its ids cut to what is left of the
    budget, whether they end at EOS, and the parser's reading of their text (the EOS left out)."""
    gen = list(tokens)[:budget - len(t.ids)]
    ended = bool(gen) and eos is not None and gen[-1] == eos
    return gen, ended, parse(tokenizer.decode(gen[:-1] if ended else gen, skip_special_tokens=False))


def _record_turn(t: Trajectory, gen: list[int], lps: Sequence[float], ended: bool, parsed: Any, tokenizer,
                 last_turn: bool) -> bool:
    """Append one generated turn (`gen`, its log-probs `lps`, `parsed` from its text; `ended`:
    it ends at EOS) to `t`, and end `t` where the turn ends it. True: its calls were sent and
    their results are to be appended."""
    t.append(gen, True, lps)
    t.messages.append(tool_call_message(parsed))
    t.num_turns += 1
    # what the reward reads: the turn's text without special tokens (the template's
    # markers, a stray pad) where it made no call, else its content
    t.final_answer = parsed.content if parsed.calls else \
        tokenizer.decode(gen[:-1] if ended else gen, skip_special_tokens=True).strip()
    if not ended:  # cut by the budget or the per-turn limit
        t.finish(truncated=True)
        return False
    if not parsed.calls:
        t.finish(truncated=False)
        return False
    if last_turn:  # its calls still run (an environment's last move counts)
        t.truncated = True
    return True


def _run_without_barrier(requests: Any, trajs: list[Trajectory], tokenizer, runner: ToolRunner,
                         cfg: MultiTurnConfig, tools: list[dict] | None, seed: int, per_turn: int) -> float:
    """The loop without a turn barrier, over an engine's request session
    (`shardwise.engine.vllm_engine.RequestSession`): every trajectory is a request of its
    own in one stepping loop; when a request ends its calls are sent, and when their results
    are back its next turn is queued at once, while the other trajectories still generate.
    Each trajectory goes through the same turns as in `_run_turns` (the same ids, the same
    sampling seed per turn: `turn_seed`, then the row's ``sample_key``, or without one this
    rank and the row's index in the batch), and ranks do not wait for each other. Returns
    the seconds blocked on the tool runner: the waits while no request was left to step."""
    parse = TOOL_PARSERS[cfg.tool_parser]
    eos = tokenizer.eos_token_id
    budget = cfg.max_response_tokens
    tool_seconds = 0.0
    running: dict[str, tuple[int, int]] = {}
    """Request id -> (trajectory index, turn)."""
    waiting: dict[int, tuple[_Sent, int]] = {}
    """Trajectory index -> its calls sent, and the turn that made them."""

    def ask(i: int, turn: int) -> None:
        t = trajs[i]
        if len(t.ids) >= budget:
            t.finish(truncated=True)
            return
        rid = f"{i}/{turn}"
        requests.add(rid, t.prompt + t.ids, max_new_tokens=max(1, min(per_turn, budget - len(t.ids))),
                     seed=turn_seed(seed, turn), key=t.sample_key, row=i)
        running[rid] = (i, turn)

    with requests:
        for i in range(len(trajs)):
            ask(i, 0)
        while running or waiting:
            if running:
                for rid, tokens, lps in requests.step():
                    i, turn = running.pop(rid)
                    t = trajs[i]
                    gen, ended, parsed = _read_turn(t, tokens, budget, eos, parse, tokenizer)
                    sent = _send_calls(t, parsed.calls, gen, runner, cfg) if ended and parsed.calls else None
                    if _record_turn(t, gen, lps[:len(gen)], ended, parsed, tokenizer, turn == cfg.max_turns - 1):
                        waiting[i] = (sent, turn)
            if waiting and not running:  # nothing to step: the rollout waits on the tools
                clock = time.perf_counter()
                runner.wait_any([s.submitted for s, _ in waiting.values()])
                tool_seconds += time.perf_counter() - clock
            for i in [i for i, (s, _) in waiting.items() if runner.done(s.submitted)]:
                s, turn = waiting.pop(i)
                _append_results(s, runner.collect(s.submitted), tokenizer, cfg, tools, eos, budget)
                if not trajs[i].done:
                    ask(i, turn + 1)
    return tool_seconds


def _start(prompts: Batch, tokenizer, tools: list[dict] | None) -> list[Trajectory]:
    if "raw_prompt" not in prompts.arrays:
        raise ValueError("run_multi_turn: prompts have no array 'raw_prompt' (each row's conversation); "
                         "build them with shardwise.agents.loop.agent_prompt_batch")
    a = prompts.arrays
    out = []
    for i in range(len(prompts)):
        real = prompts.tensors["prompt_ids"][i][prompts.tensors["prompt_mask"][i].bool()].tolist()
        row = dict(a["row"][i]) if "row" in a else {
            k: a[k][i] for k in ("prompt", "ground_truth", "data_source", "extra_info") if k in a}
        out.append(Trajectory(prompt=real, messages=copy.deepcopy(list(a["raw_prompt"][i])), row=row,
                              traj_id=f"{a['uid'][i] if 'uid' in a else i}/{uuid.uuid4().hex[:12]}",
                              sample_key=str(a["sample_key"][i]) if "sample_key" in a else None))
    return out


@dataclass
class _Sent:
    """One trajectory's calls of one turn, sent to the tool runner."""

    traj: Trajectory
    calls: list[ToolCall]
    where: list[int | None]
    """Per call: its index among the calls sent, or None (refused: over max_tool_calls)."""
    tokens: list[int]
    """The turn's generated ids the calls were parsed from."""
    submitted: Submitted


def _send_calls(t: Trajectory, calls: list[ToolCall], tokens: list[int], runner: ToolRunner,
                cfg: MultiTurnConfig) -> _Sent:
    """Count `calls` (one turn's, of `t`) against ``max_tool_calls`` and submit those
    allowed to `runner` (`ToolRunner.submit`: they run while the caller goes on)."""
    todo: list[tuple[str, ToolCall, dict]] = []
    where: list[int | None] = []
    for c in calls:
        t.tool_calls += 1
        if t.tool_calls > cfg.max_tool_calls:
            where.append(None)
            continue
        kwargs = _dotted(t.row, cfg.tools_kwargs_key) if cfg.tools_kwargs_key else None
        extra = kwargs.get(c.name) if isinstance(kwargs, dict) else None
        where.append(len(todo))
        todo.append((t.traj_id, c, dict(extra) if isinstance(extra, dict) else {}))
    return _Sent(t, list(calls), where, list(tokens), runner.submit(todo))


def _append_results(sent: _Sent, results: list[ToolResult], tokenizer, cfg: MultiTurnConfig,
                    tools: list[dict] | None, eos: int | None, budget: int) -> None:
    """Append the tool turn of `sent`'s trajectory: its calls' `results` (refused calls
    answered with an error), cut to ``max_tool_response_tokens`` each, as the template's delta."""
    t = sent.traj
    refused = ToolResult(f"error: more than rl.multi_turn.max_tool_calls={cfg.max_tool_calls} tool calls in "
                         "this conversation; this call was not run", "error")
    msgs: list[dict] = []
    for c, w in zip(sent.calls, sent.where, strict=True):
        res = refused if w is None else results[w]
        t.tool_errors += res.status in ("error", "crash")
        t.tool_timeouts += res.status == "timeout"
        text = _cut_tokens(tokenizer, res.text, cfg.max_tool_response_tokens)
        msgs.append({"role": "tool", "name": c.name, "content": text})
    delta, prefix = tool_turn_ids(tokenizer, t.messages, msgs, tools, eos)
    t.prefix_fallbacks += not prefix
    if len(t.ids) + len(delta) > budget:  # no room for the results: the trajectory ends here
        t.finish(truncated=True)
        return
    t.messages.extend(msgs)
    t.append(delta, False)
    if t.truncated:  # calls made in the last turn: nothing more is asked
        t.finish(truncated=True)


def _cut_tokens(tokenizer, text: str, limit: int) -> str:
    """`text` cut to its first `limit` tokens (the head kept)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return text if len(ids) <= limit else tokenizer.decode(ids[:limit], skip_special_tokens=False)


# ---------------------------------------------------------------- collectives


def _process_group_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _reduce_max(value: int) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.long, device=_process_group_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _any_over_ranks(flag: bool) -> bool:
    """Some rank has a trajectory going (every rank makes the same generate calls)."""
    return bool(_reduce_max(int(flag)))



# ---------------------------------------------------------------- the output


def _assemble(prompts: Batch, trajs: list[Trajectory], tokenizer, tools: list[dict] | None, pad: int, width: int,
              prompt_width: int, tool_seconds: float) -> Batch:
    rows = len(trajs)
    p_ids, p_mask = left_pad([t.prompt for t in trajs], pad, prompt_width)
    responses = torch.full((rows, width), pad, dtype=torch.long)
    r_mask = torch.zeros((rows, width), dtype=torch.long)
    real = torch.zeros((rows, width), dtype=torch.long)
    lp = torch.zeros((rows, width), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.ids)
        assert n <= width and len(t.mask) == n == len(t.log_probs)
        responses[i, :n] = torch.tensor(t.ids, dtype=torch.long)
        r_mask[i, :n] = torch.tensor(t.mask, dtype=torch.long)
        real[i, :n] = 1
        lp[i, :n] = torch.tensor(t.log_probs, dtype=torch.float32) * r_mask[i, :n]
    attention_mask = torch.cat([p_mask, real], dim=1)
    tensors = {k: v.cpu() for k, v in prompts.tensors.items()}
    tensors.update(
        prompt_ids=p_ids, prompt_mask=p_mask,
        input_ids=torch.cat([p_ids, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=default_position_ids(attention_mask),
        response_mask=torch.cat([torch.zeros_like(p_mask), r_mask], dim=1),
        responses=responses,
        rollout_log_probs=torch.cat([torch.zeros(p_mask.shape, dtype=torch.float32), lp], dim=1),
    )
    mismatch = [_retokenize_mismatch(tokenizer, t, tools) for t in trajs]
    arrays = dict(prompts.arrays)
    arrays.update(Batch.from_dict(arrays={
        "final_answer": [t.final_answer for t in trajs],
        "messages": [t.messages for t in trajs],
        "num_turns": [t.num_turns for t in trajs],
        "tool_calls": [t.tool_calls for t in trajs],
        "tool_errors": [t.tool_errors for t in trajs],
        "tool_timeouts": [t.tool_timeouts for t in trajs],
        "truncated": [t.truncated for t in trajs],
        "retokenize_mismatch": mismatch,
        "prefix_fallbacks": [t.prefix_fallbacks for t in trajs],
        "env_reward": [t.env_reward for t in trajs],
    }).arrays)
    meta = copy.deepcopy(prompts.meta)
    out = Batch(tensors=tensors, arrays=arrays, meta=meta)
    metrics = meta.setdefault("metrics", {})
    metrics.update(trajectory_metrics(out))
    metrics["time/tools"] = tool_seconds
    return out


def _retokenize_mismatch(tokenizer, t: Trajectory, tools: list[dict] | None) -> bool:
    """The trajectory's ids are not a prefix of its conversation as the template renders it."""
    rendered = _render_ids(tokenizer, t.messages, False, tools)
    mine = t.prompt + t.ids
    return rendered[:len(mine)] != mine


def trajectory_metrics(batches: Batch | Sequence[Batch]) -> dict[str, float]:
    """The multi-turn metrics of a rollout's rows (the per-row arrays of `run_multi_turn`;
    several batches: all their rows together): ``multi_turn/turns_mean`` (assistant turns
    per trajectory), ``tools/calls_per_trajectory``, ``tools/share`` (share of rows that
    called a tool at least once), ``tools/errors`` and ``tools/timeouts`` (calls, all rows
    together), ``multi_turn/truncated`` and ``multi_turn/retokenize_mismatch``
    (share of rows), ``multi_turn/prefix_fallbacks`` (tool turns whose template delta was not
    a token prefix, all rows)."""
    parts = [batches] if isinstance(batches, Batch) else list(batches)
    n = sum(len(b) for b in parts)
    if not n:
        return {}

    def total(key: str) -> float:
        return float(sum(int(x) for b in parts for x in b.arrays[key]))

    return {"multi_turn/turns_mean": total("num_turns") / n,
            "tools/calls_per_trajectory": total("tool_calls") / n,
            "tools/share": sum(int(x) > 0 for b in parts for x in b.arrays["tool_calls"]) / n,
            "tools/errors": total("tool_errors"),
            "tools/timeouts": total("tool_timeouts"),
            "multi_turn/truncated": total("truncated") / n,
            "multi_turn/retokenize_mismatch": total("retokenize_mismatch") / n,
            "multi_turn/prefix_fallbacks": total("prefix_fallbacks")}
