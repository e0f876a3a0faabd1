"""The tools a model may call and the environment it may play, named in the config.

- A tool is a plain function, ``module:function`` in ``rl.tools``, with type hints and a
  Google-style docstring (``Args:`` describing each argument): its JSON schema (OpenAI's
  function format, from transformers' ``get_json_schema``) is what the chat template shows
  the model. It returns a string: what the model reads.
- An environment, ``module:Class`` in ``rl.environment``, is constructed once per
  trajectory (without arguments); ``reset(**row)`` (optional) receives the data record's
  fields and may return a first observation; its other public methods are tools with
  state (``reward`` and ``close`` are not tools: ``reward()``, optional, is the
  trajectory's reward, ``close()``, optional, is called when the trajectory ends).

`load_tools` and `load_environment` import the modules in this process (the working
directory and PYTHONPATH on ``sys.path``, as reward functions are imported: first in a
child process, bounded, so a module whose import never returns is one line too) only to
check them and derive the schemas, before anything starts: every mistake is one
ConfigError line naming the key. The calls themselves run in worker processes (`shardwise.agents.execute`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass

from transformers.utils import get_json_schema

from shardwise.data.rewards import dotted_name, import_attribute
from shardwise.errors import ConfigError, short_repr

__all__ = ["RESERVED_METHODS", "EnvironmentSpec", "ToolSpec", "all_schemas", "load_environment", "load_tools"]

RESERVED_METHODS = ("reset", "reward", "close")
"""An environment's methods that are not tools."""

_HINT = ("give it type hints on every argument and a Google-style docstring: a summary line, then "
         "'Args:' with one 'name: description' line per argument")


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its `name` (the function's ``__name__``, or the environment method's), `spec`
    (``module:function``, or ``module:Class.method``) and `schema`, the OpenAI function schema
    ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    name: str
    spec: str
    schema: dict


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment class (`spec`, ``module:Class``): its `tools` (its public methods but
    reset / reward / close) and whether it has a ``reward()`` (`has_reward`)."""

    spec: str
    tools: list[ToolSpec]
    has_reward: bool


def _resolve(spec: object, key: str, form: str, example: str) -> tuple[str, object]:
    """``(spec stripped, the object it names)``; ConfigError on `key` otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(key, f"{short_repr(spec)} names no {form}", f"write module:{form}, e.g. {example}")
    spec = spec.strip()
    module_name, _, attr_path = spec.partition(":")
    if not (dotted_name(module_name) and dotted_name(attr_path)):
        raise ConfigError(key, f"{short_repr(spec)} is not of the form module:{form}",
                          f"write a dotted module path, a colon and a {form} name, e.g. {example}")
    return spec, import_attribute(module_name, attr_path, key)


def _schema(fn: object, name: str, spec: str, key: str) -> dict:
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException, or other
        raise ConfigError(key, f"cannot derive the JSON schema of {name} ({spec}): {' '.join(str(e).split())}",
                          _HINT) from None
    schema["function"]["name"] = name
    return schema


def load_tools(specs: Sequence[str], key: str = "rl.tools") -> list[ToolSpec]:
    """The tools named by `specs` (``module:function`` each), checked and with their schemas.
    ConfigError on ``key[i]`` for: not module:function, a module that cannot be imported, no
    such function (with the nearest name), not a function, missing type hints or docstring,
    two tools of one name."""
    if isinstance(specs, str) or not isinstance(specs, Sequence):
        raise ConfigError(key, f"{short_repr(specs)} is not a list of module:function",
                          "write e.g. [my_tools:calculator, my_tools:lookup]")
    out: list[ToolSpec] = []
    seen: dict[str, str] = {}
    for i, raw in enumerate(specs):
        at = f"{key}[{i}]"
        spec, fn = _resolve(raw, at, "function", "my_tools:calculator")
        if inspect.isclass(fn) or not callable(fn):
            what = "class" if inspect.isclass(fn) else type(fn).__name__
            hint = "a class with state is an environment: name it in rl.environment" if inspect.isclass(fn) \
                else "point it at a function"
            raise ConfigError(at, f"{spec} is a {what}, not a function", hint)
        name = getattr(fn, "__name__", "") or spec.rpartition(".")[2].rpartition(":")[2]
        if name in seen:
            raise ConfigError(at, f"two tools are named {name!r} ({seen[name]} and {spec})",
                              "the model calls a tool by its function's name: rename one")
        seen[name] = spec
        out.append(ToolSpec(name, spec, _schema(fn, name, spec, at)))
    return out


def environment_methods(cls: type) -> list[str]:
    """The public methods of `cls` that are tools (all but `RESERVED_METHODS`), sorted."""
    return sorted(n for n, member in inspect.getmembers(cls)
                  if not n.startswith("_") and n not in RESERVED_METHODS
                  and (inspect.isfunction(member) or inspect.ismethod(member)))


def load_environment(spec: str | None, key: str = "rl.environment") -> EnvironmentSpec | None:
    """The environment class named by `spec` (``module:Class``; None: none), checked: a class
    constructible without arguments, whose public methods (the tools) have type hints and
    docstrings, and ``reset`` / ``reward`` callable as the runner calls them. ConfigError on
    `key` otherwise."""
    if spec is None:
        return None
    spec, cls = _resolve(spec, key, "Class", "my_env:GuessNumber")
    if not inspect.isclass(cls):
        raise ConfigError(key, f"{spec} is a {type(cls).__name__}, not a class",
                          "an environment is a class constructed once per trajectory; a plain function is a tool "
                          "(rl.tools)")
    try:
        inspect.signature(cls).bind()
    except TypeError as e:
        raise ConfigError(key, f"{spec} cannot be constructed without arguments: {e}",
                          "take the trajectory's data in reset(**row), not in __init__") from None
    except ValueError:  # no signature to inspect (a builtin): let the first construction tell
        pass
    reward = getattr(cls, "reward", None)
    if reward is not None:
        if not callable(reward):
            raise ConfigError(key, f"{spec}.reward is a {type(reward).__name__}, not a method",
                              "define reward(self) -> float, or leave it out")
        try:
            inspect.signature(reward).bind(None)
        except TypeError as e:
            raise ConfigError(key, f"{spec}.reward cannot be called without arguments: {e}",
                              "define reward(self) -> float") from None
        except ValueError:
            pass
    names = environment_methods(cls)
    if not names:
        raise ConfigError(key, f"{spec} has no public method the model could call",
                          "define methods with type hints and a docstring (reset, reward and close are not tools)")
    tools = [ToolSpec(n, f"{spec}.{n}", _schema(getattr(cls, n), n, f"{spec}.{n}", key)) for n in names]
    return EnvironmentSpec(spec, tools, reward is not None)


def check_names(tools: list[ToolSpec], env: EnvironmentSpec | None, key: str = "rl.environment") -> None:
    """No environment method has the name of a tool (the model names what it calls)."""
    if env is None:
        return
    plain = {t.name: t.spec for t in tools}
    for t in env.tools:
        if t.name in plain:
            raise ConfigError(key, f"{t.spec} has the name of the tool {plain[t.name]} ({t.name!r})",
                              "rename the method or the function: the model calls a tool by its name")


def all_schemas(tools: list[ToolSpec], env: EnvironmentSpec | None) -> list[dict]:
    """The schemas the chat template gets (``tools=``): the tools', then the environment's
    methods'. ConfigError when a method has a tool's name."""
    check_names(tools, env)
    return [t.schema for t in tools] + ([t.schema for t in env.tools] if env is not None else [])
