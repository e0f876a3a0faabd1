"""What the commands print: the plan table, its communication and projected step, the
world-size scan of `shardwise plan`, and the summary each job prints when it ends.

One function per table, so `shardwise plan`, the jobs and anything else that shows a plan
(benchmarks, tests) print the same text. Units in the tables: bytes as KiB / MiB / GiB
(powers of 1024), communication in MiB per rank and optimizer step, times in s / ms / us.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from shardwise.config.schema import Config
from shardwise.engine.evaluate import eval_table
from shardwise.fsdp.plan import ShardingPlan
from shardwise.fsdp.projection import Hardware, Projection

__all__ = ["format_plan", "format_projection", "format_scan", "infer", "rl", "train"]

_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A"}


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def format_plan(plan: ShardingPlan) -> str:
    """The plan as a readable table (with its step's communication when `plan.comm` is set)."""
    m = plan.mesh
    lines = [
        f"world size {plan.world_size}  mesh {dict(zip(m.dim_names, m.shape))}  "
        f"strategy {m.strategy}  data-parallel {m.dp_size}  master dtype {plan.model_dtype}",
        "",
    ]
    head = ["#", "unit", "from", "param", "reduce", "output", "cast in", "store", "reshard", "offload", "recompute",
            "prefetch fwd/bwd", "params", "trainable"]
    rows = []
    for i, u in enumerate(plan.units):
        rows.append([
            str(i), u.path or "<root>", ",".join(u.sources), u.param_dtype, u.reduce_dtype,
            u.output_dtype or "-", "yes" if u.cast_forward_inputs else "no", u.storage_dtype, str(u.reshard_after_forward).lower(),
            "cpu" if u.offload else "-", "yes" if u.recompute else "-",
            f"{len(u.prefetch_forward)}/{len(u.prefetch_backward)}", f"{u.num_params:,}",
            f"{u.trainable_params:,}" if u.trainable_params else "-",
        ])
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines.append(fmt.format(*head))
    lines.append(fmt.format(*["-" * w for w in widths]))
    lines += [fmt.format(*r) for r in rows]
    extra = []
    if plan.ignored:
        extra.append("ignored (not sharded): " + ", ".join(plan.ignored))
    recompute_only = [p for p in plan.recompute if p not in {u.path for u in plan.units}]
    if recompute_only:
        extra.append("recompute (inside units): " + ", ".join(recompute_only))
    if plan.tiled_mlp:
        extra.append(f"tiled MLP ({plan.tiled_mlp_shards} slices of the sequence): " + ", ".join(plan.tiled_mlp))
    if plan.compiled:
        extra.append("compiled (torch.compile, one per unit): " + ", ".join(plan.compiled))
    if plan.buffer_casts:
        extra.append("layered precision: " + ", ".join(f"{p}={d}" for p, d in plan.buffer_casts.items()))
    if plan.frozen:
        extra.append(f"frozen parameters: {len(plan.frozen)}"
                     + (f" ({', '.join(plan.frozen[:3])}{', ...' if len(plan.frozen) > 3 else ''})"))
    if extra:
        lines += [""] + extra
    peak = {k: max(r[k] for r in plan.memory_per_rank_bytes) for k in plan.memory_per_rank_bytes[0]}
    lines += ["", "per-rank memory (largest rank; params + grads + AdamW state): "
              + "  ".join(f"{k} {_human_bytes(v)}" for k, v in peak.items())]
    if plan.lora is not None:
        lo = plan.lora
        with_, without = peak["total"], max(r["total"] for r in lo.memory_per_rank_bytes_without_lora)
        change = f"saves {1 - with_ / without:.0%}" if with_ <= without else f"adds {with_ / without - 1:.0%}"
        lines.append(f"LoRA (r={lo.r}, {len(lo.targets)} adapters on {len(lo.units)} units): trainable "
                     f"{lo.trainable_params:,} of {lo.total_params:,} parameters "
                     f"({lo.trainable_params / lo.total_params:.1%}); per-rank memory with LoRA "
                     f"{_human_bytes(with_)} vs {_human_bytes(without)} without ({change})")
    if plan.comm is not None:
        lines += _comm_lines(plan)
    for note in plan.warnings:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _comm_lines(plan: ShardingPlan) -> list[str]:
    """Per unit: MiB each rank moves per optimizer step by collective, what it sends, and
    which collectives cross nodes."""
    c = plan.comm
    head = ["unit", "AG MiB", "RS MiB", "AR MiB", "A2A MiB", "sent MiB", "network"]
    rows = []
    for uc in c.units:
        by = uc.bytes_by_kind()
        inter = sorted({_SHORT[x.kind] + {"forward": " fwd", "backward": " bwd"}.get(x.phase, "")
                        if x.kind == "all_gather" else _SHORT[x.kind] for x in uc.collectives if x.inter_node})
        net = "-" if not uc.collectives else ("inside nodes" if not inter else "between nodes: " + ", ".join(inter))
        rows.append([uc.path or "<root>", *[_mib(by[k]) for k in _SHORT], _mib(uc.wire_bytes()), net])
    total = c.bytes_per_step()
    rows.append(["total", *[_mib(total[k]) for k in _SHORT], _mib(sum(c.wire_bytes_per_step().values())), ""])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(("{:<%d}" if i in (0, 6) else "{:>%d}") % w for i, w in enumerate(widths))
    return ["", f"communication per optimizer step, per rank ({c.accumulation} micro-batch(es) of "
            f"{c.micro_batch_size} x {c.seq_len} tokens; {c.gpus_per_node} GPUs per node; buffer sizes, "
            "sent = ring wire bytes):",
            fmt.format(*head), fmt.format(*["-" * w for w in widths]), *[fmt.format(*r) for r in rows]]


def format_projection(proj: Projection, hw: Hardware) -> str:
    """The projected step in two lines."""
    fits = "fits" if proj.fits else "does NOT fit"
    return (f"projected on {hw.name} ({hw.description}), MFU {proj.mfu:.3f}: "
            f"{proj.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, step {_seconds(proj.step_s)} "
            f"(compute {_seconds(proj.compute_s)}, exposed communication {_seconds(proj.exposed_comm_s)}, "
            f"optimizer {_seconds(proj.optimizer_s)}; all communication {_seconds(proj.comm_s)})\n"
            f"memory per rank {_human_bytes(proj.memory_bytes)} (activations {_human_bytes(proj.activation_bytes)}) "
            f"of {_human_bytes(int(hw.memory_bytes))}: {fits}")


def format_scan(rows: Sequence[tuple[int, ShardingPlan, Projection]], hw: Hardware, accumulation: int,
                micro_batch_size: int) -> str:
    """`shardwise plan --scan`: one projected row per (world size, plan with its step's
    communication, projection); each rank runs `accumulation` micro-batches of
    `micro_batch_size` sequences per step."""
    head = ["world", "mesh", "tokens/s/GPU", "step", "compute", "exposed comm", "comm MiB/rank",
            "memory/rank", "fits"]
    table = [[str(w), "x".join(map(str, p.mesh.shape)), f"{pr.tokens_per_s_per_gpu:,.0f}", _seconds(pr.step_s),
              _seconds(pr.compute_s), _seconds(pr.exposed_comm_s), _mib(sum(p.comm.bytes_per_step().values())),
              _human_bytes(pr.memory_bytes), "yes" if pr.fits else "NO"] for w, p, pr in rows]
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    lines = [f"projected on {hw.name} ({hw.description}); MFU {rows[0][2].mfu:.3f}; {accumulation} micro-batch(es) "
             f"of {micro_batch_size} x {rows[0][1].comm.seq_len} tokens per rank and step",
             fmt.format(*head), fmt.format(*["-" * w for w in widths])]
    return "\n".join(lines + [fmt.format(*r) for r in table])


# ---------------------------------------------------------------------- a job's summary


def _print_paths(summary: dict, keys: Sequence[str]) -> None:
    for key in keys:
        if summary.get(key):
            print(f"  {key:<10} {summary[key]}")


def train(cfg: Config, summary: dict) -> None:
    """What `shardwise train` prints on rank 0 when it ends (`shardwise.jobs.sft.run`'s summary)."""
    final = summary["final"]
    if "loss" in final:
        print(f"done: {summary['steps']} steps, final loss {final['loss']:.4f}")
    else:  # a resume with nothing left to train, from a checkpoint that recorded no loss
        print(f"done: nothing left to train at step {summary['steps']}")
    if "accuracy" in summary:
        print(f"  held-out accuracy (greedy): {summary['accuracy']:.1%}")
    _print_eval(summary.get("val") or {})  # the last evaluation (val/loss, val/ppl, ...)
    if cfg.checkpoint.export_from == "best" and "exported_step" in summary:
        print(f"  exported the best checkpoint by {cfg.checkpoint.keep_best}: step {summary['exported_step']}")
    _print_paths(summary, ("metrics", "checkpoint", "adapter", "hf", "samples", "plot"))


def _print_eval(metrics: dict, title: str | None = None) -> None:
    """The evaluation's table (`eval_table`) under the summary's lines, indented; under
    `title` when given. Nothing without ``val/*`` figures."""
    table = eval_table(metrics)
    if not table:
        return
    if title is not None:
        print(f"  {title}")
    print(textwrap.indent(table, "    " if title is not None else "  "))


def infer(cfg: Config, s: dict) -> None:
    """What `shardwise infer` prints on rank 0 when it ends (`shardwise.jobs.infer.run`'s summary)."""
    mode = "greedy" if s["greedy"] else f"temperature {cfg.infer.temperature}, top_p {cfg.infer.top_p}"
    print(f"done: {s['prompts']} prompts x {s['samples_per_prompt']} ({mode}), {s['world_size']} ranks")
    if "accuracy" in s:
        print(f"  accuracy ({s['reward']}): {s['accuracy']:.1%}")
    elif "score_mean" in s:
        print(f"  mean score ({s['reward']}): {s['score_mean']:.4f}")
    if "multi_turn/turns_mean" in s:  # infer.multi_turn: ended_with_eos is then "not truncated"
        print(f"  trajectories: {s['multi_turn/turns_mean']:.2f} turns and {s['tools/calls_per_trajectory']:.2f} "
              f"tool calls each (mean), {s['tools/errors']:.0f} tool errors, {s['tools/timeouts']:.0f} timeouts, "
              f"{s['multi_turn/truncated']:.0%} truncated")
    print(f"  response length {s['response_length_mean']:.1f} tokens (mean), "
          f"{s['ended_with_eos']:.0%} ended with eos; {s['tokens_per_s']:.0f} tokens/s over {s['seconds']:.1f} s")
    _print_eval({k: v for k, v in s.items() if k.startswith("val/")})
    _print_paths(s, ("output", "summary", "samples"))


def rl(cfg: Config, summary: dict) -> None:
    """What `shardwise rl` prints when it ends (`shardwise.jobs.rl.run`'s summary)."""
    last = summary["history"][-1] if summary.get("history") else {}
    print(f"done: {summary['steps']} {cfg.rl.algorithm} steps"
          + (f", final reward {last['reward/mean']:.3f}" if last else ""))
    before, after = summary.get("accuracy_before"), summary.get("accuracy_after")
    if before is not None and after is not None:
        start = summary.get("resumed_from_step")
        label = "before RL" if not start else f"at step {start} (resumed)"
        print(f"  held-out accuracy (greedy): {label} {before:.1%}, after RL {after:.1%}")
        sb, sa = summary.get("sampled_before"), summary.get("sampled_after")
        if sb and sa:
            print(f"  held-out sampled (T={cfg.rl.rollout.temperature:g}): "
                  + ", ".join(f"{k} {sb[k]:.1%} -> {sa[k]:.1%}" for k in sb))
        tb, ta = summary.get("heldout_tools_before") or {}, summary.get("heldout_tools_after") or {}
        shares = [f"{kind} {tb[kind]['tools/share']:.1%} -> {ta[kind]['tools/share']:.1%}"
                  for kind in ("greedy", "sampled") if kind in tb and kind in ta]
        if shares:  # rl.multi_turn: how the answers were reached
            print("  held-out trajectories calling a tool: " + ", ".join(shares))
    if summary.get("eval"):  # the last evaluation's every figure (per data_source too)
        source = cfg.eval.source if cfg.eval.source is not None else f"{cfg.data.source}'s held-out prompts"
        _print_eval(summary["eval"], f"evaluation at step {summary['eval_step']} on {source}:")
    exported = summary.get("exported_step")
    if exported is not None:  # checkpoint.export_from: best
        print(f"  exported the best checkpoint by {cfg.checkpoint.keep_best}: step {exported}")
    timing = summary.get("timing") or {}
    if timing.get("time/step"):
        step_s = timing["time/step"]
        # rl.async: the generator's own seconds (generating, idle, swapping weights in, the
        # reference's forward) and the gather inside the publish are not phases of the
        # controller's step
        other = ("time/generate", "time/generator_wait", "time/weight_sync", "time/generator_ref",
                 "time/weight_gather") if "time/trainer_wait" in timing else ()
        phases = {k[5:]: v for k, v in timing.items() if k != "time/step" and k not in other}
        print(f"  seconds per step {step_s:.2f} (mean; "
              + ", ".join(f"{k} {v / step_s:.0%}" for k, v in phases.items()) + ")")
        if other:
            ref = timing.get("time/generator_ref")
            print(f"  generator per step: generating {timing.get('time/generate', 0.0):.2f} s, "
                  f"idle {timing.get('time/generator_wait', 0.0):.2f} s, swapping weights in "
                  f"{timing.get('time/weight_sync', 0.0):.2f} s"
                  + ("" if ref is None else f", reference forward {ref:.2f} s") + "; trainer waiting for batches "
                  f"{timing.get('time/trainer_wait', 0.0):.2f} s")
    startup = dict(summary.get("startup") or {})
    if "total" in startup:  # where the time before the first step went (time/startup/* in metrics.jsonl)
        total = startup.pop("total")
        print(f"  start-up {total:.1f} s to the first step ("
              + ", ".join(f"{k} {v:.1f}" for k, v in startup.items() if v >= 0.05) + ")")
    _print_paths(summary, ("metrics", "checkpoint", "adapter", "hf", "plot"))
