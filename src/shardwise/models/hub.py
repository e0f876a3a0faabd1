"""Where a job's models, tokenizers and data come from, decided once (issue 46).

`resolve_inputs` takes a loaded config and returns it with every input that names a Hub
repo id or a GGUF file replaced by a local path: ``model.path``, ``model.tokenizer``,
``model.lora.path``, ``rl.reward.model`` (folders), ``data.source`` / ``eval.source`` (a
file, or a glob of the split's files, which `shardwise.data.sources` reads as it reads
local files). Every later reader (the checks of ``prepare``, the ranks, the Ray workers,
the checkpoint's saved config, `shardwise export`) takes those plain paths.

- A local folder or file of that name wins; a name that is none and has the form
  ``ORG/NAME`` is a Hub id (anything else keeps the readers' own "does not exist").
- Downloads go through huggingface_hub's `snapshot_download` into its cache
  (``HF_HUB_CACHE``, else ``HF_HOME/hub``; ``HF_TOKEN`` for gated / private repos;
  ``HF_ENDPOINT``), read from the environment when the resolution runs. With
  ``HF_HUB_OFFLINE=1`` only the cache is read. A snapshot whose download was cut halfway
  is refused by the library itself (its tree listing names the missing files: an
  `IncompleteSnapshotError`); a file being written is a ``.incomplete`` blob, never
  linked into the snapshot.
- The process that resolves is the launching ``shardwise`` (one per node): it hands what
  it found to its ranks in `RESOLVED_ENV`, and a rank takes the local paths from there
  without asking the Hub. Under an outer torchrun (no launching ``shardwise``), each
  node's local rank 0 downloads and the node's other ranks read the same snapshot from
  the cache once it is complete, waiting at most `WAIT_ENV` seconds.
- Every failure is one `ConfigError` line naming the key, the id and the revision, before
  any process group or Ray worker starts (exit status 2): offline and not cached (with the
  ``hf download`` command that fetches it), an incomplete snapshot, no such repo, no such
  revision, a gated or private repo without access (401 / 403).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from shardwise.config import safe_yaml
from shardwise.config.schema import Config
from shardwise.errors import ConfigError
from shardwise.models.gguf import dequantized_folder

__all__ = ["RESOLVED_ENV", "fetch_command", "hub_cache", "is_hub_id", "resolve_dataset", "resolve_inputs",
           "resolve_model"]

log = logging.getLogger(__name__)

RESOLVED_ENV = "SHARDWISE_RESOLVED_INPUTS"
"""JSON ``{"<key> <given> <qualifiers>": local path}`` the launching process hands its ranks."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_]")
"""ORG/NAME as the Hub spells repo ids (huggingface_hub's validate_repo_id, with the org required)."""

MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
"""What a model download fetches: configs, safetensors weights, tokenizer files, chat
templates; never pickled weights (``*.bin``, ``*.pt``), which shardwise does not load."""
TOKENIZER_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
DATA_FORMATS = ("parquet", "jsonl", "json")
"""The file formats a Hub dataset is read in, preferred in this order."""


def is_hub_id(text: str) -> bool:
    """`text` has the form of a Hub repo id ORG/NAME (no ``--`` or ``..``, at most 96 characters)."""
    return (len(text) <= 96 and _HUB_ID.fullmatch(text) is not None and "--" not in text and ".." not in text)


def hub_cache() -> str:
    """The Hub cache folder as huggingface_hub derives it, from the environment now:
    ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def fetch_command(repo_id: str, revision: str, repo_type: str = "model") -> str:
    """The command that puts `repo_id` at `revision` into the cache (huggingface_hub's CLI)."""
    kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
    return f"hf download {repo_id}{kind} --revision {revision}"


def snapshot(repo_id: str, revision: str, key: str, repo_type: str = "model",
             allow_patterns: list[str] | None = None, revision_key: str | None = None) -> Path:
    """The local snapshot folder of `repo_id` at `revision` (`allow_patterns`: the files
    wanted), downloaded when online and missing; one ConfigError on `key` (on
    `revision_key` for a revision the repo lacks) for every failure the module docstring
    lists."""
    what = f"{'Hub ' + repo_type if repo_type != 'model' else 'Hub model'} {repo_id!r} (revision {revision!r})"
    fetch = fetch_command(repo_id, revision, repo_type)
    offline = _offline()
    if not offline and _local_rank_downloads():
        return _wait_for_local_rank0(repo_id, revision, repo_type, allow_patterns, key, what)
    try:
        folder = snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=hub_cache(),
                                   allow_patterns=allow_patterns, local_files_only=offline,
                                   endpoint=os.environ.get("HF_ENDPOINT") or None)
    except IncompleteSnapshotError as e:
        missing = re.search(r"(\d+ file\(s\) are missing \([^)]*\))", str(e))
        raise ConfigError(key, f"the cached snapshot of {what} is incomplete"
                          + (f": {missing.group(1)}" if missing else "") + " (a download cut halfway)",
                          f"complete it where the Hub is reachable: {fetch}") from None
    except RevisionNotFoundError:
        raise ConfigError(revision_key or key, f"{revision!r} is no branch, tag or commit of {repo_type} "
                          f"{repo_id!r} on the Hub", "check the revision (default main)") from None
    except GatedRepoError:
        raise ConfigError(key, f"{what} is gated: the Hub refused access (401/403)",
                          "accept its terms on huggingface.co with your account and set HF_TOKEN "
                          "(or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(key, f"no {repo_type} {repo_id!r} on the Hub, and no local path of that name (or it "
                          "is private and HF_TOKEN gives no access: 401)",
                          "check the id, or set HF_TOKEN for a private repo") from None
    except LocalEntryNotFoundError as e:
        cause = e.__cause__
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(cause, HfHubHTTPError) and status in (401, 403):
            raise ConfigError(key, f"the Hub refused access to {what} ({status})",
                              "set HF_TOKEN to a token with access to it") from None
        why = ("offline (HF_HUB_OFFLINE=1)" if offline or "HF_HUB_OFFLINE" in str(e)
               else f"the Hub is not reachable ({type(cause).__name__ if cause else 'no connection'})")
        raise ConfigError(key, f"{what} is not in the Hub cache {hub_cache()} and {why}",
                          f"fetch it where the Hub is reachable: {fetch}") from None
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        raise ConfigError(key, f"the Hub answered {status or 'an error'} for {what}: "
                          f"{' '.join(str(e).split())[:200]}", "check the id and HF_TOKEN") from None
    return Path(folder)


_CACHED = re.compile(r"(?P<kind>models|datasets)--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})"
                     r"(?:/(?P<rest>.*))?")
"""A path inside a Hub cache's snapshot, as a resolved config saves it."""


def from_other_cache(path: str, key: str) -> str | None:
    """`path`, a snapshot path a resolved config saved (``.../models--ORG--NAME/snapshots/
    <commit>/...``) that does not exist here (another machine, a moved cache), as the same
    file or folder of that commit in this process's Hub cache (fetched when online); None
    for any other path."""
    found = _CACHED.search(path)
    if found is None or Path(path).expanduser().exists():
        return None
    repo_type = "model" if found["kind"] == "models" else "dataset"
    rest = found["rest"] or ""
    folder = snapshot(f"{found['org']}/{found['name']}", found["commit"], key, repo_type=repo_type,
                      allow_patterns=[rest.replace("**", "*")] if rest else None)
    return str(folder / rest) if rest else str(folder)


WAIT_ENV = "SHARDWISE_HUB_WAIT_S"
"""Seconds a rank of an outer torchrun waits for its node's local rank 0 to download an
input (default `WAIT_S`)."""
WAIT_S = 3600.0
_POLL_S = 1.0


def _local_rank_downloads() -> bool:
    """This process is a rank of an outer torchrun (no launching ``shardwise`` handed it its
    paths) other than its node's local rank 0, which downloads for the node."""
    return os.environ.get("RANK") is not None and os.environ.get("LOCAL_RANK", "0") != "0"


def _wait_for_local_rank0(repo_id: str, revision: str, repo_type: str, allow_patterns: list[str] | None,
                          key: str, what: str) -> Path:
    """The snapshot local rank 0 is downloading, read from the cache once complete (the
    library's tree listing names every file; an incomplete snapshot is not returned), polled
    until `WAIT_ENV` seconds have passed; ConfigError on `key` then."""
    try:
        bound = float(os.environ.get(WAIT_ENV) or WAIT_S)
    except ValueError:
        bound = WAIT_S
    deadline = time.monotonic() + bound
    while True:
        try:
            return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=hub_cache(),
                                          allow_patterns=allow_patterns, local_files_only=True))
        except LocalEntryNotFoundError:
            if time.monotonic() >= deadline:
                raise ConfigError(key, f"local rank 0 did not finish downloading {what} into {hub_cache()} within "
                                  f"{bound:.0f} s", f"fetch it first ({fetch_command(repo_id, revision, repo_type)}),"
                                  f" or raise {WAIT_ENV}") from None
            time.sleep(_POLL_S)


def resolve_model(path: str, revision: str, key: str, *, files: list[str] | None = None,
                  gguf_file: str | None = None, revision_key: str | None = "model.revision") -> str:
    """A model (or tokenizer, adapter, reward model) input as a local folder: `path` itself
    when it is a local folder (or a path that names no Hub id: the readers say what is
    wrong with it); the snapshot folder of a Hub id; and with `gguf_file`, or `path` a
    ``.gguf`` file, the HF folder that file is dequantized into (`shardwise.models.gguf`)."""
    local = Path(path).expanduser()
    moved = from_other_cache(path, key)
    if moved is not None:
        return moved
    if path.lower().endswith(".gguf") and gguf_file is None:
        if not local.is_file() and not is_hub_id(str(Path(path).parent)):
            raise ConfigError(key, f"{path!r} does not exist", "point it at a .gguf file or an HF folder")
        if not local.is_file():  # ORG/NAME/file.gguf: that file of a Hub repo
            repo, gguf_file = str(Path(path).parent), Path(path).name
            return resolve_model(repo, revision, key, gguf_file=gguf_file, revision_key=revision_key)
        return str(dequantized_folder(local, key))
    if local.exists() or not is_hub_id(path):
        if gguf_file is not None:
            return str(dequantized_folder(local / gguf_file, "model.gguf_file"))
        return path
    if gguf_file is not None:
        folder = snapshot(path, revision, key, allow_patterns=[gguf_file, "*.json", "*.jinja"],
                          revision_key=revision_key)
        return str(dequantized_folder(folder / gguf_file, "model.gguf_file"))
    return str(snapshot(path, revision, key, allow_patterns=files or MODEL_FILES, revision_key=revision_key))


# ---------------------------------------------------------------------- datasets


def split_patterns(subset: str | None, split: str) -> list[str]:
    """Where the Hub's dataset layouts put the files of `split` (of `subset`, a config
    name), most specific first, each with ``{ext}`` for the file format: the layouts
    ``datasets`` reads without a dataset card, and the parquet export's
    ``<subset>/<split>/*.parquet``. Without a subset nothing below another folder than
    ``data/`` is taken: the splits of several subsets are never read as one."""
    if subset is not None:
        return [f"{subset}/{split}-*.{{ext}}", f"{subset}/{split}.{{ext}}", f"{subset}/{split}/*.{{ext}}",
                f"{subset}/data/{split}-*.{{ext}}", f"data/{subset}/{split}-*.{{ext}}",
                f"{subset}/*{split}*.{{ext}}"]
    return [f"data/{split}-*.{{ext}}", f"data/{split}.{{ext}}", f"data/{split}/*.{{ext}}", f"{split}-*.{{ext}}",
            f"{split}.{{ext}}", f"{split}/*.{{ext}}"]


def _card_patterns(folder: Path, subset: str | None, split: str, key: str) -> tuple[list[str], list[str]] | None:
    """The file patterns the dataset card (README.md's YAML header, ``configs:``) gives
    `split` of `subset` (None: the default config, or the only one), and the subsets it
    names; None when the card lists no configs."""
    card = folder / "README.md"
    if not card.is_file():
        return None
    try:
        text = card.read_text(encoding="utf-8")
        header = safe_yaml.loads(text.split("---", 2)[1]) if text.startswith("---") else None
    except (OSError, UnicodeDecodeError, ValueError, IndexError):
        return None
    configs = header.get("configs") if isinstance(header, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    configs = [c for c in configs if isinstance(c, dict) and "config_name" in c]
    names = [str(c["config_name"]) for c in configs]
    if subset is None:
        chosen = next((c for c in configs if c.get("default")), None) or \
            next((c for c in configs if c["config_name"] == "default"), None) or \
            (configs[0] if len(configs) == 1 else None)
        if chosen is None:
            return [], names
    else:
        chosen = next((c for c in configs if str(c["config_name"]) == subset), None)
        if chosen is None:
            return [], names
    files = chosen.get("data_files")
    if isinstance(files, str):
        return ([files] if split == "train" else []), names
    pats: list[str] = []
    for entry in files if isinstance(files, list) else []:
        if isinstance(entry, dict) and str(entry.get("split")) == split:
            p = entry.get("path")
            pats += [p] if isinstance(p, str) else [x for x in p or [] if isinstance(x, str)]
    return pats, names


def resolve_dataset(source: str, subset: str | None, split: str, key: str, *, subset_key: str = "data.subset",
                    split_key: str = "data.split", revision: str = "main") -> str:
    """A Hub dataset id as a local path `shardwise.data.sources` reads: the one file of
    `split` (of `subset`) in the snapshot, or a glob of its files (``.../data/train-*.parquet``).
    The files are found by the dataset card's ``configs`` when it has them, else by the
    layouts of `split_patterns`, in the first format of `DATA_FORMATS` present. Only those
    files (and the card) are downloaded."""
    first = [p.format(ext=ext) for p in split_patterns(subset, split) for ext in DATA_FORMATS]
    folder = snapshot(source, revision, key, repo_type="dataset", allow_patterns=["README.md", *first])
    card = _card_patterns(folder, subset, split, key)
    if card is not None:
        pats, names = card
        if not pats:
            if subset is None or subset not in names:
                near = f"one of {', '.join(names[:8])}" if names else "its config name"
                raise ConfigError(subset_key, f"{source!r} has subsets {', '.join(names[:8])}" + (
                    f", not {subset!r}" if subset is not None else "; name one"), f"set {subset_key} to {near}")
            raise ConfigError(split_key, f"{source!r} subset {subset!r} has no split {split!r} in its dataset card",
                              f"set {split_key} to a split it lists")
        if len(pats) > 1:
            raise ConfigError(split_key, f"{source!r}: its card gives split {split!r} as {len(pats)} file patterns "
                              f"({', '.join(pats[:3])}), which shardwise does not join yet",
                              "download the files and name one as data.source")
        folder = snapshot(source, revision, key, repo_type="dataset", allow_patterns=["README.md", pats[0]])
        return _one_path(folder, pats[0].replace("**", "*"), source, subset, split, key, split_key)
    for ext in DATA_FORMATS:
        for pat in split_patterns(subset, split):
            if sorted(folder.glob(pat.format(ext=ext))):
                return _one_path(folder, pat.format(ext=ext), source, subset, split, key, split_key)
    held = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()
                  and p.suffix.lstrip(".") in DATA_FORMATS)
    what = f"subset {subset!r} " if subset is not None else ""
    raise ConfigError(split_key, f"{source!r} holds no .parquet / .jsonl / .json file of {what}split {split!r} "
                      "in the layouts of Hub datasets", f"set {split_key} (or {subset_key}) to one it has"
                      + (f"; its data files: {', '.join(held[:5])}" if held else ""))


def _one_path(folder: Path, pattern: str, source: str, subset: str | None, split: str, key: str,
              split_key: str) -> str:
    files = sorted(p for p in folder.glob(pattern) if p.is_file())
    if not files:
        raise ConfigError(split_key, f"{source!r}: no file of split {split!r}"
                          + (f" of subset {subset!r}" if subset else "") + f" matches {pattern!r} in {folder}",
                          "check data.subset / data.split")
    return str(files[0]) if len(files) == 1 else str(folder / pattern)


# ---------------------------------------------------------------------- the whole config


def resolve_inputs(cfg: Config, data: bool = True) -> Config:
    """`cfg` with every Hub id / GGUF input replaced by its local path (module docstring);
    `cfg` itself when nothing names one. In the launching process the result is also put
    in `RESOLVED_ENV` for its ranks; a rank takes its paths from there. Without `data`:
    the model's inputs only (model.path, model.tokenizer, model.lora.path), what an
    export reads."""
    handed = _handed()
    found: dict[str, str] = {}

    def take(key: str, given: str, resolve: Callable[[], str], *qualifiers: Any) -> str:
        entry = " ".join([key, given, *(str(q) for q in qualifiers)])
        path = handed.get(entry)
        if path is None:
            path = resolve()
        if path != given:
            found[entry] = path
        return path

    m = cfg.model
    update: dict[str, dict[str, Any]] = {}
    if m.path is not None:
        path = take("model.path", m.path, lambda: resolve_model(m.path, m.revision, "model.path",
                                                                  gguf_file=m.gguf_file), m.revision, m.gguf_file)
        if path != m.path or m.gguf_file is not None:
            update.setdefault("model", {}).update(path=path, gguf_file=None)
        elif "revision" in m.model_fields_set and m.revision != "main" and os.environ.get("RANK") is None:
            log.warning("model.revision=%s has no effect: model.path %r is a local folder", m.revision, m.path)
    elif m.gguf_file is not None:
        raise ConfigError("model.gguf_file", f"{m.gguf_file!r} needs model.path, the folder or Hub id holding it",
                          "set model.path, or name the .gguf file itself as model.path")
    if m.tokenizer is not None:
        rev = m.revision if m.tokenizer == m.path else "main"
        tok = take("model.tokenizer", m.tokenizer, lambda: resolve_model(
            m.tokenizer, rev, "model.tokenizer", files=TOKENIZER_FILES,
            revision_key="model.revision" if rev != "main" else None), rev)
        if tok != m.tokenizer:
            update.setdefault("model", {})["tokenizer"] = tok
    if m.lora.path is not None:
        lora = take("model.lora.path", m.lora.path, lambda: resolve_model(
            m.lora.path, "main", "model.lora.path", files=["*.json", "*.safetensors"], revision_key=None))
        if lora != m.lora.path:
            update.setdefault("model", {})["lora"] = m.lora.model_copy(update={"path": lora})
    if data:
        update.update(_job_inputs(cfg, take))
    if not update:
        return cfg
    if found and os.environ.get("RANK") is None:  # the launching process: its ranks take these paths
        os.environ[RESOLVED_ENV] = json.dumps(found)
    return cfg.model_copy(update={name: getattr(cfg, name).model_copy(update=fields)
                                  for name, fields in update.items()})


def _job_inputs(cfg: Config, take: Callable[..., str]) -> dict[str, dict[str, Any]]:
    """The sections' updates for the inputs beside the model: rl.reward.model, and
    data.source / eval.source (a dataset id, or a snapshot path of another cache)."""
    d, e = cfg.data, cfg.eval
    update: dict[str, dict[str, Any]] = {}
    rm = cfg.rl.reward.model
    if rm is not None:
        reward = take("rl.reward.model", rm, lambda: resolve_model(rm, "main", "rl.reward.model", revision_key=None))
        if reward != rm:
            update["rl"] = {"reward": cfg.rl.reward.model_copy(update={"model": reward})}
    for name, sec, split in (("data", d, d.split), ("eval", e, e.split)):
        src = sec.source
        if src is None:
            continue
        moved = from_other_cache(src, f"{name}.source")
        if moved is not None:
            update[name] = {"source": moved}
        elif _is_dataset_id(src):
            update[name] = {"source": take(f"{name}.source", src, lambda src=src, name=name, split=split:
                                           resolve_dataset(src, d.subset, split, f"{name}.source",
                                                           split_key=f"{name}.split"), d.subset, split)}
    return update


def _is_dataset_id(source: str) -> bool:
    """``data.source`` names a Hub dataset: no built-in task, no local path, no file name."""
    return (not source.startswith("builtin:") and not Path(source).expanduser().exists() and is_hub_id(source)
            and not source.lower().endswith((".jsonl", ".json", ".parquet")))


def _handed() -> dict[str, str]:
    """What the launching process resolved (`RESOLVED_ENV`), in a rank; empty elsewhere."""
    if os.environ.get("RANK") is None:
        return {}
    try:
        handed = json.loads(os.environ.get(RESOLVED_ENV) or "{}")
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in handed.items()} if isinstance(handed, dict) else {}
