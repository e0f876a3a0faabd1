"""Where a job writes, checked where it will write (issue 30, items 1 and 9).

``runs/new/../other_model`` could not be looked into while ``runs/new`` did not exist, so
the "new or empty" checks saw nothing there, and the writer (which creates ``runs/new``)
then wrote into ``runs/other_model``: export replaced another model's config.json and
weights without ``--force``, infer.output replaced whatever file it named. Paths are
resolved first (`shardwise.config.paths.resolve_dots`); run.dir's case is in
tests/test_resume_rules.py. And a dotted ``data.ground_truth_key`` that names nothing is
reported as itself, not as ``data.response_key``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, run_cli

from shardwise.config import load_config
from shardwise.config.paths import out_path, resolve_dots

INFER = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")
GRPO = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _other_model(root: Path) -> Path:
    other = root / "other_model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors").write_bytes(b"not really weights")
    return other


@pytest.mark.parametrize("text,expected", [
    ("runs/a", "runs/a"),
    ("runs/new/../other", "runs/other"),
    ("runs/..", "."),
    ("/abs/new/../x", "/abs/x"),
])
def test_resolve_dots(text, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_dots(text) == expected


def test_a_written_path_starting_with_a_tilde_is_in_the_home_folder(tmp_path, monkeypatch):
    # the shell leaves `run.dir=~/x` as it is: the job wrote into a folder named "~"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert out_path("~/runs/x") == str(tmp_path / "home" / "runs" / "x")
    assert out_path("~/runs/new/../x") == str(tmp_path / "home" / "runs" / "x")
    assert load_config(None, ["run.dir=~/runs/x"]).run.dir == str(tmp_path / "home" / "runs" / "x")
    assert out_path("runs/~x") == "runs/~x"


def test_export_through_dotdot_is_refused_like_the_folder_itself_and_force_writes_there(tiny_sft_run, tmp_path,
                                                                                      capsys):
    other = _other_model(tmp_path)
    before = _snapshot(other)
    via = tmp_path / "nonexist" / ".." / "other_model"
    res = run_cli(["export", tiny_sft_run["checkpoint"], via], cwd=tmp_path)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    assert "'OUT_DIR'" in lines[0] and "is not empty" in lines[0] and f"(that is '{other}')" in lines[0], lines[0]
    assert _snapshot(other) == before and not (tmp_path / "nonexist").exists()
    # --force (in-process: the same command) writes where the check looked, and creates no
    # stray folder on the way
    from shardwise.cli import main

    assert main(["export", str(tiny_sft_run["checkpoint"]), str(via), "--force"]) == 0
    assert f"-> {other}" in capsys.readouterr().out and not (tmp_path / "nonexist").exists()
    assert json.loads((other / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.parametrize("target,fragment", [
    ("nonexist/../other_model/config.json", "does not hold generations of `shardwise infer`"),
    ("nonexist/../other_model", "is a folder"),
    ("nonexist/../prompts.jsonl", "is data.source"),
])
def test_infer_output_never_replaces_what_is_not_its_own(target, fragment, tmp_path, capsys, monkeypatch):
    """The first case through the real command, the others in-process (the same `main`)."""
    from shardwise.cli import main

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    other = _other_model(tmp_path)
    before = _snapshot(other)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "response": "2"}) + "\n")
    argv = ["infer", INFER, "model.path=null", TINY_QWEN3, f"run.dir={tmp_path / 'run'}", f"data.source={prompts}",
            f"infer.output={tmp_path / target}"]
    if target.endswith("config.json"):
        res = run_cli(argv, cwd=tmp_path)
        code, err = res.returncode, res.stderr
    else:
        code, err = main(argv), capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-3000:]
    assert "'infer.output'" in lines[0] and fragment in lines[0], lines[0]
    assert _snapshot(other) == before and not (tmp_path / "nonexist").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["reward_model.truth", "truth"])
def test_a_ground_truth_key_that_names_nothing_is_named_itself(key, tmp_path, capsys, monkeypatch):
    from shardwise.cli import main

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "reward_model": {"ground_truth": str(2 * i)}}) + "\n"
                            for i in range(4)))
    for command in (["infer", INFER, "infer.reward=builtin:arithmetic"], ["rl", GRPO]):
        code = main([*command, "model.path=null", TINY_QWEN3, f"run.dir={tmp_path / 'run'}", f"data.source={data}",
                     f"data.ground_truth_key={key}", "data.max_length=16"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "data.ground_truth_key" in err and "data.response_key" not in err and repr(key) in err, err
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("out,fragment", [
    ("nonexist/../d.yaml", "does not exist"),
    ("sub/../d.yaml", "is the file being converted"),
    ("sub/../sub", "is a directory"),
])
def test_convert_out_through_dotdot_is_refused(out, fragment, tmp_path, capsys, monkeypatch):
    """A guard, not a fix: `convert --out` opens the path as given, which fails where the
    check fails (a folder before `..` that does not exist), so it never wrote elsewhere."""
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    source = (REPO_ROOT / "tests" / "dialects" / "mindspeed_fsdp2.yaml").read_text()
    (tmp_path / "d.yaml").write_text(source)
    (tmp_path / "sub").mkdir()
    assert main(["convert", "d.yaml", "--from", "mindspeed", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "'--out'" in err and fragment in err, err
    assert (tmp_path / "d.yaml").read_text() == source and sorted(p.name for p in tmp_path.iterdir()) == ["d.yaml", "sub"]
