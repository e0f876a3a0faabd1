"""DCP checkpoints: bitwise resume, resharding, async save, interrupted saves, pruning.

Real gloo processes (run_ranks) and a real TrainEngine on the tiny Qwen3 in fp32. The
expensive runs are module fixtures shared by the tests:

- `interrupted`  (2 ranks): trains steps 1-4, saves at 4 (sync), exits. Then the parent
  copies that checkpoint elsewhere (for the reshard runs) and fabricates the debris of two
  interrupted later saves in the run folder; then NEW processes resume (`resume: auto`),
  train 5-8 and save at 6 and 8.
- `uninterrupted` (2 ranks): trains 1-8 in one go with sync saves at 2, 4, 6, 8
  (keep_last=2) and an async save at 2 into another run folder, during which the live
  weights and optimizer state are overwritten with NaN until DCP has written the files.
- `resharded`: the copied world-2 checkpoint loaded at world 1, world 4 and world 4 HSDP.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dist.common import FP32, TINY_QWEN3, full_params, loss_tokens, make_global_batch, micro_batches_of
from dist.launcher import run_ranks
from shardwise.checkpoint.dcp import (
    COMMITTED,
    CheckpointManager,
    is_complete,
    read_meta,
    step_dir_name,
)
from shardwise.config.schema import CheckpointConfig
from shardwise.distributed.runtime import Runtime
from shardwise.errors import ConfigError

GLOBAL_BATCH = 8
MICRO = 2
STEPS = 8
SAVE_AT = 4
EVAL_STEP = 1000  # seed offset of the fixed evaluation batch
OVERRIDES = [TINY_QWEN3, *FP32, "train.optimizer.lr=1e-3", f"train.max_steps={STEPS}"]

# Loading a world-2 checkpoint elsewhere: name -> (world size, extra overrides).
RESHARD = {
    "world1": (1, []),
    "world4": (4, []),
    "world4_hsdp": (4, ["parallel.fsdp_size=2"]),
}


# ------------------------------------------------------------------ rank bodies


def _engine(run_dir: str, extra_overrides: list[str]):
    from shardwise.config import load_config
    from shardwise.distributed.runtime import init_distributed
    from shardwise.engine.train import TrainEngine

    runtime = init_distributed(timeout_s=60)
    cfg = load_config(None, [*OVERRIDES, f"run.dir={run_dir}", *extra_overrides])
    return TrainEngine(cfg, runtime), CheckpointManager(run_dir, cfg.checkpoint, runtime)


def _train(engine, step: int) -> float:
    """Optimizer step `step` (1-based) on this rank's share of that step's global batch."""
    rank, world = engine.runtime.rank, engine.runtime.world_size
    rows = make_global_batch(step - 1, GLOBAL_BATCH)
    return engine.train_step(micro_batches_of(rows, rank, world, MICRO), loss_tokens(rows)).loss


def _eval(engine) -> float:
    rank, world = engine.runtime.rank, engine.runtime.world_size
    rows = make_global_batch(EVAL_STEP, GLOBAL_BATCH)
    return engine.eval_loss(micro_batches_of(rows, rank, world, MICRO), loss_tokens(rows))


def _full_optim(engine) -> dict[str, torch.Tensor]:
    """Full AdamW state (exp_avg, exp_avg_sq, step) by `<fqn>.<name>`, on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(engine.model, engine.optimizer,
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=False))
    return {f"{fqn}.{k}": v.detach().cpu().clone() for fqn, st in osd["state"].items() for k, v in st.items()}


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _draw() -> list[float]:
    """One draw from each generator a checkpoint restores (torch CPU, python, numpy)."""
    return [*torch.rand(2).tolist(), random.random(), *np.random.rand(2).tolist()]


def _sampler():
    from shardwise.data.sampler import GlobalBatchSampler

    return GlobalBatchSampler(num_examples=50, global_batch_size=GLOBAL_BATCH, seed=3)


def first_half(rank: int, world: int, run_dir: str) -> dict:
    """Steps 1-4, a sync save at 4 (the final act of this run), teardown."""
    from shardwise.distributed.runtime import teardown

    engine, manager = _engine(run_dir, ["checkpoint.async=false"])
    _seed_all(100 + rank)  # after the engine: model init seeds the global generator
    sampler = _sampler()
    batches = iter(sampler)
    losses = []
    for step in range(1, SAVE_AT + 1):
        next(batches)
        losses.append(_train(engine, step))
    manager.save(engine, SAVE_AT, extra={"sampler": sampler.state_dict()}, final=True)
    after_save = {"draw": _draw(), "next_batch": next(batches)}
    out = {"losses": losses, "eval": _eval(engine), **after_save,
           "lr": engine.scheduler.get_last_lr()[0]}
    params, optim = full_params(engine.model), _full_optim(engine)
    teardown()
    return {**out, "params": params, "optim": optim} if rank == 0 else out


def second_half(rank: int, world: int, run_dir: str) -> dict:
    """New processes: resume (auto) from the run folder, train steps 5-8, save at 6 and 8."""
    from shardwise.distributed.runtime import teardown

    engine, manager = _engine(run_dir, ["checkpoint.async=false", "checkpoint.every_steps=2",
                                        "checkpoint.keep_last=2"])
    _seed_all(999 + rank)  # anything but what the first half had: the checkpoint must restore it
    path = manager.resolve_resume()
    assert path is not None
    extra = manager.load(engine, path)
    resumed = {"path": path.name, "step": engine.step, "draw": _draw(),
               "last_epoch": engine.scheduler.last_epoch, "lr": engine.scheduler.get_last_lr()[0]}
    sampler = _sampler()
    sampler.load_state_dict(extra["sampler"])
    resumed["next_batch"] = next(iter(sampler))
    losses = []
    for step in range(engine.step + 1, STEPS + 1):
        losses.append(_train(engine, step))
        if manager.should_save(step, STEPS):
            manager.save(engine, step, extra={}, final=step == STEPS)
    params = full_params(engine.model)
    teardown()
    return {**resumed, "losses": losses, "params": params if rank == 0 else None}


def _await_written(run_dir: str, step: int, timeout: float = 60.0) -> None:
    """Until DCP's coordinator has written .metadata (after every rank's data) in the
    uncommitted folder of `step`."""
    deadline = time.monotonic() + timeout
    pattern = f"{step_dir_name(step)}.tmp-*/.metadata"
    while not list((Path(run_dir) / "checkpoints").glob(pattern)):
        assert time.monotonic() < deadline, f"async save of step {step} wrote nothing in {timeout} s"
        time.sleep(0.01)


def whole_run(rank: int, world: int, sync_dir: str, async_dir: str) -> dict:
    """Steps 1-8 in one go. Sync saves (sync_dir, keep_last=2) at 2, 4, 6, 8; an async save
    (async_dir) at 2, committed only after steps 3 and 4 have run."""
    import torch.distributed as dist

    from shardwise.distributed.runtime import teardown

    engine, sync = _engine(sync_dir, ["checkpoint.async=false", "checkpoint.every_steps=2",
                                      "checkpoint.keep_last=2"])
    async_cfg = CheckpointConfig.model_validate({"async": True, "every_steps": 2})
    asyn = CheckpointManager(async_dir, async_cfg, engine.runtime)
    out: dict = {"losses": []}
    for step in range(1, STEPS + 1):
        out["losses"].append(_train(engine, step))
        if sync.should_save(step, STEPS):
            sync.save(engine, step, extra={"by": "sync"}, final=step == STEPS)
        if step == 2:
            asyn.save(engine, step, extra={"by": "async"})
            out["in_flight_after_save"] = asyn.async_in_flight
            # save() has returned, so the state must already be copied: poison the live
            # tensors until the files are written, then put them back bit for bit.
            with torch.no_grad():
                live = [p.to_local() for p in engine.model.parameters()]
                live += [t.to_local() if hasattr(t, "to_local") else t
                         for st in engine.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
                backup = [t.clone() for t in live]
                for t in live:
                    t.fill_(float("nan"))
                _await_written(async_dir, step)
                for t, b in zip(live, backup):
                    t.copy_(b)
            dist.barrier()  # no rank trains on a poisoned shard of another
        if step == 4:
            out["latest_before_wait"] = asyn.latest()
            out["in_flight_before_wait"] = asyn.async_in_flight
            out["committed"] = str(asyn.wait())
            out["in_flight_after_wait"] = asyn.async_in_flight
            # Both step-2 checkpoints, loaded into a second engine.
            from shardwise.engine.train import TrainEngine

            probe = TrainEngine(engine.cfg, engine.runtime)
            sync.load(probe, Path(sync_dir) / "checkpoints" / step_dir_name(2))
            out["sync2"] = {"params": full_params(probe.model), "optim": _full_optim(probe)}
            asyn.load(probe, asyn.latest())
            out["async2"] = {"params": full_params(probe.model), "optim": _full_optim(probe)}
            del probe
    out["params"] = full_params(engine.model)
    asyn.close()
    teardown()
    if rank != 0:
        out = {k: v for k, v in out.items() if k not in ("params", "sync2", "async2")}
    return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


def load_elsewhere(rank: int, world: int, ckpt: str, names: list[str]) -> dict:
    """Load the world-2 checkpoint with each named layout of RESHARD at this world size."""
    from shardwise.distributed.runtime import teardown

    results = {}
    for name in names:
        _, extra_overrides = RESHARD[name]
        engine, manager = _engine(str(Path(ckpt).parent), [f"checkpoint.resume={ckpt}", *extra_overrides])
        _seed_all(7000 + rank)
        before = _draw_state()
        path = manager.resolve_resume()
        manager.load(engine, path)
        rng_kept = _draw_state() == before
        res = {"eval": _eval(engine), "step": engine.step, "lr": engine.scheduler.get_last_lr()[0],
               "dp_size": engine.dp_size, "mesh": list(engine.mesh.mesh_dim_names),
               "rng_kept": rng_kept, "draw": _draw()}
        params, optim = full_params(engine.model), _full_optim(engine)
        if rank == 0:
            res.update(params=params, optim=optim)
        results[name] = res
    teardown()
    return results


def _draw_state() -> list:
    return [torch.get_rng_state().tolist(), list(random.getstate()[1]), np.random.get_state()[1].tolist()]


# ------------------------------------------------------------------- fixtures


def _fabricate_interrupted_saves(ckpts: Path) -> None:
    """Debris of saves that died: a later .tmp- folder with part of the DCP files, and a
    later step folder holding everything but COMMITTED."""
    src = ckpts / step_dir_name(SAVE_AT)
    tmp = ckpts / f"{step_dir_name(8)}.tmp-x"
    tmp.mkdir()
    for f in sorted(src.glob("*.distcp"))[:1]:
        (tmp / f.name).write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    shutil.copy(src / "meta.json", tmp / "meta.json")
    uncommitted = ckpts / step_dir_name(6)
    shutil.copytree(src, uncommitted)
    (uncommitted / COMMITTED).unlink()


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("interrupted")
    first = run_ranks(first_half, 2, str(run_dir), timeout=120)
    ckpts = run_dir / "checkpoints"
    listing_after_first = sorted(p.name for p in ckpts.iterdir())
    moved = tmp_path_factory.mktemp("moved") / "ckpt_world2_step4"
    shutil.copytree(ckpts / step_dir_name(SAVE_AT), moved)
    _fabricate_interrupted_saves(ckpts)
    probe = CheckpointManager(run_dir, CheckpointConfig(), _runtime())
    picked = (probe.latest(), probe.resolve_resume())
    second = run_ranks(second_half, 2, str(run_dir), timeout=120)
    return {"run_dir": run_dir, "first": first, "second": second, "moved": moved, "picked": picked,
            "listing_after_first": listing_after_first,
            "listing_after_second": sorted(p.name for p in ckpts.iterdir())}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    sync_dir, async_dir = tmp_path_factory.mktemp("sync"), tmp_path_factory.mktemp("async")
    ranks = run_ranks(whole_run, 2, str(sync_dir), str(async_dir), timeout=150)
    return {"sync_dir": sync_dir, "async_dir": async_dir, "ranks": ranks}


@pytest.fixture(scope="module")
def resharded(interrupted):
    by_world: dict[int, list[str]] = {}
    for name, (world, _) in RESHARD.items():
        by_world.setdefault(world, []).append(name)
    out = {}
    for world, names in by_world.items():
        ranks = run_ranks(load_elsewhere, world, str(interrupted["moved"]), names, timeout=150)
        for name in names:
            out[name] = [r[name] for r in ranks]
    return out


def _runtime() -> Runtime:
    return Runtime(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")


def _assert_same_tensors(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensors differ, e.g. {bad[:3]}"


# ---------------------------------------------------------------------- tests


def test_resume_in_new_processes_is_bitwise_equal_to_uninterrupted_run(interrupted, uninterrupted):
    whole = uninterrupted["ranks"][0]
    first, second = interrupted["first"], interrupted["second"]
    for r in range(2):
        assert second[r]["path"] == step_dir_name(SAVE_AT)
        assert second[r]["step"] == SAVE_AT and second[r]["last_epoch"] == SAVE_AT
        assert second[r]["lr"] == first[r]["lr"]
    assert first[0]["losses"] == whole["losses"][:SAVE_AT]
    assert second[0]["losses"] == whole["losses"][SAVE_AT:]
    assert second[1]["losses"] == whole["losses"][SAVE_AT:]
    _assert_same_tensors(second[0]["params"], whole["params"], "final parameters")


def test_rng_of_each_rank_and_extra_are_restored(interrupted):
    first, second = interrupted["first"], interrupted["second"]
    assert first[0]["draw"] != first[1]["draw"]  # per-rank states, not one copied state
    for r in range(2):
        assert second[r]["draw"] == first[r]["draw"]
        assert second[r]["next_batch"] == first[r]["next_batch"]  # sampler state via `extra`
    meta = read_meta(interrupted["moved"])
    assert meta["step"] == SAVE_AT and meta["world_size"] == 2
    assert meta["config"]["checkpoint"]["async"] is False and meta["config"]["run"]["dir"]
    assert meta["scheduler"]["last_epoch"] == SAVE_AT
    assert {p.name for p in interrupted["moved"].glob("rng_rank*")} == {
        f"rng_rank{r}.{ext}" for r in range(2) for ext in ("json", "safetensors")}


def test_dcp_keys_of_weights_are_model_dot_hf_name(interrupted):
    from shardwise.checkpoint.dcp import SafeFileSystemReader

    keys = set(SafeFileSystemReader(str(interrupted["moved"])).read_metadata().state_dict_metadata)
    params = interrupted["first"][0]["params"]
    assert {f"model.{k}" for k in params} <= keys
    assert "model.lm_head.weight" in keys and "model.model.embed_tokens.weight" in keys
    assert any(k.startswith("optimizer.state.model.layers.0.") for k in keys)


@pytest.mark.parametrize("name", list(RESHARD))
def test_world2_checkpoint_loads_at_other_world_sizes(name, interrupted, resharded):
    world, _ = RESHARD[name]
    ref = interrupted["first"][0]
    ranks = resharded[name]
    assert len(ranks) == world
    assert ranks[0]["mesh"] == (["replicate", "shard"] if name == "world4_hsdp" else ["shard"])
    for r, res in enumerate(ranks):
        # same batch, other reduction order (other micro-batching and all-reduce): 1e-6
        assert abs(res["eval"] - ref["eval"]) <= 1e-6, (r, res["eval"], ref["eval"])
        assert res["step"] == SAVE_AT and res["lr"] == ref["lr"] and res["dp_size"] == world
        if r < 2:  # the checkpoint holds this rank's generators
            assert res["draw"] == interrupted["first"][r]["draw"]
        else:  # saved by 2 ranks: ranks 2 and 3 keep their own
            assert res["rng_kept"]
    _assert_same_tensors(ranks[0]["params"], ref["params"], f"{name} parameters")
    _assert_same_tensors(ranks[0]["optim"], ref["optim"], f"{name} optimizer state")


def test_async_save_equals_sync_save_and_leaves_training_alone(uninterrupted, interrupted):
    ranks = uninterrupted["ranks"]
    for r in ranks:
        assert r["in_flight_after_save"] and r["in_flight_before_wait"]
        assert r["latest_before_wait"] is None  # written but not committed: invisible
        assert not r["in_flight_after_wait"]
        assert r["committed"] == str(uninterrupted["async_dir"] / "checkpoints" / step_dir_name(2))
    zero = ranks[0]
    _assert_same_tensors(zero["async2"]["params"], zero["sync2"]["params"], "async vs sync parameters")
    _assert_same_tensors(zero["async2"]["optim"], zero["sync2"]["optim"], "async vs sync optimizer state")
    # `first_half` saves nothing before step 4: the poisoned-then-restored async save changed nothing.
    assert zero["losses"][:SAVE_AT] == interrupted["first"][0]["losses"]
    assert not any(np.isnan(zero["losses"]))
    meta = read_meta(uninterrupted["async_dir"] / "checkpoints" / step_dir_name(2))
    assert meta["extra"] == {"by": "async"} and meta["step"] == 2


def test_keep_last_prunes_older_checkpoints(uninterrupted):
    ckpts = uninterrupted["sync_dir"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [step_dir_name(6), step_dir_name(8)]
    assert all(is_complete(p) for p in ckpts.iterdir())
    manager = CheckpointManager(uninterrupted["sync_dir"], CheckpointConfig(), _runtime())
    assert manager.latest() == ckpts / step_dir_name(8)


def test_interrupted_saves_are_never_resumed(interrupted):
    ckpts = interrupted["run_dir"] / "checkpoints"
    assert interrupted["listing_after_first"] == [step_dir_name(SAVE_AT)]
    latest, resumed = interrupted["picked"]
    assert latest == resumed == ckpts / step_dir_name(SAVE_AT)
    # The resumed run saved at 6 over the uncommitted folder and at 8; keep_last=2 and the
    # debris of step 8's dead save is gone.
    assert interrupted["listing_after_second"] == [step_dir_name(6), step_dir_name(8)]
    assert read_meta(ckpts / step_dir_name(6))["step"] == 6
    assert json.loads((ckpts / step_dir_name(6) / COMMITTED).read_text())["step"] == 6


# ------------------------------------------------------- file-system-only behaviour


def _fake_checkpoint(folder: Path, step: int, committed: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    (folder / "meta.json").write_text(json.dumps({"step": step}))
    if committed:
        (folder / COMMITTED).write_text("{}")
    return folder


def test_latest_skips_tmp_and_uncommitted_folders(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(), _runtime())
    assert manager.latest() is None and manager.resolve_resume() is None  # fresh run, auto
    ckpts = tmp_path / "checkpoints"
    _fake_checkpoint(ckpts / step_dir_name(10), 10)
    _fake_checkpoint(ckpts / step_dir_name(9), 9)
    _fake_checkpoint(ckpts / f"{step_dir_name(30)}.tmp-abc", 30)  # even with COMMITTED inside
    _fake_checkpoint(ckpts / step_dir_name(20), 20, committed=False)
    _fake_checkpoint(ckpts / "backup_of_40", 40)
    assert manager.latest() == ckpts / step_dir_name(10)


def test_prune_keeps_newest_and_removes_old_debris(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        _fake_checkpoint(ckpts / step_dir_name(step), step)
    _fake_checkpoint(ckpts / f"{step_dir_name(5)}.tmp-dead", 5, committed=False)
    _fake_checkpoint(ckpts / step_dir_name(7), 7, committed=False)
    _fake_checkpoint(ckpts / f"{step_dir_name(9)}.tmp-later", 9, committed=False)
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=2), _runtime())
    manager.prune()
    assert sorted(p.name for p in ckpts.iterdir()) == [
        step_dir_name(6), step_dir_name(8), f"{step_dir_name(9)}.tmp-later"]
    other_rank = Runtime(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend="gloo")
    CheckpointManager(tmp_path, CheckpointConfig(keep_last=1), other_rank).prune()
    assert (ckpts / step_dir_name(6)).exists()  # only rank 0 deletes


def test_resume_never_and_explicit_paths(tmp_path):
    ckpts = tmp_path / "checkpoints"
    good = _fake_checkpoint(ckpts / step_dir_name(4), 4)
    half = _fake_checkpoint(ckpts / step_dir_name(6), 6, committed=False)

    def resolve(resume: str):
        return CheckpointManager(tmp_path, CheckpointConfig(resume=resume), _runtime()).resolve_resume()

    assert resolve("never") is None
    assert resolve("auto") == good
    assert resolve(str(good)) == good
    with pytest.raises(ConfigError, match="COMMITTED") as err:
        resolve(str(half))
    assert err.value.key == "checkpoint.resume"
    with pytest.raises(ConfigError, match="does not exist") as err:
        resolve(str(tmp_path / "nope"))
    assert err.value.key == "checkpoint.resume" and "checkpoint.resume" in str(err.value)
    with pytest.raises(ConfigError, match="did you mean") as err:
        resolve(str(tmp_path))  # the run folder, not a checkpoint in it
    assert str(good) in str(err.value)


@pytest.mark.parametrize(("every", "step", "max_steps", "expected"), [
    (2, 4, 10, True), (2, 5, 10, False), (3, 10, 10, True), (0, 4, 10, False), (0, 10, 10, True),
])
def test_should_save(every, step, max_steps, expected):
    manager = CheckpointManager("unused", CheckpointConfig(every_steps=every), _runtime())
    assert manager.should_save(step, max_steps) is expected


def test_metadata_unpickler_refuses_foreign_globals(tmp_path):
    import pickle

    from shardwise.checkpoint.dcp import _MetadataUnpickler

    (tmp_path / "evil").write_bytes(pickle.dumps(print))
    with open(tmp_path / "evil", "rb") as f, pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        _MetadataUnpickler(f).load()


def test_extra_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(async_save=False), _runtime())
    with pytest.raises(TypeError, match="JSON"):
        manager.save(None, 1, extra={"t": torch.zeros(1)})  # type: ignore[arg-type]
    assert not (tmp_path / "checkpoints").exists()
