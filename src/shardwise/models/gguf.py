"""A GGUF file as an HF folder the rest of a job reads (issue 46).

`dequantized_folder` loads the file once through transformers' GGUF support (the `gguf`
package; llama, mistral, qwen2, qwen3, gemma ... as transformers maps them), dequantized
to fp32, and writes it with ``save_pretrained`` (config.json, safetensors, and the
tokenizer the file describes, chat template included) into
``$XDG_CACHE_HOME/shardwise/gguf/<name>-<digest>`` (default ``~/.cache/shardwise``), the
digest taken over the file's real path, size and modification time. A second job on the
same file reads that folder. The folder is written under a temporary name and renamed
when complete, under a file lock (bounded by `LOCK_TIMEOUT_S`), so two jobs converting at
once write it once and a conversion cut halfway is never read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path

import torch
import transformers
from filelock import FileLock, Timeout

from shardwise.errors import ConfigError

__all__ = ["LOCK_TIMEOUT_S", "dequantized_folder", "gguf_cache"]

log = logging.getLogger(__name__)

LOCK_TIMEOUT_S = 1800.0
"""How long a job waits for another one converting the same file."""


def gguf_cache() -> Path:
    """Where converted GGUF files are kept: ``$XDG_CACHE_HOME/shardwise/gguf``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardwise" / "gguf"


def dequantized_folder(file: Path, key: str) -> Path:
    """The HF folder of the GGUF `file` (converted now when not kept yet); ConfigError on
    `key` when the file is missing or transformers cannot load it."""
    file = Path(file).expanduser()
    if not file.is_file():
        raise ConfigError(key, f"{str(file)!r} does not exist", "point it at a .gguf file")
    st = file.stat()
    digest = hashlib.sha256(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = gguf_cache() / f"{file.stem}-{digest}"
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(out) + ".lock", timeout=LOCK_TIMEOUT_S):
            if not (out / "config.json").is_file():
                _convert(file, out, key)
    except Timeout:
        raise ConfigError(key, f"another process held the conversion lock of {str(file)!r} ({out}.lock) for "
                          f"{LOCK_TIMEOUT_S:.0f} s", "wait for it to finish, or remove the lock file if none "
                          "runs") from None
    return out


def _convert(file: Path, out: Path, key: str) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(key, f"reading {str(file)!r} needs the gguf package, which is not installed",
                          "pip install gguf")
    log.warning("converting %s to an HF folder in %s (once)", file, out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                                                      dtype=torch.float32)
        except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as e:
            first = " ".join(str(e).split())[:200]
            raise ConfigError(key, f"transformers cannot load {str(file)!r}: {first}",
                              "use a GGUF of an architecture transformers reads (llama, mistral, qwen2, qwen3, "
                              "gemma ...), or an HF folder") from None
        model.config.quantization_config = None  # the folder holds plain weights
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(str(tmp))
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
            tok.save_pretrained(str(tmp))
        except (ValueError, KeyError, OSError, TypeError) as e:
            log.warning("%s: no tokenizer read from the file (%s); set model.tokenizer", file, e)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
