"""shardwise: FSDP2 training and RL post-training of language models from one YAML file."""

__version__ = "0.1.0"
