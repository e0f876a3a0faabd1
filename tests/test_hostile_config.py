"""Hostile input is refused before anything starts: exit status 2, one line on stderr.

Issue 22: alias bombs ("billion laughs") and 50 MB lists ran `plan`, `train` and `convert`
for minutes at 100% CPU and over 10 GB; 10,000 levels of nesting, a binary or non-UTF-8
file and `convert --out DIR` ended in tracebacks; duplicate keys were merged silently;
`lr=inf` trained; `--nproc 0` ran; `export` wrote over another model's folder. Each row
here is such an input, run through the CLI's own entry point (`shardwise.cli.main`, stderr
captured; the same function the `shardwise` command runs); a few rows also run as real
subprocesses, to prove the exit status and the single line end to end. The files are
generated in tmp_path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from dist.common import TINY_QWEN3, cli_status
from dist.launcher import REPO_ROOT, run_cli

from shardwise.cli import main
from shardwise.config import safe_yaml
from shardwise.distributed.capacity import RUNTIME_BYTES_PER_RANK, check_capacity
from shardwise.errors import ConfigError

TINY = str(REPO_ROOT / "examples" / "tiny_qwen3.yaml")
SFT = str(REPO_ROOT / "examples" / "sft_arithmetic.yaml")
GRPO = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")
INFER = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")


def bomb_lines(indent: str = "", levels: int = 9) -> str:
    """Nine anchors, each a list of nine aliases of the one before: 9**9 values expanded."""
    lines = [f"{indent}lol0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"{indent}lol{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def flow_bomb() -> str:
    """The same bomb as one flow value, for a `key=value` override."""
    parts = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    parts += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return "[" + ", ".join(parts) + "]"


MODEL_BOMB = "model:\n  config:\n    model_type: qwen3\n" + bomb_lines("    ")
VALUE_BOMB = bomb_lines() + "train: {max_steps: *a9}\n"
DEEP_FLOW = "model: " + "[" * 10_000 + "]" * 10_000 + "\n"
DEEP_BLOCK = "".join(" " * i + f"k{i}:\n" for i in range(3_000)) + " " * 3_000 + "v: 1\n"
"""3,000 levels of block mappings (4.5 MB of indentation; 10,000 would pass the size bound first)."""
BIG_LIST = "train:\n  max_steps: [" + ", ".join(["1"] * 3_000_000) + "]\n"  # ~9 MiB: under the size bound


@dataclass(frozen=True)
class Row:
    argv: tuple[str, ...]
    """The command; "{cfg}" is the generated file, "{tmp}" tmp_path."""
    fragments: tuple[str, ...]
    """Each must appear in the one stderr line ("{cfg}" as in argv)."""
    text: str | bytes | None = None
    """The generated config file's content."""
    name: str = "config.yaml"
    setup: Callable[[Path], None] | None = field(default=None, compare=False)


def _model_folder(tmp: Path) -> None:
    other = tmp / "other_model"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama"}')
    (other / "model.safetensors.index.json").write_text("{}")


def _dir_with_yaml(tmp: Path) -> None:
    (tmp / "configs").mkdir()
    (tmp / "configs" / "run.yaml").write_text("train: {max_steps: 3}\n")


ROWS = [
    # ---- item 1: alias bombs and huge files, in shardwise's YAML and every dialect
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:", "20,000 values", "alias bomb"), MODEL_BOMB), id="bomb-in-model-config"),
    pytest.param(Row(("train", "{cfg}", TINY_QWEN3), ("{cfg}:", "alias bomb"), VALUE_BOMB), id="bomb-as-max-steps"),
    pytest.param(Row(("plan", "{cfg}", "--dialect", "roll"), ("{cfg}:", "alias bomb"), bomb_lines()), id="bomb-roll"),
    pytest.param(Row(("plan", "{cfg}", "--dialect", "mindspeed"), ("{cfg}:", "alias bomb"), bomb_lines()),
                 id="bomb-mindspeed"),
    pytest.param(Row(("rl", "{cfg}", "--dialect", "rlinf"), ("{cfg}:", "alias bomb"), bomb_lines()), id="bomb-rlinf"),
    pytest.param(Row(("convert", "--from", "roll", "{cfg}"), ("{cfg}:", "alias bomb"), bomb_lines()),
                 id="bomb-convert"),
    pytest.param(Row(("plan", TINY, f"model.config.x={flow_bomb()}"), ("model.config.x", "alias bomb")),
                 id="bomb-in-override"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:", "contains it"), "model: {config: &a {model_type: qwen3, x: [*a]}}\n"),
                 id="recursive-alias"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:2", "20,000 values"), BIG_LIST), id="9-MiB-list"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}", "larger than 10 MiB"), "a: '" + "x" * (11 * 2**20) + "'\n"),
                 id="11-MiB-file"),
    # ---- item 2: deep nesting, bytes that are not text, directories, duplicate keys
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:1", "more than 64 deep"), DEEP_FLOW), id="deep-flow"),
    pytest.param(Row(("train", "{cfg}"), ("{cfg}:65", "more than 64 deep", "k0.k1.k2"), DEEP_BLOCK),
                 id="deep-block"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:2", "not UTF-8", "0xe9", "save the file as UTF-8"),
                     "train: {max_steps: 3}\nrun: {dir: caf\xe9}\n".encode("latin-1")), id="latin-1"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:1", "not UTF-8"), bytes(range(128, 256)) * 64), id="binary"),
    pytest.param(Row(("convert", "--from", "mindspeed", "{cfg}"), ("{cfg}:2", "NUL byte"), b"fsdp_size: 2\n\0\0\0\n"),
                 id="binary-nul-convert"),
    pytest.param(Row(("plan", "{tmp}/configs"), ("is a directory", "did you mean", "run.yaml"), setup=_dir_with_yaml),
                 id="directory-as-config"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:5", "duplicate key 'train.optimizer.lr'", "first on line 3"),
                     "train:\n  optimizer:\n    lr: 1.0e-4\n    eps: 1.0e-8\n    lr: 3.0\n"), id="duplicate-key-block"),
    pytest.param(Row(("plan", "{cfg}", "--dialect", "roll"), ("{cfg}:1", "duplicate key 'a'"), "{a: 1, b: 2, a: 3}\n"),
                 id="duplicate-key-flow-dialect"),
    pytest.param(Row(("plan", TINY, "fsdp.module_precision={model.norm: fp32, model.norm: bf16}"),
                     ("fsdp.module_precision", "duplicate key 'model.norm'")), id="duplicate-key-override"),
    pytest.param(Row(("plan", "{cfg}"), ("{cfg}:1", "cannot be read as int"), "train: {max_steps: " + "9" * 5000 + "}\n"),
                 id="integer-of-5000-digits"),
    pytest.param(Row(("convert", "--from", "roll", str(REPO_ROOT / "tests/dialects/roll_train.yaml"), "--out", "{tmp}"),
                     ("--out", "is a directory", "roll_train_shardwise.yaml")), id="convert-out-directory"),
    # ---- item 3: floats that must be finite
    pytest.param(Row(("plan", TINY, "train.optimizer.lr=inf"), ("train.optimizer.lr", "finite", "e.g. 0.0001, the default")), id="lr-inf"),
    pytest.param(Row(("plan", TINY, "train.optimizer.lr=.nan"), ("train.optimizer.lr", "finite")), id="lr-nan"),
    pytest.param(Row(("plan", TINY, "train.optimizer.betas=[0.9, .inf]"), ("train.optimizer.betas", "finite", "0.95")),
                 id="beta-inf"),
    pytest.param(Row(("plan", TINY, "train.grad_clip=inf"), ("train.grad_clip", "finite", "null turns it off")),
                 id="grad-clip-inf"),
    pytest.param(Row(("plan", GRPO, "--rl", "rl.rollout.temperature=inf"), ("rl.rollout.temperature", "finite")),
                 id="temperature-inf"),
    pytest.param(Row(("plan", GRPO, "--rl", "rl.rollout.top_p=nan"), ("rl.rollout.top_p", "finite")), id="top-p-nan"),
    pytest.param(Row(("plan", GRPO, "--rl", "rl.actor.entropy_coef=-inf"), ("rl.actor.entropy_coef", "finite")),
                 id="entropy-coef-minus-inf"),
    pytest.param(Row(("plan", "{cfg}", "--dialect", "roll"), ("learning_rate", "finite"),
                     "actor_train:\n  training_args:\n    learning_rate: .inf\n"), id="dialect-lr-inf"),
    # ---- item 7: process counts
    pytest.param(Row(("train", SFT, "--nproc", "0"), ("--nproc", "0 is not a positive number")), id="train-nproc-0"),
    pytest.param(Row(("rl", GRPO, "--nproc", "0"), ("--nproc", "0 is not a positive number")), id="rl-nproc-0"),
    pytest.param(Row(("infer", INFER, "--nproc", "-2"), ("--nproc", "-2 is not a positive number")),
                 id="infer-nproc-negative"),
    pytest.param(Row(("train", SFT, "--nproc", "2", "run.dir={tmp}/run", TINY_QWEN3.replace("hidden_size: 32", "hidden_size: 16384")
                      .replace("vocab_size: 64", "vocab_size: 4000000")), ("--nproc", "of host memory", "per rank", "is available")),
                 id="train-too-big-for-memory"),
    # ---- item 13: export's target
    pytest.param(Row(("export", "{tmp}/no_checkpoint", "{tmp}/other_model"), ("OUT_DIR", "is not empty", "config.json",
                                                                            "--force"), setup=_model_folder),
                 id="export-onto-another-model"),
    pytest.param(Row(("export", "{tmp}/no_checkpoint", "{cfg}"), ("OUT_DIR", "is a file"), "not a folder\n",
                     name="model.safetensors"), id="export-onto-a-file"),
    # ---- a quoted value is short
    pytest.param(Row(("plan", TINY, "train.max_steps=[" + ",".join(["123456789"] * 5000) + "]"),
                     ("train.max_steps", "expected an integer")), id="long-value-quoted-short"),
]

SUBPROCESS_ROWS = {"bomb-in-model-config", "train-nproc-0"}
"""Rows also run through the real command (a fresh process): a hostile file the loader
refuses, and a bad argument. Every row runs in this process too (a subprocess costs ~9 s of
CPU to start)."""


def _argv(row: Row, tmp_path: Path) -> tuple[list[str], str]:
    cfg = str(tmp_path / row.name)
    if row.text is not None:
        data = row.text.encode() if isinstance(row.text, str) else row.text
        Path(cfg).write_bytes(data)
    if row.setup is not None:
        row.setup(tmp_path)
    return [a.replace("{cfg}", cfg).replace("{tmp}", str(tmp_path)) for a in row.argv], cfg


def _check(row: Row, cfg: str, tmp_path: Path, code: int, out: str, err: str) -> None:
    report = f"exit {code}\n--- stdout ---\n{out[-2000:]}\n--- stderr ---\n{err[-3000:]}"
    assert "Traceback" not in err, report
    assert code == 2, report
    assert out == "", report
    assert err.startswith("shardwise: ") and len(err.strip().splitlines()) == 1, report
    assert len(err) < 1200, report  # quotes at most a few hundred characters of any value
    for fragment in row.fragments:
        fragment = fragment.replace("{cfg}", cfg).replace("{tmp}", str(tmp_path))
        assert fragment in err, f"{fragment!r} missing\n{report}"


@pytest.mark.parametrize("row", ROWS)
def test_hostile_input_in_process(row: Row, tmp_path: Path, capsys, monkeypatch) -> None:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.chdir(tmp_path)  # a default run.dir (runs/...) lands here, if anything were written
    argv, cfg = _argv(row, tmp_path)
    code = cli_status(argv)
    out, err = capsys.readouterr()
    _check(row, cfg, tmp_path, code, out, err)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.parametrize("row", [r for r in ROWS if r.id in SUBPROCESS_ROWS])
def test_hostile_input_cli_subprocess(row: Row, tmp_path: Path) -> None:
    argv, cfg = _argv(row, tmp_path)
    proc = run_cli(argv, timeout=120, cwd=tmp_path, fresh=True)
    _check(row, cfg, tmp_path, proc.returncode, proc.stdout, proc.stderr)


def test_export_refusal_leaves_the_other_model_as_it_was_and_force_goes_on(tmp_path: Path, capsys) -> None:
    _model_folder(tmp_path)
    other = tmp_path / "other_model"
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert main(["export", str(tmp_path / "no_checkpoint"), str(other)]) == 2
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before
    # --force passes the out-folder check: the next check (the checkpoint) is what refuses
    assert main(["export", str(tmp_path / "no_checkpoint"), str(other), "--force"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "OUT_DIR" in err[0] and "CHECKPOINT_DIR" in err[1] and "OUT_DIR" not in err[1], err
    # an empty folder is a fine target
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "no_checkpoint"), str(tmp_path / "empty")]) == 2
    assert "CHECKPOINT_DIR" in capsys.readouterr().err


def test_convert_out_file_is_written(tmp_path: Path, capsys) -> None:
    out = tmp_path / "converted.yaml"
    assert main(["convert", "--from", "roll", str(REPO_ROOT / "tests/dialects/roll_train.yaml"), "--out", str(out)]) == 0
    assert "# <- " in out.read_text()


def _expanded(level: int) -> list:
    """Level `level` of `bomb_lines`, expanded: nine copies of the level below."""
    return ["lol"] * 9 if level == 0 else [_expanded(level - 1)] * 9


@pytest.mark.parametrize("text,value", [
    ("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n", {"base": {"x": 1, "y": 2}, "other": {"x": 3, "y": 2}}),
    ("a: &a [1, 2]\nb: [*a, *a]\n", {"a": [1, 2], "b": [[1, 2], [1, 2]]}),
    ("lr: 1e-5\nn: 3\ns: '01'\n", {"lr": 1e-5, "n": 3, "s": "01"}),
    ("", None),
    (bomb_lines(levels=3), {f"lol{i}": _expanded(i) for i in range(4)}),
])
def test_safe_yaml_reads_what_is_within_bounds(text: str, value) -> None:
    """Anchors, aliases and merge keys within the bounds read as PyYAML reads them (a bomb of
    four levels is 9**4 = 6,561 values: allowed)."""
    assert safe_yaml.loads(text) == value


def test_safe_yaml_bounds_hold_at_the_edges() -> None:
    nested = "[" * safe_yaml.MAX_DEPTH + "]" * safe_yaml.MAX_DEPTH
    assert safe_yaml.loads(nested) is not None
    with pytest.raises(safe_yaml.YamlLimit, match="more than 64 deep"):
        safe_yaml.loads("[" + nested + "]")
    flat = "[" + ", ".join(["1"] * (safe_yaml.MAX_NODES - 1)) + "]"  # the list itself is one value
    assert len(safe_yaml.loads(flat)) == safe_yaml.MAX_NODES - 1
    with pytest.raises(safe_yaml.YamlLimit, match="20,000 values"):
        safe_yaml.loads("[" + ", ".join(["1"] * safe_yaml.MAX_NODES) + "]")


def test_capacity_line_and_refusal() -> None:
    mib = 2**20
    cap = check_capacity(2, 10 * mib, available=8 * 2**30)
    assert cap.per_rank == RUNTIME_BYTES_PER_RANK + 10 * mib and cap.total == 2 * cap.per_rank
    assert "2 processes on" in cap.line() and "per core" in cap.line() and "8.0 GiB available" in cap.line()
    # on a GPU the plan's bytes are device memory, not host memory
    assert check_capacity(2, 10 * 2**30, on_device=True, available=2**30).per_rank == RUNTIME_BYTES_PER_RANK
    with pytest.raises(ConfigError, match=r"use at most --nproc 15") as e:  # (4 GiB - 64 x 0) / 256 MiB = 16, - 1
        check_capacity(64, 0, available=4 * 2**30 - 1)
    assert "--nproc" in str(e.value)
