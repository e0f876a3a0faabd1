"""The HF engine's generation against plain HF ``generate`` on the same model and batch.

One process (a 1-rank gloo group), the long task's model (examples/grpo_long.yaml: the SFT
model of examples/sft_long.yaml, runs/sft_long/hf) and its rollout settings (99 new tokens,
temperature 1, top_p 1): ``--rows`` prompts of builtin:count (default 64: one rank's rows
of the job's 16 x 8 at --nproc 2). Timed, in interleaved rounds (median of ``--repeats``):

- ``engine``: `HFGenerator.generate_sequences` on the FSDP2 model (``TrainEngine.model``,
  what the RL rollout uses), greedy, sampled seeded per rank, and sampled per row
  (``arrays["sample_key"]``, what the RL controller sends: `RowSampler`);
- ``plain``: ``model.generate`` on an unsharded copy of the same weights, greedy and
  sampled (``top_k=0``), with and without ``output_logits`` (the engine needs the logits
  for the rollout log-probs).

Greedy rows generate the same tokens on both sides (the same work): the ratio there is the
engine's overhead. Sampled rows draw different samples (other lengths), so their time is
shown with the number of decoding steps (the widest response). On a GPU (one process, the
runtime's device) both sides decode there and the ratios are of wall time.

    PYTHONPATH=src python benchmarks/hf_generate.py [--model-path runs/sft_long/hf] [--rows 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessorList

from shardwise.config import load_config
from shardwise.data.batch import Batch
from shardwise.data.tasks import get_builtin_task
from shardwise.data.tokenizer import load_tokenizer, pad_token_id
from shardwise.distributed.runtime import init_distributed, teardown
from shardwise.engine.generate import HFGenerator, RowSampler, prompt_batch, row_seed, sample_keys
from shardwise.engine.train import TrainEngine
from shardwise.fsdp.gather import iter_full_tensors

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=str(REPO / "runs" / "sft_long" / "hf"))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (rows / n prompts)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a job's rank on 2 cores: 1)")
    args = ap.parse_args()
    if not (Path(args.model_path) / "config.json").exists():
        print(f"--model-path {args.model_path}: no HF model there; run `shardwise train examples/sft_long.yaml "
              "--nproc 2` first, or name another folder", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    cfg = load_config(str(REPO / "examples" / "grpo_long.yaml"), [f"model.path={args.model_path}"])
    runtime = init_distributed()
    actor = TrainEngine(cfg, runtime)
    device = runtime.device
    plain = AutoModelForCausalLM.from_config(actor.model.config).eval()
    plain.load_state_dict(dict(iter_full_tensors(actor.model)), strict=False)
    plain.to(device)  # the engine's device: on a GPU both sides decode there
    tok = load_tokenizer(args.model_path)
    pad, eos = pad_token_id(tok), tok.eos_token_id
    task = get_builtin_task(cfg.data.source)
    prompts = max(1, args.rows // args.n)
    uids = [f"b-{i}" for i in range(prompts)]
    batch = prompt_batch(tok, task.heldout_examples(prompts, 7), cfg.data.max_length, uids).repeat(args.n)
    keyed = batch.union(Batch.from_dict(arrays={"sample_key": sample_keys(uids, args.n)}))
    r = cfg.rl.rollout.max_new_tokens
    engine = HFGenerator(actor.model, cfg.rl.rollout, runtime, pad, eos)
    ids, mask = batch.tensors["prompt_ids"], batch.tensors["prompt_mask"]

    def run_engine(b: Batch, **meta) -> int:
        out = engine.generate_sequences(Batch(b.tensors, b.arrays, {**b.meta, "seed": 5, **meta}))
        return int(out.tensors["response_mask"].sum(-1).max())

    def run_plain(mode: str, logits: bool) -> int:
        """mode: greedy, sampled (HF's multinomial) or rows (greedy on RowSampler's forced
        token: the engine's per-row draws, the same tokens as the engine with sample_key)."""
        options = {"temperature": 1.0, "top_p": 1.0, "top_k": 0} if mode == "sampled" else {}
        processors = LogitsProcessorList([RowSampler([row_seed(5, k) for k in keyed.arrays["sample_key"]], 1.0, 1.0,
                                                     ids.shape[1], r)] if mode == "rows" else [])
        gen = GenerationConfig(do_sample=mode == "sampled", max_new_tokens=r, eos_token_id=eos, pad_token_id=pad,
                               use_cache=True, output_logits=logits, return_dict_in_generate=logits, **options)
        torch.manual_seed(5)
        with torch.no_grad():
            out = plain.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen,
                                 logits_processor=processors)
        seqs = out.sequences if logits else out
        if logits:  # what the engine does with them: the log-prob of each generated token
            gen_ids = seqs[:, ids.shape[1]:]
            torch.stack([torch.log_softmax(x.float(), -1).gather(-1, gen_ids[:, i:i + 1])[:, 0]
                         for i, x in enumerate(out.logits)], 1)
        return seqs.shape[1] - ids.shape[1]

    variants = {  # name: (call, the plain variant it is compared with)
        "plain greedy": (lambda: run_plain("greedy", False), None),
        "plain greedy + logits": (lambda: run_plain("greedy", True), None),
        "engine greedy (FSDP)": (lambda: run_engine(batch, greedy=True), "plain greedy + logits"),
        "plain sampled + logits": (lambda: run_plain("sampled", True), None),
        "engine sampled per rank (FSDP)": (lambda: run_engine(batch), "plain sampled + logits"),
        "plain RowSampler + logits": (lambda: run_plain("rows", True), "plain sampled + logits"),
        "engine sampled per row, sample_key (FSDP)": (lambda: run_engine(keyed), "plain RowSampler + logits"),
    }
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    wall: dict[str, list[float]] = {k: [] for k in variants}
    steps: dict[str, int] = {}
    for fn, _ in variants.values():  # warm-up
        fn()
    for _ in range(args.repeats):
        for name, (fn, _) in variants.items():
            w, c = time.perf_counter(), time.process_time()
            steps[name] = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            cpu[name].append(time.process_time() - c)
            wall[name].append(time.perf_counter() - w)
    # on a CPU the process's CPU seconds (other work on the machine does not count); on a
    # GPU the wall clock (the host mostly waits for the device)
    timed, clock = (wall, "wall") if device.type == "cuda" else (cpu, "CPU")
    med = {k: statistics.median(v) for k, v in timed.items()}
    print(f"{len(batch)} rows x {r} new tokens max, {args.threads} thread(s), {args.repeats} interleaved rounds, "
          f"model {args.model_path}, on {device} ({torch.__version__}); process CPU seconds (median) and wall "
          f"(median); ratios of {clock} time")
    print(f"{'variant':42s} {'CPU s':>7s} {'wall s':>7s} {'steps':>6s} {clock + ' ms/step':>12s}  vs")
    for name, (_, base) in variants.items():
        per_step = 1000 * med[name] / max(steps[name], 1)
        vs = ""
        if base is not None:  # per decoding step: sampled variants may decode different lengths
            ratio = (med[name] / max(steps[name], 1)) / (med[base] / max(steps[base], 1))
            vs = f"{ratio:.3f} x {base} (per step)"
        print(f"{name:42s} {statistics.median(cpu[name]):7.3f} {statistics.median(wall[name]):7.3f} "
              f"{steps[name]:6d} {per_step:12.2f}  {vs}")
    teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
