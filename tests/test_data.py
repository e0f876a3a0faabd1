"""The data layer: tokenizer, built-in tasks, sources, collation/packing, sampler."""

from __future__ import annotations

import json
import re

import pytest
import torch

from shardwise.data.collate import (
    IGNORE_INDEX,
    additive_mask,
    count_loss_tokens,
    pack_collate,
    pad_collate,
)
from shardwise.data.encode import tokenize_pair, tokenize_prompt
from shardwise.data.sampler import GlobalBatchSampler, micro_batches, rank_share
from shardwise.data.sources import load_records
from shardwise.data.tasks import (
    BUILTIN_TASKS,
    arithmetic_examples,
    count_examples,
    get_builtin_task,
    score_arithmetic,
)
from shardwise.data.tokenizer import BUILTIN_VOCAB_SIZE, CHAR_VOCAB_SIZE, build_char_tokenizer
from shardwise.errors import DataError, ShardwiseError


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("char_tokenizer")
    build_char_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


# ---------------------------------------------------------------- tokenizer


def test_char_tokenizer_ids_of_known_characters(tmp_path):
    tok = build_char_tokenizer(tmp_path)
    assert len(tok) == BUILTIN_VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["0", "9", "+", "-", "*", "=", " ", "a", "z"]) == [
        4, 13, 14, 15, 16, 17, 18, 19, 44,
    ]
    # One id per character, no special tokens added by encode.
    assert tok.encode("12+34=46") == [5, 6, 14, 7, 8, 17, 8, 10]
    assert tok.encode("Q") == [3]  # upper case is outside the vocabulary


@pytest.mark.parametrize("text", ["12+34=46", "a b  c", "hello, world!\n(x)='y'/2?;:.", " 7 "])
def test_char_tokenizer_round_trips_exactly_after_reload(tokenizer_dir, tokenizer, text):
    fresh = build_char_tokenizer(tokenizer_dir / "again")
    ids = tokenizer.encode(text)
    assert len(ids) == len(text)
    assert ids == fresh.encode(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([1, *ids, 2, 0, 0], skip_special_tokens=True) == text


def test_reloaded_tokenizer_keeps_special_tokens(tokenizer_dir, tokenizer):
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (
        "<pad>", "<bos>", "<eos>", "<unk>",
    )
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 2
    assert tokenizer.padding_side == "right"
    assert len(tokenizer) == BUILTIN_VOCAB_SIZE
    assert (tokenizer_dir / "tokenizer.json").is_file()


# ---------------------------------------------------------------- tasks

ARITH_RE = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def _solve(prompt: str) -> tuple[int, str, int, int]:
    m = ARITH_RE.match(prompt)
    assert m, prompt
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a, op, b, {"+": a + b, "-": a - b, "*": a * b}[op]


def test_arithmetic_examples_are_deterministic_by_seed():
    assert arithmetic_examples(50, seed=7) == arithmetic_examples(50, seed=7)
    assert arithmetic_examples(50, seed=7) != arithmetic_examples(50, seed=8)
    # A prefix of a longer run: the n-th example does not depend on n.
    assert arithmetic_examples(10, seed=7) == arithmetic_examples(50, seed=7)[:10]


@pytest.mark.parametrize("ops,max_operand", [("+-", 99), ("+-*", 12), ("-", 5), ("*", 0)])
def test_every_arithmetic_example_is_correct(ops, max_operand):
    examples = arithmetic_examples(300, seed=1, max_operand=max_operand, ops=ops)
    seen_ops = set()
    for ex in examples:
        assert set(ex) == {"prompt", "response"}
        a, op, b, result = _solve(ex["prompt"])
        seen_ops.add(op)
        assert 0 <= a <= max_operand and 0 <= b <= max_operand
        assert result >= 0
        assert ex["response"] == str(result)
    assert seen_ops == set(ops)


def test_arithmetic_rejects_unknown_ops():
    with pytest.raises(ValueError, match=r"ops must be .*'/'"):
        arithmetic_examples(3, seed=0, ops="+/")


@pytest.mark.parametrize(
    "response,truth,reward",
    [
        ("46", "46", 1.0),
        ("46<eos>", "46", 1.0),
        ("  46<eos><pad><pad>", "46", 1.0),
        ("46\n12+3=15", "46", 1.0),
        ("46 because", "46", 1.0),
        ("46", " 46 ", 1.0),
        ("4", "46", 0.0),
        ("460", "46", 0.0),
        ("46.0", "46", 0.0),
        ("", "46", 0.0),
        ("<eos>46", "46", 0.0),
        ("x46", "46", 0.0),
    ],
)
def test_score_arithmetic(response, truth, reward):
    assert score_arithmetic("12+34=", response, truth) == reward


def test_builtin_task_registry():
    task = get_builtin_task("builtin:arithmetic")
    assert task is get_builtin_task("arithmetic") is BUILTIN_TASKS["arithmetic"]
    examples = task.make_examples(20, 3)
    assert examples == arithmetic_examples(20, 3)
    assert [task.score(e["prompt"], e["response"] + "<eos>", e["response"]) for e in examples] == [1.0] * 20
    unknown = r"unknown built-in task 'arithmetc'.*did you mean builtin:arithmetic\?"
    with pytest.raises(ValueError, match=unknown):
        get_builtin_task("arithmetc")
    with pytest.raises(ShardwiseError, match=r"'builtin:poetry'.*builtin:arithmetic"):
        get_builtin_task("builtin:poetry")


def test_count_task_has_long_answers_of_varied_length(tokenizer):
    """builtin:count is the long-answer task (RL at real lengths): over its training rows the
    built-in tokenizer's response tokens average >= 32 with a longest >= 96, the lengths
    spread several-fold, and the held-out generation budget fits the longest answer and its
    eos. The rows are deterministic in the seed, right, and scored by exact answer."""
    count, mixed = get_builtin_task("builtin:count"), get_builtin_task("builtin:count_mixed")
    rows = count.make_examples(2048, 0)
    assert rows == count_examples(2048, 0) and rows != count.make_examples(2048, 1)
    assert count.make_examples(10, 0) == rows[:10]
    lengths = [len(tokenizer(r["response"], add_special_tokens=False)["input_ids"]) for r in rows]
    mean = sum(lengths) / len(lengths)
    assert mean >= 32 and max(lengths) >= 96, (mean, max(lengths))
    assert min(lengths) <= 11 and sorted(lengths)[len(lengths) // 2] < mean  # varied, a long tail
    assert count.max_new_tokens >= max(lengths) + 1 and mixed.max_new_tokens == count.max_new_tokens
    for r in rows:
        a, b = (int(x) for x in r["prompt"].removesuffix("=").split(":"))
        assert 10 <= a < b <= 99 and r["response"] == ",".join(str(x) for x in range(a, b + 1))
        assert count.score(r["prompt"], r["response"] + "<eos><pad>", r["response"]) == 1.0
        assert count.score(r["prompt"], r["response"][:-1], r["response"]) == 0.0
    # count_mixed: the same prompts; about 60% of the answers count down, the rest are right
    demos = mixed.make_examples(2048, 0)
    assert demos == mixed.make_examples(2048, 0)
    assert [d["prompt"] for d in demos] == [r["prompt"] for r in rows]
    down = [d["response"] == ",".join(reversed(r["response"].split(","))) for d, r in zip(demos, rows)]
    assert all(dn or d["response"] == r["response"] for dn, d, r in zip(down, demos, rows))
    assert 0.55 < sum(down) / len(down) < 0.65
    assert mixed.heldout_examples(50, 7) == count_examples(50, 7)


# ---------------------------------------------------------------- sources

ROWS = [
    {"question": "1+1=", "answer": "2", "extra": 0},
    {"question": "2+5=", "answer": 7, "extra": 1},  # a number: becomes "7"
    {"question": "9-3=", "answer": "6", "extra": 2},
]
EXPECTED = [
    {"prompt": "1+1=", "response": "2"},
    {"prompt": "2+5=", "response": "7"},
    {"prompt": "9-3=", "response": "6"},
]


def _write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Parquet needs one type per column: store the answers as text.
        table = pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows])
        pq.write_table(table, path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_load_records_from_local_files(tmp_path, suffix):
    path = _write(tmp_path / f"data{suffix}", ROWS)
    cache = str(tmp_path / "cache")
    assert load_records(str(path), "question", "answer", seed=0, cache_dir=cache) == EXPECTED
    prompts_only = load_records(str(path), "question", None, seed=0, cache_dir=cache)
    assert prompts_only == [{"prompt": e["prompt"], "response": None} for e in EXPECTED]


def test_load_records_builtin_follows_the_seed():
    records = load_records("builtin:arithmetic", "prompt", "response", seed=5, num_builtin=40)
    assert records == arithmetic_examples(40, 5)
    assert records != load_records("builtin:arithmetic", "prompt", "response", seed=6, num_builtin=40)
    prompts = load_records("builtin:arithmetic", "prompt", None, seed=5, num_builtin=4)
    assert [r["response"] for r in prompts] == [None] * 4


def test_load_records_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=r"'.*nope\.jsonl' does not exist"):
        load_records(str(missing), "prompt", "response", seed=0)


def test_load_records_unsupported_extension(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("prompt,response\n1+1=,2\n")
    with pytest.raises(ValueError, match=r"unsupported extension '\.csv'.*\.jsonl, \.json, \.parquet"):
        load_records(str(path), "prompt", "response", seed=0)


def test_load_records_missing_key_names_key_file_and_nearest_keys(tmp_path):
    path = _write(tmp_path / "data.jsonl", ROWS)
    cache = str(tmp_path / "cache")
    with pytest.raises(ValueError) as err:
        load_records(str(path), "questoin", "answer", seed=0, cache_dir=cache)
    msg = str(err.value)
    assert "'questoin'" in msg and str(path) in msg
    # every existing key is listed, the nearest first
    assert msg.index("'question'") < msg.index("'answer'") and "'extra'" in msg
    assert "did you mean 'question'?" in msg

    with pytest.raises(ValueError, match=r"key 'anwser' not found .* 'answer'"):
        load_records(str(path), "question", "anwser", seed=0, cache_dir=cache)
    with pytest.raises(ValueError, match=r"key 'question' not found in data source 'builtin:arithmetic'"):
        load_records("builtin:arithmetic", "question", None, seed=0, num_builtin=2)


def test_load_records_rejects_non_text_prompt(tmp_path):
    path = _write(tmp_path / "data.jsonl", [{"p": 3, "r": "x"}])
    with pytest.raises(DataError, match=r"row 0: 'p' must be text, got int 3"):
        load_records(str(path), "p", "r", seed=0, cache_dir=str(tmp_path / "cache"))


def _lines(*rows) -> bytes:
    """JSON Lines bytes; a None row is a blank line, a str row is written as it is."""
    return "".join((r if isinstance(r, str) else "" if r is None else json.dumps(r)) + "\n" for r in rows).encode()


GOOD = {"prompt": "1+1=", "response": "2"}

# name: (file name, content: bytes, a directory's {name: bytes} or None for missing,
#        prompt_key, response_key, fragments the one-line message must hold)
BAD_SOURCES = {
    "empty_file": ("empty.jsonl", b"", "prompt", "response", ["data.source", "holds no records", "one JSON object per line"]),
    "only_blank_lines": ("blank.jsonl", b"\n  \n\t\n\n", "prompt", "response", ["holds no records"]),
    "empty_json_array": ("empty.json", b" [ ] ", "prompt", "response", ["holds no records", "make it a JSON array of objects"]),
    "malformed_line_3_of_5": (
        "malformed.jsonl",
        _lines(GOOD, GOOD, '{"prompt": "3+3=", "response": }', GOOD, GOOD),
        "prompt", "response",
        ["data.source", "line 3 is not valid JSON", "Expecting value", "fix or remove that line"],
    ),
    "non_utf8_byte_on_line_2": (
        "latin1.jsonl",
        _lines(GOOD) + b'{"prompt": "caf\xe9=", "response": "2"}\n',
        "prompt", "response",
        # '{"prompt": "caf' is 15 bytes: the bad byte is at offset 15 of line 2
        ["not UTF-8", "line 2 has byte 0xe9", "offset 15 of the line", f"offset {len(_lines(GOOD)) + 15} in the file",
         "save the file as UTF-8"],
    ),
    "line_is_not_an_object": (
        "array_line.jsonl", _lines(GOOD, [1, 2]), "prompt", "response",
        ["line 2 is an array [1, 2], not an object", "one object per line"],
    ),
    "directory": ("shards", {"part-0.jsonl": _lines(GOOD), "notes.txt": b"x"}, "prompt", "response",
                  ["data.source", "is a directory", "'part-0.jsonl'", "point data.source at one"]),
    "missing_file": ("nope.jsonl", None, "prompt", "response", ["data.source", "does not exist", "resolved path"]),
    "csv_extension": ("data.csv", b"prompt,response\n1+1=,2\n", "prompt", "response",
                      ["unsupported extension '.csv'", ".jsonl, .json, .parquet", "builtin:arithmetic"]),
    "no_extension": ("data", b"{}", "prompt", "response", ["no file extension", ".jsonl, .json, .parquet"]),
    "missing_prompt_key": ("keys.jsonl", _lines(GOOD), "promt", "response",
                           ["data.prompt_key", "key 'promt' not found", "did you mean 'prompt'?"]),
    "row_missing_the_key": (
        "ragged.jsonl", _lines(GOOD, GOOD, None, {"prompt": "5+5="}), "prompt", "response",
        ["data.response_key", "line 4, row 2 has no key 'response'", "which other rows have", "'prompt'"],
    ),
    "non_text_value_is_shortened": (
        "long.jsonl", _lines({"prompt": {"text": "y" * 500}, "response": "2"}), "prompt", "response",
        ["data.prompt_key", "line 1, row 0", "must be text, got an object", "...", "make every 'prompt' a string"],
    ),
    "json_element_not_an_object": (
        "mixed.json", json.dumps([GOOD, "2+2=", GOOD]).encode(), "prompt", "response",
        ["element [1] is a string '2+2=', not an object", "every element of the array must be an object"],
    ),
    "json_truncated": (
        "cut.json", b'[\n {"prompt": "1+1=", "response": "2"},\n {"prompt": "2+', "prompt", "response",
        ["is not valid JSON", "Unterminated string", "line 3, column 13", "one array of objects"],
    ),
    "parquet_garbage": ("garbage.parquet", b"this is not parquet", "prompt", "response",
                        ["not a readable Parquet file", "magic bytes", "rewrite it"]),
    "parquet_missing_key": ("table.parquet", "parquet", "prompt", "answer",
                            ["data.prompt_key", "key 'prompt' not found", "'question'"]),
}


def _place_bad(tmp_path, name, content):
    path = tmp_path / name
    if content == "parquet":
        _write(path, ROWS)
    elif isinstance(content, dict):
        path.mkdir()
        for child, data in content.items():
            (path / child).write_bytes(data)
    elif content is not None:
        path.write_bytes(content)
    return path


@pytest.mark.parametrize("case", list(BAD_SOURCES), ids=list(BAD_SOURCES))
def test_bad_source_is_one_line_data_error_naming_file_place_and_fix(tmp_path, case):
    name, content, prompt_key, response_key, fragments = BAD_SOURCES[case]
    path = _place_bad(tmp_path, name, content)
    with pytest.raises(DataError) as err:
        load_records(str(path), prompt_key, response_key, seed=0)
    msg = str(err.value)
    assert "\n" not in msg and "\r" not in msg
    assert len(msg) < 400 + len(str(path.resolve())), msg  # long values are shortened
    assert str(path) in msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    if case == "missing_file":
        assert str(path.resolve()) in msg


def test_bad_key_name_with_newline_stays_one_line(tmp_path):
    path = _write(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(DataError) as err:
        load_records(str(path), "ques\ntion", None, seed=0)
    msg = str(err.value)
    assert "\n" not in msg and r"'ques\ntion'" in msg


GOOD_VARIANTS = {
    # what `datasets` also accepted, and what it got wrong
    "json_lines_named_json": ("data.json", "".join(json.dumps(r) + "\n" for r in ROWS)),
    "pretty_array_named_jsonl": ("data.jsonl", json.dumps(ROWS, indent=2)),
    "crlf_and_blank_lines": ("data.jsonl", "\r\n\r\n" + "\r\n\r\n".join(json.dumps(r) for r in ROWS) + "\r\n"),
    "byte_order_mark": ("data.jsonl", "\ufeff" + "".join(json.dumps(r) + "\n" for r in ROWS)),
}


@pytest.mark.parametrize("case", list(GOOD_VARIANTS), ids=list(GOOD_VARIANTS))
def test_load_records_reads_json_variants(tmp_path, case):
    name, text = GOOD_VARIANTS[case]
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    assert load_records(str(path), "question", "answer", seed=0) == EXPECTED


def test_load_records_keeps_unicode_line_separators_inside_strings(tmp_path):
    # U+2028 is legal raw inside a JSON string: it must not split the line
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "a\u2028b", "answer": 7.5}\n', encoding="utf-8")
    assert load_records(str(path), "question", "answer", seed=0) == [{"prompt": "a\u2028b", "response": "7.5"}]


def test_load_records_pretty_printed_single_object(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(ROWS[0], indent=2))
    assert load_records(str(path), "question", "answer", seed=0) == EXPECTED[:1]


def test_load_records_imports_no_datasets_and_writes_no_cache(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import shardwise

    path = _write(tmp_path / "data.jsonl", ROWS)
    home = tmp_path / "home"
    home.mkdir()
    code = (
        "import sys; from shardwise.data.sources import load_records; "
        f"r = load_records({str(path)!r}, 'question', 'answer', seed=0); "
        "print(len(r), 'datasets' in sys.modules, 'pyarrow' in sys.modules)"
    )
    src = str(Path(shardwise.__file__).parents[1])
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3", "False", "False"]
    assert list(home.iterdir()) == []


# ---------------------------------------------------------------- tokenize / collate


def test_tokenize_pair_masks_only_response_and_eos(tokenizer):
    ex = tokenize_pair(tokenizer, "12+34=", "46", max_length=64)
    assert ex["input_ids"] == [1, 5, 6, 14, 7, 8, 17, 8, 10, 2]
    assert ex["loss_mask"] == [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]

    cut = tokenize_pair(tokenizer, "12+34=", "46", max_length=8)
    assert cut["input_ids"] == [1, 5, 6, 14, 7, 8, 17, 8]
    assert cut["loss_mask"] == [0, 0, 0, 0, 0, 0, 0, 1]
    assert tokenize_pair(tokenizer, "12+34=", "46", max_length=5)["loss_mask"] == [0] * 5

    assert tokenize_prompt(tokenizer, "12+34=", max_length=64) == [1, 5, 6, 14, 7, 8, 17]
    assert tokenize_prompt(tokenizer, "12+34=", max_length=3) == [7, 8, 17]


def test_encode_records_batched_texts_give_each_texts_own_ids(tokenizer, qwen_tool_tokenizer):
    """`encode_records` tokenizes the plain texts of many records in one call
    (`encode_texts`): the ids, masks and lengths are those of one call per text, for the
    char tokenizer and a byte-level BPE one (merges across spaces), repeated, empty and
    non-ASCII texts, cut or not, pairs and text prompts."""
    from shardwise.data.encode import BATCH, encode_prompt, encode_record, encode_records

    bpe = qwen_tool_tokenizer[0]
    texts = ["12+34=", "46", "", " the  answer is 7 ", "héllo wörld ✓", "12+34=", "x" * 40]
    records = [{"prompt": texts[i % len(texts)], "response": texts[(3 * i + 1) % len(texts)]}
               for i in range(BATCH + 5)]  # more than one batch
    for tok in (tokenizer, bpe):
        for max_length in (8, 64):
            got = encode_records(tok, records, max_length)
            assert got == [encode_record(tok, r, max_length) for r in records]
            got = encode_records(tok, records, max_length, prompts=True)
            assert got == [encode_prompt(tok, r["prompt"], max_length) for r in records]


def _ex(ids, mask):
    return {"input_ids": list(ids), "loss_mask": list(mask)}


def test_pad_collate_shapes_labels_and_loss_token_count():
    a = _ex([1, 5, 6, 7, 2], [0, 0, 0, 1, 1])
    b = _ex([1, 8, 2], [0, 1, 1])
    batch = pad_collate([a, b], pad_id=0)
    assert {k: (tuple(v.shape), v.dtype) for k, v in batch.items()} == {
        k: ((2, 5), torch.long) for k in ("input_ids", "attention_mask", "position_ids", "labels")
    }
    assert batch["input_ids"].tolist() == [[1, 5, 6, 7, 2], [1, 8, 2, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4]] * 2
    x = IGNORE_INDEX
    assert batch["labels"].tolist() == [[x, x, x, 7, 2], [x, 8, 2, x, x]]
    assert count_loss_tokens(batch) == 4

    # Position 0 is never a target, even when its loss_mask is 1.
    whole = pad_collate([_ex([5, 6, 2], [1, 1, 1])], pad_id=0)
    assert whole["labels"].tolist() == [[x, 6, 2]] and count_loss_tokens(whole) == 2

    assert pad_collate([a, b], pad_id=0, pad_to=7)["input_ids"].shape == (2, 7)
    assert pad_collate([a, b], pad_id=0, pad_to_multiple_of=4)["labels"].shape == (2, 8)
    with pytest.raises(ValueError, match="5 tokens, more than pad_to=4"):
        pad_collate([a, b], pad_id=0, pad_to=4)


def test_pack_collate_layout_and_block_diagonal_mask():
    a = _ex([1, 5, 2], [0, 1, 1])
    b = _ex([1, 6], [0, 1])
    c = _ex([1, 7, 8, 2], [0, 0, 1, 1])
    batch = pack_collate([a, b, c], max_length=6, pad_id=0)
    x = IGNORE_INDEX
    # a and b share row 0 (5 tokens); c does not fit and opens row 1.
    assert batch["input_ids"].tolist() == [[1, 5, 2, 1, 6], [1, 7, 8, 2, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch["labels"].tolist() == [[x, 5, 2, x, 6], [x, x, 8, 2, x]]
    assert count_loss_tokens(batch) == 5
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    # the padding token attends only to itself
    assert mask[1, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    add = additive_mask(mask, torch.float32)
    assert add.dtype == torch.float32 and add[0, 0, 3, 0] == torch.finfo(torch.float32).min
    assert add[0, 0, 4, 3] == 0.0
    with pytest.raises(ValueError, match="4 tokens, more than max_length=3"):
        pack_collate([c], max_length=3, pad_id=0)


def _tiny_qwen3(attn_implementation: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=CHAR_VOCAB_SIZE,
        attn_implementation=attn_implementation,
    )
    return Qwen3ForCausalLM(config).to(torch.float32).eval()


def _summed_loss(model, batch, attention_mask) -> torch.Tensor:
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=attention_mask,
        position_ids=batch["position_ids"],
        use_cache=False,
    ).logits.float()
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@pytest.mark.parametrize(
    "attn_implementation,route",
    [("sdpa", "bool_4d"), ("eager", "additive_4d"), ("sdpa", "position_ids"), ("eager", "position_ids")],
)
def test_packed_loss_equals_padded_loss_on_tiny_qwen3(tokenizer, attn_implementation, route):
    records = arithmetic_examples(9, seed=4, ops="+-*")
    examples = [tokenize_pair(tokenizer, r["prompt"], r["response"], max_length=32) for r in records]
    model = _tiny_qwen3(attn_implementation)

    padded = pad_collate(examples, pad_id=tokenizer.pad_token_id)
    packed = pack_collate(examples, max_length=48, pad_id=tokenizer.pad_token_id)
    assert packed["input_ids"].shape[0] < len(examples) // 2  # really packed
    assert count_loss_tokens(packed) == count_loss_tokens(padded) == sum(
        sum(e["loss_mask"]) for e in examples
    )

    mask = {
        "bool_4d": packed["attention_mask"],
        "additive_4d": additive_mask(packed["attention_mask"], torch.float32),
        "position_ids": None,
    }[route]
    with torch.no_grad():
        reference = _summed_loss(model, padded, padded["attention_mask"])
        packed_loss = _summed_loss(model, packed, mask)
        # Packed rows with only a padding mask attend across examples: must differ,
        # or this test would not notice a missing block-diagonal mask.
        leaky = _summed_loss(model, packed, (packed["input_ids"] != 0).long())
        # The HF loss (internal shift, mean over targets) counts the same tokens.
        hf_mean = model(**padded, use_cache=False).loss
    torch.testing.assert_close(packed_loss, reference, rtol=0, atol=1e-5)
    assert abs(leaky.item() - reference.item()) > 1e-3
    torch.testing.assert_close(hf_mean * count_loss_tokens(padded), reference, rtol=1e-6, atol=1e-5)


# ---------------------------------------------------------------- sampler


def _take(sampler, n):
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_is_deterministic_and_seeded():
    a = _take(GlobalBatchSampler(37, 8, seed=11), 12)
    assert a == _take(GlobalBatchSampler(37, 8, seed=11), 12)
    assert a != _take(GlobalBatchSampler(37, 8, seed=12), 12)
    assert all(len(batch) == 8 for batch in a)
    order = torch.randperm(37, generator=torch.Generator().manual_seed(11)).tolist()
    assert a[0] == order[:8]
    assert _take(GlobalBatchSampler(10, 4, seed=0, shuffle=False), 3) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3],
    ]


def test_sampler_visits_every_example_once_per_epoch():
    sampler = GlobalBatchSampler(24, 6, seed=3)
    assert sampler.steps_per_epoch == 4
    batches = _take(sampler, 12)
    epochs = [sum(batches[i : i + 4], []) for i in range(0, 12, 4)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(24))
    assert epochs[0] != epochs[1] != epochs[2]


def test_sampler_drop_last():
    kept = _take(GlobalBatchSampler(10, 4, seed=0, drop_last=False), 3)
    assert [len(b) for b in kept] == [4, 4, 2] and sorted(sum(kept, [])) == list(range(10))
    dropped = _take(GlobalBatchSampler(10, 4, seed=0, drop_last=True), 3)
    assert [len(b) for b in dropped] == [4, 4, 4]
    assert dropped[2] == torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()[:4]
    with pytest.raises(ValueError, match="fewer than one global batch"):
        GlobalBatchSampler(3, 4, seed=0)


@pytest.mark.parametrize("stop_after", [1, 2, 3, 7])
def test_sampler_resumes_with_the_same_next_batches(stop_after):
    uninterrupted = _take(GlobalBatchSampler(10, 4, seed=5), stop_after + 6)
    first = GlobalBatchSampler(10, 4, seed=5)
    seen = _take(first, stop_after)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
    assert set(state) == {"epoch", "position"}
    resumed = GlobalBatchSampler(10, 4, seed=5)
    resumed.load_state_dict(state)
    assert seen + _take(resumed, 6) == uninterrupted


def test_rank_shares_reassemble_the_same_global_batch():
    batch = next(iter(GlobalBatchSampler(100, 16, seed=2)))
    for dp_size in (1, 2, 4):
        shares = [rank_share(batch, rank, dp_size) for rank in range(dp_size)]
        assert [len(s) for s in shares] == [16 // dp_size] * dp_size
        assert sum(shares, []) == batch
        for share in shares:
            micros = micro_batches(share, 2)
            assert all(len(m) == 2 for m in micros) and sum(micros, []) == share
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    with pytest.raises(ValueError, match="16 examples does not split evenly over 3"):
        rank_share(batch, 0, 3)
    with pytest.raises(ValueError, match=r"dp_rank 2 is not in \[0, dp_size=2\)"):
        rank_share(batch, 2, 2)
