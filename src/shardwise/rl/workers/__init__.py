"""RL workers: the roles a single controller drives (seed 003).

Each worker is a plain class built inside one rank of a torch.distributed group
(``Worker(cfg, runtime)``); `shardwise.rl.cluster` hosts them in Ray actors, and tests
build them directly under `run_ranks`. Every method that touches a sharded model is
collective: all ranks call it, each with its own rows (its data-parallel share).

The rollout batch layout, shared by every role (``B`` rows, ``P`` prompt width, ``R`` =
``rl.rollout.max_new_tokens``, ``T = P + R``):

- prompts (controller -> ``generate_sequences``): tensors ``prompt_ids`` ``(B, P)``
  int64, LEFT-padded with the pad id, and ``prompt_mask`` ``(B, P)`` int64 (1 on real
  tokens); arrays ``prompt`` (str), ``ground_truth`` (str), ``uid`` (group id, str);
  meta ``seed`` (int, sampling seed of this call) and optionally ``greedy`` (bool).
- sequences (``generate_sequences`` ->): the prompt part plus ``input_ids`` ``(B, T)``
  (prompt left-padded, response right-padded to exactly ``R`` with the pad id),
  ``attention_mask`` ``(B, T)``, ``position_ids`` ``(B, T)`` (=
  `shardwise.engine.infer.default_position_ids`), ``response_mask`` ``(B, T)`` int64
  (1 on generated tokens up to and including the first EOS) and ``responses``
  ``(B, R)``.
- per-token values are ``(B, T)`` fp32 aligned with ``input_ids`` like log-probs
  (`shardwise.engine.infer`): ``old_log_probs``, ``ref_log_probs``, ``entropy``,
  ``values`` (``values[:, t]`` is the critic's estimate at the state before token t),
  ``token_level_scores`` / ``token_level_rewards`` (the sequence score at the last
  response token), ``advantages``, ``returns``. Everything outside ``response_mask``
  is ignored (and set to 0 by the producers).
"""
