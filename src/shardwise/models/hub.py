"""No model hub: shardwise reads models, tokenizers and data from local folders only."""

from __future__ import annotations

import os

__all__ = ["local_files_only"]


def local_files_only() -> None:
    """No model hub: make HF libraries fail fast instead of trying the network."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
