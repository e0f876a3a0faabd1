"""Agents: tools, environments and the multi-turn rollout loop (issue 27)."""
