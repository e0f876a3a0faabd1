"""Tool conversations on the data side (issue 27): the built-in tokenizer's tools variant,
the loss mask of a tool conversation (only the assistant's tokens, its calls included) with
it and with a BPE tokenizer whose Qwen2.5-style template renders ``tools``, the built-in
calculator (no eval) and GuessNumber, the builtin:calc records, and `shardwise data`."""

from __future__ import annotations

import json

import pytest
from chat_data import write_jsonl
from dist.launcher import REPO_ROOT

from shardwise.agents.builtin import GuessNumber, calculator
from shardwise.cli import main
from shardwise.data import chat, encode
from shardwise.data.sources import load_records
from shardwise.data.tasks import CALC_TOOL, calc_demonstrations, get_builtin_task, guess_demonstrations
from shardwise.data.tokenizer import (
    BUILTIN_TOOLS_VOCAB_SIZE,
    BUILTIN_VOCAB_SIZE,
    TOOL_TOKENS,
    build_char_tokenizer,
)
from shardwise.errors import DataError

CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123*456"}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "use the tool."},
    {"role": "user", "content": "123*456="},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calculator", "tool_call_id": "c0", "content": "56088"},
    {"role": "assistant", "content": "56088"},
]
SCHEMA = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}


@pytest.fixture(scope="module")
def tools_tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("tools_tok"), tools=True)


def trained_text(tok, enc: encode.Encoded) -> list[str]:
    """The decoded runs of trained tokens, in order."""
    runs, cur = [], []
    for tid, m in zip(enc.ids, enc.loss_mask):
        if m:
            cur.append(tid)
        elif cur:
            runs, cur = runs + [tok.decode(cur)], []
    return runs + ([tok.decode(cur)] if cur else [])


def test_tools_variant_keeps_every_id_and_round_trips(tools_tok, tmp_path):
    plain = build_char_tokenizer(tmp_path / "plain")
    assert len(plain) == BUILTIN_VOCAB_SIZE == 60 and len(tools_tok) == BUILTIN_TOOLS_VOCAB_SIZE == 67
    assert all(tools_tok.convert_tokens_to_ids(t) == i for t, i in plain.get_vocab().items())
    assert tools_tok.convert_tokens_to_ids(list(TOOL_TOKENS)) == [65, 66]
    text = chat.render_text(tools_tok, chat.normalize_messages(TOOL_CONVERSATION, "row 0"), False, "row 0")
    assert '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><eos>' in text
    assert "<|user|>tool: 56088\n" in text
    ids = tools_tok(text, add_special_tokens=False)["input_ids"]
    assert tools_tok.unk_token_id not in ids and tools_tok.decode(ids) == text
    # tools render nothing in the built-in template; the transformers render is the same text
    assert tools_tok.apply_chat_template(TOOL_CONVERSATION, tokenize=False, tools=[SCHEMA]) == text


def test_tool_conversation_trains_only_the_assistant_with_the_builtin_tokenizer(tools_tok):
    messages = chat.normalize_messages(TOOL_CONVERSATION, "row 0")
    enc = encode.encode_record(tools_tok, {"messages": messages, "tools": [SCHEMA]}, 1000)
    assert trained_text(tools_tok, enc) == [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><eos>', "56088<eos>"]
    # OpenAI's JSON-text arguments and a missing content are the same conversation
    as_text = [*TOOL_CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "123*456"}'}}]},
        *TOOL_CONVERSATION[3:]]
    assert encode.encode_record(tools_tok, {"messages": chat.normalize_messages(as_text, "r")}, 1000) == enc
    # the prompt of the second assistant turn is exactly the example's ids before it
    prompt = encode.encode_prompt(tools_tok, messages[:4], 1000, tools=[SCHEMA])
    assert enc.ids[:len(prompt.ids)] == prompt.ids and sum(enc.loss_mask[len(prompt.ids):]) == 6


def test_tool_conversation_trains_only_the_assistant_with_a_qwen_style_bpe(qwen_tool_tokenizer):
    tok, _ = qwen_tool_tokenizer
    messages = chat.normalize_messages(TOOL_CONVERSATION[1:] + [
        {"role": "user", "content": "and 2+2?"},
        {"role": "assistant", "content": "let me see",
         "tool_calls": [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+2"}}}]},
        {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}], "row 0")
    enc = encode.encode_record(tok, {"messages": messages, "tools": [SCHEMA]}, 10_000)
    assert trained_text(tok, enc) == [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call><|im_end|>',
        "56088<|im_end|>",
        'let me see\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call><|im_end|>',
        "4<|im_end|>"]
    text = tok.apply_chat_template(messages, tokenize=False, tools=[SCHEMA])
    assert enc.ids == tok(text, add_special_tokens=False)["input_ids"]  # one tokenization of the whole text
    assert "<tools>\n" + json.dumps(SCHEMA) in text and "<tool_response>\n56088\n</tool_response>" in text
    prompt = encode.encode_prompt(tok, messages[:3], 10_000, tools=[SCHEMA])
    assert enc.ids[:len(prompt.ids)] == prompt.ids
    assert tok.decode(prompt.ids).endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert len(encode.encode_prompt(tok, messages[:1], 10_000).ids) < len(
        encode.encode_prompt(tok, messages[:1], 10_000, tools=[SCHEMA]).ids)


@pytest.mark.parametrize("turns,fragment", [
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], "only assistant turns call tools"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}],
     "arguments that are not JSON"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}], "with a name"),
    ([{"role": "assistant", "content": "", "tool_calls": CALL}], "not a list of calls"),
    ([{"role": "assistant", "content": None}], "content must be a string"),
])
def test_bad_tool_calls_are_one_line_errors(turns, fragment):
    with pytest.raises(DataError, match=fragment) as e:
        chat.normalize_messages(turns, "data.source 'x.jsonl' row 3")
    assert "\n" not in str(e.value) and "row 3" in str(e.value)
    with pytest.raises(DataError, match="not a list of function schemas"):
        chat.check_tools({"name": "f"}, "row 1")


def test_calculator_is_exact_bounded_and_never_evaluates_python():
    assert calculator("123*456") == "56088" and calculator(" (7+5)/4 ") == "3" and calculator("7/2") == "3.5"
    assert calculator("-3 - -4") == "1" and calculator("1/0") == "error: division by zero"
    for hostile in ("__import__('os').system('true')", "open('x')", "(lambda: 1)()", "[1][0]", "x", "1 if 1 else 2",
                    "2**100000", "9**9**9", "1.5*2", "True+1", "'a'*3"):
        assert calculator(hostile).startswith("error: "), hostile
    assert "digits" in calculator("*".join(["99999999999"] * 8))  # 88 digits: refused
    assert "longer than" in calculator("1+" * 200 + "1") and calculator("") == "error: the expression is empty"
    assert calculator(12).startswith("error: ")


def test_guess_number_environment():
    env = GuessNumber()
    assert "1 to 15" in env.reset(prompt="guess my number.", response="9")
    assert [env.guess(8), env.guess(12), env.reward(), env.guess(9), env.reward()] == [
        "higher", "lower", 0.0, "correct", 1.0]
    env.reset(extra_info={"secret": 3}, max_guesses=1)
    assert env.guess(5) == "lower" and env.guess(3) == "no guesses left" and env.reward() == 0.0
    with pytest.raises(ValueError, match="no integer secret"):
        env.reset(prompt="x")


def test_calc_task_records():
    task = get_builtin_task("builtin:calc")
    assert task.needs_tools and task.tools == (CALC_TOOL,) and get_builtin_task("guess").needs_tools
    rows = calc_demonstrations(1000, 0)
    assert rows == calc_demonstrations(1000, 0) and rows != calc_demonstrations(1000, 1)
    with_tool = [r for r in rows if len(r["messages"]) == 4]
    assert 0.25 < len(with_tool) / len(rows) < 0.35
    for r in rows:
        a, b = r["prompt"].removesuffix("=").split("*")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and r["response"] == str(int(a) * int(b))
        assert r["messages"][-1] == {"role": "assistant", "content": r["response"]}
    call = with_tool[0]["messages"][1]["tool_calls"][0]["function"]
    assert calculator(**call["arguments"]) == with_tool[0]["messages"][2]["content"] == with_tool[0]["response"]
    heldout = task.heldout_examples(5, 10)
    assert all(set(r) == {"prompt", "response"} for r in heldout)
    # SFT reads the demonstrations as conversations; RL reads prompts as one user turn
    sft = load_records("builtin:calc", "prompt", "response", 0, num_builtin=8, messages_key="messages",
                       fmt="auto", conversations=True)
    assert [r["messages"] for r in sft] == [r["messages"] for r in rows[:8]]
    games = guess_demonstrations(50, 0)
    assert all(sum(m["role"] == "tool" for m in g["messages"]) <= 4 for g in games)
    assert all(g["messages"][-2]["content"] == "correct" and g["messages"][1]["role"] == "user" for g in games)
    env = GuessNumber()
    assert env.reset(**games[0]) == games[0]["messages"][1]["content"]  # the observation the demonstrations show


def test_shardwise_data_shows_a_tool_conversation(capsys, tmp_path, monkeypatch, qwen_tool_tokenizer):
    monkeypatch.chdir(REPO_ROOT)
    source = write_jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CONVERSATION[1:], "tools": [SCHEMA]}])
    _, folder = qwen_tool_tokenizer
    assert main(["data", "examples/sft_chat.yaml", f"run.dir={tmp_path / 'run'}", f"data.source={source}",
                 f"model.tokenizer={folder}", "data.max_length=1024", "--n", "1"]) == 0
    out = capsys.readouterr().out
    assert "<tools>\n" in out and '\u27e6<tool_call>\n{"name": "calculator"' in out
    assert "</tool_call><|im_end|>\u27e7\n<|im_start|>user\n<tool_response>\n56088\n</tool_response>" in out
    assert "\u27e656088<|im_end|>\u27e7" in out
    # the built-in task with the built-in tokenizer's tools variant
    assert main(["data", "examples/sft_tools.yaml", f"run.dir={tmp_path / 'run2'}", "--n", "3"]) == 0
    out = capsys.readouterr().out
    assert '<|assistant|>\u27e6<tool_call>{"name": "calculator", "arguments": {"expression": "' in out
    assert "</tool_call><eos>\u27e7<|user|>tool: " in out
