"""The weight bridge (actor group -> generator group) and the generator worker.

- the bridge's wire format on its own: a header of JSON as uint8 (never pickle) and flat
  buckets, round-tripped between a root and two receivers in threads of this process over
  a real gloo group, dtypes and shapes intact, every bucket size;
- a real pair of Ray worker groups: an actor (the hybrid engine, actor + rollout, 1 rank)
  updates its weights and publishes version 1; a 1-rank generator group receives it and
  generates bitwise what the hybrid engine generates with those weights, rows stamped with
  their version; a generator asked for a version nobody publishes fails within timeout_s,
  in one line naming the generator rank and the version.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from shardwise.data.batch import Batch
from shardwise.distributed.bridge import (
    ALONE_BYTES,
    BridgeError,
    WeightBridge,
    bucket_layout,
    decode_header,
    encode_header,
    open_store,
)

# ----------------------------------------------------------------- the wire format


def _tensors(shift: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [("model.embed_tokens.weight", torch.randn(5, 7, generator=g) + shift),
            ("layers.0.bias", (torch.randn(3, generator=g) + shift).bfloat16()),
            ("odd", torch.randn(1, 3, generator=g).half()),  # 6 bytes: the next offset needs aligning
            ("steps", torch.arange(5, dtype=torch.int64)),
            ("flag", torch.tensor(True)),
            ("empty", torch.zeros(0, 4)),
            ("last", torch.randn(2, 2, generator=g).double() + shift)]


def test_header_round_trip_and_bucket_layout():
    named = _tensors()
    for bucket_bytes in (0, 1, 64, 10**9):
        slots, sizes = bucket_layout(named, bucket_bytes)
        version, back, back_sizes = decode_header(encode_header(7, slots, sizes))
        assert (version, back, back_sizes) == (7, slots, sizes)
        assert all(s.offset % 16 == 0 for s in slots)
        if bucket_bytes == 0:
            assert len(sizes) == len(named)
        if bucket_bytes == 10**9:
            assert len(sizes) == 1
        assert all(size <= max(bucket_bytes, max(s.nbytes for s in slots)) for size in sizes)
    # small tensors share a bucket; one of ALONE_BYTES or more is a bucket of its own
    big = [("a", torch.zeros(4)), ("big", torch.zeros(ALONE_BYTES // 4)), ("b", torch.zeros(4)), ("c", torch.zeros(4))]
    slots, sizes = bucket_layout(big, 2**30)
    assert [s.bucket for s in slots] == [0, 1, 2, 2] and sizes == [16, ALONE_BYTES, 32]
    with pytest.raises(ValueError, match="not one"):
        decode_header(torch.frombuffer(bytearray(b'{"version": 1}'), dtype=torch.uint8))
    with pytest.raises(ValueError, match="not one"):
        decode_header(torch.frombuffer(bytearray(b"\x80\x04pickle"), dtype=torch.uint8))


def _bridges(world: int, timeout_s: float) -> tuple[WeightBridge, list[WeightBridge]]:
    store = open_store("127.0.0.1", timeout_s)
    receivers: dict[int, WeightBridge] = {}

    def join(rank: int) -> None:
        receivers[rank] = WeightBridge("127.0.0.1", store.port, rank, world, torch.device("cpu"), timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    root = WeightBridge("127.0.0.1", store.port, 0, world, torch.device("cpu"), timeout_s, store=store)
    for t in threads:
        t.join(timeout_s)
    return root, [receivers[r] for r in range(1, world)]


def test_pushes_reach_every_receiver_in_order_bitwise():
    root, receivers = _bridges(3, 20.0)
    got: dict[int, list] = {1: [], 2: []}
    done = threading.Event()

    def keep(rank):
        def on_weights(version, tensors):
            got[rank].append((version, {k: v.clone() for k, v in tensors.items()}))
            if all(len(g) == 3 for g in got.values()):
                done.set()
        return on_weights

    for r in receivers:
        r.start_receiving(keep(r.rank))
    pushes = {1: (_tensors(0.0), 0), 2: (_tensors(1.0), 64), 3: (_tensors(2.0), 10**9)}
    for version, (named, bucket_bytes) in pushes.items():
        root.send(version, named, bucket_bytes)  # returns at once; the next waits for it
    assert done.wait(20)
    root.close()
    for r in receivers:
        r.close()
        assert r.error is None
    for rank in (1, 2):
        assert [v for v, _ in got[rank]] == [1, 2, 3]
        for version, tensors in got[rank]:
            want = pushes[version][0]
            assert list(tensors) == [n for n, _ in want]
            for name, t in want:
                assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape
                assert torch.equal(tensors[name], t), (rank, version, name)
    assert root.last_bytes > 0


def test_a_receiver_that_never_joins_is_named():
    store = open_store("127.0.0.1", 1.0)
    start = time.monotonic()
    with pytest.raises(BridgeError, match=r"generator rank 1 did not join within 1 s"):
        receiver = threading.Thread(target=lambda: _try_join(store.port, 1), daemon=True)
        receiver.start()
        WeightBridge("127.0.0.1", store.port, 0, 3, torch.device("cpu"), 1.0, store=store)
    assert time.monotonic() - start < 15


def test_a_push_nobody_takes_raises_at_the_next_send_naming_the_receiver():
    root, (receiver,) = _bridges(2, 1.0)  # joined, but never receives
    weights = [("w", torch.zeros(64, 64))]  # gloo sends once the receiver posted its buffer
    root.send(1, weights, 0)  # returns at once
    with pytest.raises(BridgeError, match=r"the push of version 1 did not finish in 1 s.*generator rank 0 "
                                          r"did not answer"):
        root.send(2, weights, 0)
    receiver.close()


def test_a_receiver_whose_root_stops_mid_push_keeps_one_line():
    root, (receiver,) = _bridges(2, 1.0)
    receiver.start_receiving(lambda version, tensors: None)
    root.store.set("push/1", "4")  # announced, never broadcast
    deadline = time.monotonic() + 15
    while receiver.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert str(receiver.error) == ("weight bridge: generator rank 0 waited 1 s for the header of version 4: "
                                   "the actor group (bridge rank 0) did not answer")
    receiver.close()


ROOT_THAT_DIES = """
import sys, time, torch
from shardwise.distributed.bridge import WeightBridge, open_store
store = open_store("127.0.0.1", 20)
print(store.port, flush=True)
bridge = WeightBridge("127.0.0.1", store.port, 0, 2, torch.device("cpu"), 20, store=store)
time.sleep(120)
"""


def test_a_root_process_that_dies_is_noticed_in_seconds():
    """The actor's rank 0 killed between pushes: its receiver says so within seconds (its
    store's connection breaks), not after timeout_s."""
    import os
    import subprocess
    import sys

    from dist.launcher import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "OMP_NUM_THREADS": "1"}
    root = subprocess.Popen([sys.executable, "-c", ROOT_THAT_DIES], stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(root.stdout.readline())
        receiver = WeightBridge("127.0.0.1", port, 1, 2, torch.device("cpu"), 20.0)
        receiver.start_receiving(lambda version, tensors: None)
        root.kill()
        deadline = time.monotonic() + 15  # well under timeout_s (20 s)
        while receiver.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert str(receiver.error).startswith("weight bridge: generator rank 0 lost the actor group (bridge rank 0) "
                                              "while waiting for the next push: DistNetworkError")
        assert "\n" not in str(receiver.error)
        receiver.close()
    finally:
        root.kill()
        root.wait(10)


def _try_join(port: int, rank: int) -> None:
    try:
        WeightBridge("127.0.0.1", port, rank, 3, torch.device("cpu"), 1.0)
    except BridgeError:
        pass


# ----------------------------------------------------------------- Ray groups

PROMPT_ROWS = 4
VOCAB, PAD, EOS = 64, 0, 2


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    folder = tmp_path_factory.mktemp("bridge_model")
    shape = Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                        tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=PAD)
    torch.manual_seed(0)
    Qwen3ForCausalLM(shape).save_pretrained(folder)
    return folder


def _prompts(seed: int) -> Batch:
    g = torch.Generator().manual_seed(11)
    lengths = [3, 5, 2, 4]
    ids = torch.full((PROMPT_ROWS, 5), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, 5 - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, 5 - n:] = 1
    b = Batch.from_dict({"prompt_ids": ids, "prompt_mask": mask},
                        {"prompt": [""] * PROMPT_ROWS, "ground_truth": [""] * PROMPT_ROWS,
                         "uid": [f"u{i}" for i in range(PROMPT_ROWS)]})
    b.meta["seed"] = seed
    return b


@pytest.fixture(scope="module")
def groups(tiny_model_dir, tmp_path_factory):
    """An actor group (the hybrid engine: actor + rollout, 1 rank) and a 1-rank generator
    group, joined over the bridge (both sides at once, as the controller does)."""
    pytest.importorskip("ray")
    from shardwise.config import load_config
    from shardwise.rl.cluster import RayWorkerGroup, init_ray, shutdown_ray
    from shardwise.rl.workers.generator import GeneratorWorker
    from shardwise.rl.workers.hybrid import RLWorker

    cfg = load_config(None, [f"model.path={tiny_model_dir}", "fsdp.mixed_precision.param_dtype=fp32",
                             f"run.dir={tmp_path_factory.mktemp('bridge_run')}", "train.optimizer.lr=5e-2",
                             "train.scheduler.warmup_steps=0", "train.micro_batch_size=4",
                             "rl.rollout.max_new_tokens=6", "rl.rollout.vllm.sync_bucket_mb=0.001"])
    raw = cfg.model_dump(by_alias=True, mode="json")
    init_ray(num_cpus=4)
    made: list = []
    errors: list = []

    def start(name, cls, *args):
        try:
            made.append((name, RayWorkerGroup(cls, 1, raw, *args, PAD, EOS, name=name)))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=start, args=("rl", RLWorker, ["actor", "rollout"])),
               threading.Thread(target=start, args=("gen", GeneratorWorker))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    found = dict(made)
    try:
        if errors:
            raise errors[0]
        actor, gen = found["rl"], found["gen"]
        addr, port = actor.bridge_address()
        joined = threading.Thread(target=gen.bridge_join, args=(addr, port, 2, 30.0))
        joined.start()
        actor.bridge_join(addr, port, 2, 30.0)
        joined.join(60)
        yield actor, gen
    finally:
        for g in found.values():
            g.shutdown()
        shutdown_ray()


def _same(a: Batch, b: Batch) -> None:
    for k in ("input_ids", "attention_mask", "response_mask", "responses", "rollout_log_probs"):
        assert torch.equal(a.tensors[k], b.tensors[k]), k


def test_generator_generates_what_the_hybrid_engine_does_after_a_push(groups):
    actor, gen = groups
    prompts = _prompts(seed=5)
    # version 0: both hold model.path's weights
    hybrid0 = actor.generate_sequences(prompts)
    gen0 = gen.generate_sequences(prompts, 0)
    _same(hybrid0, gen0)
    assert gen0.arrays["version"].tolist() == [0] * PROMPT_ROWS
    assert gen0.arrays["version"].dtype == np.int64
    # one update of the actor (on-policy: advantages of both signs), then version 1
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0]).unsqueeze(1) * hybrid0.tensors["response_mask"]
    batch = hybrid0.union(Batch.from_dict({"advantages": adv}))
    actor.update_actor(batch)
    published = actor.publish_weights(1)
    assert published["weight_sync/bytes"] > 0 and published["time/weight_gather"] >= 0
    hybrid1 = actor.generate_sequences(prompts)
    gen1 = gen.generate_sequences(prompts, 1)
    # the update moved what is sampled, and the generator samples exactly that
    assert not torch.equal(hybrid1.tensors["rollout_log_probs"], hybrid0.tensors["rollout_log_probs"])
    _same(hybrid1, gen1)
    assert gen1.arrays["version"].tolist() == [1] * PROMPT_ROWS
    metrics = gen1.meta["metrics"]  # one entry per generator rank
    assert metrics["time/weight_sync"][0] > 0 and metrics["time/generator_wait"][0] >= 0
    assert gen.weight_version() == 1
    # nothing new: no swap, the same samples again
    again = gen.generate_sequences(prompts, 1)
    _same(gen1, again)
    assert again.meta["metrics"]["time/weight_sync"] == [0.0]


def test_a_version_never_published_fails_in_one_line_within_timeout(groups):
    """Last in this module: the failed call shuts the generator group down."""
    from shardwise.rl.cluster import WorkerError

    actor, gen = groups
    # the generator rejoins a bridge whose root (this process) never pushes, 2 s timeout
    store = open_store("127.0.0.1", 2.0)
    joined = threading.Thread(target=gen.bridge_join, args=("127.0.0.1", store.port, 2, 2.0))
    joined.start()
    root = WeightBridge("127.0.0.1", store.port, 0, 2, torch.device("cpu"), 2.0, store=store)
    joined.join(30)
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        gen.generate_sequences(_prompts(seed=5), 9)
    assert time.monotonic() - start < 30
    line = str(err.value)
    assert "\n" not in line
    assert "generator rank 0 waited 2 s for policy version 9" in line and "gen.generate_sequences" in line
    root.close()


# ----------------------------------------------------------------- swap-in: full tensors into shards


def _scatter_body(rank: int, world: int) -> dict:
    from dist.common import FP32, TINY_QWEN3_MOE

    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed, teardown
    from shardwise.engine.infer import InferEngine
    from shardwise.fsdp.build import build_full
    from shardwise.fsdp.gather import iter_full_tensors
    from shardwise.fsdp.scatter import load_full_tensors

    runtime = init_distributed(timeout_s=60)
    tied_moe = TINY_QWEN3_MOE.replace("tie_word_embeddings: false", "tie_word_embeddings: true")
    engine = InferEngine(load_config(None, [tied_moe, *FP32, "run.seed=0"]), runtime)
    # another model's weights, as a push brings them: HF names, experts cut, the tied head once
    pushed = dict(iter_full_tensors(build_full(load_config(None, [tied_moe, *FP32, "run.seed=1"]))))
    assert "lm_head.weight" not in pushed and any(".experts.0." in k for k in pushed)
    before = dict(iter_full_tensors(engine.model))
    assert any(not torch.equal(before[k], v) for k, v in pushed.items())
    load_full_tensors(engine.model, pushed)
    after = dict(iter_full_tensors(engine.model))
    out = {"moe": list(after) == list(pushed) and all(torch.equal(after[k], v) for k, v in pushed.items())}
    try:
        load_full_tensors(engine.model, {**pushed, "not.a.weight": torch.zeros(1)})
    except ValueError as e:
        out["moe_unknown"] = str(e)
    teardown()
    return out


def test_pushed_tensors_land_in_every_rank_s_shards():
    """The generator's swap-in (`load_full_tensors`) is the inverse of the actor's gather:
    on 2 ranks, fused MoE experts put back together and a tied head, bitwise."""
    from dist.launcher import run_ranks

    for res in run_ranks(_scatter_body, 2, timeout=240):
        assert res["moe"]
        assert "has unknown ['not.a.weight']" in res["moe_unknown"]
