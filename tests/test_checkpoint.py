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
- `integrity` (2 ranks): sync saves at 2 and 4 and an async save at 4 (polled until it is
  committed, with no further call); then copies of the run with the step-4 checkpoint
  damaged in one way each, every copy resumed by new processes (`resume: auto` and the
  damaged folder named explicitly).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from dist.common import (
    FP32,
    TINY_QWEN3,
    eval_loss,
    full_params,
    loss_tokens,
    make_global_batch,
    micro_batches_of,
)
from dist.launcher import run_ranks
from torch.distributed.checkpoint.metadata import Metadata

from shardwise.checkpoint.best import (
    best_checkpoint,
    forget_best_after,
    lower_is_better,
    read_best,
    record_best,
)
from shardwise.checkpoint.dcp import (
    COMMITTED,
    CheckpointManager,
    is_complete,
    read_meta,
    step_dir_name,
    verify_checkpoint,
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
    return eval_loss(engine, micro_batches_of(rows, rank, world, MICRO), loss_tokens(rows))


def _full_optim(engine) -> dict[str, torch.Tensor]:
    """Full AdamW state (exp_avg, exp_avg_sq, step) by `<fqn>.<name>`, on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

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
    """Until DCP's coordinator has written .metadata (after every rank's data) in the folder
    of `step`: still uncommitted, or already committed and renamed by the background commit."""
    deadline = time.monotonic() + timeout
    folder = Path(run_dir) / "checkpoints"
    while not (list(folder.glob(f"{step_dir_name(step)}.tmp-*/.metadata"))
               or (folder / step_dir_name(step) / ".metadata").is_file()):
        assert time.monotonic() < deadline, f"async save of step {step} wrote nothing in {timeout} s"
        time.sleep(0.01)


def whole_run(rank: int, world: int, sync_dir: str, async_dir: str) -> dict:
    """Steps 1-8 in one go. Sync saves (sync_dir, keep_last=2) at 2, 4, 6, 8; an async save
    (async_dir) at 2, collected by `wait` after steps 3 and 4 have run (its background
    commit may have happened any time after its files were written)."""
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
        # Committed in the background once written (test_async_save_is_committed_without_wait),
        # so at step 4 it is either not yet visible or complete, never anything else.
        assert r["latest_before_wait"] in (None, str(uninterrupted["async_dir"] / "checkpoints" / step_dir_name(2)))
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
    # an empty DCP Metadata: what the restricted unpickler of verify_checkpoint accepts
    (folder / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))
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


def test_prune_spares_the_best_checkpoint_and_best_json_follows_the_metric(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert lower_is_better("val/loss") and lower_is_better("val/gsm8k/ppl") and not lower_is_better("val/pass@4")
    # val/loss: lower wins, the earliest of equals stays, a non-finite value is not recorded
    for step, loss in ((0, 3.0), (2, 1.5), (4, 1.5), (6, 2.0), (8, float("nan"))):
        _fake_checkpoint(ckpts / step_dir_name(step), step)
        new = record_best(tmp_path, "val/loss", step, {"val/loss": loss, "val/ppl": 9.0})
        assert new is (step in (0, 2)), step
    assert read_best(tmp_path) | {"history": None} == {"metric": "val/loss", "mode": "min", "step": 2, "value": 1.5,
                                                       "history": None}
    manager = CheckpointManager(tmp_path, CheckpointConfig(keep_last=1, keep_best="val/loss"), _runtime())
    manager.prune()
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.json", step_dir_name(2), step_dir_name(8)]
    assert best_checkpoint(tmp_path) == ckpts / step_dir_name(2)
    # without keep_best the record spares nothing
    CheckpointManager(tmp_path, CheckpointConfig(keep_last=1), _runtime()).prune()
    assert best_checkpoint(tmp_path) is None and not (ckpts / step_dir_name(2)).exists()


def test_a_resume_from_an_earlier_step_forgets_the_later_evaluations(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step, acc in ((1, 0.2), (2, 0.5), (3, 0.4), (4, 0.9)):
        _fake_checkpoint(ckpts / step_dir_name(step), step)
        record_best(tmp_path, "val/accuracy", step, {"val/accuracy": acc})
    assert read_best(tmp_path)["step"] == 4 and read_best(tmp_path)["mode"] == "max"
    forget_best_after(tmp_path, 4)  # nothing later: unchanged
    assert read_best(tmp_path)["step"] == 4
    shutil.rmtree(ckpts / step_dir_name(2))  # pruned while 4 was the best
    forget_best_after(tmp_path, 3)
    assert read_best(tmp_path) | {"history": None} == {"metric": "val/accuracy", "mode": "max", "step": 3,
                                                       "value": 0.4, "history": None}
    assert record_best(tmp_path, "val/accuracy", 3, {"val/accuracy": 0.1}) is False  # re-evaluated: 1 is best now
    assert read_best(tmp_path)["step"] == 1 and best_checkpoint(tmp_path) == ckpts / step_dir_name(1)
    assert record_best(tmp_path, "val/loss", 3, {"val/loss": 2.0}) is True  # keep_best changed: a new record
    forget_best_after(tmp_path, 2)
    assert read_best(tmp_path) is None and best_checkpoint(tmp_path) is None
    (ckpts / "best.json").write_text("{not json")
    assert read_best(tmp_path) is None  # a warning; recorded anew
    assert record_best(tmp_path, "val/loss", 4, {"val/loss": 2.0}) is True


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

    from shardwise.checkpoint.safe_load import _MetadataUnpickler

    (tmp_path / "evil").write_bytes(pickle.dumps(print))
    with open(tmp_path / "evil", "rb") as f, pytest.raises(pickle.UnpicklingError, match="builtins.print"):
        _MetadataUnpickler(f).load()


def test_extra_that_is_not_json_is_refused_before_anything_is_written(tmp_path):
    manager = CheckpointManager(tmp_path, CheckpointConfig(async_save=False), _runtime())
    with pytest.raises(TypeError, match="JSON"):
        manager.save(None, 1, extra={"t": torch.zeros(1)})  # type: ignore[arg-type]
    assert not (tmp_path / "checkpoints").exists()


# ------------------------------------------------- integrity: checksums, fallback, async commit

INTEGRITY_STEPS = 4  # sync saves at 2 and 4 (the step-4 one gets damaged in each copy)
EMBED_KEY = "model.model.embed_tokens.weight"


def save_for_integrity(rank: int, world: int, run_dir: str, async_dir: str) -> dict:
    """Steps 1-4 with sync saves at 2 and 4; then an async save of step 4 into `async_dir`,
    after which this thread only polls the file system (no collective, no save, no wait)
    until COMMITTED appears in the renamed folder, or 60 s pass."""
    from shardwise.distributed.runtime import teardown

    engine, manager = _engine(run_dir, ["checkpoint.async=false", "checkpoint.keep_last=5"])
    params = {}
    for step in range(1, INTEGRITY_STEPS + 1):
        _train(engine, step)
        if step % 2 == 0:
            manager.save(engine, step, extra={"step": step}, final=step == INTEGRITY_STEPS)
            params[step] = full_params(engine.model)
    asyn = CheckpointManager(async_dir, CheckpointConfig.model_validate({"async": True}), engine.runtime)
    asyn.save(engine, INTEGRITY_STEPS, extra={"by": "async"})
    seen = {"in_flight_after_save": asyn.async_in_flight}
    marker = Path(async_dir) / "checkpoints" / step_dir_name(INTEGRITY_STEPS) / COMMITTED
    deadline = time.monotonic() + 60.0  # a hang guard, not a speed requirement
    while not marker.is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    seen["committed_without_wait"] = marker.is_file()
    seen["listing"] = sorted(p.name for p in marker.parent.parent.iterdir())
    seen["in_flight_before_wait"] = asyn.async_in_flight  # not collected by `wait` yet
    seen["waited"] = str(asyn.wait())
    seen["in_flight_after_wait"] = asyn.async_in_flight
    asyn.close()
    teardown()
    return {"async": seen, "params": params if rank == 0 else None}


def resume_each(rank: int, world: int, root: str, names: list[str]) -> dict:
    """For each copy `root/<name>`: a fresh engine resumes with `resume: auto` (warnings of
    the checkpoint module recorded, load errors caught), then a second manager names the
    step-4 folder explicitly."""
    import logging

    from shardwise.distributed.runtime import teardown
    from shardwise.errors import CheckpointError

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("shardwise.checkpoint.dcp").addHandler(Keep(level=logging.WARNING))
    out = {}
    for name in names:
        run_dir = Path(root) / name
        engine, manager = _engine(str(run_dir), ["checkpoint.async=false"])
        records.clear()
        res: dict = {}
        path = None
        try:
            path = manager.resolve_resume()
            res["path"] = str(path)
        except ConfigError as exc:
            res["auto_error"] = [exc.key, str(exc)]
        res["warnings"] = list(records)
        if path is not None:
            try:
                manager.load(engine, path)
                res["step"] = engine.step
                params = full_params(engine.model)
                if rank == 0:
                    res["params"] = params
            except CheckpointError as exc:
                res["load_error"] = str(exc)
        named = run_dir / "checkpoints" / step_dir_name(INTEGRITY_STEPS)
        explicit = CheckpointManager(run_dir, engine.cfg.checkpoint.model_copy(update={"resume": str(named)}),
                                     engine.runtime)
        try:
            res["explicit"] = str(explicit.resolve_resume())
        except ConfigError as exc:
            res["explicit_error"] = [exc.key, str(exc)]
        out[name] = res
    teardown()
    return out


def _truncate(f: Path) -> str:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f.name


def _embedding_span(folder: Path) -> tuple[str, int, int]:
    """(file, offset, length) of the first stored piece of the embedding weight."""
    from shardwise.checkpoint.dcp import SafeFileSystemReader

    md = SafeFileSystemReader(str(folder)).read_metadata()
    return next((info.relative_path, info.offset, info.length)
                for index, info in md.storage_data.items() if index.fqn == EMBED_KEY)


def _flip_embedding_bytes(folder: Path, n: int = 256) -> str:
    """Invert `n` bytes in the middle of an embedding shard; the file keeps its size."""
    name, offset, length = _embedding_span(folder)
    assert length >= 4 * n, length  # the middle of the shard is tensor data, not framing
    data = bytearray((folder / name).read_bytes())
    start = offset + length // 2 - n // 2
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    (folder / name).write_bytes(bytes(data))
    return name


def _old_format(folder: Path) -> None:
    """COMMITTED as written before checksums existed."""
    (folder / COMMITTED).write_text(json.dumps({"step": INTEGRITY_STEPS, "world_size": 2}))


def _delete_rng(folder: Path) -> str:
    (folder / "rng_rank1.safetensors").unlink()
    return "rng_rank1.safetensors"


# name -> damage to the step-4 folder, returning the file it hit. The first five are
# detected by checksums; the old-format ones have no checksums and fail (or not) at load.
DAMAGE = {
    "distcp": lambda d: _truncate(sorted(d.glob("*.distcp"))[0]),
    "metadata": lambda d: _truncate(d / ".metadata"),
    "meta_json": lambda d: _truncate(d / "meta.json"),
    "flipped": _flip_embedding_bytes,
    "rng_deleted": _delete_rng,
    "old_format": lambda d: _old_format(d),
    "old_format_rng_deleted": lambda d: (_old_format(d), _delete_rng(d))[1],
    "old_format_distcp": lambda d: (_old_format(d), _truncate(sorted(d.glob("*.distcp"))[-1]))[1],
    "all_damaged": lambda d: (_truncate(sorted(d.parent.glob(f"{step_dir_name(2)}/*.distcp"))[0]),
                              _truncate(sorted(d.glob("*.distcp"))[0]))[1],
}
CAUGHT_BY_CHECKSUMS = ["distcp", "metadata", "meta_json", "flipped", "rng_deleted"]


@pytest.fixture(scope="module")
def integrity(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    saved = run_ranks(save_for_integrity, 2, str(root / "run"), str(root / "async"), timeout=150)
    damaged = {}
    for name, damage in DAMAGE.items():
        shutil.copytree(root / "run" / "checkpoints", root / "copies" / name / "checkpoints")
        damaged[name] = damage(root / "copies" / name / "checkpoints" / step_dir_name(INTEGRITY_STEPS))
    resumed = run_ranks(resume_each, 2, str(root / "copies"), list(DAMAGE), timeout=240)
    return {"root": root, "saved": saved, "damaged": damaged,
            "resumed": {name: [r[name] for r in resumed] for name in DAMAGE}}


def _step_folder(integrity, name: str, step: int = INTEGRITY_STEPS) -> Path:
    return integrity["root"] / "copies" / name / "checkpoints" / step_dir_name(step)


def test_committed_records_size_and_sha256_of_every_file(integrity):
    run = integrity["root"] / "run" / "checkpoints"
    folders = [run / step_dir_name(2), run / step_dir_name(4),
               integrity["root"] / "async" / "checkpoints" / step_dir_name(4)]
    for folder in folders:
        marker = json.loads((folder / COMMITTED).read_text())
        assert marker["step"] == read_meta(folder)["step"] and marker["world_size"] == 2
        on_disk = {p.name for p in folder.iterdir() if p.name != COMMITTED}
        assert set(marker["files"]) == on_disk, folder
        assert {".metadata", "meta.json", "rng_rank0.json", "rng_rank1.safetensors"} <= on_disk
        assert any(n.startswith("__0_") for n in on_disk) and any(n.startswith("__1_") for n in on_disk)
        for name, entry in marker["files"].items():
            data = (folder / name).read_bytes()
            assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
        assert verify_checkpoint(folder) == []


@pytest.mark.parametrize("name", CAUGHT_BY_CHECKSUMS)
def test_damaged_newest_checkpoint_falls_back_to_the_older_one(name, integrity):
    bad, older = _step_folder(integrity, name), _step_folder(integrity, name, 2)
    hit = integrity["damaged"][name]
    problems = verify_checkpoint(bad)
    assert problems and hit in problems[0], problems
    ranks = integrity["resumed"][name]
    for res in ranks:
        assert res["path"] == str(older) and res["step"] == 2
    warnings = [w for res in ranks for w in res["warnings"]]
    assert len(warnings) == 1 and ranks[0]["warnings"] == warnings, warnings  # one, from rank 0
    assert f"checkpoint {bad} is damaged" in warnings[0] and hit in warnings[0]
    assert f"resuming from {older} instead" in warnings[0]
    _assert_same_tensors(ranks[0]["params"], integrity["saved"][0]["params"][2], f"{name}: resumed parameters")


@pytest.mark.parametrize("name", CAUGHT_BY_CHECKSUMS)
def test_damaged_checkpoint_named_explicitly_is_a_config_error_on_every_rank(name, integrity):
    bad, hit = _step_folder(integrity, name), integrity["damaged"][name]
    for res in integrity["resumed"][name]:
        assert "explicit" not in res
        key, message = res["explicit_error"]
        assert key == "checkpoint.resume"
        assert f"{bad} failed verification" in message and hit in message, message


def test_flipped_bytes_keep_the_size_and_are_refused_by_export(integrity, tmp_path):
    import torch.distributed.checkpoint as dcp

    from shardwise.checkpoint.dcp import SafeFileSystemReader
    from shardwise.checkpoint.hf_export import ExportError, export_checkpoint

    bad = _step_folder(integrity, "flipped")
    intact = integrity["root"] / "run" / "checkpoints" / step_dir_name(INTEGRITY_STEPS)
    name = integrity["damaged"]["flipped"]
    assert (bad / name).stat().st_size == (intact / name).stat().st_size
    assert "fails its sha256 checksum" in verify_checkpoint(bad)[0]
    # The damage is the silent kind: DCP itself reads it without complaint.
    loaded = {}
    for folder in (bad, intact):
        buf = {EMBED_KEY: torch.empty(64, 32)}
        with warnings.catch_warnings():  # single-process loading is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(buf, storage_reader=SafeFileSystemReader(str(folder)), no_dist=True)
        loaded[folder] = buf[EMBED_KEY]
    assert not torch.equal(loaded[bad], loaded[intact])
    with pytest.raises(ExportError, match="failed verification") as err:
        export_checkpoint(bad, tmp_path / "bad_hf")
    assert str(bad) in str(err.value) and name in str(err.value)
    assert not (tmp_path / "bad_hf").exists()
    report = export_checkpoint(intact, tmp_path / "good_hf")  # verification passes an intact one
    assert report.num_tensors > 0 and (tmp_path / "good_hf" / "config.json").is_file()


def test_missing_rng_file_is_named(integrity):
    assert "missing file rng_rank1.safetensors" in verify_checkpoint(_step_folder(integrity, "rng_deleted"))
    # Without checksums (old COMMITTED) the folder is picked, and load names the file on every rank.
    folder = _step_folder(integrity, "old_format_rng_deleted")
    for res in integrity["resumed"]["old_format_rng_deleted"]:
        assert res["path"] == str(folder) and "step" not in res
        assert str(folder) in res["load_error"] and "missing file rng_rank1.safetensors" in res["load_error"]


def test_unreadable_dcp_file_is_a_one_line_checkpoint_error(integrity):
    folder = _step_folder(integrity, "old_format_distcp")
    for res in integrity["resumed"]["old_format_distcp"]:
        assert res["path"] == str(folder) and "step" not in res
        message = res["load_error"]
        assert message.startswith(f"checkpoint {folder} cannot be loaded") and "\n" not in message, message


def test_old_format_committed_still_resumes(integrity):
    folder = _step_folder(integrity, "old_format")
    assert "files" not in json.loads((folder / COMMITTED).read_text())
    assert verify_checkpoint(folder) == []
    ranks = integrity["resumed"]["old_format"]
    for res in ranks:
        assert res["path"] == res["explicit"] == str(folder)
        assert res["step"] == INTEGRITY_STEPS and res["warnings"] == []
    _assert_same_tensors(ranks[0]["params"], integrity["saved"][0]["params"][INTEGRITY_STEPS], "old format")


def test_no_intact_checkpoint_left_is_a_config_error(integrity):
    for res in integrity["resumed"]["all_damaged"]:
        key, message = res["auto_error"]
        assert key == "checkpoint.resume" and "path" not in res
        assert f"{_step_folder(integrity, 'all_damaged')} is damaged" in message, message


def test_async_save_is_committed_without_wait(integrity):
    folder = integrity["root"] / "async" / "checkpoints" / step_dir_name(INTEGRITY_STEPS)
    for res in (r["async"] for r in integrity["saved"]):
        assert res["committed_without_wait"] and res["listing"] == [folder.name]  # renamed, no .tmp-
        assert res["in_flight_after_save"] and res["in_flight_before_wait"] and not res["in_flight_after_wait"]
        assert res["waited"] == str(folder)
    assert read_meta(folder)["extra"] == {"by": "async"}


def test_verification_is_split_over_ranks(integrity, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(integrity["root"] / "run" / "checkpoints" / step_dir_name(INTEGRITY_STEPS), folder)
    names = sorted(json.loads((folder / COMMITTED).read_text())["files"])
    for name in names:  # every file one byte longer (meta.json stays valid JSON)
        with open(folder / name, "ab") as f:
            f.write(b"\n")
    shares = [verify_checkpoint(folder, ranks=(r, 2)) for r in range(2)]
    for r, share in enumerate(shares):
        assert [p.split(" ")[0] for p in share] == names[r::2]
    assert sorted(shares[0] + shares[1]) == sorted(verify_checkpoint(folder))
