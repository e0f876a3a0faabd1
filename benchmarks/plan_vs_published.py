"""`shardwise plan --hardware` against published throughput: the plan's projected tokens/s
per GPU for runs whose configuration and hardware were published, side by side with the
published figure.

Runs (each source's numbers quoted in RUNS below):
- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, commit
  9dec370 of 2024-12-26 measured; the page is in the repository's benchmarks/ folder):
  Llama 3.1 8B, FSDP only, seq 8192, local batch 2, selective activation checkpointing,
  bf16 (fp32 reduce), on 8 H100 (Table 1) and on 128 H100 (Table 3), each without and
  with torch.compile. Hardware: Grand Teton hosts, 8 H100 SXM at 500 W, 96 GB HBM2e,
  400 Gb/s RDMA per GPU (benchmarks/plan_configs/h100_grand_teton.yaml).
- Trainy on WhiteFiber, torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md:
  Llama 3.1 8B, FSDP, local batch 2, torch.compile and Float8 linears with Float8
  all-gather, on 4 and 8 hosts of 8 H200 (400 Gb/s per GPU).

The MFU each row assumes, and where it comes from, is in the table: the h100 profile's
default (itself taken from the 8-GPU row: that row agrees by construction up to the
exposed communication the model adds), the page's 39% with compile, and for the Float8
H200 runs an MFU fitted to the 4-host row (bf16 MFU means nothing there), so only the
8-host row and the ratios are predictions. The checks the issue asks for: every
torchtitan row within 25% of the published tokens/s per GPU, and the 128-GPU / 8-GPU
ratio within 5% of the published one.

Writes plan_vs_published.{md,json} to --out (default results/plan_vs_published) and
prints the table. Runs in a few seconds (meta-device models, no GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from shardwise.config import load_config  # noqa: E402
from shardwise.config.validate import check_sft_batch, mesh_spec  # noqa: E402
from shardwise.fsdp.build import plan_for  # noqa: E402
from shardwise.fsdp.comm import step_comm  # noqa: E402
from shardwise.fsdp.plan import build_plan  # noqa: E402
from shardwise.fsdp.projection import load_hardware, project  # noqa: E402

CONFIGS = REPO / "benchmarks" / "plan_configs"
TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TRAINY = "torchtitan benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"

RUNS = [
    # name, config, hardware, GPUs, published tokens/s/GPU, source, MFU (None: the profile's default), MFU source
    ("llama3.1-8b fsdp", "torchtitan_llama3_8b.yaml", "h100_grand_teton.yaml", 8, 5762, f"{TT}, Table 1",
     None, "profile default (from this row)"),
    ("llama3.1-8b fsdp", "torchtitan_llama3_8b.yaml", "h100_grand_teton.yaml", 128, 5605, f"{TT}, Table 3",
     None, "profile default (from the 8-GPU row)"),
    ("llama3.1-8b fsdp+compile", "torchtitan_llama3_8b.yaml", "h100_grand_teton.yaml", 8, 6667, f"{TT}, Table 1",
     0.39, "the page's footnote: 39% with compile"),
    ("llama3.1-8b fsdp+compile", "torchtitan_llama3_8b.yaml", "h100_grand_teton.yaml", 128, 6514, f"{TT}, Table 3",
     0.39, "the page's footnote: 39% with compile"),
    ("llama3.1-8b fsdp+compile+float8", "torchtitan_llama3_8b.yaml", "h200", 32, 10938, TRAINY,
     "fit", "fitted to this row (Float8: bf16 MFU does not apply)"),
    ("llama3.1-8b fsdp+compile+float8", "torchtitan_llama3_8b.yaml", "h200", 64, 10753, TRAINY,
     "fit", "fitted to the 4-host row"),
]
RATIOS = [  # (label, row index of the larger run, row index of the smaller)
    ("fsdp 128 / 8 GPUs", 1, 0), ("fsdp+compile 128 / 8 GPUs", 3, 2), ("h200 float8 64 / 32 GPUs", 5, 4)]


class Planner:
    """One meta model per config; a plan and its communication per world size (cached:
    fitting an MFU projects the same plan many times)."""

    def __init__(self) -> None:
        self.models: dict[str, object] = {}
        self.plans: dict[tuple[str, str, int], tuple] = {}

    def projection(self, config: str, hardware: str, world: int, mfu: float | None):
        key = (config, hardware, world)
        if key not in self.plans:
            self.plans[key] = self._plan(config, hardware, world)
        model, plan, hw = self.plans[key]
        return project(model, plan, plan.comm, hw, mfu)

    def _plan(self, config: str, hardware: str, world: int):
        """Each rank keeps the config's local batch (its step at 8 GPUs); the global batch
        grows with the data-parallel size, as in the published runs."""
        cfg = load_config(str(CONFIGS / config), [])
        spec = mesh_spec(cfg.parallel, world)
        local = cfg.train.micro_batch_size * check_sft_batch(cfg.train, mesh_spec(cfg.parallel, 8).dp_size)
        cfg = load_config(str(CONFIGS / config), [f"train.global_batch_size={local * spec.dp_size}"])
        if config not in self.models:
            self.models[config], _ = plan_for(cfg, spec)
        model = self.models[config]
        plan = build_plan(model, cfg, spec)
        hw_path = CONFIGS / hardware
        hw = load_hardware(str(hw_path) if hw_path.is_file() else hardware)
        plan.comm = step_comm(model, plan, spec, accumulation=check_sft_batch(cfg.train, spec.dp_size),
                              micro_batch_size=cfg.train.micro_batch_size, max_length=cfg.data.max_length,
                              gpus_per_node=hw.gpus_per_node)
        return model, plan, hw


def fit_mfu(planner: Planner, config: str, hardware: str, world: int, target: float) -> float:
    """The MFU at which the projection gives `target` tokens/s per GPU (bisection)."""
    lo, hi = 0.01, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        if planner.projection(config, hardware, world, mid).tokens_per_s_per_gpu < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "results" / "plan_vs_published")
    args = p.parse_args()
    t0 = time.perf_counter()
    planner = Planner()
    rows = []
    fitted: float | None = None
    for name, config, hardware, world, published, source, mfu, mfu_source in RUNS:
        if mfu == "fit":
            if fitted is None:
                fitted = fit_mfu(planner, config, hardware, world, published)
            mfu = fitted
        proj = planner.projection(config, hardware, world, mfu)
        got = proj.tokens_per_s_per_gpu
        rows.append({"run": name, "gpus": world, "hardware": proj.hardware, "published_tokens_per_s_per_gpu": published,
                     "projected_tokens_per_s_per_gpu": round(got, 1), "off": got / published - 1,
                     "mfu": round(proj.mfu, 4), "mfu_source": mfu_source, "step_s": proj.step_s,
                     "compute_s": proj.compute_s, "exposed_comm_s": proj.exposed_comm_s,
                     "comm_s": proj.comm_s, "fits": proj.fits, "memory_gib": proj.memory_bytes / 2**30,
                     "source": source})
    ratios = []
    for label, big, small in RATIOS:
        pub = rows[big]["published_tokens_per_s_per_gpu"] / rows[small]["published_tokens_per_s_per_gpu"]
        got = rows[big]["projected_tokens_per_s_per_gpu"] / rows[small]["projected_tokens_per_s_per_gpu"]
        ratios.append({"ratio": label, "published": pub, "projected": got, "off": got / pub - 1})
    torchtitan = [r for r in rows if r["source"].startswith(TT)]
    checks = {"every torchtitan row within 25%": all(abs(r["off"]) <= 0.25 for r in torchtitan),
              "fsdp 128/8 ratio within 5%": abs(ratios[0]["off"]) <= 0.05}
    md = _markdown(rows, ratios, checks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_vs_published.md").write_text(md)
    (args.out / "plan_vs_published.json").write_text(json.dumps(
        {"rows": rows, "ratios": ratios, "checks": checks}, indent=2) + "\n")
    print(md)
    print(f"wrote {args.out}/plan_vs_published.{{md,json}} in {time.perf_counter() - t0:.1f} s")
    return 0 if all(checks.values()) else 1


def _markdown(rows: list[dict], ratios: list[dict], checks: dict[str, bool]) -> str:
    lines = ["# shardwise plan --hardware vs published tokens/s per GPU", "",
             "| run | GPUs | hardware | published | projected | off | MFU | MFU from | step s | exposed comm s "
             "| all comm s | fits (plan's memory) |",
             "|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['gpus']} | {r['hardware']} | {r['published_tokens_per_s_per_gpu']:,} | "
                     f"{r['projected_tokens_per_s_per_gpu']:,.0f} | {r['off']:+.1%} | {r['mfu']:.3f} | "
                     f"{r['mfu_source']} | {r['step_s']:.3f} | {r['exposed_comm_s']:.3f} | {r['comm_s']:.3f} | "
                     f"{'yes' if r['fits'] else 'no'} ({r['memory_gib']:.0f} GiB) |")
    lines += ["", "| ratio | published | projected | off |", "|---|---:|---:|---:|"]
    lines += [f"| {r['ratio']} | {r['published']:.4f} | {r['projected']:.4f} | {r['off']:+.1%} |" for r in ratios]
    lines += ["", "Checks: " + "; ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in checks.items()), "",
              "Sources: " + "; ".join(sorted({r['source'] for r in rows})) + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
