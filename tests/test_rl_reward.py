"""Rewards: `resolve_reward_fn` (builtin and module:function specs, every error naming
rl.reward.function with a hint), `score_sequences` on sequences of the real character
tokenizer, and `RewardModelWorker` under 2 processes with uneven rows against the
unsharded sequence-classification model read at each row's last real token."""

from __future__ import annotations

import copy
import math
import signal
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest
import torch
from dist.common import FP32, TINY_QWEN3
from dist.launcher import run_ranks

from shardwise.data.rewards import (
    RewardFunctionError,
    resolve_reward_fn,
    score_sequences,
)
from shardwise.data.tasks import score_arithmetic
from shardwise.errors import ConfigError

KEY = "rl.reward.function"

REWARDS_PY = """
THRESHOLD = 3

def score(prompt, response, ground_truth):
    return float(len(response)) + (10.0 if response == ground_truth else 0.0)

def two_args(prompt, response):
    return 0.0

class Scorer:
    @staticmethod
    def score(prompt, response, ground_truth):
        return -1.0
"""


def write_module(folder, source: str) -> str:
    """A module with a fresh name in `folder` (fresh, so no test sees another's import)."""
    name = f"rewards_{uuid.uuid4().hex[:8]}"
    (folder / f"{name}.py").write_text(textwrap.dedent(source))
    return name


# ---------------------------------------------------------------------- resolving


def test_builtin_resolves_to_the_task_scorer():
    fn = resolve_reward_fn("builtin:arithmetic")
    assert fn is score_arithmetic
    assert fn("12+34=", "46", "46") == 1.0 and fn("12+34=", "47", "46") == 0.0


def test_module_function_from_the_working_directory(tmp_path, monkeypatch):
    name = write_module(tmp_path, REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    fn = resolve_reward_fn(f"{name}:score")
    assert fn("p", "46", "46") == 12.0 and fn("p", "4", "46") == 1.0
    assert resolve_reward_fn(f"{name}:Scorer.score")("p", "r", "g") == -1.0  # dotted attribute path
    assert sys.path == path_before  # the working directory was on sys.path for the import only


def test_module_function_from_pythonpath(tmp_path, monkeypatch):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    name = write_module(folder, REWARDS_PY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(folder))
    assert resolve_reward_fn(f"{name}:score")("p", "ab", "x") == 2.0


# (spec template, problem words, hint words); {mod} is a module written to the working
# directory, {broken} one that raises on import, {needs_dep} one importing a missing package.
ERRORS = {
    "unknown_builtin": ("builtin:arithmetc", "unknown built-in reward 'arithmetc'", "did you mean builtin:arithmetic?"),
    "no_colon": ("my_rewards", "is not of the form", "module:function"),
    "empty_function": ("{mod}:", "is not of the form", "module:function"),
    "empty_module": (":score", "is not of the form", "module:function"),
    "two_colons": ("{mod}:score:x", "is not of the form", "module:function"),
    "code_not_a_name": ("__import__('os').getcwd:score", "is not of the form", "module:function"),
    "missing_module": ("no_such_rewards_mod:score", "no module named 'no_such_rewards_mod'", "PYTHONPATH"),
    "missing_attribute": ("{mod}:scroe", "has no attribute 'scroe'", "did you mean score?"),
    "missing_nested": ("{mod}:Scorer.scroe", "Scorer has no attribute 'scroe'", "did you mean score?"),
    "not_callable": ("{mod}:THRESHOLD", "is a int, not a function", "point it at a function"),
    "wrong_arity": ("{mod}:two_args", "takes neither (prompt, response, ground_truth) nor verl's", "signature"),
    "raises_on_import": ("{broken}:score", "importing '{broken}' failed: RuntimeError: boom", "imports cleanly"),
    "missing_dependency": ("{needs_dep}:score", "No module named 'no_such_dependency_xyz'", "install"),
    "empty": ("", "names no reward function", "builtin:NAME"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_specs_raise_config_errors_with_a_hint(case, tmp_path, monkeypatch):
    names = {"mod": write_module(tmp_path, REWARDS_PY),
             "broken": write_module(tmp_path, "raise RuntimeError('boom')\n"),
             "needs_dep": write_module(tmp_path, "import no_such_dependency_xyz\n")}
    monkeypatch.chdir(tmp_path)
    spec, problem, hint = (part.format(**names) for part in ERRORS[case])
    with pytest.raises(ConfigError) as info:
        resolve_reward_fn(spec)
    err = info.value
    assert err.key == KEY
    assert problem in err.problem, err.problem
    assert err.hint and hint in err.hint, err.hint


# ---------------------------------------------------------------------- scoring text

PROMPT_W, RESP_W = 8, 6
# (prompt, ground truth, response tokens as text + special markers, response_mask length).
# "|" separates what the mask covers from what follows it in the row.
ROWS = [
    ("12+34=", "46", "46<eos>|", "right answer"),
    ("12+34=", "46", "47<eos>|", "wrong answer"),
    ("5+5=", "10", "10<eos>|x9", "junk after the EOS, outside the mask (the layout)"),
    ("5+5=", "10", "10<eos>x9|", "junk after the EOS inside the mask: cut at the EOS"),
    ("9-2=", "7", " 7\nabc|", "truncated (no EOS): first_answer stops at the newline"),
    ("1+1=", "2", "|", "empty response"),
]


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    from shardwise.data.tokenizer import build_char_tokenizer

    return build_char_tokenizer(tmp_path_factory.mktemp("char_tok"))


def encode(tok, text: str) -> list[int]:
    """Characters to ids, ``<eos>`` as the EOS id."""
    ids = []
    for i, piece in enumerate(text.split("<eos>")):
        if i:
            ids.append(tok.eos_token_id)
        ids += tok.convert_tokens_to_ids(list(piece))
    return ids


def text_batch(tok):
    """Rows in the layout: ``<bos>`` + prompt left-padded to PROMPT_W, response
    right-padded to RESP_W, response_mask on the part before ``|``."""
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    pad = tok.pad_token_id
    ids = torch.full((len(ROWS), PROMPT_W + RESP_W), pad, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for r, (prompt, _, response, _) in enumerate(ROWS):
        p = [tok.bos_token_id] + encode(tok, prompt)
        masked, rest = (encode(tok, part) for part in response.split("|"))
        ids[r, PROMPT_W - len(p):PROMPT_W] = torch.tensor(p)
        attn[r, PROMPT_W - len(p):PROMPT_W] = 1
        n = len(masked) + len(rest)
        ids[r, PROMPT_W:PROMPT_W + n] = torch.tensor(masked + rest, dtype=torch.long)
        attn[r, PROMPT_W:PROMPT_W + n] = 1
        resp[r, PROMPT_W:PROMPT_W + len(masked)] = 1
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn),
                            "response_mask": resp},
                           {"prompt": [row[0] for row in ROWS], "ground_truth": [row[1] for row in ROWS]})


def test_score_sequences_with_the_arithmetic_reward(char_tokenizer):
    batch = text_batch(char_tokenizer)
    out = score_sequences(batch, char_tokenizer, resolve_reward_fn("builtin:arithmetic"))
    assert list(out.arrays["response_text"]) == ["46", "47", "10", "10", " 7\nabc", ""]
    scores = out.tensors["token_level_scores"]
    assert scores.dtype == torch.float32 and scores.shape == batch.tensors["input_ids"].shape
    want = torch.zeros_like(scores)
    # the score sits on the last response_mask token: the EOS, the last junk token, the
    # last token of a truncated response; the empty row has none
    for row, (col, value) in {0: (PROMPT_W + 2, 1.0), 1: (PROMPT_W + 2, 0.0), 2: (PROMPT_W + 2, 1.0),
                              3: (PROMPT_W + 4, 1.0), 4: (PROMPT_W + 5, 1.0)}.items():
        want[row, col] = value
    assert torch.equal(scores, want)
    metrics = out.meta["metrics"]
    assert metrics["reward/empty_responses"] == 1.0
    assert metrics["reward/score_mean"] == pytest.approx(4 / 6)
    assert (metrics["reward/score_min"], metrics["reward/score_max"]) == (0.0, 1.0)


def test_empty_response_is_scored_but_placed_nowhere(char_tokenizer):
    seen = []

    def constant(prompt, response, ground_truth):
        seen.append((prompt, response, ground_truth))
        return 2.5

    batch = text_batch(char_tokenizer)
    out = score_sequences(batch, char_tokenizer, constant)
    assert seen[-1] == ("1+1=", "", "2") and len(seen) == len(ROWS)
    scores = out.tensors["token_level_scores"]
    mask = batch.tensors["response_mask"].bool()
    assert scores[-1].abs().sum() == 0 and not mask[-1].any()
    assert scores.sum() == pytest.approx(2.5 * (len(ROWS) - 1))
    assert out.meta["metrics"]["reward/score_mean"] == 2.5


def _raises(prompt, response, ground_truth):
    raise KeyError("no such field")


BAD_RETURNS = {
    "raises": (_raises, "raised KeyError"),
    "none": (lambda p, r, g: None, "returned NoneType"),
    "string": (lambda p, r, g: "1.0", "returned str"),
    "tensor": (lambda p, r, g: torch.tensor([1.0]), ".item()"),
    "nan": (lambda p, r, g: math.nan, "returned nan"),
    "inf": (lambda p, r, g: -math.inf, "returned -inf"),
}


@pytest.mark.parametrize("case", list(BAD_RETURNS))
def test_a_bad_reward_function_names_itself_and_the_prompt(case, char_tokenizer):
    fn, words = BAD_RETURNS[case]
    with pytest.raises(RewardFunctionError) as info:
        score_sequences(text_batch(char_tokenizer), char_tokenizer, fn)
    message = str(info.value)
    assert words in message and "row 0" in message and "'12+34='" in message
    assert (fn.__qualname__ if case == "raises" else "<lambda>") in message


def test_numpy_and_bool_rewards_are_numbers(char_tokenizer):
    batch = text_batch(char_tokenizer)
    out = score_sequences(batch, char_tokenizer, lambda p, r, g: np.float32(0.5) if r else True)
    assert out.tensors["token_level_scores"].sum() == pytest.approx(0.5 * (len(ROWS) - 1))
    assert out.meta["metrics"]["reward/score_max"] == 1.0  # the empty row's True


# ---------------------------------------------------------------------- reward model

SEQ = 10
# (left padding, real tokens); the rest of the row is right padding
RM_LAYOUT = [(2, 8), (0, 6), (0, SEQ), (3, 5), (1, 4), (0, 3)]
PAD_LAST_ROW = 3  # its last real token has the pad id (as with tokenizers where pad == eos)


def rm_batch():
    from shardwise.data.batch import Batch
    from shardwise.engine.infer import default_position_ids

    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(len(RM_LAYOUT), SEQ, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, (left, n) in enumerate(RM_LAYOUT):
        ids[r, left:left + n] = torch.randint(3, 57, (n,), generator=g)
        attn[r, left:left + n] = 1
    ids[PAD_LAST_ROW, sum(RM_LAYOUT[PAD_LAST_ROW]) - 1] = 0
    return Batch.from_dict({"input_ids": ids, "attention_mask": attn, "position_ids": default_position_ids(attn)})


RM_SPLITS = {"even": [[0, 1, 2], [3, 4, 5]], "five_one": [[0, 1, 2, 3, 4], [5]], "all_none": [list(range(6)), []]}


def rm_body(rank: int, world: int, overrides: list[str]) -> dict:
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.rl.workers.reward import RewardModelWorker

    runtime = init_distributed(timeout_s=60)
    worker = RewardModelWorker(load_config(None, overrides), runtime)
    batch = rm_batch()
    out = {name: worker.compute_rm_score(batch[split[rank]]).tensors["rm_scores"] for name, split in RM_SPLITS.items()}
    no_pos = batch.select(tensor_keys=["input_ids", "attention_mask"])
    out["without_position_ids"] = worker.compute_rm_score(no_pos[RM_SPLITS["even"][rank]]).tensors["rm_scores"]
    out["training"] = worker.engine.model.training
    teardown()
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny Qwen3 sequence-classification model (one label, no pad id in its config)."""
    from shardwise.config import load_config
    from shardwise.models.loading import build_full_model

    path = tmp_path_factory.mktemp("reward_model")
    model = build_full_model(load_config(None, [TINY_QWEN3, *FP32]).model, seed=9, task="sequence_classification",
                             num_labels=1)
    assert model.config.pad_token_id is None
    model.save_pretrained(path)
    return path


def test_reward_model_scores_the_last_real_token(rm_dir):
    from transformers import AutoModelForSequenceClassification

    # the actor's model.config is replaced by rl.reward.model in the worker's copy
    overrides = [TINY_QWEN3, *FP32, "train.micro_batch_size=2", f"rl.reward.model={rm_dir}"]
    ranks = run_ranks(rm_body, 2, overrides, timeout=180)

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    b = rm_batch().tensors
    want = torch.zeros(len(RM_LAYOUT))
    with torch.no_grad():
        for r in range(len(RM_LAYOUT)):  # each row alone, its real tokens only, head read by hand
            real = b["input_ids"][r, b["attention_mask"][r].bool()][None]
            want[r] = model.score(model.model(input_ids=real).last_hidden_state)[0, -1, 0]
        # HF's own pooling (rightmost id != pad id, with pad id 0) misses PAD_LAST_ROW's token
        model.config.pad_token_id = 0
        hf = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, 0]
    assert abs(float(hf[PAD_LAST_ROW] - want[PAD_LAST_ROW])) > 1e-3

    for name, split in RM_SPLITS.items():
        got = torch.cat([r[name] for r in ranks])[torch.argsort(torch.tensor(split[0] + split[1]))]
        assert got.dtype == torch.float32 and got.shape == (len(RM_LAYOUT),)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=name)
    got = torch.cat([r["without_position_ids"] for r in ranks])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert ranks[1]["all_none"].shape == (0,)
    assert not ranks[0]["training"]


RM_ROWS = [  # (prompt as the data gives it, the policy's response text, eos written)
    ([{"role": "system", "content": "be short"}, {"role": "user", "content": "what is 12+34"}], "46", True),
    ([{"role": "user", "content": "reverse the word hello"}], "olleh", True),
    ([{"role": "user", "content": "what is 5+5"}], "10 and more", False),  # cut by max_new_tokens
    ("answer 9-2=", "7", True),  # a text prompt: a plain pair, [bos] + prompt + answer + eos
    ([{"role": "user", "content": "hello"}], "", True),  # the eos alone
]


def test_a_reward_model_of_another_tokenizer_scores_the_rows_rendered_for_it(char_tokenizer, tmp_path):
    """The policy speaks the built-in character tokenizer (its template, bos); the reward
    model is a byte-level BPE with a Qwen-style template and no bos. Each rollout row is
    decoded and rendered again with the reward model's tokenizer: its ids are the reward
    model's own rendering of the conversation (what a training pair of it would be), and the
    padded batch scores as each conversation's text scored alone."""
    from chat_data import build_bpe_chat_tokenizer
    from transformers import AutoModelForSequenceClassification, Qwen3Config, Qwen3ForSequenceClassification

    from shardwise.data.batch import Batch
    from shardwise.engine.generate import left_pad, prompt_batch
    from shardwise.jobs.preference import check_reward_model
    from shardwise.rl.workers.reward import RAW_PROMPT, RewardModelInputs

    rm_dir = tmp_path / "rm"
    rm_tok = build_bpe_chat_tokenizer(rm_dir)
    torch.manual_seed(0)
    Qwen3ForSequenceClassification(Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=len(rm_tok), max_position_embeddings=256, num_labels=1,
        pad_token_id=rm_tok.pad_token_id)).save_pretrained(rm_dir)
    # the policy's rollout: prompts as prompt_batch asks them, responses (eos, then pad) after them
    tok = char_tokenizer
    records = [{"prompt": p} for p, _, _ in RM_ROWS]
    prompts = prompt_batch(tok, records, 256, [str(i) for i in range(len(RM_ROWS))])
    written = [tok(r, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
               for _, r, eos in RM_ROWS]
    responses, rmask = (t.flip(-1) for t in left_pad([w[::-1] for w in written], tok.pad_token_id))  # right-padded
    pm = prompts.tensors["prompt_mask"]
    batch = prompts.union(Batch.from_dict(
        {"input_ids": torch.cat([prompts.tensors["prompt_ids"], responses], 1),
         "attention_mask": torch.cat([pm, rmask], 1), "response_mask": torch.cat([torch.zeros_like(pm), rmask], 1)},
        {RAW_PROMPT: [p for p, _, _ in RM_ROWS]}))
    for r in range(len(RM_ROWS)):  # each response's tokens in order
        got = batch.tensors["input_ids"][r, batch.tensors["response_mask"][r].bool()].tolist()
        assert tok.decode(got, skip_special_tokens=True) == RM_ROWS[r][1]

    check_reward_model(str(rm_dir), tok)  # no longer refused before launch: its rows are rendered for it
    assert RewardModelInputs.needed(None, tok) is None
    assert RewardModelInputs.needed(str(tmp_path), tok) is None  # no tokenizer files: the policy's ids
    assert RewardModelInputs.needed(str(tok.name_or_path), tok) is None  # the same tokenizer
    inputs = RewardModelInputs.needed(str(rm_dir), tok)
    assert inputs is not None
    rendered = inputs.batch(batch, tok)

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        padded = model(input_ids=rendered.tensors["input_ids"],
                       attention_mask=rendered.tensors["attention_mask"]).logits[:, 0]
    for r, (prompt, response, _) in enumerate(RM_ROWS):
        if isinstance(prompt, str):  # no bos in this tokenizer; the eos the reward model was trained with
            text = prompt + response + rm_tok.eos_token
        else:
            text = rm_tok.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)
        want_ids = rm_tok(text, add_special_tokens=False)["input_ids"]
        row = rendered.tensors["input_ids"][r, rendered.tensors["attention_mask"][r].bool()].tolist()
        assert row == want_ids, (r, rm_tok.decode(row), text)
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([want_ids])).logits[0, 0]
        assert abs(float(padded[r] - alone)) < 1e-5, r


@pytest.mark.parametrize("value,problem", [(None, "no reward model given"), ("{tmp}", "holds no config.json")])
def test_reward_model_worker_needs_a_model_folder(value, problem, tmp_path):
    from shardwise.config import load_config
    from shardwise.rl.workers.reward import RewardModelWorker

    cfg = load_config(None, [TINY_QWEN3])
    cfg.rl.reward.model = value if value is None else value.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as info:
        RewardModelWorker(cfg, runtime=None)  # raised before any process group is needed
    assert info.value.key == "rl.reward.model" and problem in info.value.problem
    assert "save_pretrained" in info.value.hint


def _never_returns(prompt, response, ground_truth):
    while True:  # swallows ordinary exceptions, as careless user code does
        try:
            time.sleep(3600)
        except Exception:
            pass


def test_a_reward_call_past_its_timeout_names_the_function_and_row(char_tokenizer):
    """In the main thread (SIGALRM) and in another thread (a watchdog thread), one line's
    error within about the timeout; the main thread's alarm handler is put back."""
    import threading

    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        score_sequences(text_batch(char_tokenizer), char_tokenizer, _never_returns, timeout_s=0.2)
    assert "_never_returns did not return within 0.2 s on row 0" in str(info.value)
    assert "rl.reward.timeout_s" in str(info.value) and time.monotonic() - t0 < 5
    assert signal.getsignal(signal.SIGALRM) == before
    caught: list[BaseException] = []

    def in_thread():
        try:
            score_sequences(text_batch(char_tokenizer), char_tokenizer, _never_returns, timeout_s=0.2,
                            timeout_key="infer.reward_timeout_s")
        except RewardFunctionError as e:
            caught.append(e)

    worker = threading.Thread(target=in_thread)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and caught and "infer.reward_timeout_s" in str(caught[0])


HOSTILE_PY = """
import os, signal, time

def score(prompt, response, ground_truth):
    return {"score": float(len(response)) + (10.0 if response == ground_truth else 0.0), "length": len(response)}

def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["w"]) if data_source == "mine" else 0.0

def swallows(prompt, response, ground_truth):
    if prompt == "5+5=":  # a later row: the rows before it were scored
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                pass
    return 0.0

def kills_parent(prompt, response, ground_truth):
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(3600)
"""


def test_a_users_function_in_its_process_scores_as_in_this_one(char_tokenizer, tmp_path, monkeypatch):
    """A module:function is called in a contained child (the whole batch in one round trip):
    the same scores and metrics as called here, verl's form with data_source / extra_info."""
    from shardwise.data.rewards import ContainedReward, contain

    monkeypatch.chdir(tmp_path)
    name = write_module(tmp_path, HOSTILE_PY)
    batch = text_batch(char_tokenizer)
    here = score_sequences(batch, char_tokenizer, resolve_reward_fn(f"{name}:score"))
    fn = contain(resolve_reward_fn(f"{name}:score"), f"{name}:score")
    assert isinstance(fn, ContainedReward) and contain(score_arithmetic, "builtin:arithmetic") is score_arithmetic
    try:
        there = score_sequences(batch, char_tokenizer, fn)
    finally:
        fn.close()
    assert torch.equal(here.tensors["token_level_scores"], there.tensors["token_level_scores"])
    assert here.meta["metrics"] == there.meta["metrics"] and "reward/length" in there.meta["metrics"]
    batch.arrays["data_source"] = np.array(["mine", "other"] * 3, dtype=object)
    batch.arrays["extra_info"] = np.array([{"w": i} for i in range(6)], dtype=object)
    fn = contain(resolve_reward_fn(f"{name}:verl_score"), f"{name}:verl_score")
    try:
        scores = score_sequences(batch, char_tokenizer, fn).tensors["token_level_scores"].sum(-1)
    finally:
        fn.close()
    assert scores.tolist() == [0.0, 0.0, 2.0, 0.0, 4.0, 0.0]


@pytest.mark.parametrize("fn,words", [
    ("swallows", "swallows did not return within 1 s on row 2 (prompt '5+5=')"),
    ("kills_parent", "kills_parent crashed on row 0 (prompt '12+34='), response '46': its process was killed by "
                     "SIGKILL"),
])
def test_a_users_function_that_defeats_the_timeout_or_kills_its_parent_is_named(fn, words, char_tokenizer,
                                                                                   tmp_path, monkeypatch):
    """Issue 30, section 4.4: a function that swallows every exception and ignores SIGALRM
    hung the job forever; one that kills its parent took the job's process with it. In its
    own process, each ends in a RewardFunctionError naming it and the row."""
    from shardwise.data.rewards import contain

    monkeypatch.chdir(tmp_path)
    name = write_module(tmp_path, HOSTILE_PY)
    contained = contain(resolve_reward_fn(f"{name}:{fn}"), f"{name}:{fn}")
    try:
        with pytest.raises(RewardFunctionError) as info:
            score_sequences(text_batch(char_tokenizer), char_tokenizer, contained, timeout_s=1)
    finally:
        contained.close()
    assert f"{name}.{words}" in str(info.value), str(info.value)


# ---------------------------------------------------------------------- multi-turn rows

MULTI_TURN_PY = """
def plain(prompt, response, ground_truth, messages):
    turns = len(messages)
    messages.append({"role": "user", "content": "mutated"})  # its own copy: the row's stay as they are
    return {"score": float(response == ground_truth), "messages": float(turns)}

def verl(data_source, solution_str, ground_truth, extra_info=None):
    w = extra_info.get("w", 0)
    extra_info["mutated"] = True
    return float(10 * extra_info["num_turns"] + extra_info["tool_calls"] + w / 100)
"""


def multi_turn_batch(tok):
    """`text_batch` with the arrays of a multi-turn rollout. Row 2's mask has a hole (a
    tool turn) and ends on the '9' after it; row 2 has an environment's reward, row 4 is
    truncated (and has one too: truncated_reward comes first)."""
    batch = text_batch(tok)
    batch.tensors["response_mask"][2, PROMPT_W + 4] = 1
    answers = ["46", "47", "10", "10", "7", ""]
    msgs = []
    for r, (prompt, _, _, _) in enumerate(ROWS):
        conv = [{"role": "user", "content": prompt}]
        conv += [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": prompt[:-1]}}}]},
            {"role": "tool", "content": "x"}] * r
        msgs.append(conv + [{"role": "assistant", "content": answers[r]}])
    batch.arrays.update(
        final_answer=np.array(answers, dtype=object), messages=np.array(msgs + [None], dtype=object)[:-1],
        num_turns=np.array([r + 1 for r in range(len(ROWS))], dtype=object),
        tool_calls=np.array(list(range(len(ROWS))), dtype=object),
        truncated=np.array([False] * 4 + [True, False], dtype=object),
        env_reward=np.array([None, None, 0.5, None, 7.0, None], dtype=object),
        extra_info=np.array([{"w": r} for r in range(5)] + [None], dtype=object))
    return batch


def test_a_trajectory_is_scored_on_its_final_answer_with_its_messages(char_tokenizer, tmp_path, monkeypatch):
    """Multi-turn rows: the function sees the final answer and (by signature) a copy of the
    messages, verl's form an extra_info copy with num_turns / tool_calls; the environment's
    reward and truncated_reward replace it; each score sits on the row's last mask token
    (after a hole); in a contained child as in this process."""
    from shardwise.data.rewards import contain

    monkeypatch.chdir(tmp_path)
    name = write_module(tmp_path, MULTI_TURN_PY)
    batch = multi_turn_batch(char_tokenizer)
    before = (copy.deepcopy(list(batch.arrays["messages"])), copy.deepcopy(list(batch.arrays["extra_info"])))
    want = torch.zeros(batch.tensors["input_ids"].shape)
    for row, (col, value) in {0: (PROMPT_W + 2, 1.0), 2: (PROMPT_W + 4, 0.5), 3: (PROMPT_W + 4, 1.0),
                              4: (PROMPT_W + 5, -1.0)}.items():
        want[row, col] = value
    for contained in (False, True):
        fn = resolve_reward_fn(f"{name}:plain")
        fn = contain(fn, f"{name}:plain") if contained else fn
        try:
            out = score_sequences(batch, char_tokenizer, fn, truncated_reward=-1.0)
        finally:
            if contained:
                fn.close()
        assert torch.equal(out.tensors["token_level_scores"], want), (contained, out.tensors["token_level_scores"])
        assert list(out.arrays["response_text"]) == list(batch.arrays["final_answer"])
        # the function's metric over the rows it scored (0, 1, 3, 5): their conversations' lengths
        assert out.meta["metrics"]["reward/messages"] == (2 + 4 + 8 + 12) / 4
        assert out.meta["metrics"]["reward/score_min"] == -1.0
    verl = resolve_reward_fn(f"{name}:verl")
    contained = contain(verl, f"{name}:verl")
    try:
        for fn in (verl, contained):
            scores = score_sequences(batch, char_tokenizer, fn).tensors["token_level_scores"].sum(-1)
            assert scores.tolist() == pytest.approx([10.0, 21.01, 0.5, 43.03, 7.0, 0.0]), scores
    finally:
        contained.close()
    assert (list(batch.arrays["messages"]), list(batch.arrays["extra_info"])) == before  # not mutated


def test_an_environment_reward_needs_no_function_and_single_turn_messages_are_none(char_tokenizer):
    batch = multi_turn_batch(char_tokenizer)
    batch.arrays["env_reward"] = np.array([float(r) for r in range(len(ROWS))], dtype=object)
    scores = score_sequences(batch, char_tokenizer, None).tensors["token_level_scores"].sum(-1)
    assert scores.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 0.0]  # the last row has no token to hold its 5
    batch.arrays["env_reward"][3] = None  # its reward() failed, or its process was lost: 0, counted, the job goes on
    out = score_sequences(batch, char_tokenizer, None)
    assert out.tensors["token_level_scores"].sum(-1).tolist() == [0.0, 1.0, 2.0, 0.0, 4.0, 0.0]
    assert out.meta["metrics"]["reward/env_missing"] == 1.0

    def sees(prompt, response, ground_truth, messages=()):
        return float(messages is None)

    out = score_sequences(text_batch(char_tokenizer), char_tokenizer, sees)  # a single-turn batch
    assert out.meta["metrics"]["reward/score_min"] == 1.0
