"""What a resume may change (`shardwise.jobs.resume`, issue 30 item 2) and what a resume
with nothing left to train says (item 9).

A resume that changes ``model.path`` used to take the actor from the checkpoint and the
RL reference (or a LoRA run's frozen base) from the new folder, with exit 0 and a note that
the new value applies. Every config key now has one rule: applies, refused or cannot
change. The CLI tests run one process on the session's one-step SFT run
(`tiny_sft_run`), copied first: a refusal must leave the run as it was.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
from dist.launcher import REPO_ROOT, run_cli

from shardwise.config.schema import Config
from shardwise.jobs.resume import APPLIES, KEPT, REFUSED, RESUME_RULES, changed_settings, rule_for


def _leaves(value, prefix=""):
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("key,decision", [
    ("model.path", REFUSED),
    ("model.tokenizer", REFUSED),
    ("model.lora.path", REFUSED),
    ("model.lora.r", REFUSED),
    ("model.config.hidden_size", REFUSED),
    ("model.freeze", REFUSED),
    ("rl.critic.enabled", REFUSED),
    ("model.config.attention_dropout", APPLIES),
    ("model.lora.alpha", APPLIES),
    ("model.dtype", APPLIES),
    ("train.optimizer.lr", APPLIES),
    ("train.max_steps", APPLIES),
    ("parallel.fsdp_size", APPLIES),
    ("data.source", APPLIES),
    ("rl.kl_in_reward.coef", APPLIES),
    ("rl.reference.enabled", APPLIES),
    ("run.seed", APPLIES),
    ("run.name", KEPT),
    ("run.project", KEPT),
])
def test_resume_rule_of_a_key(key, decision):
    assert rule_for(key).decision == decision


def test_every_config_key_has_a_resume_rule_and_the_docs_list_the_refused_and_kept():
    keys = list(_leaves(Config().model_dump(by_alias=True, mode="json")))
    assert len(keys) > 100
    decisions = {k: rule_for(k).decision for k in keys}  # KeyError for a key without a rule
    assert set(decisions.values()) == {APPLIES, REFUSED, KEPT}
    # the one page of docs/ that holds the rules (When something goes wrong), wherever it moves
    pages = [p for p in sorted((REPO_ROOT / "docs").glob("*.md")) if "<!-- resume rules -->" in p.read_text()]
    assert len(pages) == 1, f"one page of docs/ holds the resume rules, found {[p.name for p in pages]}"
    text = pages[0].read_text()
    section = text[text.index("<!-- resume rules -->"):text.index("<!-- /resume rules -->")]
    for key, rule in RESUME_RULES.items():
        if rule.decision != APPLIES:
            assert f"`{key}`" in section, f"docs/{pages[0].name}'s resume rules do not name {key} ({rule.decision})"
    with pytest.raises(KeyError, match="RESUME_RULES"):
        rule_for("nosuchsection.key")


def test_where_the_run_is_and_the_same_folder_spelled_otherwise_are_no_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    saved = {"run": {"dir": "runs/a"}, "model": {"path": str(tmp_path / "m")}, "checkpoint": {"resume": "auto"},
             "train": {"max_steps": 2}}
    now = {"run": {"dir": "/elsewhere/a"}, "model": {"path": "./m"}, "checkpoint": {"resume": "runs/a/x"},
           "train": {"max_steps": 4}}
    assert changed_settings(saved, now) == {"train.max_steps": (2, 4)}
    now["model"]["path"] = str(tmp_path / "other")
    assert "model.path" in changed_settings(saved, now)


def test_resume_with_another_model_path_is_refused_and_writes_nothing(tiny_sft_run, tmp_path, capsys, monkeypatch):
    """Another folder of the same shape (the refusal of another shape existed): exit 2, one
    line naming model.path and its saved folder, the run folder as it was. In-process, and
    through the real command with a run.dir written with `..` past a folder that does not
    exist (item 1: the checks used to see no checkpoint there, and the ranks then resumed it)."""
    from shardwise.cli import main

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    shutil.copytree(tiny_sft_run["run"], run)
    before = _snapshot(run)
    argv = [*(a for a in tiny_sft_run["argv"] if not a.startswith("model.path=")),
            f"model.path={tiny_sft_run['other_model']}", "train.max_steps=2"]

    def refused(code: int, err: str) -> None:
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, err[-3000:]
        assert lines[0].startswith("shardwise: config error at 'model.path'"), lines[0]
        assert str(tiny_sft_run["model"]) in lines[0] and "reference" in lines[0], lines[0]
        assert _snapshot(run) == before

    code = main([*argv, f"run.dir={run}"])
    refused(code, capsys.readouterr().err)
    res = run_cli([*argv, f"run.dir={tmp_path / 'nonexist' / '..' / 'run'}"], cwd=tmp_path)
    refused(res.returncode, res.stderr)
    assert not (tmp_path / "nonexist").exists()


def test_resume_with_nothing_left_to_train_says_so_and_reports_the_saved_loss(tiny_sft_run, tmp_path):
    """A resume at train.max_steps used to print `final loss nan`. The same model folder named
    by another spelling (a path relative to the working directory) is no change."""
    run = tmp_path / "run"
    shutil.copytree(tiny_sft_run["run"], run)
    saved_loss = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()
                  if "loss" in json.loads(x)][-1]["loss"]
    argv = [a for a in tiny_sft_run["argv"] if not a.startswith("model.path=")]
    relative = Path("..") / tiny_sft_run["model"].relative_to(tiny_sft_run["root"].parent)
    res = run_cli([*argv, f"model.path={relative}", f"run.dir={run}", "train.max_steps=1"],
                  cwd=tiny_sft_run["root"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nan" not in res.stdout, res.stdout
    assert "shardwise note" not in res.stderr, res.stderr  # nothing changed
    notes = [x for x in res.stderr.splitlines() if "nothing left to train" in x]
    assert len(notes) == 1 and str(tiny_sft_run["checkpoint"].name) in notes[0] and "step 1" in notes[0], res.stderr
    loss = float(re.search(r"final loss (\S+)", res.stdout).group(1))
    assert math.isfinite(loss) and loss == pytest.approx(saved_loss, abs=1e-4), res.stdout


@pytest.mark.parametrize("saved,now,expected", [
    (("fixed", 0.1), ("fixed", 0.5), 0.5),  # a fixed coef applies (it used to keep the saved one)
    (("adaptive", 0.1), ("adaptive", 0.1), 0.37),  # the adapted value goes on
    (("adaptive", 0.1), ("adaptive", 0.2), 0.2),  # a new starting coef restarts it
    (("adaptive", 0.1), ("fixed", 0.1), 0.1),
])
def test_rl_kl_in_reward_applies_on_resume(saved, now, expected):
    """`rl.kl_in_reward` is ruled "applies": the controller state a checkpoint restores."""
    from types import SimpleNamespace

    from shardwise.data.sampler import GlobalBatchSampler
    from shardwise.rl.algorithms import kl_controller
    from shardwise.rl.trainer import Controller

    def controller(kind: str, coef: float):
        cfg = Config.model_validate({"rl": {"kl_in_reward": {"enabled": True, "controller": kind, "coef": coef}}})
        k = cfg.rl.kl_in_reward
        return SimpleNamespace(cfg=cfg, step=0, sampler=GlobalBatchSampler(8, 4, 0),
                               kl_ctl=kl_controller(k.controller, k.coef, k.target, k.horizon))

    before = controller(*saved)
    before.kl_ctl.value = 0.37  # adapted during the saved run (a fixed one never moves, but the state holds it)
    state = json.loads(json.dumps(Controller.state_dict(before)))  # as meta.json keeps it
    after = controller(*now)
    Controller.load_state_dict(after, state)
    assert after.kl_ctl.value == pytest.approx(expected)
