"""`shardwise infer` through the real CLI: generation with the FSDP2 infer engine.

- greedy under 2 ranks gives, prompt by prompt, the text plain unsharded transformers
  generates from the same exported model, and the accuracy the SFT job reports;
- sampling is seeded: the same command repeats byte for byte, another seed differs, every
  prompt gets n samples, with prompts split unevenly over the ranks;
- file prompts scored by a user function (module:function from the working directory),
  prompt-only files, the output path;
- input mistakes exit 2 with the key and a hint, before any process starts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, at_once, run_cli

from shardwise.cli import main

EXAMPLE = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")
INLINE = ["model.path=null", TINY_QWEN3]  # a random tiny model instead of the demo's RL output


def infer(run_dir: Path, *overrides: str, nproc: int | None = 2, cwd: Path | None = None):
    argv = ["infer", EXAMPLE, f"run.dir={run_dir}", *overrides] + (["--nproc", str(nproc)] if nproc else [])
    res = run_cli(argv, timeout=300, cwd=cwd)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    return res


def rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@torch.no_grad()
def plain_greedy(hf_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Each prompt alone (no padding) through plain transformers, unsharded, greedy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.data.encode import tokenize_prompt

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([tokenize_prompt(tok, p, 16)])
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = gen[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in new:
            new = new[:new.index(tok.eos_token_id)]
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


@torch.no_grad()
def task_accuracy(hf_dir: Path, task_name: str, n: int, seed: int, max_new_tokens: int = 6,
                  batch_size: int = 50) -> float:
    """The reference: plain unsharded transformers on the exported folder, left-padded
    batches of 50, greedy, scored by the task's own scorer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.data.encode import tokenize_prompt
    from shardwise.data.tasks import get_builtin_task

    task = get_builtin_task(task_name)
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    examples = task.heldout_examples(n, seed)
    correct = 0.0
    for i in range(0, n, batch_size):
        chunk = examples[i:i + batch_size]
        ids = [tokenize_prompt(tok, ex["prompt"], 64) for ex in chunk]
        width = max(len(x) for x in ids)
        pad = tok.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=pad, eos_token_id=tok.eos_token_id)
        for ex, row in zip(chunk, out[:, width:]):
            correct += task.score(ex["prompt"], tok.decode(row, skip_special_tokens=False), ex["response"])
    return correct / n


def test_greedy_on_two_ranks_equals_plain_unsharded_generate(sft_demo_model, tmp_path):
    from shardwise.data.tasks import HELDOUT_SEED_OFFSET, get_builtin_task

    run_dir = tmp_path / "run"
    # 32 prompts per call: 4 calls per rank, the last with 4 prompts, all of other widths
    res = infer(run_dir, f"model.path={sft_demo_model}", "infer.batch_size=32", "data.source=builtin:reverse",
                "infer.max_new_tokens=8")
    got = rows(run_dir / "generations.jsonl")
    held_out = get_builtin_task("reverse").heldout_examples(200, HELDOUT_SEED_OFFSET)
    assert [r["index"] for r in got] == list(range(200))
    assert [r["prompt"] for r in got] == [e["prompt"] for e in held_out]
    assert [r["ground_truth"] for r in got] == [e["response"] for e in held_out]
    assert [r["response"] for r in got] == plain_greedy(sft_demo_model, [e["prompt"] for e in held_out], 8)

    # the accuracy the SFT job printed for this model (plain transformers, batches of 50)
    accuracy = task_accuracy(sft_demo_model, "reverse", n=200, seed=HELDOUT_SEED_OFFSET, max_new_tokens=8)
    summary = json.loads((run_dir / "infer_summary.json").read_text())
    assert summary["accuracy"] == accuracy == sum(r["score"] for r in got) / 200
    # Right and wrong answers both, so the comparison means something: the demo SFT model
    # mostly copies the word (its demonstrations did 60% of the time), sometimes reverses it.
    assert 0.05 < accuracy < 0.95
    assert f"accuracy (builtin:reverse): {accuracy:.1%}" in res.stdout
    # the evaluation every job counts (issue 29): the same figure, and one greedy row per prompt
    samples = rows(run_dir / "samples" / "step_0000000.jsonl")
    assert summary["val/accuracy"] == accuracy == sum(r["reward"] >= 1 for r in samples) / 200
    assert [(r["index"], r["greedy"], r["response"]) for r in samples] == [(r["index"], True, r["response"]) for r in got]
    assert summary["world_size"] == 2 and summary["responses"] == 200
    assert "infer" in res.stderr  # the rank-0 progress bar


def test_sampling_is_seeded_with_n_samples_per_prompt_over_uneven_ranks(tmp_path):
    # 7 prompts over 2 ranks: 4 and 3; 2 prompts per call: 2 calls each, the last of rank 1
    # with one prompt
    common = [*INLINE, "infer.temperature=1.0", "infer.n=3", "infer.num_prompts=7", "infer.batch_size=2",
              "infer.max_new_tokens=5"]
    at_once(lambda: infer(tmp_path / "a", *common), lambda: infer(tmp_path / "b", *common),
            lambda: infer(tmp_path / "c", *common, "run.seed=1"))  # side by side, independent
    a, b = (tmp_path / "a" / "generations.jsonl").read_text(), (tmp_path / "b" / "generations.jsonl").read_text()
    assert a == b
    ra, rc = rows(tmp_path / "a" / "generations.jsonl"), rows(tmp_path / "c" / "generations.jsonl")
    assert [(r["index"], r["sample"]) for r in ra] == [(i, k) for i in range(7) for k in range(3)]
    assert [r["response"] for r in ra] != [r["response"] for r in rc]
    by_prompt = [{r["response"] for r in ra if r["index"] == i} for i in range(7)]
    assert any(len(s) > 1 for s in by_prompt), by_prompt  # the n samples of a prompt differ
    assert all(1 <= r["response_tokens"] <= 5 and r["score"] in (0.0, 1.0) for r in ra)


SCORER = "def length(prompt, response, ground_truth):\n    return float(len(response) + len(ground_truth))\n"


def test_file_prompts_user_scorer_and_prompt_only_file(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+{i}=", "answer": "x" * i}) + "\n" for i in range(6)))
    (tmp_path / "my_scores.py").write_text(SCORER)
    out = tmp_path / "out" / "gen.jsonl"
    # one process each (no --nproc): the plain path. A file with a user scorer and, side by
    # side, a prompts-only file: no reward, the response column is not read.
    bare = tmp_path / "bare.jsonl"
    bare.write_text("".join(json.dumps({"q": p}) + "\n" for p in ("1+1=", "2+2=", "3+3=")))
    res, _ = at_once(lambda: infer(tmp_path / "run", *INLINE, f"data.source={data}", "data.prompt_key=question",
                                   "data.response_key=answer", "infer.reward=my_scores:length",
                                   "infer.num_prompts=4", f"infer.output={out}", nproc=None, cwd=tmp_path),
                     lambda: infer(tmp_path / "bare", *INLINE, f"data.source={bare}", "data.prompt_key=q", nproc=None))
    got = rows(out)
    assert [r["prompt"] for r in got] == [f"{i}+{i}=" for i in range(4)]
    assert [r["ground_truth"] for r in got] == ["x" * i for i in range(4)]
    assert [r["score"] for r in got] == [len(r["response"]) + len(r["ground_truth"]) for r in got]
    summary = json.loads((tmp_path / "run" / "infer_summary.json").read_text())
    assert summary["score_mean"] == sum(r["score"] for r in got) / 4 and "accuracy" not in summary
    assert "mean score (my_scores:length)" in res.stdout

    # the prompts-only file
    got = rows(tmp_path / "bare" / "generations.jsonl")
    assert [r["prompt"] for r in got] == ["1+1=", "2+2=", "3+3="]
    assert all("score" not in r and "ground_truth" not in r for r in got)


ROWS = [
    (["infer.reward=no_such_module_xyz:score"], "infer.reward", "PYTHONPATH"),
    (["infer.reward=builtin:arithmatic"], "infer.reward", "builtin:arithmetic"),
    (["infer.temprature=1"], "infer.temprature", "did you mean infer.temperature?"),
    (["infer.num_prompts=0"], "infer.num_prompts", None),
    (["infer.top_p=0"], "infer.top_p", None),
    (["fsdp.wrap.modules=[model.layerz.{*}]"], "fsdp.wrap.modules[0]", "model.layers.{*}"),
    (["data.source=/nonexistent/prompts.jsonl"], "/nonexistent/prompts.jsonl", "does not exist"),
]


@pytest.mark.parametrize("overrides,key,hint", ROWS, ids=[r[0][0] for r in ROWS])
def test_infer_input_errors_exit_2_before_any_process(overrides, key, hint, capsys, monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    code = main(["infer", EXAMPLE, *INLINE, f"run.dir={tmp_path / 'run'}", *overrides, "--nproc", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert key in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    if hint:
        assert hint in err, err
    assert not (tmp_path / "run").exists()


def test_a_file_without_the_ground_truth_column_names_the_key(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"q": "1+1="}) + "\n")
    code = main(["infer", EXAMPLE, *INLINE, f"run.dir={tmp_path / 'run'}", f"data.source={data}",
                 "data.prompt_key=q", "infer.reward=builtin:arithmetic", "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "data.response_key: key 'response' not found" in err and "'q'" in err, err
    assert not (tmp_path / "run").exists()
