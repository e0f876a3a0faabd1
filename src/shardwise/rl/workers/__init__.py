"""RL workers: the roles a single controller drives.

Each worker is a plain class built inside one rank of a torch.distributed group
(``Worker(cfg, runtime)``); `shardwise.rl.cluster` hosts them in Ray actors, and tests
build them directly under `run_ranks`. Every method that touches a sharded model is
collective: all ranks call it, each with its own rows (its data-parallel share).

The batch layout every role shares is the generation engine's (`shardwise.engine.generate`:
prompts, then sequences ``(B, T)`` with ``input_ids``, ``attention_mask``,
``position_ids``, ``response_mask``, ``responses``, ``rollout_log_probs``), plus
per-token values ``(B, T)`` fp32 aligned with ``input_ids`` like log-probs
(`shardwise.engine.infer`): ``old_log_probs``, ``ref_log_probs``, ``entropy``, ``values``
(``values[:, t]`` is the critic's estimate at the state before token t),
``token_level_scores`` / ``token_level_rewards`` (the sequence score at the last response
token), ``advantages``, ``returns``. Everything outside ``response_mask`` is ignored (and
set to 0 by the producers).
"""
