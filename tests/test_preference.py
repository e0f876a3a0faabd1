"""Preference optimisation and reward models (`shardwise train` with train.objective dpo /
reward_model): the losses against their formulas written out here, the pair checks, and
end-to-end runs (1 rank = 2 ranks, ln 2 at step 1, the precomputed reference = the frozen
copy, resume, a reward model learning a rule and exported as a classifier)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from dist.launcher import REPO_ROOT, at_once, run_cli

from shardwise.config.schema import DPOConfig
from shardwise.data.pairs import check_pairs, load_pairs
from shardwise.data.tokenizer import build_char_tokenizer
from shardwise.engine.preference import dpo_losses, reward_model_losses
from shardwise.errors import DataError

LN2 = math.log(2.0)


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _expected(kind: str, pc, pr, rc, rr, nc, nr, beta, ls, gamma) -> float:
    """One pair's loss written from the papers / TRL, in plain floats."""
    if kind == "sigmoid":
        h = (pc - rc) - (pr - rr)
        return -(1 - ls) * math.log(_sig(beta * h)) - ls * math.log(_sig(-beta * h))
    if kind == "hinge":
        return max(0.0, 1 - beta * ((pc - rc) - (pr - rr)))
    if kind == "ipo":
        return ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2
    ac, ar = pc / nc, pr / nr
    if kind == "simpo":
        z = beta * (ac - ar) - gamma
        return -(1 - ls) * math.log(_sig(z)) - ls * math.log(_sig(-z))
    odds = (ac - ar) - (math.log(1 - math.exp(ac)) - math.log(1 - math.exp(ar)))
    return -ac - beta * math.log(_sig(odds))


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge", "simpo", "orpo"])
def test_each_loss_type_is_its_formula(kind):
    g = torch.Generator().manual_seed(0)
    n_c, n_r = torch.randint(1, 9, (6,), generator=g).double(), torch.randint(1, 9, (6,), generator=g).double()
    pi_c, pi_r = -torch.rand(6, generator=g, dtype=torch.float64) * n_c, -torch.rand(6, generator=g,
                                                                                      dtype=torch.float64) * n_r
    ref_c, ref_r = pi_c - torch.randn(6, generator=g, dtype=torch.float64), pi_r + torch.randn(6, generator=g,
                                                                                              dtype=torch.float64)
    cfg = DPOConfig(loss_type=kind, beta=0.3, label_smoothing=0.1 if kind in ("sigmoid", "simpo") else 0.0,
                    gamma=0.7)
    losses, _, _ = dpo_losses(pi_c, pi_r, ref_c, ref_r, n_c, n_r, cfg)
    want = [_expected(kind, *(float(t[i]) for t in (pi_c, pi_r, ref_c, ref_r, n_c, n_r)), cfg.beta,
                      cfg.label_smoothing, cfg.gamma) for i in range(6)]
    assert losses.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    if kind not in ("simpo", "orpo"):  # policy = reference: sigmoid's ln 2 on every pair
        same, _, _ = dpo_losses(pi_c, pi_r, pi_c, pi_r, n_c, n_r, cfg.model_copy(update={"label_smoothing": 0.0}))
        at_start = {"sigmoid": LN2, "hinge": 1.0, "ipo": (1 / (2 * cfg.beta)) ** 2}[kind]
        assert same.tolist() == pytest.approx([at_start] * 6, rel=1e-15)


def test_reward_model_loss_is_bradley_terry_with_margin_and_centering():
    r_c, r_r = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), torch.tensor([0.1, 0.3, -2.0],
                                                                                dtype=torch.float64)
    margin = torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64)
    got = reward_model_losses(r_c, r_r, margin, 0.01).tolist()
    want = [-math.log(_sig(c - r - m)) + 0.01 * (c + r) ** 2 for c, r, m in zip(r_c.tolist(), r_r.tolist(),
                                                                                  margin.tolist())]
    assert got == pytest.approx(want, rel=1e-12)


def _cfg(source: Path, max_length: int = 16, **data):
    from shardwise.config.load import load_config

    return load_config(REPO_ROOT / "examples/sft_arithmetic.yaml",
                       ["train.objective=dpo", f"data.source={source}", f"data.max_length={max_length}",
                        *[f"data.{k}={v}" for k, v in data.items()]])


BAD_ROWS = [
    ({"prompt": "1+1=", "chosen": "", "rejected": "3"}, "'chosen' is missing or empty"),
    ({"prompt": "1+1=", "chosen": "2"}, "data.rejected_key"),
    ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "chosen and rejected are the same"),
    ({"prompt": "1234567890+1234567890=", "chosen": "2", "rejected": "3"}, "the prompt takes 23 tokens"),
    ({"prompt": "1+1=", "chosen": "2222222222222229", "rejected": "2222222222222228"},
     "the same after the cut"),
]


def test_bad_pairs_are_one_line_naming_the_row_or_dropped_and_counted(tmp_path):
    tok = build_char_tokenizer(tmp_path / "tok")
    good = {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
    for row, words in BAD_ROWS:
        path = tmp_path / "pairs.jsonl"
        path.write_text("\n".join(json.dumps(r) for r in (good, row)) + "\n")
        cfg = _cfg(path)
        with pytest.raises(DataError) as err:
            check_pairs(tok, load_pairs(cfg), cfg.data.max_length, drop=False)
        msg = str(err.value)
        assert "\n" not in msg and words in msg and ("row 1" in msg or "data.rejected_key" in msg), msg
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [good] + [r for r, _ in BAD_ROWS[2:]]) + "\n")
    kept, enc, note = check_pairs(tok, load_pairs(_cfg(path)), 16, drop=True)
    assert len(kept) == len(enc) == 1 and note.startswith("3 of 4 pairs dropped"), note


def test_conversational_pairs_train_the_answer_turn_only(tmp_path, qwen_tool_tokenizer):
    tok, _ = qwen_tool_tokenizer
    path = tmp_path / "chat.jsonl"
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "hello"}],
           "rejected": "go away"}
    path.write_text(json.dumps(row) + "\n")
    _, (enc,), _ = check_pairs(tok, load_pairs(_cfg(path, 64)), 64, drop=False)
    for side, text in (("chosen", "hello"), ("rejected", "go away")):
        ex = enc[side]
        trained = tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
        assert trained.startswith(text) and "hi" not in trained, trained


def _pair_files(root: Path) -> tuple[Path, Path]:
    """A rule a tiny model learns in a few steps: the answer ending in an even digit is
    preferred to one ending in an odd digit."""
    rng = random.Random(0)
    rows = []
    for _ in range(80):
        a, b = rng.randint(1, 40), rng.randint(1, 40)
        even, odd = 2 * rng.randint(0, 40), 2 * rng.randint(0, 40) + 1
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(even), "rejected": str(odd)})
    train, val = root / "pairs.jsonl", root / "val.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:64]))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[64:]))
    return train, val


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]


def test_dpo_one_rank_equals_two_and_the_precomputed_reference_and_resumes(tmp_path):
    train, val = _pair_files(tmp_path)
    base = ["train", str(REPO_ROOT / "examples/sft_arithmetic.yaml"), "train.objective=dpo", f"data.source={train}",
            f"eval.source={val}", "train.max_steps=4", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.optimizer.lr=1e-2", "train.scheduler.name=constant", "train.scheduler.warmup_steps=0",
            "checkpoint.every_steps=2",
            "checkpoint.async=false", "checkpoint.export_hf=false", "train.log_every=1"]
    runs = {"one": tmp_path / "one", "two": tmp_path / "two", "pre": tmp_path / "pre"}
    pre = [*base, f"run.dir={runs['pre']}", "train.dpo.precompute_ref=true"]
    results = at_once(lambda: run_cli([*base, f"run.dir={runs['one']}"], timeout=300),
                      lambda: run_cli([*base, "--nproc", "2", f"run.dir={runs['two']}"], timeout=300),
                      lambda: run_cli([*pre, "train.max_steps=2"], timeout=300))
    # the precomputed run resumed from step 2: its stored reference is read back for steps 3-4
    results.append(run_cli(pre, timeout=300))
    for res in results:
        assert res.returncode == 0, res.stderr[-3000:]
    assert (runs["pre"] / "dpo_reference.safetensors").is_file() and "resuming" in results[-1].stderr
    one, two, pre = (_steps(runs[k]) for k in ("one", "two", "pre"))
    assert [x["step"] for x in one] == [x["step"] for x in pre] == [1, 2, 3, 4]
    # step 1: policy = reference, every pair's loss is ln 2 (fp32 log-probs subtract to 0 exactly)
    for steps in (one, two, pre):
        assert steps[0]["dpo/loss"] == pytest.approx(LN2, abs=1e-7) and steps[0]["rewards/margins"] == 0.0
    # fp32 sums in another order (pairs split over ranks) differ by ~1e-7 relative; AdamW's
    # normalised step turns that into at most a sign flip of a near-zero gradient component,
    # a weight change of 2 x lr there: 1e-4 on the loss after 3 updates is ten times that.
    for a, b, c in zip(one, two, pre):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
        assert c["loss"] == pytest.approx(a["loss"], abs=1e-4)  # stored reference = frozen copy
    val_lines = [json.loads(x) for x in (runs["one"] / "metrics.jsonl").read_text().splitlines() if "val/dpo/loss" in x]
    assert [x["step"] for x in val_lines] == [0, 4] and val_lines[0]["val/dpo/loss"] == pytest.approx(LN2, abs=1e-7)
    assert val_lines[1]["val/rewards/accuracies"] >= 0.75 and val_lines[1]["val/dpo/loss"] < LN2 - 0.03, val_lines  # learns


def test_reward_model_learns_the_rule_is_exported_as_a_classifier_and_scores_rl(tmp_path, tiny_sft_run):
    train, val = _pair_files(tmp_path)
    run_dir = tmp_path / "rm"
    res = run_cli(["train", str(REPO_ROOT / "examples/sft_arithmetic.yaml"), "--nproc", "2",
                   "train.objective=reward_model", f"data.source={train}", f"eval.source={val}",
                   "train.max_steps=30", "train.global_batch_size=16", "train.micro_batch_size=4",
                   "train.optimizer.lr=3e-3", "train.scheduler.warmup_steps=0", "checkpoint.every_steps=0",
                   "checkpoint.async=false", "train.log_every=1", f"run.dir={run_dir}"], timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val_lines = [x for x in lines if "val/rm/accuracy" in x]
    assert val_lines[0]["val/rm/loss"] == pytest.approx(LN2, abs=0.05)  # a fresh head scores about 0
    assert val_lines[-1]["val/rm/accuracy"] >= 0.8, val_lines
    config = json.loads((run_dir / "hf/config.json").read_text())
    assert config["architectures"] == ["Qwen3ForSequenceClassification"] and len(config["id2label"]) == 1
    # the exported folder is the reward of an RL step as it is (rl.reward.model), handed to a
    # rule-based function that makes the reward of it (rl.reward.combine: function)
    (tmp_path / "combo.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                       "    return 10.0 + 2.0 * extra_info['model_score']\n")
    rl_dir = tmp_path / "rl"
    res = run_cli(["rl", str(REPO_ROOT / "examples/grpo_arithmetic.yaml"), f"model.path={tiny_sft_run['model']}",
                   f"rl.reward.model={run_dir / 'hf'}", "rl.reward.function=combo:compute_score",
                   "rl.reward.combine=function", f"run.dir={rl_dir}", "train.max_steps=1", "rl.heldout_eval=false",
                   "checkpoint.export_hf=false", "data.max_length=16"], timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (step,) = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines() if '"reward/mean"' in x]
    assert math.isfinite(step["reward/model_mean"]) and step["reward/model_mean"] != 0.0
    assert step["reward/mean"] == pytest.approx(10.0 + 2.0 * step["reward/model_mean"], abs=1e-5)


def test_a_reward_model_folder_without_a_classification_head_is_refused(tiny_sft_run, tmp_path):
    from shardwise.errors import ConfigError
    from shardwise.jobs.preference import check_reward_model

    tok = build_char_tokenizer(tmp_path / "tok")
    with pytest.raises(ConfigError) as err:
        check_reward_model(str(tiny_sft_run["model"]), tok)
    assert "rl.reward.model" in str(err.value) and "without a classification head" in str(err.value)


def test_a_bad_pair_exits_2_before_launch(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "2"}) + "\n")
    res = run_cli(["train", str(REPO_ROOT / "examples/sft_arithmetic.yaml"), "--nproc", "2",
                   "train.objective=dpo", f"data.source={path}", f"run.dir={tmp_path / 'run'}"], timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    line = res.stderr.strip().splitlines()[-1]
    assert "row 0" in line and "chosen and rejected are the same" in line, res.stderr
    assert not (tmp_path / "run").exists()
