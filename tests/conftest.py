"""Fixtures shared by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_data import build_bpe_tool_tokenizer
from dist.launcher import REPO_ROOT, run_cli


@pytest.fixture(scope="session")
def sft_demo_model(tmp_path_factory) -> Path:
    """The exported HF folder of the SFT demo (examples/sft_reverse.yaml as it is, 500
    steps, 2 processes, ~70 s): a model that mostly copies the word it should reverse
    (25-35% greedy held-out accuracy), the warm start of the demo's RL stage.
    Built once per test session (the RL trainer and infer job tests start from it)."""
    run_dir = tmp_path_factory.mktemp("sft_demo")
    res = run_cli(["train", str(REPO_ROOT / "examples" / "sft_reverse.yaml"), "--nproc", "2",
                   f"run.dir={run_dir}", "checkpoint.every_steps=0", "train.log_every=50"], timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    hf = run_dir / "hf"
    assert (hf / "model.safetensors").is_file() or (hf / "model.safetensors.index.json").is_file()
    return hf


@pytest.fixture(scope="session")
def tiny_sft_run(tmp_path_factory) -> dict[str, Path]:
    """One step of `shardwise train` (one process, ~15 s) from a saved tiny Qwen3 folder
    (``model``, as model.path), and a second folder of the same shape and other weights
    (``other_model``): ``run`` holds the committed checkpoint ``checkpoint`` (step 1),
    ``argv`` is the command (without run.dir and max_steps). Tests that could write into the
    run copy it first."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("tiny_sft")
    shape = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64)
    for seed, name in ((0, "model"), (1, "other_model")):
        torch.manual_seed(seed)
        Qwen3ForCausalLM(shape).save_pretrained(root / name)
    argv = ["train", str(REPO_ROOT / "examples" / "sft_arithmetic.yaml"), "model.config=null",
            f"model.path={root / 'model'}", "train.global_batch_size=8", "train.micro_batch_size=4", "data.max_length=16",
            "checkpoint.every_steps=1", "checkpoint.async=false", "checkpoint.export_hf=false"]
    run = root / "run"
    res = run_cli([*argv, f"run.dir={run}", "train.max_steps=1"], timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
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
