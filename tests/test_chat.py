"""Data users bring (issue 18): conversations and chat templates, verl's parquet with nested
columns, verl-form reward functions, and `shardwise data`.

The loss masks are checked against spans found independently, from the token ids: after a
template's assistant header up to and including its end-of-turn token. Tokenizers: the
built-in one (role tokens, a template with {% generation %} markers) and a byte-level BPE
one with a Qwen-style template (no markers: the prefix route), trained by the test, because
a character tokenizer hides merges across turn boundaries.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from chat_data import arithmetic_conversations, build_bpe_chat_tokenizer, write_jsonl
from dist.launcher import REPO_ROOT, at_once, run_cli, run_python

from shardwise.cli import main
from shardwise.data import chat, encode
from shardwise.data.batch import Batch
from shardwise.data.encode import tokenize_prompt
from shardwise.data.rewards import check_data_sources, resolve_reward_fn, score_sequences
from shardwise.data.sources import load_records
from shardwise.data.tokenizer import build_char_tokenizer, load_tokenizer
from shardwise.engine.generate import prompt_batch
from shardwise.errors import ConfigError, DataError

EXAMPLES = REPO_ROOT / "examples"


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bpe")
    build_bpe_chat_tokenizer(folder)
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory):
    folder = tmp_path_factory.mktemp("builtin")
    build_char_tokenizer(folder)
    return load_tokenizer(folder)


CONVERSATION = [
    {"role": "system", "content": "answer with the number"},
    {"role": "user", "content": "what is 12+30"}, {"role": "assistant", "content": "42"},
    {"role": "user", "content": "and 7+1"}, {"role": "assistant", "content": "the answer is 8"},
]


def independent_spans(tok, ids: list[int], header: list[int], end: int) -> list[list[int]]:
    """Per assistant turn, the positions from just after `header` (the template's assistant
    header, as ids) up to and including the next `end` token."""
    spans, i = [], 0
    while i < len(ids):
        if ids[i:i + len(header)] == header:
            start = i + len(header)
            stop = ids.index(end, start)
            spans.append(list(range(start, stop + 1)))
            i = stop + 1
        else:
            i += 1
    return spans


def mask_of(spans: list[list[int]], n: int) -> list[int]:
    on = {p for s in spans for p in s}
    return [int(p in on) for p in range(n)]


def test_bpe_template_without_markers_trains_exactly_the_assistant_turns(bpe):
    ex, length, lost = encode.conversation_example(bpe, CONVERSATION, 10_000, "assistant", "row 0")
    ids = ex["input_ids"]
    # One tokenization of the whole rendered text, as a model sees it at inference
    text = bpe.apply_chat_template(CONVERSATION, tokenize=False)
    assert ids == bpe(text, add_special_tokens=False)["input_ids"] and length == len(ids) and lost == 0
    header = bpe("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    spans = independent_spans(bpe, ids, header, bpe.convert_tokens_to_ids("<|im_end|>"))
    assert len(spans) == 2
    assert ex["loss_mask"] == mask_of(spans, len(ids))
    assert bpe.decode([ids[p] for p in spans[1]]) == "the answer is 8<|im_end|>"  # the newline after it is not
    last, _, _ = encode.conversation_example(bpe, CONVERSATION, 10_000, "last_assistant", "row 0")
    assert last["loss_mask"] == mask_of(spans[1:], len(ids))
    every, _, _ = encode.conversation_example(bpe, CONVERSATION, 10_000, "all", "row 0")
    assert every["loss_mask"] == [1] * len(ids)
    # The RL prompt of the first exchange is exactly the ids the SFT example has before its answer
    prompt = tokenize_prompt(bpe, CONVERSATION[:2], 10_000)
    assert ids[:len(prompt)] == prompt and prompt[-len(header):] == header


def test_builtin_template_marks_assistant_text_and_eos(builtin):
    assert chat.has_generation_markers(builtin)
    ex, _, _ = encode.conversation_example(builtin, CONVERSATION[:3] + [{"role": "tool", "content": "1"}],
                                         10_000, "assistant", "row 0")
    ids = ex["input_ids"]
    spans = independent_spans(builtin, ids, [builtin.convert_tokens_to_ids("<|assistant|>")], builtin.eos_token_id)
    assert ex["loss_mask"] == mask_of(spans, len(ids)) and len(spans) == 1
    assert builtin.decode([ids[p] for p in spans[0]]) == "42<eos>"
    assert ids[0] == builtin.bos_token_id


def test_truncation_keeps_the_beginning_and_counts_the_lost_trained_tokens(bpe):
    full, n, _ = encode.conversation_example(bpe, CONVERSATION, 10_000, "assistant", "row 0")
    cut, n2, lost = encode.conversation_example(bpe, CONVERSATION, 30, "assistant", "row 0")
    assert n2 == n > 30 and cut["input_ids"] == full["input_ids"][:30]
    assert lost == sum(full["loss_mask"][30:]) > 0


def test_load_records_reads_messages_sharegpt_and_verl_parquet(tmp_path):
    conv = write_jsonl(tmp_path / "conv.jsonl", arithmetic_conversations(4, 0))
    recs = load_records(str(conv), "prompt", "response", seed=0, messages_key="messages", fmt="auto",
                        conversations=True)
    assert recs[0]["messages"] == arithmetic_conversations(4, 0)[0]["messages"]
    share = write_jsonl(tmp_path / "share.jsonl", [{"conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}])
    recs = load_records(str(share), "prompt", "response", seed=0, messages_key="messages", fmt="auto",
                        conversations=True)
    assert [t["role"] for t in recs[0]["messages"]] == ["system", "user", "assistant"]

    table = pa.table({
        "data_source": ["openai/gsm8k", "lighteval/MATH"],
        "prompt": [[{"role": "user", "content": "q1"}], [{"role": "system", "content": "s"},
                                                         {"role": "user", "content": "q2"}]],
        "reward_model": [{"style": "rule", "ground_truth": "72"}, {"style": "rule", "ground_truth": "\\frac12"}],
        "extra_info": [{"index": 0, "answer": "#### 72"}, {"index": 1, "answer": "x"}],
        "tags": pa.array([[("k", "v")], [("k", "w")]], type=pa.map_(pa.string(), pa.string())),
    })
    path = tmp_path / "verl.parquet"
    pq.write_table(table, path)
    extra = {"data_source": ("data_source", "data.data_source_key", False),
             "extra_info": ("extra_info", "data.extra_info_key", False),
             "tag": ("tags.k", "data.extra_info_key", True)}
    recs = load_records(str(path), "prompt", "reward_model.ground_truth", seed=0, fmt="auto", extra_keys=extra)
    assert recs[1]["prompt"][1] == {"role": "user", "content": "q2"} and recs[1]["response"] == "\\frac12"
    assert recs[0]["extra_info"] == {"index": 0, "answer": "#### 72"} and recs[0]["data_source"] == "openai/gsm8k"
    assert [r["tag"] for r in recs] == ["v", "w"]  # a Parquet map, by key
    with pytest.raises(DataError, match=r"data.prompt_key: .* must be text.*data.format=auto"):
        load_records(str(path), "prompt", None, seed=0, fmt="text")
    # a text prompt as one user turn when a template is asked for
    text = write_jsonl(tmp_path / "t.jsonl", [{"q": {"text": "12+3="}, "a": [5, 15]}])
    recs = load_records(str(text), "q.text", "a.1", seed=0, as_chat=True)
    assert recs[0]["prompt"] == [{"role": "user", "content": "12+3="}] and recs[0]["response"] == "15"


BAD_RECORDS = {
    "unknown-role": ({"messages": [{"role": "usr", "content": "a"}, {"role": "assistant", "content": "b"}]},
                     "data.messages_key: 'bad.jsonl' line 1, row 0: turn 0 has the unknown role 'usr'; did you mean user?"),
    "content-not-text": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]},
                         "turn 0 (user) has content int 3"),
    "no-assistant": ({"messages": [{"role": "user", "content": "a"}]}, "has no assistant turn"),
    "not-a-list": ({"messages": "hello"}, "expected a non-empty list of turns"),
    "sharegpt-unknown": ({"conversations": [{"from": "humn", "value": "a"}]}, "did you mean human?"),
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_bad_turns_name_the_file_row_and_turn(case, tmp_path):
    row, fragment = BAD_RECORDS[case]
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(DataError) as info:
        load_records(str(path), "prompt", "response", seed=0, messages_key="messages", fmt="auto",
                     conversations=True)
    message = str(info.value).replace(str(tmp_path) + "/", "")
    assert fragment in message and "\n" not in message, message


def test_a_dotted_key_that_names_nothing_lists_the_keys_at_that_level(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "reward_model": {"style": "rule", "ground_truth": 1}}])
    with pytest.raises(DataError) as info:
        load_records(str(path), "prompt", "reward_model.ground_truht", seed=0)
    message = str(info.value)
    assert "'reward_model.ground_truht' names nothing" in message and "line 1, row 0" in message
    assert "'style', 'ground_truth'" in message and "did you mean 'reward_model.ground_truth'?" in message
    with pytest.raises(DataError, match="its first part 'reward'"):
        load_records(str(path), "prompt", "reward.ground_truth", seed=0)


def test_templates_that_cannot_be_used_are_clear_errors(bpe, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ raise_exception('only user turns, please') }}{% endfor %}")
    tok = chat.use_chat_template(load_tokenizer(bpe.name_or_path), str(broken))
    with pytest.raises(DataError, match="row 3: the chat template failed to render.*only user turns, please"):
        encode.conversation_example(tok, CONVERSATION, 100, "assistant", "row 3")
    # A template that rewrites earlier turns (as Qwen3 drops earlier reasoning) cannot use prefixes
    rewriting = tmp_path / "rewrites.jinja"
    rewriting.write_text("{% for m in messages %}{% if loop.last %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% else %}{{ m['role'] }}\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    chat.use_chat_template(tok, str(rewriting))
    with pytest.raises(DataError, match=r"\{% generation %\}"):
        encode.conversation_example(tok, CONVERSATION, 100, "assistant", "row 0")
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template; set data.chat_template"):
        encode.prompt_ids(tok, CONVERSATION[:2], "row 0")
    with pytest.raises(ConfigError, match="data.chat_template.*does not exist"):
        chat.use_chat_template(tok, str(tmp_path / "missing.jinja"))


# ---------------------------------------------------------------- reward functions


VERL_REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ.get("RECEIVED", "received.jsonl"), "a") as f:
        f.write(json.dumps([data_source, solution_str, ground_truth, extra_info]) + "\\n")
    right = solution_str.strip() == ground_truth
    return {"score": float(right), "echo_index": float(extra_info["index"])}

def neither(a, b):
    return 0.0
'''


def test_verl_form_reward_gets_source_and_extra_info_and_returns_metrics(builtin, tmp_path, monkeypatch):
    (tmp_path / "verl_rw.py").write_text(VERL_REWARD)
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward_fn("verl_rw:compute_score")
    records = [{"prompt": [{"role": "user", "content": "1+1="}], "response": "2", "data_source": "src",
                "extra_info": {"index": 7}},
               {"prompt": "2+2=", "response": "4", "data_source": "src", "extra_info": {"index": 9}}]
    batch = prompt_batch(builtin, records, 16, ["a", "b"])
    assert batch.arrays["prompt"][0] == "<bos><|user|>1+1=\n<|assistant|>"  # the text asked
    answers = torch.tensor([builtin.encode("2")[0], builtin.encode("5")[0]])
    ids = torch.cat([batch.tensors["prompt_ids"], answers[:, None], torch.full((2, 1), builtin.eos_token_id)], 1)
    mask = torch.zeros_like(ids)
    mask[:, -2:] = 1
    seqs = batch.union(Batch.from_dict({"input_ids": ids, "response_mask": mask}))
    scored = score_sequences(seqs, builtin, fn)
    assert scored.tensors["token_level_scores"].sum(-1).tolist() == [1.0, 0.0]
    assert scored.meta["metrics"]["reward/echo_index"] == 8.0
    received = [json.loads(x) for x in (tmp_path / "received.jsonl").read_text().splitlines()]
    assert received == [["src", "2", "2", {"index": 7}], ["src", "5", "4", {"index": 9}]]
    with pytest.raises(ConfigError, match="takes neither"):
        resolve_reward_fn("verl_rw:neither")


def test_by_source_routes_like_verl_and_refuses_unknown_sources():
    fn = resolve_reward_fn("builtin:by_source")
    assert fn("", "so #### 1,000", "1000", data_source="openai/gsm8k") == 1.0
    assert fn("", "it is \\boxed{\\frac12}", "0.5", data_source="lighteval/MATH") == 1.0
    assert resolve_reward_fn("builtin:gsm8k")("p", "#### 72", "72") == 1.0  # the plain form, as every built-in
    with pytest.raises(DataError, match="'my/own' is none of .*openai/gsm8k"):
        check_data_sources(fn, [{"data_source": "openai/gsm8k"}, {"data_source": "my/own", "where": "row 1"}])


# ---------------------------------------------------------------- the CLI


def _data_view(name: str) -> list[str]:
    """The view of an example config: the prompts for RL and infer configs."""
    return ["--prompts"] if name.startswith(("grpo_", "infer_")) else []


@pytest.mark.parametrize("config,extra", [
    *[(p.name, _data_view(p.name)) for p in sorted(EXAMPLES.glob("*.yaml"))],
    ("sft_arithmetic.yaml", ["--json"]), ("grpo_chat.yaml", ["--prompts", "--json"]),
])
def test_shardwise_data_shows_each_example_config(config, extra, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)
    assert main(["data", str(EXAMPLES / config), f"run.dir={tmp_path / 'run'}", "--n", "2", *extra]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "run").exists()  # nothing written
    if "--json" in extra:
        rows = [json.loads(x) for x in out.splitlines()]
        assert len(rows) == 2
        assert set(rows[0]) == ({"prompt_ids", "prompt_text"} if "--prompts" in extra
                                else {"input_ids", "loss_mask", "text"})
        return
    assert out.startswith("#0 ") and out.count("\n#1 ") == 1 and "2 of " in out
    if config == "sft_chat.yaml":
        assert "<|assistant|>\u27e6" in out and "<eos>\u27e7" in out and "2 of 6000 examples shown" in out
    elif config == "grpo_chat.yaml":
        assert "<bos><|user|>" in out and out.count("<|assistant|>\n") >= 2 and "of 1024 prompts" in out
    elif config == "sft_colours.yaml":
        assert "<id 61 x4>" in out  # the image's tokens, past the tokenizer's vocabulary
    elif not extra:
        assert "\u27e6" in out and "<eos>\u27e7" in out


@pytest.mark.parametrize("overrides,fragment", [
    (["data.chat_template=none"], "data.chat_template': none, but"),
    (["data.source=examples/data/reverse_verl.parquet", "data.ground_truth_key=reward_model.truth"],
     "'reward_model.truth' names nothing"),
])
def test_shardwise_data_bad_input_is_one_line_exit_2(overrides, fragment, capsys, tmp_path, monkeypatch,
                                                     sft_demo_model):
    monkeypatch.chdir(REPO_ROOT)
    config = "grpo_chat.yaml" if "ground_truth_key" in " ".join(overrides) else "sft_chat.yaml"
    command = ["rl", "--nproc", "2"] if config == "grpo_chat.yaml" else ["data"]
    if config == "grpo_chat.yaml":  # its warm start (runs/sft_chat/hf) is not in a clean clone
        overrides = [f"model.path={sft_demo_model}", *overrides]
    code = main([command[0], str(EXAMPLES / config), f"run.dir={tmp_path / 'run'}", *overrides, *command[1:]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and fragment in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_multi_turn_sft_on_two_ranks_equals_one_rank_and_learns(tmp_path):
    """BPE tokenizer, Qwen-style template (the prefix route), 2-3 exchanges per record."""
    build_bpe_chat_tokenizer(tmp_path / "bpe")
    data = write_jsonl(tmp_path / "conv.jsonl", arithmetic_conversations(256, 1))
    args = ["train", str(EXAMPLES / "sft_chat.yaml"), f"data.source={data}", f"model.tokenizer={tmp_path / 'bpe'}",
            "model.config.vocab_size=320", "model.config.hidden_size=64", "model.config.intermediate_size=128",
            "model.config.head_dim=16", "data.max_length=128", "train.max_steps=12", "train.log_every=1",
            "train.global_batch_size=16", "train.micro_batch_size=4", "checkpoint.every_steps=0",
            "checkpoint.export_hf=false", "train.scheduler.warmup_steps=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    r1, r2 = at_once(lambda: run_cli([*args, "--nproc", "1", f"run.dir={one}"], timeout=300),
                     lambda: run_cli([*args, "--nproc", "2", f"run.dir={two}"], timeout=300))
    assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr[-2000:], r2.stderr[-2000:])
    l1 = [json.loads(x)["loss"] for x in (one / "metrics.jsonl").read_text().splitlines()]
    l2 = [json.loads(x)["loss"] for x in (two / "metrics.jsonl").read_text().splitlines()]
    # fp32 and the same global batch: sharding changes only the order of sums (tests/test_parity.py)
    torch.testing.assert_close(torch.tensor(l2), torch.tensor(l1), rtol=1e-5, atol=0)
    assert l1[-1] < l1[0] - 1.0, l1  # ln(320) = 5.77 at the start; measured 5.79 -> 4.17


RAW_TEMPLATE = "{{ bos_token }}{{ messages[-1]['content'] }}"
"""A template file that renders a one-turn prompt as the text the SFT demo model was trained on."""

RECORDING_REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["RECEIVED"], "a") as f:
        f.write(json.dumps([data_source, ground_truth, extra_info]) + "\\n")
    answer = solution_str.strip().split()[0] if solution_str.strip() else ""
    return {"score": float(answer == ground_truth), "copied": float(answer == extra_info["word"])}
'''


def test_grpo_from_verl_parquet_with_a_verl_reward_function(sft_demo_model, tmp_path):
    """verl's columns (prompt as messages, nested reward_model.ground_truth, extra_info), a
    template file, a verl-form function that records what it receives; from the SFT demo's
    model, which mostly copies the word (the demo: 22% -> 98% held-out in 30 steps)."""
    from shardwise.data.tasks import reverse_examples

    rows = reverse_examples(256, 5)
    pq.write_table(pa.table({
        "data_source": ["shardwise/reverse"] * len(rows),
        "prompt": [[{"role": "user", "content": r["prompt"]}] for r in rows],
        "reward_model": [{"style": "rule", "ground_truth": r["response"]} for r in rows],
        "extra_info": [{"index": i, "word": r["prompt"][:-1]} for i, r in enumerate(rows)],
    }), tmp_path / "train.parquet")
    (tmp_path / "raw.jinja").write_text(RAW_TEMPLATE)
    (tmp_path / "recording_reward.py").write_text(RECORDING_REWARD)
    run_dir = tmp_path / "run"
    res = run_cli(["rl", str(EXAMPLES / "grpo_reverse.yaml"), "--nproc", "2", f"run.dir={run_dir}",
                   f"model.path={sft_demo_model}", f"data.source={tmp_path / 'train.parquet'}",
                   "data.ground_truth_key=reward_model.ground_truth", f"data.chat_template={tmp_path / 'raw.jinja'}",
                   "rl.reward.function=recording_reward:compute_score", "train.max_steps=10",
                   "rl.heldout_eval=false", "checkpoint.every_steps=0", "checkpoint.export_hf=false"],
                  timeout=400, cwd=tmp_path, env={"RECEIVED": str(tmp_path / "received.jsonl")})
    assert res.returncode == 0, res.stderr[-4000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reward = [m["reward/mean"] for m in steps]
    assert all("reward/copied" in m for m in steps)
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.15, reward
    received = [json.loads(x) for x in (tmp_path / "received.jsonl").read_text().splitlines()]
    assert len(received) == 10 * 32 * 8  # steps x prompts x samples
    for source, truth, info in received:
        row = rows[info["index"]]
        assert (source, truth, info["word"]) == ("shardwise/reverse", row["response"], row["prompt"][:-1])


def test_heldout_prompts_follow_the_jobs_chat_setting(builtin, tmp_path):
    from shardwise.config import load_config
    from shardwise.data.chat import text_prompts_as_chat
    from shardwise.data.tasks import get_builtin_task
    from shardwise.engine.evaluate import asked_records
    from shardwise.engine.generate import prompt_batch

    (tmp_path / "t.jinja").write_text("x")
    assert not text_prompts_as_chat(load_config(None, []).data)
    assert text_prompts_as_chat(load_config(None, ["data.format=messages"]).data)
    assert text_prompts_as_chat(load_config(None, [f"data.chat_template={tmp_path / 't.jinja'}"]).data)
    records = get_builtin_task("builtin:reverse").heldout_examples(3, 0)
    uids = [f"heldout-{i}" for i in range(3)]
    plain = prompt_batch(builtin, asked_records(records, False), 32, uids)
    chatted = prompt_batch(builtin, asked_records(records, True), 32, uids)
    for text, asked in zip(plain.arrays["prompt"], chatted.arrays["prompt"]):
        assert asked == f"<bos><|user|>{text}\n<|assistant|>"
    ids = chatted.tensors["prompt_ids"][0][chatted.tensors["prompt_mask"][0].bool()].tolist()
    assert ids == tokenize_prompt(builtin, [{"role": "user", "content": plain.arrays["prompt"][0]}], 32)


# ---------------------------------------------------------------- templates bounded, conversations linear (issue 30)


def old_prefix_method(tok, messages: list[dict]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The per-prefix method shardwise used before issue 30 (two transformers renders per
    assistant turn: quadratic), kept as the reference: (ids, loss mask, character spans)."""
    full = tok.apply_chat_template(messages, tokenize=False)
    special = set(tok.all_special_tokens) | {str(t) for t in tok.added_tokens_decoder.values()}
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = tok.apply_chat_template(messages[: i + 1], tokenize=False)
        assert upto.startswith(before) and full.startswith(upto)
        start, end = len(before), len(upto)
        stripped = upto.rstrip()
        if len(stripped) > start and any(stripped.endswith(t) for t in special if t):
            end = len(stripped)
        spans.append((start, end))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= s < b for a, b in spans)) if e > s else 0 for s, e in enc["offset_mapping"]]
    return enc["input_ids"], mask, spans


def test_one_pass_spans_equal_the_old_per_prefix_method(bpe, builtin):
    """Assistant turns are found in one render (linear in a conversation's length) and give
    the masks the per-prefix renders gave, with and without generation markers."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from shardwise.data.encode import _one_pass_spans, _special_tokens

    conversations = [r["messages"] for r in arithmetic_conversations(12, 3)] + [CONVERSATION]
    for messages in conversations:
        ids, mask, spans = old_prefix_method(bpe, messages)
        ex, _, _ = encode.conversation_example(bpe, messages, 10_000, "assistant", "row 0")
        assert (ex["input_ids"], ex["loss_mask"]) == (ids, mask)
        # the one pass alone (not only after its spot checks) finds the same spans
        rendered = chat.render(bpe, messages, False, "row 0")
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        checked = {turns[0]: spans[0], turns[-1]: spans[-1]}
        assert _one_pass_spans(messages, rendered, turns, checked, _special_tokens(bpe)) == spans
        # markers: the spans transformers' assistant mask gave
        marked = builtin.apply_chat_template(messages, tokenize=False)
        text, indices = render_jinja_template([messages], chat_template=builtin.chat_template,
                                              return_assistant_tokens_mask=True, **builtin.special_tokens_map)
        assert encode.assistant_spans(builtin, messages, "row 0") == (marked, [tuple(x) for x in indices[0]])


def test_a_20000_turn_conversation_prepares_in_one_pass_through_the_cli(tmp_path):
    """20,000 turns (10,000 assistant answers): one render and one walk over the tokens,
    not a render per turn (which ran for minutes with no output)."""
    turns = []
    for i in range(10_000):
        turns += [{"role": "user", "content": f"what is {i}+1"}, {"role": "assistant", "content": str(i + 1)}]
    source = write_jsonl(tmp_path / "long.jsonl", [{"messages": turns}])
    res = run_cli(["data", EXAMPLES / "sft_chat.yaml", f"run.dir={tmp_path / 'run'}", f"data.source={source}",
                   "data.max_length=64", "--n", "1", "--json"], timeout=150)
    assert res.returncode == 0, res.stderr
    row = json.loads(res.stdout)
    assert len(row["input_ids"]) == 64 and row["text"].startswith("<bos><|user|>what is 0+1\n<|assistant|>1<eos>")
    # the first answer and its eos are trained, nothing before it
    first = row["input_ids"].index(2)  # <eos>
    assert row["loss_mask"][:first + 1] == [0] * (first - 1) + [1, 1]


HOSTILE_TEMPLATES = {
    "output": "{{ messages[0]['content'] * 10000000 }}",  # 10 million times a message's content
    "time": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_one_line_exit_2_in_bounded_time_and_memory(kind, tmp_path):
    """A tiny template that writes gigabytes, or loops 10^10 times writing nothing, stops at
    its render budget: one line naming data.chat_template and the row, exit 2, the process's
    peak memory far from the gigabytes (the run_cli timeout is far below the minutes they
    took)."""
    template = tmp_path / "hostile.jinja"
    template.write_text(HOSTILE_TEMPLATES[kind])
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION * 10}])
    script = ("import resource, sys\nfrom shardwise.cli import main\ncode = main(sys.argv[1:])\n"
              "print('peak_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)\n")
    res = run_python(["-c", script, "data", EXAMPLES / "sft_chat.yaml", f"run.dir={tmp_path / 'run'}",
                      f"data.source={source}", f"data.chat_template={template}"], timeout=90)
    errors = [line for line in res.stderr.splitlines() if "error" in line]
    assert res.returncode == 2 and len(errors) == 1, res.stderr
    assert "'data.chat_template'" in errors[0] and "line 1, row 0" in errors[0] and "budget" in errors[0]
    assert "Traceback" not in res.stderr
    peak_kb = int(res.stdout.split("peak_kb")[1].split()[0])
    assert peak_kb < 1_500_000, peak_kb  # the imports are most of it; the template adds nothing near a GB


def test_ctrl_c_stops_a_template_that_is_rendering(builtin, tmp_path):
    """Rendering runs Python between jinja's steps, so Ctrl-C (SIGINT) interrupts a slow
    template at once instead of waiting for the budget."""
    import os
    import signal
    import threading

    tok = chat.use_chat_template(load_tokenizer(builtin.name_or_path), str(_write(tmp_path / "slow.jinja",
                                                                                   HOSTILE_TEMPLATES["time"])))
    # Ctrl-C as a fresh `shardwise` process has it. This test shares its xdist worker with
    # earlier ones that ran jobs in-process, and twice (stop 42, stop 43, in 2 of ~8 suite
    # runs) SIGINT did not interrupt here: the render ran into its 10 s budget instead.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                chat.render(tok, CONVERSATION, False, "row 0")
            except ConfigError as e:  # the budget, not Ctrl-C, ended it
                raise AssertionError(f"SIGINT did not interrupt (its handler before this test: {before!r})") from e
    finally:
        timer.cancel()
        if before is not None:  # None: set outside Python, which cannot be put back
            signal.signal(signal.SIGINT, before)


def _write(path, text: str):
    path.write_text(text)
    return path


@pytest.mark.parametrize("source", [
    "{{ messages[0]['content'] * 10000000 }}", "{{ 'x'.center(10**9) }}", "{{ messages[0]['content'] | center(10**9) }}",
    "{{ messages[0]['content'].replace('', 'x' * 99999) }}", "{{ (['y' * 99999] * 9) | join }}",
    "{{ ' '.join(['y' * 99999] * 9) }}", "{{ '%0999999999d' % 1 }}", "{{ '%0999999999d' | format(1) }}", "{{ '{:>999999999}'.format(1) }}", "{% for i in range(99999) %}{{ messages[0]['content'] * 99 }}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
])
def test_every_way_a_template_builds_too_much_stops_at_its_budget(source):
    """Output, any one value built while rendering (``*``, ``%``, a filter's or method's
    width) and time are bounded; the render stops with TemplateBudgetError, nothing big
    allocated first."""
    from shardwise.data.template import Budget, TemplateBudgetError, render

    with pytest.raises(TemplateBudgetError):
        render(source, CONVERSATION, Budget(max_chars=100_000, seconds=1.0))
    assert render("{% for m in messages %}{{ m['content'] }}{% endfor %}", CONVERSATION,
                  Budget(max_chars=100_000, seconds=1.0)).text.startswith("answer with the number")
