"""`shardwise infer` with infer.multi_turn: the RL rollout's multi-turn loop, through the
real CLI on 2 ranks, writing whole trajectories.

The model (tests/tool_model.py) calls the built-in calculator in every assistant turn, so
each trajectory is 2 turns, 2 calls and 2 tool turns, truncated at infer.multi_turn.max_turns.
3 prompts over 2 ranks with infer.batch_size=1: rank 1 makes its second call with no rows
(the loop is collective). The reward function takes ``messages`` (by signature) and is
contained in its own process. Side by side, one process with an environment instead of
tools: its own ``calculator`` counts the calls of its trajectory, ``reset`` reads the row's
extra_info and asks a first question, and ``reward()`` scores it (no reward function).
"""

from __future__ import annotations

import json

import pytest
from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, at_once, run_cli
from tool_model import TOOL, build_tool_model

from shardwise.cli import main

EXAMPLE = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")
MULTI_TURN = ["infer.multi_turn.enabled=true", f"infer.tools=[{TOOL}]", "infer.multi_turn.max_turns=2",
              "infer.multi_turn.max_response_tokens=48", "infer.multi_turn.max_tool_response_tokens=8",
              "infer.max_new_tokens=8"]
REWARD_PY = """
def score(prompt, response, ground_truth, messages):
    tools = [m["content"] for m in messages if m["role"] == "tool"]
    return {"score": float(tools.count(ground_truth)), "messages": float(len(messages))}
"""
ENV_PY = """
class Counter:
    def reset(self, **row):
        self.calls, self.bonus = 0, row["extra_info"]["bonus"]
        return "count with me"

    def calculator(self, expression: str) -> str:
        \"\"\"Count a call.

        Args:
            expression: anything
        \"\"\"
        self.calls += 1
        return str(self.calls)

    def reward(self):
        return 10.0 * self.bonus + self.calls
"""


def test_infer_writes_whole_trajectories_of_tool_calls(tmp_path):
    model = build_tool_model(tmp_path / "model")
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is 2*3? ({i})", "response": "6"}) + "\n" for i in range(3)))
    (tmp_path / "my_reward.py").write_text(REWARD_PY)
    (tmp_path / "my_env.py").write_text(ENV_PY)
    env_data = tmp_path / "e.jsonl"
    env_data.write_text("".join(json.dumps({"prompt": "count", "extra_info": {"bonus": i}}) + "\n" for i in range(2)))
    common = ["infer", EXAMPLE, f"model.path={model}", "data.max_length=32", *MULTI_TURN]
    res, env_res = at_once(
        lambda: run_cli([*common, f"run.dir={tmp_path / 'run'}", f"data.source={data}", "infer.batch_size=1",
                         "infer.reward=my_reward:score", "--nproc", "2"], timeout=300, cwd=tmp_path),
        lambda: run_cli([*common, f"run.dir={tmp_path / 'env'}", f"data.source={env_data}", "infer.tools=[]",
                         "infer.environment=my_env:Counter"], timeout=300, cwd=tmp_path))
    for r in (res, env_res):
        assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    rows = [json.loads(x) for x in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    call = {"name": "calculator", "arguments": {"expression": "2*3"}}
    for i, r in enumerate(rows):
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant", "tool"], r
        assert r["messages"][0]["content"] == f"what is 2*3? ({i})"
        assert [m["tool_calls"][0]["function"] for m in r["messages"][1::2]] == [call, call]
        assert [m["content"] for m in r["messages"][2::2]] == ["6", "6"]
        assert (r["num_turns"], r["tool_calls"], r["tool_errors"], r["truncated"]) == (2, 2, 0, True), r
        # the final answer (no text beside the call), the model's tokens only (2 x 4), scored with the messages
        assert (r["response"], r["response_tokens"], r["score"]) == ("", 8, 2.0), r
    summary = json.loads((tmp_path / "run" / "infer_summary.json").read_text())
    assert summary["multi_turn/turns_mean"] == 2.0 and summary["tools/calls_per_trajectory"] == 2.0
    assert summary["multi_turn/truncated"] == 1.0 and summary["score_mean"] == 2.0
    assert "2.00 turns and 2.00 tool calls each" in res.stdout

    rows = [json.loads(x) for x in (tmp_path / "env" / "generations.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):  # the observation asked after the prompt, each trajectory its own count
        assert [(m["role"], m["content"]) for m in r["messages"][:2]] == [("user", "count"), ("user", "count with me")]
        assert [m["content"] for m in r["messages"][3::2]] == ["1", "2"], r["messages"]
        assert r["env_reward"] == r["score"] == 10.0 * i + 2, r
    summary = json.loads((tmp_path / "env" / "infer_summary.json").read_text())
    assert summary["reward"] == "my_env:Counter.reward" and summary["score_mean"] == 7.0


BAD = [
    (["infer.tools=[no_such_tools_xyz:calc]"], "infer.tools[0]", "no_such_tools_xyz"),
    (["infer.tools=[]"], "infer.multi_turn.enabled", "infer.tools is empty and infer.environment is null"),
    (["infer.multi_turn.tool_parser=hermez"], "infer.multi_turn.tool_parser", "did you mean hermes?"),
]


@pytest.mark.parametrize("overrides,key,words", BAD, ids=[b[1] for b in BAD])
def test_bad_infer_tool_settings_exit_2_before_any_process(overrides, key, words, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    code = main(["infer", EXAMPLE, "model.path=null", TINY_QWEN3, f"run.dir={tmp_path / 'run'}", *MULTI_TURN,
                 *overrides, "--nproc", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"'{key}'" in err and words in err, err
    assert not (tmp_path / "run").exists()
