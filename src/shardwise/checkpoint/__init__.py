"""Checkpoints: DCP save / commit / verify / resume of training state
(`shardwise.checkpoint.dcp`, with its parts `integrity`, `safe_load`, `rng` and
`disk`), the best one by an evaluation metric
(`shardwise.checkpoint.best`), and the HF export (`shardwise.checkpoint.hf_export`).

Nothing is imported here: what needs only a run's checkpoint folders and their names
(`shardwise.checkpoint.layout`, `best`) must not pay for torch.distributed.checkpoint.
"""
