"""Named implementations that a config key selects: one registry per key.

A registry maps names (what a user writes, e.g. ``rl.advantage: rloo``) to the functions
that implement them. The module that defines the functions registers each with a
decorator, so adding one is one edit; the config schema checks a name against the same
registry, so it needs no second list. The schema sits below the modules that register
(``config`` < ``rl``), so a registry knows the module that fills it and imports it, by name,
the first time its names are asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

from shardwise.errors import ConfigError, did_you_mean

__all__ = ["ADVANTAGE_ESTIMATORS", "POLICY_LOSSES", "TRACKERS", "Registry"]


class Registry:
    """Implementations registered under names, for the config key `key`."""

    def __init__(self, key: str, provider: str):
        self.key = key
        self.provider = provider
        """The module whose import registers the implementations."""
        self._entries: dict[str, Callable[..., Any]] = {}
        self._traits: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **traits: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register the function as `name`. `traits` are facts about it that
        config checks read (e.g. ``needs_critic=True``)."""
        def add(fn: Callable[..., Any]) -> Callable[..., Any]:
            assert name not in self._entries, f"{self.key}: {name!r} registered twice"
            self._entries[name] = fn
            self._traits[name] = dict(traits)
            return fn

        return add

    def traits(self, name: str) -> dict[str, Any]:
        """The facts registered with `name` (ConfigError for an unknown name)."""
        self.check(name)
        return self._traits[name]

    def _filled(self) -> dict[str, Callable[..., Any]]:
        if not self._entries:
            importlib.import_module(self.provider)
        return self._entries

    def names(self) -> list[str]:
        return list(self._filled())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self._filled()

    def get(self, name: str) -> Callable[..., Any]:
        """The implementation called `name`; ConfigError on the key otherwise."""
        return self._filled()[self.check(name)]

    def check(self, name: str) -> str:
        """`name` when it is registered; a ConfigError on the key naming the nearest one."""
        if name not in self._filled():
            raise ConfigError(self.key, f"{name!r} is not a valid choice",
                              did_you_mean(str(name), self.names()))
        return name

    def check_or_path(self, name: str) -> str:
        """`name` when it is registered or of the form ``module:function`` (a user's
        implementation, imported where it runs; the form is checked here, the import
        before launch); a ConfigError on the key naming the nearest name otherwise."""
        module, sep, attr = str(name).partition(":")
        if sep and all(p.isidentifier() for part in (module, attr) for p in part.split(".")):
            return name
        return self.check(name)


ADVANTAGE_ESTIMATORS = Registry("rl.advantage", "shardwise.rl.algorithms")
"""``rl.advantage``: ``fn(rewards, mask, *, values, group_ids, gamma, lam, **options) ->
(advantages, returns)``, all ``(batch, seq)``; options (``norm_adv_by_std``,
``reward_baselines``, ``epsilon``) are passed where the function takes them. Traits:
``needs_critic``, ``compares_samples``, ``needs_baseline``."""

POLICY_LOSSES = Registry("rl.actor.policy_loss", "shardwise.rl.algorithms")
"""``rl.actor.policy_loss``: verl's signature, ``fn(old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights=None) -> (loss, metrics)``
(`shardwise.rl.algorithms.policy_losses`)."""

TRACKERS = Registry("run.loggers", "shardwise.telemetry.trackers")
"""``run.loggers``: ``cls(TrackerRun) -> Tracker`` (`shardwise.telemetry.trackers`); trait
``missing``: ``fn() -> [module names]`` the tracker needs here and that are not installed,
``extra``: the ``shardwise[...]`` extra that installs them (None: nothing to install)."""
