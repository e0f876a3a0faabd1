"""`agentic.py --sleep-tool`'s tool: shardwise's built-in calculator after a 50 ms sleep.

It has the built-in's name, docstring and type hints (so both sides derive the same
schema and the SFT model calls it as it learned to), and lives here, importable by module
path from the repository root (``benchmarks._agentic_tools:calculator``) by `shardwise rl`
and by TRL's worker alike.
"""

from __future__ import annotations

import functools
import time

from shardwise.agents import builtin

SLEEP_S = 0.05


@functools.wraps(builtin.calculator)
def calculator(*args, **kwargs):
    time.sleep(SLEEP_S)
    return builtin.calculator(*args, **kwargs)


# functools.wraps copied the built-in's module too: this function is found (and pickled
# by reference) here, not as the built-in.
calculator.__module__ = __name__
