"""Agents: multi-turn rollouts where the model calls tools and plays environments.

- `shardwise.agents.tools`: the tools (``module:function``) and the environment
  (``module:Class``) of the config, checked and with their JSON schemas;
- `shardwise.agents.parsers`: the tool calls in a model's turn (Hermes ``<tool_call>``);
- `shardwise.agents.execute`: `ToolRunner`, the calls run concurrently in worker processes
  that contain whatever the user's code does (`shardwise.agents.host` is their side);
- `shardwise.agents.loop`: the multi-turn rollout over a generation engine;
- `shardwise.agents.builtin`: the built-in calculator tool and GuessNumber environment.

This package imports nothing itself: the workers import `shardwise.agents.host` (standard
library only) and start in a fraction of a second.
"""
