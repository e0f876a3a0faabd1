"""Fixtures shared by several test files."""

from __future__ import annotations

from pathlib import Path

import pytest
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
