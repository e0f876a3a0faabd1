"""Models and data by Hub id, and GGUF files (issue 46, `shardwise.models.hub`).

The tests build a Hub cache in a temporary ``HF_HUB_CACHE`` with the Hub's own layout
(``models--ORG--NAME/refs/<ref>`` holding a commit, ``snapshots/<commit>/<file>`` linked
to ``blobs/<hash>``; datasets likewise) and run the commands by id in offline mode, through
huggingface_hub's real ``snapshot_download``: train (2 ranks, a dataset by id with a
subset, eval by id, a revision pinned by tag) then export, infer (ref main) and rl (a
pinned commit hash), a GGUF file fine-tuned. Every refusal exits 2 with one line before
anything starts: offline and not cached, a snapshot cut halfway, and, against a local
stand-in of the Hub's HTTP API, no such repo, no such revision, a gated repo, 401 / 403.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from dist.launcher import REPO_ROOT, at_once, run_cli, run_python

from shardwise.data.sources import load_records
from shardwise.errors import ConfigError
from shardwise.models import hub

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40
COMMIT_D = "d" * 40
MODEL = "tiny-org/tiny-qwen"
SUMS = "tiny-org/sums"
SFT = str(REPO_ROOT / "examples" / "sft_arithmetic.yaml")


def put(cache: Path, repo_type: str, repo_id: str, commit: str, files: dict[str, bytes], refs=("main",)) -> Path:
    """One snapshot of `repo_id` in the Hub cache `cache`, as huggingface_hub writes it."""
    root = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    for rel, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return root / "snapshots" / commit


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def parquet_bytes(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def sums(n: int, start: int) -> list[dict]:
    return [{"question": f"{a}+{a + 1}=", "answer": {"text": str(2 * a + 1)}} for a in range(start, start + n)]


GSM_CARD = b"""---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
# sums
"""


@pytest.fixture(scope="module")
def cache(tmp_path_factory, tiny_sft_run) -> Path:
    """A Hub cache: the tiny Qwen3 at main (commit A) and its other weights at tag v2
    (commit B); a gsm8k-shaped dataset (subsets main / socratic named by its card, main's
    train split in two parquet shards, nested answer column)."""
    cache = tmp_path_factory.mktemp("hub") / "hub"
    put(cache, "model", MODEL, COMMIT_A, folder_files(tiny_sft_run["model"]))
    put(cache, "model", MODEL, COMMIT_B, folder_files(tiny_sft_run["other_model"]), refs=("v2",))
    put(cache, "dataset", SUMS, COMMIT_D, {
        "README.md": GSM_CARD,
        "main/train-00000-of-00002.parquet": parquet_bytes(sums(10, 0)),
        "main/train-00001-of-00002.parquet": parquet_bytes(sums(6, 10)),
        "main/test-00000-of-00001.parquet": parquet_bytes(sums(4, 30)),
        "socratic/train-00000-of-00001.parquet": parquet_bytes(sums(3, 40))})
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache.parent / "home")}


def ok(res) -> None:
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"


def refused(res, *words: str) -> str:
    """The one line of a command refused before launch (exit 2), holding `words`."""
    lines = [x for x in res.stderr.splitlines() if x.startswith("shardwise:")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_dataset_layouts_resolve_to_the_split_files(tmp_path, monkeypatch):
    """The Hub's dataset layouts, found through snapshot_download in an offline cache: a
    card's configs (subset / split, shards joined in name order), ``data/<split>-*``,
    a plain ``<split>.jsonl``; a subset or split the dataset lacks is one line naming the key."""
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    put(cache, "dataset", SUMS, COMMIT_D, {
        "README.md": GSM_CARD, "main/train-00000-of-00002.parquet": parquet_bytes(sums(10, 0)),
        "main/train-00001-of-00002.parquet": parquet_bytes(sums(6, 10)),
        "main/test-00000-of-00001.parquet": parquet_bytes(sums(4, 30))})
    put(cache, "dataset", "o/plain", COMMIT_D, {
        "data/train-00000-of-00001.parquet": parquet_bytes(sums(5, 0)),
        "data/test-00000-of-00001.parquet": parquet_bytes(sums(2, 0))})
    rows = "\n".join(json.dumps(r) for r in sums(3, 7)).encode()
    put(cache, "dataset", "o/lines", COMMIT_D, {"train.jsonl": rows, "test.jsonl": rows})

    path = hub.resolve_dataset(SUMS, "main", "train", "data.source")
    assert path.endswith(f"snapshots/{COMMIT_D}/main/train-*")
    recs = load_records(path, "question", "answer.text", seed=0)
    assert [r["prompt"] for r in recs] == [r["question"] for r in sums(16, 0)]  # both shards, in order
    assert hub.resolve_dataset(SUMS, "main", "test", "eval.source").endswith("main/test-00000-of-00001.parquet")
    assert hub.resolve_dataset("o/plain", None, "test", "data.source").endswith("data/test-00000-of-00001.parquet")
    assert len(load_records(hub.resolve_dataset("o/lines", None, "train", "data.source"), "question",
                            "answer.text", seed=0)) == 3
    with pytest.raises(ConfigError, match=r"data.subset.*subsets main, socratic.*name one"):
        hub.resolve_dataset(SUMS, None, "train", "data.source")
    with pytest.raises(ConfigError, match=r"data.split.*no split 'validation'"):
        hub.resolve_dataset(SUMS, "main", "validation", "data.source")
    with pytest.raises(ConfigError, match=r"eval.split.*split 'dev'.*its data files: data/test"):
        hub.resolve_dataset("o/plain", None, "dev", "eval.source", split_key="eval.split")
    elsewhere = f"/other/machine/hub/datasets--o--plain/snapshots/{COMMIT_D}/data/test-00000-of-00001.parquet"
    assert hub.from_other_cache(elsewhere, "data.source") == str(
        cache / "datasets--o--plain" / "snapshots" / COMMIT_D / "data" / "test-00000-of-00001.parquet")
    # a rank takes the launching process's paths (RESOLVED_ENV) and asks no cache or Hub
    from shardwise.config.schema import Config
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(hub.RESOLVED_ENV, json.dumps({"model.path nobody/anything main None": str(tmp_path)}))
    assert hub.resolve_inputs(Config(model={"path": "nobody/anything"})).model.path == str(tmp_path)
    # a rank of an outer torchrun waits, bounded, for its local rank 0's download
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv(hub.WAIT_ENV, "0")
    assert hub.resolve_dataset("o/plain", None, "test", "data.source").endswith("test-00000-of-00001.parquet")
    with pytest.raises(ConfigError, match=r"local rank 0 did not finish downloading Hub model 'o/absent'.* 0 s"):
        hub.resolve_model("o/absent", "main", "model.path")
    assert not hub.is_hub_id("runs/a/b") and not hub.is_hub_id("/abs/x") and hub.is_hub_id("Qwen/Qwen3-0.6B")


def test_train_export_infer_rl_by_hub_id_offline(cache, tmp_path, tiny_sft_run):
    """The commands by id, offline, from the cache: `train` on 2 ranks (the model at tag
    v2, the dataset's subset main by id, eval by id on its test split); `export` of its
    checkpoint; `infer` at main; `rl` with a pinned commit hash. The run's saved config
    names the snapshot each input was read from: the ranks took the launcher's paths."""
    run = tmp_path / "sft"
    train = ["train", SFT, "--nproc", "2", f"run.dir={run}", "model.config=null", f"model.path={MODEL}",
             "model.revision=v2", f"data.source={SUMS}", "data.subset=main", "data.prompt_key=question",
             "data.response_key=answer.text", f"eval.source={SUMS}", "data.max_length=16",
             "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=1",
             "checkpoint.async=false", "checkpoint.export_hf=false"]
    ok(run_cli(train, timeout=300, env=offline(cache)))
    meta = json.loads((run / "checkpoints" / "step_00000001" / "meta.json").read_text())
    snap = cache / "models--tiny-org--tiny-qwen" / "snapshots"
    assert meta["config"]["model"]["path"] == str(snap / COMMIT_B)  # the tag, not main
    assert meta["config"]["data"]["source"].endswith(f"datasets--tiny-org--sums/snapshots/{COMMIT_D}/main/train-*")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val/loss" in r for r in lines) and any("train/loss" in r or "loss" in r for r in lines)

    out = tmp_path / "exported"
    infer_dir, rl_dir = tmp_path / "infer", tmp_path / "rl"
    exported, inferred, rl = at_once(
        lambda: run_cli(["export", str(run / "checkpoints" / "step_00000001"), str(out)], env=offline(cache)),
        lambda: run_cli(["infer", str(REPO_ROOT / "examples" / "infer_arithmetic.yaml"), f"run.dir={infer_dir}",
                         f"model.path={MODEL}", "infer.num_prompts=4", "infer.max_new_tokens=2"],
                        timeout=300, env=offline(cache)),
        lambda: run_cli(["rl", str(REPO_ROOT / "examples" / "grpo_arithmetic.yaml"), "--nproc", "1",
                         f"run.dir={rl_dir}", f"model.path={MODEL}", f"model.revision={COMMIT_A}",
                         "train.global_batch_size=2", "train.micro_batch_size=8", "rl.rollout.n=2",
                         "rl.rollout.max_new_tokens=2", "train.max_steps=1", "rl.heldout_eval=false",
                         "checkpoint.export_hf=false", "checkpoint.async=false", "rl.backend=local"],
                        timeout=300, env=offline(cache)))
    for res in (exported, inferred, rl):
        ok(res)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert len((infer_dir / "generations.jsonl").read_text().splitlines()) == 4
    assert [json.loads(x)["step"] for x in (rl_dir / "metrics.jsonl").read_text().splitlines()
            if "time/eval" not in x][-1] == 1
    (rl_meta,) = rl_dir.glob("checkpoints/step_*/meta.json")
    assert json.loads(rl_meta.read_text())["config"]["model"]["path"] == str(snap / COMMIT_A)  # the pinned commit


def tiny_gguf(path: Path) -> torch.nn.Module:
    """A tiny llama written as a GGUF file the way llama.cpp's converter writes one (F32
    tensors, q / k rows permuted, a byte-level BPE vocabulary with two merges); returns the
    HF model it was written from."""
    import gguf
    import numpy as np
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>"]
    torch.manual_seed(0)
    c = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                    tie_word_embeddings=False)
    model = LlamaForCausalLM(c).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(len(tokens) - 1)
    w.add_bos_token_id(len(tokens) - 1)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
             ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
             ("mlp.down_proj", "ffn_down"), ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm")]
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{a}.weight": f"blk.{i}.{b}.weight" for a, b in parts})

    def permute(v, heads):  # llama.cpp's convert_hf_to_gguf: rotary halves interleaved
        return v.reshape(heads, 2, v.shape[0] // heads // 2, *v.shape[1:]).swapaxes(1, 2).reshape(v.shape)

    for k, v in model.state_dict().items():
        v = v.float().numpy()
        v = permute(v, c.num_attention_heads) if "q_proj" in k else permute(v, c.num_key_value_heads) \
            if "k_proj" in k else v
        w.add_tensor(names[k], np.ascontiguousarray(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_a_gguf_file_is_fine_tuned(tmp_path, monkeypatch):
    """``model.path: x.gguf``: dequantized once into an HF folder (the same logits as the
    model the file was written from, its tokenizer beside), which a `train` job fine-tunes
    and exports; the second resolution reuses the folder; the file in a Hub repo
    (``ORG/NAME/x.gguf``) converts to the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.models.gguf import dequantized_folder

    file = tmp_path / "tiny.gguf"
    ref = tiny_gguf(file)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    run = tmp_path / "run"
    ok(run_cli(["train", SFT, f"run.dir={run}", "model.config=null", f"model.path={file}", "train.max_steps=1",
                "train.global_batch_size=8", "train.micro_batch_size=8", "checkpoint.async=false"],
               timeout=300, env=env))
    (folder,) = (tmp_path / "xdg" / "shardwise" / "gguf").glob("tiny-*[!k]")  # not the .lock file
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dequantized_folder(file, "model.path") == folder  # kept, not converted again
    # the same file in a Hub repo, named ORG/NAME/FILE.gguf: read from the (offline) cache, converted there
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    put(tmp_path / "hub", "model", "tiny-org/gguf", COMMIT_A, {"tiny.gguf": file.read_bytes()})
    from_hub = Path(hub.resolve_model("tiny-org/gguf/tiny.gguf", "main", "model.path"))
    assert from_hub.parent == folder.parent and (from_hub / "model.safetensors").read_bytes() == \
        (folder / "model.safetensors").read_bytes()
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok("the sum is 12")["input_ids"]])
    assert tok.convert_tokens_to_ids("he") in ids[0].tolist()  # the file's merges were read
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits,
                                   ref(ids).logits, rtol=0, atol=0)  # F32 in the file: exact
    assert (run / "hf" / "model.safetensors").is_file() and (run / "hf" / "tokenizer.json").is_file()


def test_inputs_not_there_are_refused_before_launch(cache, tmp_path):
    """Offline and not cached (model, dataset): one line with the id, the revision and the
    command that fetches it; a snapshot whose download was cut halfway (the Hub library's
    tree listing names a file the snapshot lacks, its blob still ``.incomplete``): refused,
    never loaded; a path that is neither a folder nor an id: the loader's own line."""
    broken = cache.parent / "broken"
    snap = put(broken, "model", "tiny-org/cut", COMMIT_A, {"config.json": b"{}"})
    trees = snap.parent.parent / "trees"
    trees.mkdir()
    (trees / f"{COMMIT_A}.json").write_text(json.dumps({"format_version": 1, "files": {
        "config.json": {"size": 2, "blob_id": "x"}, "model.safetensors": {"size": 9, "blob_id": "y"}}}))
    (snap.parent.parent / "blobs" / "y.incomplete").write_bytes(b"half")
    base = ["plan", SFT, "model.config=null"]
    results = at_once(
        lambda: run_cli([*base, "model.path=nobody/nothing", "model.revision=v1"], env=offline(cache)),
        lambda: run_cli([*base, f"model.path={MODEL}", "data.source=nobody/data"], env=offline(cache)),
        lambda: run_cli([*base, "model.path=tiny-org/cut"], env=offline(broken)),
        lambda: run_cli([*base, f"model.path={tmp_path}/no/such/folder"], env=offline(cache)))
    refused(results[0], "model.path", "'nobody/nothing'", "'v1'", "offline",
            "hf download nobody/nothing --revision v1")
    refused(results[1], "data.source", "hf download nobody/data --repo-type dataset --revision main")
    refused(results[2], "model.path", "incomplete", "model.safetensors", "hf download tiny-org/cut")
    refused(results[3], "model.path", "no/such/folder")  # the loader's line, as before


class _FakeHub(BaseHTTPRequestHandler):
    """The Hub's answers to ``GET /api/models/ORG/NAME/revision/REV`` for repos that fail."""

    ANSWERS = {"nobody/missing": (404, "RepoNotFound"), "org/gated": (403, "GatedRepo"),
               "org/private": (401, None), "org/forbidden": (403, None)}

    def do_GET(self):  # noqa: N802 - http.server's name
        parts = self.path.split("?")[0].split("/")
        repo, rev = "/".join(parts[3:5]), parts[6] if len(parts) > 6 else "main"
        status, code = (404, "RevisionNotFound") if rev == "nope" else self.ANSWERS.get(repo, (404, "RepoNotFound"))
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(json.dumps({"error": f"{code or status}"}).encode())

    def log_message(self, *args):
        pass


def test_hub_refusals_are_one_line_each(tmp_path):
    """Online, against a local stand-in of the Hub's API (huggingface_hub's own requests
    and error types): a wrong id, a revision the repo lacks, a gated repo, 401, 403, each
    one ConfigError line naming the key and the id."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = tmp_path / "resolve.py"
    script.write_text(
        "import sys\nfrom shardwise.models.hub import resolve_model\nfrom shardwise.errors import ConfigError\n"
        "for repo, rev in [('nobody/missing', 'main'), ('org/model', 'nope'), ('org/gated', 'main'),\n"
        "                  ('org/private', 'main'), ('org/forbidden', 'main')]:\n"
        "    try:\n        resolve_model(repo, rev, 'model.path')\n        print('resolved', repo)\n"
        "    except ConfigError as e:\n        print(e)\n")
    try:
        res = run_python([str(script)], timeout=120, env={
            "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
            "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_TOKEN": None, "HF_HUB_ETAG_TIMEOUT": "5",
            "PYTHONPATH": str(REPO_ROOT / "src")})
    finally:
        server.shutdown()
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == 5, res.stdout + res.stderr[-3000:]
    assert "'model.path': no model 'nobody/missing' on the Hub" in lines[0]
    assert "'model.revision': 'nope' is no branch, tag or commit of model 'org/model'" in lines[1]
    assert "'org/gated' (revision 'main') is gated" in lines[2] and "HF_TOKEN" in lines[2]
    assert "'org/private'" in lines[3] and "401" in lines[3]
    assert "refused access" in lines[4] and "(403)" in lines[4]
