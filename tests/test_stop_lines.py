"""Issue 50, findings 8 and 9: the lines a stopped or refused job prints say what happened.

- `shardwise infer` interrupted names no checkpoint (it keeps none);
- ``rl.multi_turn.tools_kwargs_key`` naming a value that is not a mapping is one line, exit 2;
- ``--rdzv-timeout`` bounds the wait for a port another program holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, SRC_DIR, _kill_tree, run_cli

INFER = str(REPO_ROOT / "examples" / "infer_arithmetic.yaml")


def test_ctrl_c_of_infer_names_no_checkpoint(tmp_path):
    """`shardwise infer` keeps no checkpoints: its Ctrl-C line said "no checkpoint was
    committed yet", as if one could have been. It now says what infer keeps (130, one line)."""
    (tmp_path / "hangs.py").write_text(
        "import os, pathlib, time\n"
        "def score(prompt, response, ground_truth):\n"
        "    (pathlib.Path(os.environ['HERE']) / 'scoring').touch()\n"
        "    time.sleep(600)\n"
        "    return 0.0\n")
    out = open(tmp_path / "out.txt", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "infer", INFER, "--nproc", "1", f"run.dir={tmp_path / 'run'}",
         "model.path=null", TINY_QWEN3, "infer.num_prompts=2", "infer.max_new_tokens=2",
         "infer.reward=hangs:score", "infer.reward_timeout_s=600"],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(SRC_DIR), "OMP_NUM_THREADS": "1", "HERE": str(tmp_path)})
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "scoring").exists():
            out.seek(0)
            assert proc.poll() is None and time.monotonic() < deadline, out.read()[-3000:]
            time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
        out.seek(0)
        text = out.read()
        said = [x for x in text.splitlines() if x.startswith("shardwise: interrupted by SIGINT")]
        assert code == 130 and len(said) == 1, f"exit {code}\n{text[-3000:]}"
        assert "checkpoint was committed" not in said[0] and "keeps no checkpoints" in said[0], said[0]
        assert "generations.jsonl" in said[0], said[0]
    finally:
        _kill_tree(proc.pid)
        proc.wait()
        out.close()


GRPO = str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml")


def test_tools_kwargs_key_naming_no_mapping_is_one_line(tmp_path):
    """``rl.multi_turn.tools_kwargs_key`` naming a value that is not ``{tool: {argument:
    value}}`` was ignored on every call, silently; it is one line naming the key and the
    row, exit 2, before anything starts (and a tool's entry that is not a mapping too)."""
    rows = [{"prompt": "2+3=", "response": "5", "extra_info": {"answer": "5", "tools_kwargs": {"calculator": {}}}},
            {"prompt": "1+1=", "response": "2", "extra_info": {"answer": "2", "tools_kwargs": {"calculator": 7}}}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["rl", GRPO, "--nproc", "1", "model.path=null", TINY_QWEN3.replace("vocab_size: 64", "vocab_size: 72"),
              f"data.source={tmp_path / 'data.jsonl'}",
              "rl.multi_turn.enabled=true", "rl.tools=[shardwise.agents.builtin:calculator]", "rl.reward.function=builtin:arithmetic",
              "rl.heldout_eval=false"]
    for key, said in (("extra_info.answer", "'extra_info.answer' holds str '5' in data.source row 0, not a mapping"),
                      ("extra_info.tools_kwargs", "in data.source row 1 gives tool 'calculator' int 7")):
        run = tmp_path / key
        res = run_cli([*common, f"run.dir={run}", f"rl.multi_turn.tools_kwargs_key={key}"], timeout=120, cwd=tmp_path)
        lines = [x for x in res.stderr.splitlines() if "config error" in x]
        assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
        assert "rl.multi_turn.tools_kwargs_key" in lines[0] and said in lines[0], lines[0]
        assert not run.exists()
