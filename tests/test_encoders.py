"""Encoder models (seed 002: BERT under FSDP): ``model.task`` masked_lm and
sequence_classification trained by `shardwise train`.

What is checked here: FSDP1's strategy names as aliases; BERT's masking (rates, special
tokens never chosen, the same masks whatever the data-parallel split); the plan's units
for BERT; the one-line errors of a task that does not fit the model, the data or the
command; a 2-rank CLI run whose loss falls and whose export (live and offline) loads in
plain transformers with equal weights; the export of each task from a sharded model.
Parity with the unsharded run is in tests/test_parity.py (rows ``encoder_*``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from dist.common import FP32, TINY_BERT, batch_kind, full_params, micro_batches_of
from dist.launcher import run_cli, run_ranks

from shardwise.config import load_config
from shardwise.config.schema import canonical_strategy
from shardwise.config.validate import mesh_spec
from shardwise.data.collate import IGNORE_INDEX
from shardwise.data.encoder import EncoderData, collate, mask_tokens
from shardwise.data.tokenizer import CHAR_VOCAB_SIZE, build_char_tokenizer
from shardwise.errors import ConfigError, DataError
from shardwise.fsdp.build import plan_for
from shardwise.jobs import export, infer, rl, sft

TINY_QWEN3_CFG = ("model.config={model_type: qwen3, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
                  "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 8, vocab_size: 64}")


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _empty_yaml(folder: Path) -> Path:
    """A config file that sets nothing (the tests give every key as an override)."""
    path = folder / "config.yaml"
    path.write_text("{}\n")
    return path


@pytest.fixture(scope="module")
def mlm_data(tmp_path_factory) -> Path:
    """Texts a tiny MLM can learn from: one random 3-letter word repeated five times, so a
    masked letter is readable from the other repeats."""
    r = random.Random(0)
    words = ["".join(r.choice("abcdefgh") for _ in range(3)) for _ in range(256)]
    return _write_jsonl(tmp_path_factory.mktemp("mlm") / "mlm.jsonl", [{"text": " ".join([w] * 5)} for w in words])


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(("given", "stored"), [
    ("FULL_SHARD", "full_shard"), ("SHARD_GRAD_OP", "shard_grad_op"), ("NO_SHARD", "no_shard"),
    ("Hybrid_Shard", "hybrid_shard"), ("ShardingStrategy.SHARD_GRAD_OP", "shard_grad_op"),
    ("full_shard", "full_shard"), ("zero3", "zero3"), (3, 3),
])
def test_canonical_strategy(given, stored):
    assert canonical_strategy(given) == stored


def test_fsdp1_strategy_names_are_stored_canonical():
    cfg = load_config(None, ["parallel.sharding_strategy=SHARD_GRAD_OP"])
    assert cfg.parallel.sharding_strategy == "shard_grad_op"
    assert mesh_spec(cfg.parallel, 2).strategy == "shard_grad_op"
    hybrid = load_config(None, ["parallel.sharding_strategy=HYBRID_SHARD", "parallel.fsdp_size=2"])
    assert mesh_spec(hybrid.parallel, 4).shape == (2, 2)
    with pytest.raises(ConfigError, match=r"parallel.sharding_strategy.*did you mean shard_grad_op"):
        load_config(None, ["parallel.sharding_strategy=SHARD_GRAD"])


# ------------------------------------------------------------------ data


def test_mask_tokens_is_bert_masking_deterministic_per_example():
    special, mask_id = {0, 1, 2}, 99
    ordinary = torch.arange(3, 90)
    ids = [1] + list(range(3, 53)) + [2]
    chosen = as_mask = as_random = 0
    for i in range(400):
        inputs, labels = mask_tokens(ids, special, mask_id, ordinary, seed=7, index=i)
        assert (inputs, labels) == mask_tokens(ids, special, mask_id, ordinary, seed=7, index=i)
        assert labels[0] == labels[-1] == IGNORE_INDEX and inputs[0] == 1 and inputs[-1] == 2
        for t, (x, y) in enumerate(zip(inputs, labels)):
            if y == IGNORE_INDEX:
                assert x == ids[t]
                continue
            assert y == ids[t]
            chosen += 1
            as_mask += x == mask_id
            as_random += x != mask_id and x != ids[t]
    # 20,000 maskable positions: the standard deviation of the chosen share is 0.25%
    assert 0.14 < chosen / 20000 < 0.16
    assert 0.77 < as_mask / chosen < 0.83
    assert 0.07 < as_random / chosen < 0.115  # a random draw may hit the token itself (1/87)
    assert mask_tokens(ids, special, mask_id, ordinary, 7, 0) != mask_tokens(ids, special, mask_id, ordinary, 7, 1)
    assert mask_tokens(ids, special, mask_id, ordinary, 7, 0) != mask_tokens(ids, special, mask_id, ordinary, 8, 0)
    # every example with a maskable token gets at least one loss position
    for i in range(50):
        assert sum(y != IGNORE_INDEX for y in mask_tokens([1, 5, 2], special, mask_id, ordinary, 0, i)[1]) == 1


def test_encoder_data_same_rows_whatever_the_split(tmp_path, mlm_data):
    tok = build_char_tokenizer(tmp_path / "tok", encoder=True)
    assert (tok.mask_token_id, tok.cls_token_id, tok.sep_token_id) == (CHAR_VOCAB_SIZE, 1, 2)
    assert tok("ab")["input_ids"] == [1, 19, 20, 2]
    cfg = load_config(None, [TINY_BERT, "model.task=masked_lm", f"data.source={mlm_data}", "train.global_batch_size=8",
                             "train.micro_batch_size=2", "data.max_length=12"])
    records = sft.prepare(cfg, world_size=2).records
    one = EncoderData(cfg, records, tok, 0, 1)
    halves = [EncoderData(cfg, records, tok, r, 2) for r in range(2)]
    for _ in range(3):
        mbs, n_loss, _ = one.next_step()
        split = [h.next_step() for h in halves]
        assert all(s[1] == n_loss for s in split)
        rows = torch.cat([mb["input_ids"] for mb in mbs])
        assert torch.equal(rows, torch.cat([mb["input_ids"] for s in split for mb in s[0]]))
        labels = torch.cat([mb["labels"] for mb in mbs])
        assert int((labels != IGNORE_INDEX).sum()) == n_loss > 0
        assert rows.shape[1] == 12 and bool((rows == tok.mask_token_id).any())  # cut to max_length, masked
        assert bool((rows[:, -1] == 2).all())  # the closing token survives the cut


def test_classification_batches_carry_one_label_per_row():
    batch = collate([{"input_ids": [1, 5, 2], "labels": 2}, {"input_ids": [1, 2], "labels": 0}], pad_id=0)
    assert batch["labels"].tolist() == [2, 0]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]


def test_non_persistent_buffers_are_broadcast_in_one_order_on_every_rank():
    """Rank 0 broadcasts the non-persistent buffers (BERT: position_ids, token_type_ids, one
    shape) in this order and every rank receives in its own: the order must not be a set's,
    which differs between processes started apart (torchrun) by their hash seeds. Seen as
    rank 1 of a `shardwise train` BERT run getting zero position ids."""
    from torch import nn

    from shardwise.models.loading import non_persistent_buffers

    mod = nn.Module()
    names = [f"b{i:02d}_{c}" for i, c in enumerate("zyxwvutsrqponmlkjihgfedcba")][::-1]
    for n in names:
        mod.register_buffer(n, torch.zeros(1), persistent=False)
    root = nn.Module()
    root.add_module("emb", mod)
    assert non_persistent_buffers(root) == [f"emb.{n}" for n in sorted(names)]


# ------------------------------------------------------------------ plan and errors


def test_plan_wraps_bert_layers():
    spec = mesh_spec(load_config(None, []).parallel, 2)
    mlm = plan_for(load_config(None, [TINY_BERT, "model.task=masked_lm"]), spec, "masked_lm")[1]
    # BertEmbeddings (in _no_split_modules) would split the decoder weight it shares: left in the root
    assert [u.path for u in mlm.units] == ["bert.encoder.layer.0", "bert.encoder.layer.1", ""]
    assert any("bert.embeddings" in n and "tie_word_embeddings" in n for n in mlm.warnings)
    cls_cfg = load_config(None, [TINY_BERT, "model.task=sequence_classification", "fsdp.wrap.classes=[BertLayer]"])
    cls = plan_for(cls_cfg, spec, "sequence_classification")[1]
    assert [u.path for u in cls.units] == ["bert.encoder.layer.0", "bert.encoder.layer.1", ""]
    default = plan_for(load_config(None, [TINY_BERT, "model.task=sequence_classification"]), spec,
                       "sequence_classification")[1]
    assert [u.path for u in default.units] == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", ""]


def test_tasks_that_do_not_fit_are_one_line_errors(tmp_path, mlm_data):
    def prepare(*overrides, job=sft):
        return job.prepare(load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides]), world_size=2)

    with pytest.raises(ConfigError, match=r"'model.task'.*causal_lm.*encoder.*did you mean masked_lm") as e:
        prepare(TINY_BERT, f"data.source={mlm_data}")  # task causal_lm (the default) on a BERT config
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"'model.task'.*masked_lm.*qwen3.*did you mean causal_lm"):
        prepare(TINY_QWEN3_CFG, "model.task=masked_lm", f"data.source={mlm_data}")
    with pytest.raises(DataError, match=r"data.text_key: key 'words' not found.*'text'"):
        prepare(TINY_BERT, "model.task=masked_lm", f"data.source={mlm_data}", "data.text_key=words")
    labelled = _write_jsonl(tmp_path / "cls.jsonl", [{"text": "ab", "label": 1}, {"text": "cd", "label": 3}])
    with pytest.raises(DataError, match=r"data.label_key: .* row 1: label '3' is not a class .*0 .. 2"):
        prepare(TINY_BERT, "model.task=sequence_classification", f"data.source={labelled}",
                "train.global_batch_size=2", "train.micro_batch_size=1")
    with pytest.raises(ConfigError, match=r"'data.packing'"):
        prepare(TINY_BERT, "model.task=masked_lm", f"data.source={mlm_data}", "data.packing=true")
    causal_tok = tmp_path / "causal_tok"
    build_char_tokenizer(causal_tok)
    with pytest.raises(ConfigError, match=r"'model.tokenizer'.*no mask token"):
        prepare(TINY_BERT, "model.task=masked_lm", f"data.source={mlm_data}", f"model.tokenizer={causal_tok}")
    with pytest.raises(ConfigError, match=r"'model.task'.*`shardwise infer`.*causal LM"):
        prepare(TINY_BERT, "model.task=masked_lm", job=infer)
    with pytest.raises(ConfigError, match=r"'model.task'.*`shardwise rl`.*causal LM"):
        prepare(TINY_BERT, "model.task=sequence_classification", job=rl)


def test_cli_task_mismatch_exits_2_before_any_process(tmp_path, mlm_data):
    run_dir = tmp_path / "run"
    res = run_cli(["train", str(_empty_yaml(tmp_path)), "--nproc", "2", f"run.dir={run_dir}", TINY_BERT,
                   f"data.source={mlm_data}"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "'model.task'" in res.stderr and "masked_lm" in res.stderr and "Traceback" not in res.stderr
    assert not run_dir.exists()


# ------------------------------------------------------------------ end to end and export


def test_cli_masked_lm_trains_and_exports_for_plain_transformers(tmp_path, mlm_data):
    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from shardwise.models.loading import build_full_model

    run_dir = tmp_path / "run"
    overrides = [f"run.dir={run_dir}", TINY_BERT.replace("hidden_size: 32", "hidden_size: 64"),
                 "model.task=masked_lm", f"data.source={mlm_data}", "data.max_length=24", *FP32,
                 "train.global_batch_size=16", "train.micro_batch_size=8", "train.max_steps=16",
                 "train.optimizer.lr=3e-3", "train.scheduler.warmup_steps=2", "checkpoint.every_steps=0"]
    res = run_cli(["train", str(_empty_yaml(tmp_path)), "--nproc", "2", *overrides], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 16
    # ln(58) = 4.06 at the start; the letters' frequencies alone give about 2.2
    assert losses[0] > 3.8 and max(losses[-3:]) < 0.7 * losses[0], losses
    assert "held-out accuracy" not in res.stdout  # no generation for an encoder

    hf = run_dir / "hf"
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    model, info = AutoModelForMaskedLM.from_pretrained(hf, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    written = load_file(str(hf / "model.safetensors"))
    loaded = model.state_dict()
    assert written and all(torch.equal(loaded[k], v) for k, v in written.items())
    init = build_full_model(load_config(None, overrides).model, 0, "masked_lm").state_dict()
    assert not torch.equal(init["bert.encoder.layer.0.attention.self.query.weight"],
                           loaded["bert.encoder.layer.0.attention.self.query.weight"])  # trained, not the init
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok.mask_token == "<mask>" and tok("ab <mask>")["input_ids"][-2] == tok.mask_token_id

    # the offline export (`shardwise export`) of the final checkpoint takes the task from the run's config
    offline = tmp_path / "offline"
    export.run(export.prepare(str(run_dir / "checkpoints" / "step_00000016"), str(offline)))
    again = load_file(str(offline / "model.safetensors"))
    assert again.keys() == written.keys() and all(torch.equal(again[k], written[k]) for k in written)


def _export_each_task(rank: int, world: int, root: str) -> dict:
    from shardwise.checkpoint.hf_export import export_model
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.train import TrainEngine
    from shardwise.models.loading import load_hf_config

    runtime = init_distributed(timeout_s=60)
    out = {}
    for task in ("masked_lm", "sequence_classification"):
        cfg = load_config(None, [TINY_BERT, f"model.task={task}", *FP32, "train.optimizer.lr=1e-2",
                                 "train.scheduler.warmup_steps=0"])
        engine = TrainEngine(cfg, runtime, task=task)
        kind = batch_kind(task)
        for step in range(2):
            rows = kind.rows(step, 4, cfg.model.config)
            engine.train_step(micro_batches_of(rows, rank, world, 2), kind.count(rows), loss_fn=kind.loss_fn)
        export_model(engine.model, Path(root) / task, load_hf_config(cfg.model))
        params = full_params(engine.model)  # collective: every rank gathers
        out[task] = params if rank == 0 else None
    teardown()
    return out


def test_sharded_export_of_each_task_loads_with_equal_weights(tmp_path):
    from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

    got = run_ranks(_export_each_task, 2, str(tmp_path), timeout=180)[0]
    for task, auto in (("masked_lm", AutoModelForMaskedLM), ("sequence_classification",
                                                             AutoModelForSequenceClassification)):
        model, info = auto.from_pretrained(tmp_path / task, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (task, info)
        loaded = model.state_dict()
        live = got[task]
        assert loaded.keys() == live.keys(), task
        for k in live:
            assert torch.equal(loaded[k], live[k]), (task, k)
    assert model.classifier.out_features == 3
