"""Agentic RL with a tool: `shardwise rl` (HF and vLLM engines) against TRL's `GRPOTrainer(tools=[...])`.

The tool task, builtin:calc (products of 3-digit numbers, which a tiny model cannot
compute; its tool ``shardwise.agents.builtin:calculator``), as the same GRPO job on each
side, from the same SFT model (examples/sft_tools.yaml's; the RL config is
benchmarks/agentic.yaml, `--config`), each with `--nproc` CPU
processes, `--seeds` times per side (seeds run.seed, run.seed + 1, ...; each figure the
mean and the range over seeds):

- shardwise: ``python -m shardwise.cli rl benchmarks/agentic.yaml --nproc N`` with
  rl.multi_turn on, once per rollout engine (``--engines hf,vllm``), read from its
  metrics.jsonl and recorded batches (`rl_vs_trl.run_shardwise`);
- TRL 1.16: `_trl_agentic_worker.py` (`rl_vs_trl`'s `_trl_grpo_worker` with TRL's tool
  loop) under ``torch.distributed.run`` in TRL's own venv (``--venv``, made as
  `rl_vs_trl.py` makes it).

Every shared setting is read from the shardwise config, as `rl_vs_trl.py` maps it (its
`settings` table: model, prompts in shardwise's sampler order, samples per prompt,
prompts per step, sampling, AdamW, schedule, clip ratios, KL, loss aggregation,
advantages), plus the multi-turn ones (`multi_turn_settings`): the response budget
(``rl.multi_turn.max_response_tokens``: the model's and the tools' tokens after the
prompt, TRL's ``max_completion_length``), the turns (``max_turns`` assistant turns, TRL's
``max_tool_calling_iterations = max_turns - 1`` tool rounds), the tools and the reward on
the trajectory's final answer.

How TRL 1.16 runs tools (read in its source, trl/trainer/grpo_trainer.py and
trl/chat_template_utils.py, with transformers 5.19):

- ``GRPOTrainer(tools=[fn, ...])`` takes plain functions (type hints and a Google-style
  docstring); their schemas come from transformers' ``get_json_schema`` (as shardwise's
  `load_tools` derives them) and reach the chat template as ``apply_chat_template(...,
  tools=...)``. The prompts must be conversational (lists of messages): TRL parses tool
  calls only then.
- Tool calls are parsed by ``tokenizer.parse_response(ids, prefix=prompt_ids, tools=...)``
  with a response template (transformers >= 5.13). ``add_response_schema`` sets one only
  for chat templates it knows byte for byte (Qwen2.5/3/3.5, Llama 3.1/3.2, GPT-OSS,
  GLM-4-MoE, ...) and raises "Unrecognized chat template" otherwise. The built-in character
  tokenizer's template is not among them, so the worker sets one itself
  (`_trl_agentic_worker.hermes_response_template`: text, then any number of Hermes
  ``<tool_call>{json}</tool_call>`` blocks after the template's generation prompt, up to
  eos), the route TRL's error message names. A call that does not parse (bad JSON) makes
  TRL fall back to the decoded text: no call, no error counted.
- TRL requires a template that renders tool calls and tool turns (``supports_tool_calling``:
  the call's name, arguments and the tool's content must appear) and that is prefix
  preserving; else it swaps in its own training template (only for templates it knows).
  The tool turn's ids are the delta of the template's rendering of a dummy conversation
  with and without the tool messages, cut after the last eos (``_get_tool_suffix_ids``),
  appended to prompt + completion ids (no re-tokenization), as shardwise's loop does.
- The loop (``_tool_call_loop``): after each generation round, the completions with calls
  run them, each call in turn, in the trainer's process (a sync tool inline; async tools
  of one completion gathered), then generate again for those completions only, one row per
  trajectory, with ``max_completion_length`` new tokens each round, then cut to the
  budget; a tool result that would overflow the budget ends the trajectory. A tool that
  raises becomes ``{"error": ...}`` for the model; nothing bounds a tool that hangs, and a
  tool that kills the process kills the rank. ``tool_mask`` (1 on model tokens, 0 on tool
  results) multiplies the completion mask of the loss; TRL's ``completions/*_length``
  count model tokens only.
- The reward functions get ``completions`` as the list of messages of each trajectory
  (assistant turns with ``tool_calls``, tool turns); the worker scores the content of the
  last assistant message with shardwise's reward function, as shardwise scores
  ``final_answer``.

Tokenizer: the built-in character tokenizer's tools variant (examples/sft_tools.yaml's
model; its template renders Hermes calls and tool turns), on both sides. TRL's own
tokenization is replaced by shardwise's `encode_prompt` (tools passed), as rl_vs_trl does
for plain prompts, so both sides ask the same ids.

Figures (each side; steps after the first for per-step figures): time to TRL's final mean
reward (shardwise's wall time until its trailing `--window`-step mean reward first reaches
the same seed's TRL final mean reward, over TRL's train time: the issue's target <= 0.5),
s / step, start-up and whole-run wall time, rollout tokens / s (model-generated tokens of
the whole job over the generation time less the tool time: HF generate on TRL's side and
shardwise's hf engine, vLLM on shardwise's vllm engine), the tools' share of a step
(``time/tools`` / step time: the issue's target < 10% with a tool that sleeps 50 ms,
``--sleep-tool``; shardwise's ``time/tools`` is the time its rollout waited on the tools,
whose calls run while the engine still generates the turn's other rows), tool calls per trajectory, and the padding share of the multi-turn
update forwards (shardwise: its recorded batches laid out as its update lays them out,
packed; TRL: counted in its loss forwards; target < 15% with packing).

    python benchmarks/agentic.py                       # 3 seeds x (TRL, shardwise hf, shardwise vllm)
    python benchmarks/agentic.py --seeds 1 --steps 20  # a short run
    python benchmarks/agentic.py --sleep-tool          # the 50 ms tool: agentic_sleep_tool.{md,json,png}

The kept figures and their command are in results/agentic/ (its README; benchmarks/README.md
quotes every run).

Needs the SFT model (`shardwise train examples/sft_tools.yaml --nproc 2`, or --model).
Writes agentic.{json,md,png} (``--sleep-tool``: agentic_sleep_tool.*) to --out (default
results/agentic) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

from harness import over_seeds, pyplot, seeds_table, show, time_to_reach, trailing_mean, unreached_note
from rl_vs_trl import (
    REPO,
    Setting,
    ensure_venv,
    installed,
    run_shardwise,
    run_trl,
    settings,
    summarise,
    venv_versions,
)

from shardwise.config import Config, load_config

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_trl_agentic_worker.py"
CONFIG = HERE / "agentic.yaml"
"""The GRPO stage of the tool demo (builtin:calc from examples/sft_tools.yaml's model)."""
SLEEP_TOOL = "benchmarks._agentic_tools:calculator"
"""--sleep-tool: the built-in calculator after a 50 ms sleep (same name, schema and answers)."""
TARGET_TIME_RATIO = 0.5
TARGET_TOOLS_SHARE = 0.10
TARGET_PADDING_SHARE = 0.15


# ---------------------------------------------------------------------- the settings


def multi_turn_settings(cfg: Config) -> tuple[list[Setting], dict[str, Any]]:
    """The multi-turn settings both sides share (table rows) and the GRPOConfig fields they
    set. Raises SystemExit naming the key for what TRL's tool loop cannot do the same way."""
    mt = cfg.rl.multi_turn
    unsupported = [
        ("rl.multi_turn.enabled", not mt.enabled, "the benchmark compares multi-turn tool use"),
        ("rl.environment", cfg.rl.environment is not None, "this benchmark compares plain tools"),
        ("rl.multi_turn.tool_parser", mt.tool_parser != "hermes", "the TRL side parses Hermes calls"),
        ("rl.multi_turn.truncated_reward", mt.truncated_reward is not None,
         "TRL scores a truncated trajectory like any other"),
        ("rl.tools", not cfg.rl.tools, "a tool is needed"),
    ]
    for key, bad, why in unsupported:
        if bad:
            raise SystemExit(f"agentic: {key} is not comparable: {why}")
    rows = [
        Setting("response tokens", "rl.multi_turn.max_response_tokens", mt.max_response_tokens,
                "max_completion_length", mt.max_response_tokens,
                "the model's and the tools' tokens after the prompt, on both sides"),
        Setting("tokens per model turn", "rl.rollout.max_new_tokens (and what is left)", cfg.rl.rollout.max_new_tokens,
                "max_completion_length", mt.max_response_tokens,
                "TRL generates max_completion_length per round, then cuts to the budget"),
        Setting("assistant turns", "rl.multi_turn.max_turns", mt.max_turns, "max_tool_calling_iterations",
                mt.max_turns - 1, "TRL counts tool rounds: turns - 1"),
        Setting("tool calls", "rl.multi_turn.max_tool_calls", mt.max_tool_calls, "(none)", "unbounded",
                "TRL runs every call of a turn"),
        Setting("tool result tokens", "rl.multi_turn.max_tool_response_tokens", mt.max_tool_response_tokens,
                "(none)", "uncut", "the calculator's answers are short: no cut on either side"),
        Setting("tools", "rl.tools", list(cfg.rl.tools), "tools", list(cfg.rl.tools),
                "TRL: called in turn in the trainer process; shardwise: concurrently in worker processes"),
        Setting("tool timeout", "rl.tool_timeout_s", cfg.rl.tool_timeout_s, "(none)", "none", ""),
        Setting("call format", "rl.multi_turn.tool_parser", mt.tool_parser, "tokenizer.response_template",
                "Hermes (set by the worker)", "<tool_call>{json}</tool_call>"),
    ]
    fields = {"max_completion_length": mt.max_response_tokens, "max_tool_calling_iterations": mt.max_turns - 1}
    return rows, fields


def all_settings(cfg: Config, nproc: int, steps: int) -> tuple[list[Setting], dict[str, Any]]:
    """`rl_vs_trl.settings` with its single-turn rows replaced by the multi-turn ones."""
    mt_rows, fields = multi_turn_settings(cfg)
    base = settings(cfg, nproc, steps)
    out = []
    for s in base:
        if s.what == "response tokens":
            out += mt_rows
        elif s.what == "reward":
            out.append(dataclasses.replace(s, note="on the final answer: the last assistant turn's content, "
                                                   "calls removed (TRL: its parser's; shardwise: its loop's)"))
        elif s.what == "generation":
            out.append(dataclasses.replace(s, value="hf, vllm (--engines)", note="TRL: HF generate (its vLLM mode "
                                                                                  "does not run on CPU: rl_vs_trl.py)"))
        elif s.what == "prompt tokens":
            out.append(dataclasses.replace(s, field="(shardwise's encode_prompt, tools passed)",
                                           note="the chat template with the tools' schemas and its generation prompt"))
        else:
            out.append(s)
    return out, fields


# ---------------------------------------------------------------------- the numbers


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def derive(r: dict[str, Any], name: str, rows_per_step: int, nproc: int) -> None:
    """Add the agentic figures to a summarised run (steps after the first): rollout tokens
    / s, the tools' share of a step, tool calls per trajectory, turns per trajectory."""
    later = r["steps"][1:] if len(r["steps"]) > 1 else r["steps"]
    t = [0.0] + [s["t"] for s in r["steps"]]
    durations = [b - a for a, b in zip(t, t[1:])]
    later_durations = durations[1:] if len(durations) > 1 else durations
    gen = [s["phases"].get("time/generate", 0.0) - s["phases"].get("time/tools", 0.0) for s in later]
    tools = [s["phases"].get("time/tools", 0.0) for s in later]
    m = [s["metrics"] for s in later]
    if name == "trl":  # rank 0's counts; the ranks generate side by side
        tokens = [x.get("rollout/model_tokens", 0.0) * nproc for x in m]
        calls = _mean([x.get("tools/call_frequency") for x in m])
        turns = None
    else:
        tokens = [x.get("response_length/mean", 0.0) * rows_per_step for x in m]
        calls = _mean([x.get("tools/calls_per_trajectory") for x in m])
        turns = _mean([x.get("multi_turn/turns_mean") for x in m])
    r["rollout_tokens_per_s"] = sum(tokens) / sum(gen) if sum(gen) > 0 else None
    r["tools_s"] = statistics.fmean(tools)
    r["tools_share"] = sum(tools) / sum(later_durations) if sum(later_durations) > 0 else None
    r["calls_per_trajectory"] = calls
    r["turns_mean"] = turns


FIGURES = [  # (key in a run, column, format)
    ("time_ratio", "time to TRL's final reward / TRL's train time", ".2f"),
    ("step_s", "s / step", ".3f"),
    ("startup_s", "start-up s", ".1f"),
    ("train_s", "train s", ".1f"),
    ("wall_s", "wall s", ".1f"),
    ("first_reward", "reward, first window", ".3f"),
    ("final_reward", "final reward (last window)", ".3f"),
    ("rollout_tokens_per_s", "rollout tokens / s", ".0f"),
    ("tools_s", "time/tools s / step", ".3f"),
    ("tools_share", "tools' share of a step", ".1%"),
    ("calls_per_trajectory", "tool calls / trajectory", ".2f"),
    ("update_padding_share", "padding share, update", ".1%"),
]


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]], window: int) -> dict[str, dict[str, Any]]:
    """Each side's figures over the seeds (`spread`); the time ratio against the same seed's TRL run."""
    sides = sorted({n for runs in per_seed.values() for n in runs}, key=lambda n: (n != "trl", n))
    for runs in per_seed.values():
        trl = runs.get("trl")
        for r in runs.values():
            if "error" in r or not trl or "error" in trl:
                continue
            reach = time_to_reach(r, trl["final_reward"], window)
            r["s_to_trl_final_reward"] = reach
            r["time_ratio"] = None if reach is None else reach / trl["train_s"]
    return over_seeds(per_seed, sides, FIGURES, unreached=lambda r: "time_ratio" in r and r["time_ratio"] is None)


def table(agg: dict[str, dict[str, Any]], versions: dict[str, dict[str, str]]) -> str:
    def cell(name: str, key: str, a: dict[str, Any], text: str) -> str:
        if key != "time_ratio":
            return text
        return "1 (the reference)" if name == "trl" else unreached_note(text, a)

    lines = seeds_table(agg, FIGURES, "side", cell=cell)
    lines += ["", "Versions: " + "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in vs.items())
                                         for n, vs in versions.items()) + "."]
    return "\n".join(lines)


def verdicts(agg: dict[str, dict[str, Any]], sleep_tool: bool) -> str:
    out = []
    for name, a in agg.items():
        if name == "trl" or a["time_ratio"] is None and not a["unreached"]:
            continue
        ratio = a["time_ratio"]
        met = ratio is not None and not a["unreached"] and ratio["max"] <= TARGET_TIME_RATIO
        never = f", {a['unreached']} seed(s) never reached it" if a["unreached"] else ""
        out.append(f"- {name}: time to TRL's final mean reward / TRL's train time {show(ratio, '.2f')}{never}; "
                   f"target <= {TARGET_TIME_RATIO} on every seed: **{'met' if met else 'not met'}**.")
    for name, a in agg.items():
        if name == "trl" or a["tools_share"] is None:
            continue
        if sleep_tool:
            met = a["tools_share"]["max"] < TARGET_TOOLS_SHARE
            out.append(f"- {name}: time/tools {show(a['tools_share'], '.1%')} of a step with the 50 ms tool "
                       f"(TRL: {show(agg.get('trl', {}).get('tools_share'), '.1%')}); target < "
                       f"{TARGET_TOOLS_SHARE:.0%}: **{'met' if met else 'not met'}**.")
        if a["update_padding_share"] is not None:
            met = a["update_padding_share"]["max"] < TARGET_PADDING_SHARE
            out.append(f"- {name}: padding share of the multi-turn update {show(a['update_padding_share'], '.1%')}; "
                       f"target < {TARGET_PADDING_SHARE:.0%} with packing: **{'met' if met else 'not met'}**.")
    return "\n".join(out)


def plot(per_seed: dict[int, dict[str, dict[str, Any]]], path: Path, smooth: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    colors = {"trl": "tab:orange", "shardwise_hf": "tab:blue", "shardwise_vllm": "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.2))
    names = sorted({n for runs in per_seed.values() for n in runs}, key=lambda n: (n != "trl", n))
    bars = {}
    for name in names:
        color = colors.get(name, "tab:gray")
        runs = [per_seed[s][name] for s in per_seed if name in per_seed[s] and "error" not in per_seed[s][name]]
        if not runs:
            continue
        # reward per step: the mean over seeds (line) and its range (band)
        n = min(len(r["steps"]) for r in runs)
        curves = [trailing_mean([s["reward"] for s in r["steps"][:n]], smooth) for r in runs]
        xs = list(range(1, n + 1))
        axes[0].plot(xs, [statistics.fmean(c[i] for c in curves) for i in range(n)], color=color,
                     label=f"{name} ({len(runs)} seed(s))")
        axes[0].fill_between(xs, [min(c[i] for c in curves) for i in range(n)],
                             [max(c[i] for c in curves) for i in range(n)], color=color, alpha=0.2)
        for k, r in enumerate(runs):  # reward per wall-clock second: each seed
            axes[1].plot([s["t"] for s in r["steps"]], trailing_mean([s["reward"] for s in r["steps"]], smooth),
                         color=color, alpha=0.8, label=name if k == 0 else None)
        later = [s for r in runs for s in (r["steps"][1:] or r["steps"])]
        tools = statistics.fmean(s["phases"].get("time/tools", 0.0) for s in later)
        gen = statistics.fmean(s["phases"].get("time/generate", 0.0) for s in later) - tools
        bars[name] = (gen, tools, statistics.fmean(r["step_s"] for r in runs) - gen - tools)
    for ax, title, xlabel in zip(axes[:2], ("reward per step (mean over seeds, band: range)",
                                            "reward per wall-clock second (each seed)"),
                                 ("step", "seconds since the first step began")):
        ax.set_title(f"{title}; mean of {smooth} steps", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean reward")
        ax.legend(fontsize=8)
    ax = axes[2]
    bottom = [0.0] * len(bars)
    for i, (part, color) in enumerate((("generation (tools apart)", "tab:purple"), ("tools", "tab:red"),
                                       ("the rest of the step", "tab:gray"))):
        vals = [v[i] for v in bars.values()]
        ax.bar(list(bars), vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("seconds per step (steps after the first, mean over seeds)", fontsize=9)
    ax.set_ylabel("s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------- main


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, default=3, help="runs per side (seeds run.seed, run.seed + 1, ...)")
    p.add_argument("--config", type=Path, default=CONFIG, help="the shardwise RL config (multi-turn, with tools)")
    p.add_argument("--model", default=None, help="the SFT model folder (default: the config's model.path)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--engines", default="hf,vllm", help="shardwise's rollout engines, comma-separated")
    p.add_argument("--sleep-tool", action="store_true",
                   help=f"both sides call {SLEEP_TOOL} (the calculator after a 50 ms sleep) instead")
    p.add_argument("--set", dest="shardwise_set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for shardwise's runs (repeatable), e.g. rl.async.enabled=true")
    p.add_argument("--out", type=Path, default=REPO / "results" / "agentic")
    p.add_argument("--venv", type=Path, default=REPO / "results" / "venv-trl", help="TRL's venv")
    p.add_argument("--skip-trl-install", action="store_true", help="use --venv as it is")
    p.add_argument("--skip-trl", action="store_true", help="shardwise's side only")
    p.add_argument("--window", type=int, default=5, help="steps in the final mean reward")
    p.add_argument("--smooth", type=int, default=3, help="steps in the plot's moving average")
    p.add_argument("--timeout", type=float, default=3600)
    args = p.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    args.heldout_eval = False
    config = args.config.resolve()
    model = Path(args.model).resolve() if args.model else REPO / (load_config(config).model.path or "")
    if not (model / "config.json").is_file():
        raise SystemExit(f"agentic: no model folder at {model}: run `shardwise train examples/sft_tools.yaml "
                         "--nproc 2` or pass --model")
    engines = [e for e in args.engines.split(",") if e]
    variant = "agentic_sleep_tool" if args.sleep_tool else "agentic"
    tools = [f'rl.tools=["{SLEEP_TOOL}"]'] if args.sleep_tool else []
    seed0 = load_config(config).run.seed
    seeds = [seed0 + i for i in range(args.seeds)]

    versions = {"shardwise": {k: installed(k) for k in ("shardwise", "torch", "transformers", "ray", "vllm")}}
    py = None
    if not args.skip_trl:
        py = ensure_venv(args.venv, args.skip_trl_install)
        versions["trl"] = venv_versions(py)
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    setting_rows: list[Setting] = []
    for seed in seeds:
        overrides = [f"model.path={model}", "train.log_every=1", f"run.seed={seed}", *tools, *args.shardwise_set]
        cfg = load_config(config, [*overrides, f"train.max_steps={args.steps}"])
        setting_rows, fields = all_settings(cfg, args.nproc, args.steps)
        rows_per_step = cfg.train.global_batch_size * cfg.rl.rollout.n
        runs: dict[str, dict[str, Any]] = {}
        sides = ([] if args.skip_trl else ["trl"]) + [f"shardwise_{e}" for e in engines]
        for name in sides:
            ns = argparse.Namespace(**{**vars(args), "out": args.out / variant / f"seed_{seed}",
                                       "engine": name.removeprefix("shardwise_")})
            if name == "trl":
                r = run_trl(py, cfg, ns, WORKER, {"tools": list(cfg.rl.tools), "grpo_config": fields})
            else:
                r = run_shardwise(config, overrides, ns)
            if "error" not in r:
                summarise(r, args.window)
                derive(r, name, rows_per_step, args.nproc)
            runs[name] = r
            print(f"seed {seed} {name}: " + (f"unavailable: {r['error']}" if "error" in r else
                                             f"{r['step_s']:.3f} s/step, startup {r['startup_s']:.1f} s, wall "
                                             f"{r['wall_s']:.1f} s, final mean reward {r['final_reward']:.3f}, "
                                             f"tools {r['tools_share'] or 0:.1%} of a step"), flush=True)
        per_seed[seed] = runs
    agg = aggregate(per_seed, args.window)
    extra = f" with {' '.join(args.shardwise_set)}" if args.shardwise_set else ""
    head = (f"TRL `GRPOTrainer(tools=[...])` vs `shardwise rl {config.relative_to(REPO) if config.is_relative_to(REPO) else config}`"
            f"{extra} ({', '.join(engines)} engines), the tool "
            f"{'`' + SLEEP_TOOL + '` (the calculator after a 50 ms sleep)' if args.sleep_tool else 'of the config'}, "
            f"{args.steps} steps, {len(seeds)} seed(s) ({', '.join(map(str, seeds))}) per side, {args.nproc} CPU "
            f"processes each (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}), {platform.machine()} "
            f"{os.cpu_count()} CPUs. Each figure: the mean over seeds [min, max]; per-step figures over the steps "
            f"after the first; final reward: the mean of the last {args.window} steps.\n\n")
    md = head + table(agg, versions) + "\n\n" + verdicts(agg, args.sleep_tool)
    md += "\n\n| setting | shardwise key | value | TRL | value | note |\n|---|---|---|---|---|---|\n"
    md += "\n".join(f"| {s.what} | `{s.key}` | {s.value} | `{s.field}` | {s.trl_value} | {s.note} |"
                    for s in setting_rows)
    (args.out / f"{variant}.md").write_text(md + "\n")
    (args.out / f"{variant}.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "versions": versions,
         "settings": [s.__dict__ for s in setting_rows], "figures": agg,
         "runs": {str(k): v for k, v in per_seed.items()}}, indent=2, default=str) + "\n")
    plot(per_seed, args.out / f"{variant}.png", args.smooth)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
