"""RLWorker: the roles one rank hosts, and the dispatch rule of each method.

The hybrid engine is ``roles=("actor", "rollout", "ref")`` in one worker: the rollout is
the generation engine ``rl.rollout.engine`` names, over the actor's FSDP model (the HF
engine generates with the actor's own parameters, gathered for generation then resharded,
so there is no second copy of the policy and no weight transfer); the reference sits on
the same devices. "critic" and "reward_model" may join the same worker (colocated) or form
a group of their own (separate processes and process group).

Methods a role does not host raise a clear error. Every method is collective over the
worker group.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.agents.execute import ToolRunner
from shardwise.agents.loop import run_multi_turn
from shardwise.agents.tools import all_schemas, load_environment, load_tools
from shardwise.checkpoint.dcp import CheckpointManager, is_complete
from shardwise.checkpoint.hf_export import export_adapter, export_model
from shardwise.config.load import config_from_dict
from shardwise.config.schema import Config
from shardwise.data.batch import Batch
from shardwise.data.chat import use_chat_template
from shardwise.data.tokenizer import load_tokenizer, tokenizer_dir
from shardwise.distributed.bridge import BridgeError, WeightBridge, open_store
from shardwise.distributed.runtime import Runtime, seed_everything
from shardwise.engine.generate import build_generator
from shardwise.engine.weight_sync import WeightSync, bucket_bytes
from shardwise.errors import ConfigError
from shardwise.fsdp.gather import iter_full_tensors
from shardwise.models.loading import load_hf_config
from shardwise.rl import distill
from shardwise.rl.dispatch import Dispatch, register
from shardwise.rl.workers.actor import ActorWorker, LoraReference, ReferenceWorker
from shardwise.rl.workers.critic import CriticWorker
from shardwise.rl.workers.reward import RewardModelWorker

log = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref", "critic", "reward_model")
BRIDGE_STORE_TIMEOUT_S = 600.0
"""The weight bridge's store, before `bridge_join` sets the run's timeout."""
CRITIC_DIR = "critic"


def start_tools(cfg: Config, run_dir: Path, name: str) -> tuple[list[dict], Any, ToolRunner]:
    """What a rank that rolls out multi-turn trajectories needs (`run_multi_turn`): the
    tools' schemas (the tools were checked by the job's prepare step and are imported again
    here), the run's tokenizer with its template (the controller built it before the
    workers started) and the `ToolRunner`, whose processes print to run.dir/logs/<name>.log."""
    rl, m = cfg.rl, cfg.model
    tools, env = load_tools(rl.tools), load_environment(rl.environment)
    folder = tokenizer_dir(m.tokenizer, m.path, run_dir, build=False)
    tokenizer = use_chat_template(load_tokenizer(folder), cfg.data.chat_template)
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    runner = ToolRunner(tools, env, timeout_s=rl.tool_timeout_s, workers=rl.multi_turn.tool_workers,
                        max_chars=max(4096, 16 * rl.multi_turn.max_tool_response_tokens),
                        output=str(logs / f"{name}.log"))
    return all_schemas(tools, env), tokenizer, runner


class RLWorker:
    def __init__(self, cfg: dict[str, Any], roles: Sequence[str], pad_id: int, eos_id: int, *, runtime: Runtime):
        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown roles {unknown}; valid roles are {list(ROLES)}")
        if "rollout" in roles and "actor" not in roles:
            raise ValueError("the rollout generates with (or syncs from) the actor's model: colocate 'rollout' "
                             "with 'actor'")
        self.cfg = config_from_dict(cfg)
        self.runtime = runtime
        self.roles = tuple(roles)
        seed_everything(self.cfg.run.seed)
        self.actor = self.rollout = self.ref = self.critic = self.reward_model = None
        self.tools: ToolRunner | None = None
        """rl.multi_turn: the runner of this rank's tool calls (its processes live until `close`)."""
        self._ckpt = self._critic_ckpt = None
        self._bridge: WeightBridge | None = None
        """Asynchronous RL, actor rank 0: the weight bridge to the generator group."""
        self._bridge_store = None
        self.startup_s: dict[str, float] = {}
        """Seconds this rank spent building each part (`startup_seconds`)."""
        clock = time.perf_counter()

        def lap(part: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            self.startup_s[part] = self.startup_s.get(part, 0.0) + now - clock
            clock = now

        run_dir = Path(self.cfg.run.dir)
        if "actor" in roles:
            self.actor = ActorWorker(self.cfg, runtime)
            self._ckpt = CheckpointManager(run_dir, self.cfg.checkpoint, runtime, job="rl")
            lap("model_load")
        if "rollout" in roles:
            self.rollout = build_generator(self.cfg.rl.rollout.engine, self.actor.model, self.cfg.rl.rollout,
                                           runtime, pad_id, eos_id,
                                           compute_dtype=self.cfg.fsdp.mixed_precision.param_dtype)
            self.weight_sync = WeightSync(self.actor.model, self.rollout,
                                          bucket_bytes=bucket_bytes(self.cfg.rl.rollout))
            # Ulysses: the sp peers of a group get the same prompts and must draw the same samples
            if hasattr(self.rollout, "seed_rank"):
                self.rollout.seed_rank = runtime.rank // self.cfg.parallel.ulysses_size
            lap("engine")
            if self.cfg.rl.multi_turn.enabled:
                self._start_tools(run_dir)
                lap("tools")
        if "ref" in roles:
            # LoRA: the actor with its adapters disabled is the initial policy, for free
            lora_ref = self.cfg.model.lora.enabled and self.actor is not None
            if self.cfg.rl.distill.teacher is not None:  # rl.distill: the teacher is the reference
                self.ref = ReferenceWorker(distill.teacher_config(self.cfg), runtime)
            else:
                self.ref = LoraReference(self.actor) if lora_ref else ReferenceWorker(self.cfg, runtime)
            lap("reference")
        if "critic" in roles:
            self.critic = CriticWorker(self.cfg, runtime)
            self._critic_ckpt = CheckpointManager(run_dir / CRITIC_DIR, self.cfg.checkpoint, runtime, job="rl")
            lap("critic")
        if "reward_model" in roles:
            self.reward_model = RewardModelWorker(self.cfg, runtime)
            lap("reward_model")

    def _start_tools(self, run_dir: Path) -> None:
        self.schemas, self.tokenizer, self.tools = start_tools(self.cfg, run_dir, f"tools-rank{self.runtime.rank}")

    def _need(self, role: str) -> Any:
        obj = getattr(self, role)
        if obj is None:
            raise RuntimeError(f"this worker hosts {list(self.roles)}, not {role!r}")
        return obj

    # -- rollout, scoring, updates
    @register(Dispatch.DP_COMPUTE)
    def generate_sequences(self, prompts: Batch) -> Batch:
        rollout = self._need("rollout")
        # A no-op for the HF engine (it uses the actor's parameters) and when the actor has
        # not changed since the last push (the held-out evaluation after a step).
        synced = self.weight_sync.sync_if_changed()
        if self.tools is not None:  # rl.multi_turn: trajectories with tool calls
            out = self._multi_turn(prompts)
        else:
            out = rollout.generate_sequences(prompts)
        if synced:
            out.meta.setdefault("metrics", {}).update(self.weight_sync.last_metrics())
        return out

    def _multi_turn(self, prompts: Batch) -> Batch:
        """`run_multi_turn` on this rank's prompts. Under Ulysses the peers of a sequence-
        parallel group hold the same prompts: the group's first rank alone runs the
        trajectories (each tool call once, the same rows for all) while the others take part
        in every collective generate call with 0 rows, then get its rows."""
        prompts.meta.setdefault("max_new_tokens", self.cfg.rl.rollout.max_new_tokens)  # per assistant turn
        group = self.actor.engine.sp_group
        leader = dist.get_process_group_ranks(group)[0] if group is not None else self.runtime.rank
        mine = prompts if self.runtime.rank == leader else prompts[:0]
        out = run_multi_turn(self.rollout, mine, self.tokenizer, self.tools, self.cfg.rl.multi_turn, self.schemas)
        if group is not None:
            box = [out.to_bytes() if self.runtime.rank == leader else None]
            dist.broadcast_object_list(box, src=leader, group=group)  # bytes of our own processes
            out = Batch.from_bytes(box[0])
        return out

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        return self._need("actor").compute_log_prob(batch)

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return self._need("ref").compute_ref_log_prob(batch)

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        return self._need("critic").compute_values(batch)

    @register(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, batch: Batch) -> Batch:
        return self._need("reward_model").compute_rm_score(batch)

    @register(Dispatch.DP_COMPUTE, collect="first", pad=False)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        out = self._need("actor").update_actor(batch)
        if self.rollout is not None:
            self.weight_sync.actor_changed()
        return out

    @register(Dispatch.DP_COMPUTE, collect="first", pad=False)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        return self._need("critic").update_critic(batch)

    @register(Dispatch.ONE_TO_ALL)
    def startup_seconds(self) -> dict[str, float]:
        """Seconds this rank spent building its parts: ``model_load`` (the actor's model,
        weights and optimizer), ``engine`` (the rollout's generation engine), ``reference``,
        ``critic``, ``reward_model``; only the parts it hosts."""
        return dict(self.startup_s)

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def push_weights(self) -> dict[str, float]:
        """Push the actor's weights into a rollout engine that keeps its own copy, if they
        changed since the last push (the first push: at start-up, rather than inside the
        first generation); the push's metrics, or {} when nothing moved."""
        if self.rollout is None or not self.weight_sync.sync_if_changed():
            return {}
        return self.weight_sync.last_metrics()

    # -- asynchronous RL: the weight bridge to the generator group
    @register(Dispatch.ONE_TO_ALL, collect="first")
    def bridge_address(self) -> tuple[str, int]:
        """Actor rank 0 opens the weight bridge's store (`shardwise.distributed.bridge`) on a
        free port of its node; ``(address, port)`` for `bridge_join` on both groups."""
        self._need("actor")
        if self.runtime.rank != 0:
            return "", 0
        # the group's rendezvous address is rank 0's node (RayWorkerGroup); alone: loopback
        addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        self._bridge_store = open_store(addr, BRIDGE_STORE_TIMEOUT_S)  # a fresh one per join
        return addr, int(self._bridge_store.port)

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def bridge_join(self, addr: str, port: int, world: int, timeout_s: float) -> None:
        """Actor rank 0 joins the weight bridge as its root (bridge rank 0; the generator
        ranks join at the same time), at most `timeout_s`; the other actor ranks do nothing."""
        self._need("actor")
        if self.runtime.rank != 0:
            return
        if self._bridge is not None:
            self._close_bridge()
        self._bridge = WeightBridge(addr, port, 0, world, self.runtime.device, timeout_s, store=self._bridge_store,
                                    name="weight bridge (actor -> gen)")

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def publish_weights(self, version: int) -> dict[str, float]:
        """Push the actor's weights as policy `version` to the generator group: every actor
        rank gathers the full tensors (`iter_full_tensors`, collective; a LoRA actor's
        merged), rank 0 hands them to the bridge, which broadcasts them in the background
        (raising here if its previous push failed or has not finished in time).
        ``{"time/weight_gather": seconds, "weight_sync/bytes": bytes pushed}``."""
        actor = self._need("actor")
        main = self.runtime.rank == 0
        if main and self._bridge is None:
            raise RuntimeError("publish_weights before bridge_join: actor rank 0 has no weight bridge")
        start = time.perf_counter()
        bb = bucket_bytes(self.cfg.rl.rollout)
        sd = actor.model.state_dict()
        # plain (unsharded) entries come as the model's own tensors: copied, the bridge keeps them
        own = {t.untyped_storage().data_ptr() for t in sd.values() if not isinstance(t, DTensor)}
        del sd
        named: list[tuple[str, torch.Tensor]] = []
        nbytes = 0
        for name, t in iter_full_tensors(actor.model, bucket_bytes=bb):
            nbytes += t.numel() * t.element_size()
            if main:
                named.append((name, t.clone() if t.untyped_storage().data_ptr() in own else t))
        out = {"time/weight_gather": time.perf_counter() - start, "weight_sync/bytes": float(nbytes)}
        if main:
            self._bridge.send(int(version), named, bb)
        return out

    def _close_bridge(self) -> None:
        bridge, self._bridge = self._bridge, None
        try:
            bridge.close()
        except BridgeError as e:
            log.warning("%s", e)

    # -- checkpoints and export
    @register(Dispatch.ONE_TO_ALL, collect="first")
    def save_checkpoint(self, step: int, extra: dict[str, Any], final: bool = False) -> str:
        """Actor (with the controller's `extra`) under run.dir/checkpoints, critic under
        run.dir/critic/checkpoints, same step."""
        if self._ckpt is not None:
            self._ckpt.save(self.actor.engine, step, extra=extra, final=final)
        if self._critic_ckpt is not None:
            self._critic_ckpt.save(self.critic.engine, step, extra=extra, final=final)
        return str((self._ckpt or self._critic_ckpt).dir)

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def load_checkpoint(self) -> dict[str, Any] | None:
        """Resume per `checkpoint.resume` (which names the actor's checkpoints, as does
        auto: the latest under run.dir/checkpoints); the critic loads the same step from
        run.dir/critic/checkpoints. Returns the saved `extra` (None: fresh start)."""
        if self._ckpt is None and self._critic_ckpt is None:
            return None
        actor_ckpts = self._ckpt or CheckpointManager(Path(self.cfg.run.dir), self.cfg.checkpoint, self.runtime)
        path = actor_ckpts.resolve_resume()
        if path is None:
            return None
        extra = None
        if self._ckpt is not None:
            extra = self._ckpt.load(self.actor.engine, path)
            if self.rollout is not None:
                self.weight_sync.actor_changed()
        if self._critic_ckpt is not None:
            critic_path = self._critic_ckpt.dir / path.name
            if not is_complete(critic_path):
                raise ConfigError("checkpoint.resume", f"resuming from {str(path)!r}: the critic has no complete "
                                  f"checkpoint at {str(critic_path)!r}",
                                  "resume from a step both were saved at, or set checkpoint.resume=never")
            critic_extra = self._critic_ckpt.load(self.critic.engine, critic_path)
            extra = critic_extra if extra is None else extra
        if self.runtime.is_main:
            log.info("resumed from %s", path)
        return extra

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def load_actor(self, path: str) -> None:
        """The actor (model, optimizer, step) from the complete checkpoint folder `path`:
        ``checkpoint.export_from: best`` before the export."""
        self._need("actor")
        assert self._ckpt is not None
        self._ckpt.load(self.actor.engine, path)
        if self.rollout is not None:
            self.weight_sync.actor_changed()

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def prune_checkpoints(self) -> None:
        """`CheckpointManager.prune` now (rank 0 acts): a new best (``checkpoint.keep_best``,
        recorded after its step's save had pruned) frees the former best's folder."""
        for m in (self._ckpt, self._critic_ckpt):
            if m is not None:
                m.prune()

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def wait_checkpoint(self) -> None:
        for m in (self._ckpt, self._critic_ckpt):
            if m is not None:
                m.wait()

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def export_hf(self, out_dir: str, tokenizer_dir: str | None) -> str:
        """The actor as an HF folder (safetensors), written by rank 0 (a LoRA actor merged)."""
        export_model(self._need("actor").model, Path(out_dir), load_hf_config(self.cfg.model),
                     tokenizer_dir=tokenizer_dir)
        return out_dir

    @register(Dispatch.ONE_TO_ALL, collect="first")
    def export_adapter(self, out_dir: str) -> str:
        """A LoRA actor's adapters as a PEFT adapter folder, written by rank 0."""
        export_adapter(self._need("actor").model, Path(out_dir), base=self.cfg.model.path)
        return out_dir

    def close(self) -> None:
        """Before the process group goes: the rollout engine's own teardown is collective."""
        if self.tools is not None:
            self.tools.close()
            self.tools = None
        if self._bridge is not None:
            self._close_bridge()
        if self.rollout is not None:
            self.rollout.shutdown()
        for m in (self._ckpt, self._critic_ckpt):
            if m is not None:
                m.close()
