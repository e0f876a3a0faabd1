"""The user documentation (README.md and docs/*.md) against the code: the site builds in
strict mode, every config key the pages name is a key of the schema, and every `shardwise`
command line they show parses. In seconds, no training.

What is read:

- config keys: the inline code spans (`rl.actor.clip_ratio`, `data.packing: true`,
  `eval.k=[1,8]`, `run.dir/hf/`) whose text starts with a section of the schema followed by
  a dotted key, and every key of a YAML example whose top-level keys are sections (which
  then loads as a config, values checked too). A key
  under a free-form mapping (`model.config.hidden_size`, `fsdp.module_precision.lm_head`) is
  that mapping's; `*` is a glob (`data.*_key`). A YAML example of another system's config is
  skipped when its first line is a comment naming it (`# verl`, `# ROLL`, ...:
  `FOREIGN_YAML`).
- command lines: in ```bash / sh / console blocks every line that starts `shardwise` (after
  `$ ` and `VAR=value` prefixes; also `-m shardwise.cli`), in other blocks the `$ shardwise`
  lines, parsed by the real argument parser as `shardwise.cli.main` parses them; their
  `key=value` overrides are keys of the schema, and where CONFIG is one of the repository's
  files the config loads with them. `[--opt X]` brackets of a synopsis are read as written
  without them. An inline `shardwise ...` span that names a .yaml file is a command line too;
  any other is a mention: its subcommand and its `--options` must exist.
- the README's links into docs/ lead to a page and, with `#anchor`, to one of its headings
  (GitHub's anchors; mkdocs checks its own in the site's pages).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import os
import re
import shlex
import subprocess
import sys
import types
from functools import cache
from pathlib import Path
from typing import Union, get_args, get_origin

import yaml
from dist.common import import_optional
from dist.launcher import REPO_ROOT

from shardwise.cli import build_parser
from shardwise.config.describe import schema_keys
from shardwise.config.load import config_from_dict, load_config
from shardwise.errors import ConfigError, did_you_mean

DOCS = REPO_ROOT / "docs"
PAGES = [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

PENDING_PAGES: set[str] = set()
"""Pages of docs/ written in parallel branches of issue 49: the README links them (and
mkdocs.yml names them in commented nav lines) before they are merged. A link to one is
tolerated only while the page is missing; once it is there it is checked like any other.
Empty this set when they have all landed."""

NOT_KEYS = {
    "rl.png": "the plot a `shardwise rl` run writes into run.dir",
}
"""Spans that start like a config key and are not one, with why; each must still be named by
a page (a module pattern such as `model.layers.{0-3}.mlp` needs no entry: a key is followed
by the span's end, a space or one of `=:/[,)`, never by `.{`)."""

FOREIGN_YAML = re.compile(r"#\s*(verl|roll|mindspeed|rlinf|trl|openrlhf|torchtitan|not shardwise)\b", re.I)
"""The first line of a YAML example that is another system's config."""


@cache
def schema() -> tuple[set[str], set[str], set[str]]:
    """(every key, the sections, the keys whose value is a free-form mapping)."""
    keys, mappings = set(), set()
    for k in schema_keys():
        keys.add(k.name)
        if not k.section and _is_mapping(k.field.annotation):
            mappings.add(k.name)
    return keys, {k.split(".")[0] for k in keys}, mappings


def _is_mapping(annotation) -> bool:
    if get_origin(annotation) is dict:
        return True
    return get_origin(annotation) in (Union, types.UnionType) and any(_is_mapping(a) for a in get_args(annotation))


def key_problem(key: str) -> str | None:
    """None when `key` names the schema (a key, a section, a glob over them, or inside a
    free-form mapping); else what is wrong."""
    keys, _, mappings = schema()
    if key in keys or key in NOT_KEYS or any(key.startswith(n + ".") for n in NOT_KEYS):
        return None
    if "*" in key:
        return None if any(fnmatch.fnmatchcase(k, key) for k in keys) else f"{key!r} matches no key"
    if any(key.startswith(m + ".") for m in mappings):
        return None
    return f"{key!r} is no key of the schema{_hint(key)}"


def _hint(key: str) -> str:
    hint = did_you_mean(key, sorted(schema()[0]))
    return f" ({hint})" if hint else ""


# --------------------------------------------------------------------------- reading pages


def split_page(text: str) -> tuple[str, list[tuple[str, int, str]]]:
    """(the prose with fenced blocks blanked, [(language, first line number, block text)])."""
    prose, blocks = [], []
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = (stripped[3:].strip().lower(), n + 1, [])
            prose.append("")
        elif fence is not None and stripped.startswith("```"):
            blocks.append((fence[0], fence[1], "\n".join(fence[2])))
            fence = None
            prose.append("")
        elif fence is not None:
            fence[2].append(line)
            prose.append("")
        else:
            prose.append(line)
    assert fence is None, f"a code block opened at line {fence[1] - 1} is not closed"
    return "\n".join(prose), blocks


def code_spans(prose: str) -> list[tuple[int, str]]:
    """(line number, text) of each inline code span, whitespace of a span that wraps lines
    made single."""
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose)]


def span_key(span: str) -> str | None:
    """The config key a code span starts with, if it starts with one."""
    sections = "|".join(sorted(schema()[1]))
    m = re.match(rf"(?:{sections})(?:\.(?:[A-Za-z_*][\w*]*))+(?=$|[\s=:/\[,)])", span)
    return m.group(0) if m else None


def yaml_keys(data, prefix: str = "") -> list[str]:
    """The dotted keys of a YAML example, stopping inside free-form mappings."""
    out = []
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.append(key)
        if isinstance(v, dict) and key not in schema()[2]:
            out.extend(yaml_keys(v, key))
    return out


def command_lines(lang: str, block: str) -> list[list[str]]:
    """The `shardwise` argument lists of a code block (continuation lines joined)."""
    shell = lang in ("bash", "sh", "shell", "console")
    out = []
    for line in block.replace("\\\n", " ").split("\n"):
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        elif not shell:
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
            words.pop(0)  # VAR=value prefixes
        if "-m" in words and "shardwise.cli" in words:
            words = words[words.index("shardwise.cli") + 1:]
        elif words[:1] == ["shardwise"]:
            words = words[1:]
        else:
            continue
        out.append(_unbracket(words))
    return out


def _unbracket(words: list[str]) -> list[str]:
    """A synopsis's `[--opt X]` read as `--opt X`."""
    out, depth = [], 0
    for w in words:
        while w.startswith("[") and (w[1:2] == "-" or depth):
            w, depth = w[1:], depth + 1
        while depth and w.endswith("]"):
            w, depth = w[:-1], depth - 1
        out.append(w)
    return out


def parse_command(words: list[str]) -> argparse.Namespace:
    """`words` parsed as `shardwise.cli.main` parses them (its options and overrides in any
    order); SystemExit with argparse's message otherwise."""
    parser = build_parser()
    args, rest = parser.parse_known_args(words)
    unknown = [r for r in rest if r.startswith("-")]
    if unknown or (rest and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or rest)}")
    if hasattr(args, "overrides"):
        args.overrides = list(args.overrides) + rest
    return args


def command_problem(words: list[str]) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_command(words)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    for override in getattr(args, "overrides", []):
        if "=" not in override:
            return f"{override!r} is neither an option nor a key=value override"
        problem = key_problem(override.split("=", 1)[0])
        if problem:
            return problem
    config = getattr(args, "config", None)
    if config and not getattr(args, "dialect", None) and (REPO_ROOT / config).is_file():
        try:
            load_config(REPO_ROOT / config, args.overrides)
        except ConfigError as e:
            return f"does not load: {e}"
    return None


@cache
def subcommand_options() -> dict[str, set[str]]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {name: set(p._option_string_actions) for name, p in sub.choices.items()}


def mention_problem(span: str) -> str | None:
    """An inline `shardwise CMD [--opt ...]`: the command and its options exist."""
    words = _unbracket(span.replace("|", " ").split())[1:]
    options = subcommand_options()
    if not words or words[0] not in options:
        return f"no command {words[:1]}"
    for w in words[1:]:
        if w.startswith("--") and w.split("=")[0] not in options[words[0]]:
            return f"`shardwise {words[0]}` has no option {w.split('=')[0]}"
        if re.match(r"[a-z_]+\.[\w.]+=", w):
            problem = key_problem(w.split("=", 1)[0])
            if problem:
                return problem
    return None


# --------------------------------------------------------------------------- the checks


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(REPO_ROOT)}:{line}"


def test_every_config_key_the_docs_name_is_in_the_schema():
    problems, named, exempt = [], 0, set()
    for page in PAGES:
        prose, blocks = split_page(page.read_text())
        for line, span in code_spans(prose):
            key = span_key(span)
            if key:
                named += 1
                exempt |= {n for n in NOT_KEYS if key == n or key.startswith(n + ".")}
                if problem := key_problem(key):
                    problems.append(f"{_where(page, line)}: `{span}`: {problem}")
        for lang, line, block in blocks:
            if lang not in ("yaml", "yml") or FOREIGN_YAML.match(block.lstrip()):
                continue
            data = yaml.safe_load(block)
            if not isinstance(data, dict) or not set(data) & schema()[1]:
                continue
            keyed = [p for key in yaml_keys(data) if (p := key_problem(key))]
            named += len(yaml_keys(data))
            problems += [f"{_where(page, line)}: YAML example: {p}" for p in keyed]
            if not keyed:
                try:  # and its values: the example loads as a config of its own
                    config_from_dict(data)
                except ConfigError as e:
                    problems.append(f"{_where(page, line)}: YAML example does not load: {e}")
    assert named > 200, f"only {named} config keys found in the docs: is the reading broken?"
    assert not problems, "config keys the docs name that the schema does not have:\n" + "\n".join(problems)
    assert exempt == set(NOT_KEYS), f"NOT_KEYS holds {set(NOT_KEYS) - exempt}, which no page names: remove it"


def test_every_shardwise_command_the_docs_show_parses():
    problems, commands, mentions = [], 0, 0
    for page in PAGES:
        prose, blocks = split_page(page.read_text())
        for lang, line, block in blocks:
            for words in command_lines(lang, block):
                commands += 1
                if problem := command_problem(words):
                    problems.append(f"{_where(page, line)}: shardwise {' '.join(words)}: {problem}")
        for line, span in code_spans(prose):
            if span.startswith("shardwise ") and not span.startswith("shardwise.") and ":" not in span.split()[1]:
                mentions += 1
                words = shlex.split(span)[1:]
                concrete = any(w.endswith((".yaml", ".yml")) for w in words) and not re.search(r"[\[|]", span)
                if problem := (command_problem(words) if concrete else mention_problem(span)):
                    problems.append(f"{_where(page, line)}: `{span}`: {problem}")
    assert commands > 25 and mentions > 40, (commands, mentions)
    assert not problems, "command lines in the docs that do not parse:\n" + "\n".join(problems)


def test_the_checks_catch_what_they_are_for():
    """The readers above find a wrong key, option and override (so a pass means something)."""
    assert key_problem("rl.actor.clip_ratio") is None and key_problem("model.config.hidden_size") is None
    assert key_problem("data.*_key") is None
    assert "rl.actor.clip_ratio" in key_problem("rl.actor.clip_ratoi")
    assert span_key("train.optimizer.lr=1e-5") == "train.optimizer.lr" and span_key("run.dir/hf/") == "run.dir"
    assert span_key("runs/sft") is None
    assert command_problem(["rl", "examples/grpo_reverse.yaml", "--nproc", "2", "rl.rollout.n=4"]) is None
    assert "--nprocs" in command_problem(["rl", "examples/grpo_reverse.yaml", "--nprocs", "2"])
    assert "rl.rollout.m" in command_problem(["rl", "examples/grpo_reverse.yaml", "rl.rollout.m=4"])
    assert "does not load" in command_problem(["rl", "examples/grpo_reverse.yaml", "rl.rollout.n=-1"])
    assert command_lines("bash", "RAY_ADDRESS=h:1 shardwise plan c.yaml [--mfu 0.3]  # x\nls") == [
        ["plan", "c.yaml", "--mfu", "0.3"]]
    assert "--scan" not in (mention_problem("shardwise plan CONFIG [--scan N,N,...]") or "")
    assert "--scna" in mention_problem("shardwise plan --scna")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped,
    each space a `-`."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(page: Path) -> set[str]:
    prose, _ = split_page(page.read_text())
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose, re.M)}


def test_the_readme_links_every_page_and_each_link_lands():
    readme = (REPO_ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    problems = []
    for target, anchor in links:
        path = REPO_ROOT / target
        if not path.is_file():
            if path.name not in PENDING_PAGES:
                problems.append(f"README links {target}, which does not exist")
        elif anchor and anchor not in headings(path):
            problems.append(f"README links {target}#{anchor}: no such heading")
    linked = {Path(t).name for t, _ in links}
    problems += [f"README does not link docs/{p.name}" for p in DOCS.glob("*.md") if p.name not in linked]
    assert not problems, "\n".join(problems)
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 250, "the README is a landing page"


def test_the_site_builds_in_strict_mode(tmp_path):
    """mkdocs build --strict: a broken link or anchor, a nav entry without its page or a page
    the nav leaves out fails it (mkdocs.yml's `validation`)."""
    import_optional("mkdocs", "pip install -e '.[docs]'")
    import_optional("material", "pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's notice of its successor, once per build
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                          "--config-file", str(REPO_ROOT / "mkdocs.yml")],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "rl" / "index.html").is_file()
