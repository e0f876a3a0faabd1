"""Checks of the files a config names, run by every job's `prepare` in the launching
process: before any process group, Ray worker or file of the run exists.

Each check raises one `ShardwiseError` (exit status 2, one line) naming the key and what
to change. What they cover: the model folder (config.json and readable safetensors, no
pickles), the tokenizer folder, the data source (readable, parseable, not empty, with the
keys), and an explicit ``checkpoint.resume`` folder (a complete checkpoint).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from shardwise.agents.tools import EnvironmentSpec, ToolSpec, all_schemas, load_environment, load_tools
from shardwise.checkpoint.dcp import CheckpointManager, incomplete_reason, is_complete
from shardwise.config.schema import Config
from shardwise.data.chat import text_prompts_as_chat, use_chat_template
from shardwise.data.collate import example_loss_tokens
from shardwise.data.encode import UNLIMITED, encode_record, encode_records
from shardwise.data.sources import load_records
from shardwise.data.tasks import task_needs_tools
from shardwise.data.tokenizer import (
    build_char_tokenizer,
    check_vocab,
    has_tokenizer_files,
    load_tokenizer,
    locate_tokenizer,
)
from shardwise.errors import ConfigError
from shardwise.jobs.resume import check_same_job
from shardwise.models.loading import check_task, check_weights_folder, load_hf_config
from shardwise.models.vision import VisionInputs, is_vision_language, resolve_images


def check_model(cfg: Config) -> None:
    """``model.path`` (when set) holds config.json and readable safetensors weights, and
    the model's config fits ``model.task`` (`shardwise.models.loading.check_task`)."""
    if cfg.model.path is not None:
        check_weights_folder(cfg.model.path, "model.path")
    check_task(load_hf_config(cfg.model), cfg.model.task)


def check_causal_task(cfg: Config, what: str) -> None:
    """`what` (a command: generation, RL) runs causal LMs only: ConfigError on ``model.task``
    for the encoder tasks, which only `shardwise train` trains."""
    if cfg.model.task != "causal_lm":
        raise ConfigError("model.task", f"{what} generates text and needs a causal LM, not {cfg.model.task}",
                          "set model.task=causal_lm (encoders are trained by `shardwise train`)")


def check_tokenizer(cfg: Config) -> None:
    """An explicit ``model.tokenizer`` folder holds tokenizer files."""
    if cfg.model.tokenizer is not None and not has_tokenizer_files(cfg.model.tokenizer):
        raise ConfigError("model.tokenizer", f"{cfg.model.tokenizer!r} holds no tokenizer files",
                          "point it at a folder with tokenizer.json (or vocab files), or leave it unset")


def check_resume(cfg: Config, job: str | None = None) -> None:
    """The checkpoint to resume passes the quick checks (`CheckpointManager.check_resumable`:
    an explicit folder is a complete checkpoint, and with auto some checkpoint of the run
    is; the checksums are verified by the ranks when they load). With `job`
    (``train``, ``rl``): the checkpoint to be resumed was written by that command for the
    same model, and no setting differs from the saved run's that a resume refuses
    (`shardwise.jobs.resume.check_same_job`: model.path, ...); the others are listed in one
    note."""
    resume = cfg.checkpoint.resume
    if resume == "never":
        return
    if resume == "auto":
        latest = CheckpointManager(cfg.run.dir, cfg.checkpoint, None).check_resumable()
        if job is not None and latest is not None:
            check_same_job(cfg, job, latest, "run.dir")
        return
    path = Path(resume).expanduser()
    if is_complete(path):
        CheckpointManager(cfg.run.dir, cfg.checkpoint, None).check_resumable()
        if job is not None:
            check_same_job(cfg, job, path, "checkpoint.resume")
        return
    hint = "use auto, never, or a folder like <run.dir>/checkpoints/step_00000100"
    inner = CheckpointManager(path, cfg.checkpoint, None).latest() if path.is_dir() else None
    if inner is not None:
        hint = f"did you mean {inner}?"
    raise ConfigError("checkpoint.resume", f"{resume!r} {incomplete_reason(path)}", hint)


def ground_truth_key(cfg: Config) -> tuple[str, str]:
    """The column scorers compare against and the config key that names it:
    ``data.ground_truth_key`` when set, else ``data.response_key``."""
    if cfg.data.ground_truth_key is not None:
        return cfg.data.ground_truth_key, "data.ground_truth_key"
    return cfg.data.response_key, "data.response_key"


def check_data(cfg: Config, response_key: str | None, seed: int | None = None,
               num_builtin: int | None = None, heldout: bool = False, sft: bool = False,
               scoring: bool = False, response_name: str = "data.response_key") -> list[dict[str, Any]]:
    """The records of ``data.source`` (every read, parse and key problem raised here).
    A built-in task makes `num_builtin` examples (default: ``data.num_examples``) from `seed`
    (default ``run.seed``); `heldout`: its held-out examples (true answers). For a VL model
    every record also carries its image (``data.image_key``), checked readable.

    `sft`: records are training examples (conversations from ``data.messages_key``);
    `response_name`: the config key that set `response_key`, for messages
    (`ground_truth_key`). Otherwise prompts, which with `scoring` also carry ``data_source`` and ``extra_info``
    (``data.data_source_key`` / ``data.extra_info_key``; required only when set). Each
    record carries ``"where"`` (file and row, for messages). When the data are chat messages
    (or a template file is set) every record is rendered and tokenized here with the job's
    tokenizer, so a template that fails, a tokenizer without one or an unusable turn is an
    error before anything starts.
    """
    d = cfg.data
    vl = vision_inputs(cfg) is not None
    extra = {}
    if scoring:
        extra = {"data_source": (d.data_source_key, "data.data_source_key", "data_source_key" in d.model_fields_set),
                 "extra_info": (d.extra_info_key, "data.extra_info_key", "extra_info_key" in d.model_fields_set)}
    records = load_records(d.source, d.prompt_key, response_key, seed=cfg.run.seed if seed is None else seed,
                           num_builtin=d.num_examples if num_builtin is None else num_builtin, heldout=heldout,
                           image_key=("image" if d.source.startswith("builtin:") else d.image_key) if vl else None,
                           key_names=("data.prompt_key", response_name),
                           messages_key=d.messages_key if sft else None, fmt=d.format, conversations=sft,
                           as_chat=text_prompts_as_chat(d), extra_keys=extra)
    if vl:
        resolve_images(records, "image", d.source)
    if any("messages" in r or isinstance(r.get("prompt"), list) for r in records):
        check_chat(cfg, records, sft, vl)
    return records


def check_chat(cfg: Config, records: list[dict[str, Any]], sft: bool, vl: bool) -> None:
    """Chat records render: a template exists (``data.chat_template`` or the tokenizer's)
    and every conversation / prompt renders and tokenizes."""
    d = cfg.data
    if vl:
        raise ConfigError("data.format", "chat messages for vision-language models are not supported yet",
                          "use text prompts (data.format=text)")
    if d.chat_template == "none":
        raise ConfigError("data.chat_template", f"none, but {d.source!r} holds chat messages",
                          "set auto (the tokenizer's template) or the path of a template file")
    encode_records(job_tokenizer(cfg), records, d.max_length, d.train_on, prompts=not sft, progress=True)


def check_tokens(cfg: Config, records: list[dict[str, Any]] | None = None) -> None:
    """What the ranks found only after launch (issue 22, item 14), with the job's tokenizer:
    the model's ``vocab_size`` holds every token id it makes; and with SFT `records` (text
    or chat, not images), ``data.max_length`` keeps a trained (response) token of some
    example (at 1, none kept one and the first global batch failed on every rank). The
    error names the smallest value that works."""
    tokenizer = job_tokenizer(cfg)
    check_vocab(tokenizer, load_hf_config(cfg.model).get_text_config().vocab_size)
    if not records or any("image" in r for r in records):
        return
    d = cfg.data
    # lazily: the first example with a trained token ends the check (usually the first one)
    if any(example_loss_tokens(encode_record(tokenizer, r, d.max_length, d.train_on).example) for r in records):
        return
    firsts = []
    for e in encode_records(tokenizer, records, UNLIMITED, d.train_on):
        mask = e.loss_mask
        firsts += [next((i + 1 for i, m in enumerate(mask) if m and i > 0), None)]  # position 0 is never a label
    needed = [n for n in firsts if n is not None]
    if not needed:
        raise ConfigError("data.train_on", f"{d.train_on}: no example of {d.source!r} has a token to train on",
                          "set data.train_on=all, or check data.response_key / the assistant turns")
    raise ConfigError("data.max_length", f"{d.max_length} keeps no trained (response) token of any of the "
                      f"{len(records)} examples (their prompts are longer)",
                      f"set data.max_length >= {max(needed)}, the smallest that keeps a trained token of every "
                      "example, or more to keep whole responses")


def wants_tools_tokenizer(cfg: Config) -> bool:
    """A job that builds the built-in tokenizer builds its tools variant (Hermes tool calls
    in its template, `shardwise.data.tokenizer`): its data are a built-in task that calls
    tools (``builtin:calc``, ``builtin:guess``), or its rollouts do (``rl.multi_turn``,
    ``infer.multi_turn``)."""
    return task_needs_tools(cfg.data.source) or cfg.rl.multi_turn.enabled or cfg.infer.multi_turn.enabled


def job_tokenizer(cfg: Config):
    """The tokenizer a job will use, for checks before it starts: ``model.tokenizer`` /
    ``model.path``'s / the run's built-in one, else the built-in one (its tools variant
    when `wants_tools_tokenizer`) built in a temporary folder (a job builds it in run.dir);
    with ``data.chat_template`` applied."""
    found = locate_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir)
    if found is None:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer = build_char_tokenizer(tmp, tools=wants_tools_tokenizer(cfg))
    else:
        tokenizer = load_tokenizer(found)
    return use_chat_template(tokenizer, cfg.data.chat_template)


def vision_inputs(cfg: Config, tokenizer=None) -> VisionInputs | None:
    """The image encoder of a VL model (None for a text model), after the checks only a VL
    job needs: one image per example does not pack, Ulysses splits no image, the roles and
    engines that take images are the actor, the reference and the HF rollout, and the
    vision token ids are no ordinary tokens of `tokenizer` (default: the one a job would
    find on disk, else the built-in one it would build)."""
    hf = load_hf_config(cfg.model)
    if not is_vision_language(hf):
        return None
    if cfg.data.packing:
        raise ConfigError("data.packing", "vision-language examples are not packed (one image per row)",
                          "set data.packing=false")
    if cfg.parallel.ulysses_size > 1:
        raise ConfigError("parallel.ulysses_size", "Ulysses sequence parallel does not split a vision-language "
                          "model's image tokens and 3-D rotary positions", "set parallel.ulysses_size=1")
    if cfg.rl.packing:
        raise ConfigError("rl.packing", "a vision-language model's rows are not packed (3-D rotary positions, "
                          "one image per row)", "set rl.packing=false (or leave it unset)")
    budgets = {"rl.actor.max_tokens_per_micro_batch": cfg.rl.actor.max_tokens_per_micro_batch,
               "rl.log_prob_max_tokens_per_micro_batch": cfg.rl.log_prob_max_tokens_per_micro_batch}
    for key, budget in budgets.items():
        if budget is not None:
            raise ConfigError(key, "a vision-language model's micro-batches are made by rows (one image each)",
                              "unset it; train.micro_batch_size sets the rows")
    for key, engine in (("rl.rollout.engine", cfg.rl.rollout.engine), ("infer.engine", cfg.infer.engine)):
        if engine != "hf":
            raise ConfigError(key, f"the {engine} engine takes no images from shardwise yet", "use hf")
    if cfg.rl.critic.enabled or cfg.rl.reward.model is not None:
        key = "rl.critic.enabled" if cfg.rl.critic.enabled else "rl.reward.model"
        raise ConfigError(key, "critic and reward models of a vision-language policy are not supported",
                          "use GRPO (rl.advantage: grpo) with a rule-based reward")
    vision = VisionInputs(hf, cfg.data.image_size)
    need = len(vision.prompt_prefix) + 3  # bos, the image, a prompt token, an answer token
    if cfg.data.max_length < need:
        raise ConfigError("data.max_length", f"{cfg.data.max_length} tokens leave no room for text after an "
                          f"image's {len(vision.prompt_prefix)} tokens (data.image_size={cfg.data.image_size})",
                          f"raise it to at least {need}, or lower data.image_size")
    if tokenizer is None:
        found = locate_tokenizer(cfg.model.tokenizer, cfg.model.path, cfg.run.dir)
        tokenizer = load_tokenizer(found) if found is not None else None
    vision.check_tokenizer(tokenizer)
    return vision


def check_agents(cfg: Config, section: str) -> tuple[list[dict], list[ToolSpec], EnvironmentSpec | None] | None:
    """With ``<section>.multi_turn.enabled`` (`section`: rl or infer): the tools and the
    environment imported and checked here (`shardwise.agents.tools`: one ConfigError line
    naming the key for a module that cannot be imported, a function without type hints or
    docstring, ...), before any process starts; returns the schemas the chat template gets,
    the tools and the environment. None when multi-turn is off (``<section>.tools`` /
    ``.environment`` are then ignored, with a warning)."""
    sec = cfg.rl if section == "rl" else cfg.infer
    if not sec.multi_turn.enabled:
        if sec.tools or sec.environment is not None:
            logging.getLogger(__name__).warning("%s.tools / %s.environment have no effect with "
                                                "%s.multi_turn.enabled=false", section, section, section)
        return None
    if is_vision_language(load_hf_config(cfg.model)):
        raise ConfigError(f"{section}.multi_turn.enabled", "multi-turn rollouts of a vision-language model are "
                          "not supported yet", f"set {section}.multi_turn.enabled=false, or use a text model")
    tools = load_tools(sec.tools, f"{section}.tools")
    env = load_environment(sec.environment, f"{section}.environment")
    return all_schemas(tools, env), tools, env
