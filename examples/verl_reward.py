"""A reward function in verl's form, as examples/grpo_chat.yaml names it
(``rl.reward.function: examples.verl_reward:compute_score``, run from the repository root).

shardwise calls it with each row's ``data_source`` (data.data_source_key), the decoded
response, the ground truth (data.ground_truth_key: ``reward_model.ground_truth``) and the
row's ``extra_info``. The dict's ``score`` is the reward; its other numbers are logged as
``reward/<key>`` metrics.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.strip().split("\n")[0].strip()
    copied = extra_info is not None and answer == extra_info.get("word")
    if data_source != "shardwise/reverse_chat":
        raise ValueError(f"unknown data_source {data_source!r}")
    return {"score": 1.0 if answer == ground_truth else 0.0, "copied": float(copied)}
