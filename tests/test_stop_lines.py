"""Issue 50, findings 8 and 9: the lines a stopped or refused job prints say what happened.

- `shardwise infer` interrupted names no checkpoint (it keeps none);
- ``rl.multi_turn.tools_kwargs_key`` naming a value that is not a mapping is one line, exit 2;
- ``--rdzv-timeout`` bounds the wait for a port another program holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dist.common import TINY_QWEN3
from dist.launcher import REPO_ROOT, SRC_DIR, _kill_tree

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
