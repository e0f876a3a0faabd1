"""Issue 50, findings 6 and 7: what an evaluation holds and writes is bounded.

- a huge row of ``eval.source`` is cut before it is held whole, with one note;
- a full disk while writing ``samples/step_*.jsonl``: one line naming the file and the free
  space, the partial file removed, no empty ``error.txt``.
"""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
from dist.common import TINY_QWEN3, tmpfs
from dist.launcher import REPO_ROOT


def test_a_full_disk_while_writing_samples_names_the_file_and_removes_the_partial_one(tmp_path):
    """A full disk while writing an evaluation's samples ended with a line naming neither the
    file nor the free space, a partial ``step_*.jsonl.tmp`` left on the full disk (so the
    suggested resume failed again) and an empty ``error.txt``. Now: DiskFullError (exit
    74) naming the file, the free space and the file's size; no partial file; the earlier
    samples intact; and a report that cannot be written leaves no empty error.txt."""
    from shardwise.checkpoint.layout import resume_line
    from shardwise.engine.evaluate import samples_path, write_samples
    from shardwise.errors import DiskFullError
    from shardwise.jobs.rundir import ERROR_FILE, write_error_file

    with tmpfs(tmp_path / "small", "size=256k") as run:
        first = write_samples(run, 0, [{"index": 0, "response": "4"}])
        rows = [{"index": i, "prompt": "x" * 1000, "response": "y" * 1000} for i in range(200)]  # ~400 KB
        with pytest.raises(DiskFullError) as err:
            write_samples(run, 2, rows, resume_line)
        line = str(err.value)
        assert err.value.exit_status == 74 and "\n" not in line
        assert f"evaluation samples '{samples_path(run, 2)}' could not be written: the disk holding it is full" in line
        assert " free, the file needs about 39" in line and "KiB" in line, line  # 200 rows of ~2 KB
        assert "step_0000002.jsonl.tmp was removed" in line and "no checkpoint was committed yet" in line, line
        assert sorted(p.name for p in (run / "samples").iterdir()) == [first.name]
        assert first.read_text() == '{"index": 0, "response": "4"}\n'
        # the disk full again (by something else): the error report cannot be written, and
        # no empty error.txt claims to be it
        with contextlib.suppress(OSError), open(run / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
        assert write_error_file(run, "the controller", "Traceback ...\n" * 1000) is None
        assert not (run / ERROR_FILE).exists()


def test_a_huge_evaluation_prompt_is_cut_when_read_keeping_the_tokens_asked(tmp_path, caplog):
    """One 50 MB prompt in eval.source with data.max_length 16 grew the RL controller to
    17.8 GB (a 5 MB one: 1.9 GB and 23 s to tokenize, each evaluation, with the built-in
    tokenizer): the whole text was held, tokenized and written per answer, to keep its last
    16 tokens. The reader now cuts a prompt to its last `prompt_chars_bound` characters
    (one note), so nothing beyond them is held; the ids asked are the same."""
    from shardwise.config.load import load_config
    from shardwise.data.encode import PROMPT_CHARS_FLOOR, encode_prompt, prompt_chars_bound
    from shardwise.jobs.inputs import check_eval, job_tokenizer

    huge = "".join(f"{i % 10}+{i % 7}=" for i in range(80_000)) + "12+30="  # 320 KB: over the floor
    rows = [{"prompt": huge, "response": "42"}, {"prompt": "1+1=", "response": "2"}]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"),
                      ["model.path=null", TINY_QWEN3, f"run.dir={tmp_path / 'run'}", "data.max_length=16",
                       "rl.reward.function=builtin:arithmetic", f"eval.source={tmp_path / 'val.jsonl'}"])
    with caplog.at_level(logging.WARNING):
        plan = check_eval(cfg, "rl")
    tokenizer = job_tokenizer(cfg)
    bound = prompt_chars_bound(tokenizer, 16)
    assert bound == PROMPT_CHARS_FLOOR < len(huge)
    kept = plan.records[0]["prompt"]
    assert kept == huge[-bound:] and plan.records[1]["prompt"] == "1+1="
    assert encode_prompt(tokenizer, kept, 16).ids == encode_prompt(tokenizer, huge, 16).ids
    notes = [r.getMessage() for r in caplog.records if "cut to their last" in r.getMessage()]
    assert len(notes) == 1 and "eval.source" in notes[0] and f"longest {len(huge):,}" in notes[0], notes
