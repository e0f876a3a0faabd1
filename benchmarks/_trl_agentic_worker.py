"""One rank of TRL's `GRPOTrainer(tools=[...])` for `agentic.py`; runs in the benchmark's TRL venv.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/_trl_agentic_worker.py SPEC.json

`_trl_grpo_worker.py`'s run (its `TimedTrainer`: shardwise's learning-rate factors, rank
0's phases and update-token counts, the step log) with TRL's tool loop on:

- ``tools=``: the functions SPEC["tools"] names (``module:function``, imported here, the
  shardwise source tree and the repository on the path), each wrapped to count its seconds
  into ``time/tools``; TRL calls them one after another in this process
  (`GRPOTrainer._tool_call_loop`: a sync tool is called inline, only async tools of one
  completion are gathered);
- the prompts as TRL's tool loop needs them: conversational (``[{"role": "user",
  "content": prompt}]`` for a text prompt), their ids shardwise's (the
  chat template with the tools' schemas and the generation prompt, the last
  ``data.max_length`` tokens: `encode_prompt`);
- a response template on the tokenizer when TRL's `add_response_schema` knows no template
  for it (the built-in character tokenizer): Hermes calls, ``<tool_call>{json}</tool_call>``,
  after the template's generation prompt, up to its eos (`hermes_response_template`);
- the reward on the final answer, as shardwise scores a trajectory: the reward function on
  the content of the completion's last assistant message (its calls removed by TRL's
  parser).

Rank 0's step lines (SPEC["steps_path"]) also carry ``time/tools`` (seconds in the tools),
``rollout/model_tokens`` (tokens the model generated: TRL's tool_mask 1),
``rollout/tokens`` (all completion tokens, tool results included) and ``tools/calls``.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
import sys
import time
from pathlib import Path

import _trl_grpo_worker as base
from _trl_grpo_worker import PHASES, TimedTrainer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # module:function tools from the repository (benchmarks._agentic_tools)

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from transformers.utils import get_json_schema  # noqa: E402
from trl.chat_template_utils import add_response_schema  # noqa: E402

from shardwise.data.encode import encode_prompt  # noqa: E402
from shardwise.data.rewards import resolve_reward_fn  # noqa: E402


def load_tool(spec: str):
    """The function ``module:function`` names, wrapped to add its seconds to ``time/tools``
    (functools.wraps keeps its name, docstring and hints: TRL derives the same schema)."""
    module, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(module), name)

    @functools.wraps(fn)
    def tool(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PHASES.add("time/tools", time.perf_counter() - t0)
            PHASES.add("tools/calls", 1.0)

    return tool


def hermes_response_template(tokenizer) -> dict:
    """A transformers response template for a chat template TRL does not know: the
    assistant turn starts where the generation prompt ends, holds text and any number of
    Hermes calls, and ends at the eos token."""
    user = [{"role": "user", "content": "x"}]
    with_prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    without = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=False)
    anchor = with_prompt[len(without):]
    if not anchor:
        raise SystemExit("_trl_agentic_worker: the chat template writes no generation prompt to anchor the parser on")
    eos = tokenizer.eos_token
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": anchor,
        "fields": {
            "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True,
                           "content": "json", "transform": {"type": "function", "function": "{content}"}},
            "content": {"close_pattern": re.escape(eos) + r"\s*", "content": "text"},
        },
    }


def final_answer(completion: list[dict]) -> str:
    """The content of a trajectory's last assistant message ("" when it has none)."""
    return next((m.get("content") or "" for m in reversed(completion) if m.get("role") == "assistant"), "")


def trajectory_reward(fn):
    """A TRL reward function scoring each trajectory's final answer with shardwise's
    ``fn(prompt, answer, ground_truth)`` (``prompt``: the record's text)."""

    def reward(prompts, completions, ground_truth, prompt_text, completion_ids=None, tool_mask=None, **kwargs):
        return [float(fn(str(p), final_answer(c), str(g)))
                for p, c, g in zip(prompt_text, completions, ground_truth, strict=True)]

    reward.__name__ = "task_reward"
    return reward


class ToolTrainer(TimedTrainer):
    """`TimedTrainer` whose prompts are chat messages rendered with the tools' schemas by
    shardwise (the last max_length tokens), and which counts the rollout's tokens."""

    def _tokenize_prompts(self, prompts: list):
        schemas = [get_json_schema(t) for t in self.tools]
        return [encode_prompt(self.processing_class, p, self.prompt_max_length, tools=schemas).ids
                for p in prompts], None, {}

    def _generate(self, prompts):
        out = super()._generate(prompts)
        completion_ids, tool_mask = out[1], out[2]
        PHASES.add("rollout/tokens", float(sum(len(c) for c in completion_ids)))
        PHASES.add("rollout/model_tokens", float(sum(sum(m) for m in tool_mask) if tool_mask is not None
                                                 else sum(len(c) for c in completion_ids)))
        return out


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    try:
        add_response_schema(tokenizer)
    except ValueError:  # "Unrecognized chat template": the built-in tokenizer's
        tokenizer.response_template = hermes_response_template(tokenizer)
    tools = [load_tool(t) for t in spec["tools"]]
    rows = []
    for r in base.records(spec):
        prompt = r["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        rows.append({"prompt": messages, "prompt_text": text, "ground_truth": r["ground_truth"]})
    return base.train(spec, ToolTrainer, reward_funcs=trajectory_reward(resolve_reward_fn(spec["reward"])),
                      train_dataset=Dataset.from_list(rows), processing_class=tokenizer, tools=tools)


if __name__ == "__main__":
    base.leave(main())
