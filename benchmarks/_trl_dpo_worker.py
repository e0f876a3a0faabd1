"""One rank of TRL's `DPOTrainer` for `dpo_vs_trl.py`; runs in the benchmark's TRL venv.

    python -m torch.distributed.run --standalone --nproc_per_node 2 benchmarks/_trl_dpo_worker.py SPEC.json

SPEC.json (written by `dpo_vs_trl.py`): the model folder, the pairs file, where to write,
``max_length``, ``steps``, ``beta``, ``lr`` and ``per_device_batch`` (the pairs over the
ranks: every step trains on all of them).

What is shardwise's here, imported from its source tree: the pairs' token ids
(`shardwise.data.pairs.encode_pairs`: ``[bos] + prompt`` then ``answer + eos``). They are
handed to TRL as text whose tokenization gives those ids (the prompt with the bos token's
text in front; TRL adds the eos to each answer), and before training the worker collates
TRL's first batch and checks that it holds exactly shardwise's ids: if TRL 1.16 tokenizes
otherwise, it stops with one line instead of comparing two different jobs. Everything
else (the reference, the loss, the optimizer) is TRL's.

Rank 0 writes one JSON line per optimizer step to SPEC["steps_path"]: ``step``, ``loss``,
``accuracy`` (TRL's rewards/accuracies), ``margin``, ``time``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import DPOConfig, DPOTrainer  # noqa: E402

from shardwise.data.pairs import encode_pairs  # noqa: E402


class StepLog(TrainerCallback):
    def __init__(self, path: str, rank: int):
        self.path, self.rank = Path(path), rank
        if rank == 0:
            self.path.write_text("")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.rank != 0 or not logs or "loss" not in logs:
            return
        line = {"step": state.global_step, "loss": logs["loss"], "accuracy": logs.get("rewards/accuracies"),
                "margin": logs.get("rewards/margins"), "time": time.time()}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    tok = AutoTokenizer.from_pretrained(spec["model"])
    pairs = [json.loads(x) for x in Path(spec["pairs_path"]).read_text().splitlines()]
    want = encode_pairs(tok, [{**p, "margin": None, "where": "pairs"} for p in pairs], spec["max_length"])
    bos = tok.bos_token or ""
    data = Dataset.from_list([{"prompt": bos + p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]}
                              for p in pairs])
    config = DPOConfig(
        output_dir=spec["output_dir"], per_device_train_batch_size=spec["per_device_batch"],
        gradient_accumulation_steps=1, max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        adam_epsilon=1e-8, max_grad_norm=1.0, beta=spec["beta"], loss_type="sigmoid", logging_steps=1,
        save_strategy="no", report_to=[], max_length=spec["max_length"], seed=0, bf16=False, fp16=False,
        use_cpu=True, dataloader_drop_last=False, remove_unused_columns=False)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tok)
    rank = trainer.accelerator.process_index
    # the premise: TRL's tokens of each pair are shardwise's
    row = trainer.train_dataset[0]
    got_c = [*(row.get("prompt_ids") or row.get("prompt_input_ids") or []),
             *(row.get("chosen_ids") or row.get("chosen_input_ids") or [])]  # TRL 1.x's names, then 0.x's
    want_c = want[0]["chosen"]["input_ids"]
    if got_c != want_c:
        raise SystemExit(f"dpo_vs_trl: TRL's tokens of pair 0 (chosen) are {got_c}, shardwise's {want_c}; "
                         f"the two runs would not train on the same ids (TRL's columns: {sorted(row)})")
    trainer.add_callback(StepLog(spec["steps_path"], rank))
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
