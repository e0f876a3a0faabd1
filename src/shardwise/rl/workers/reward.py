"""The reward model worker: a sharded sequence-classification model (``rl.reward.model``)
whose head's output at the last real token of each row is that row's score. A reward model
with a tokenizer or chat template of its own (another family than the policy's) reads the
rows re-rendered for it (`RewardModelInputs`). Rule-based reward functions live in
`shardwise.data.rewards`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shardwise.config.schema import Config
from shardwise.data.batch import Batch
from shardwise.data.encode import UNLIMITED, encode_records
from shardwise.data.pairs import answer_record
from shardwise.data.rewards import decode_responses
from shardwise.data.tokenizer import has_tokenizer_files, load_tokenizer, pad_token_id
from shardwise.distributed.runtime import Runtime
from shardwise.engine.generate import left_pad
from shardwise.engine.infer import (
    InferEngine,
    default_position_ids,
    forward_by_micro_batch,
)
from shardwise.errors import ConfigError
from shardwise.models.loading import load_hf_config

__all__ = ["RAW_PROMPT", "RewardModelInputs", "RewardModelWorker", "with_model_scores"]


class RewardModelWorker:
    """A sharded sequence-classification model (one output) over ``rl.reward.model``.

    Built like the InferEngine of the actor's config with ``model.path`` replaced by
    ``rl.reward.model`` (``model.config``, ``model.tokenizer`` and ``model.freeze`` of the
    actor do not apply). Collective: every rank calls `compute_rm_score` with its rows.
    """

    def __init__(self, cfg: Config, runtime: Runtime):
        path = cfg.rl.reward.model
        if path is None:
            raise ConfigError("rl.reward.model", "no reward model given",
                              "set it to a local folder written by save_pretrained of a sequence-classification model")
        if not (Path(path) / "config.json").is_file():
            raise ConfigError("rl.reward.model", f"{path!r} holds no config.json",
                              "point it at a folder written by save_pretrained of a sequence-classification model")
        model = cfg.model.model_copy(update={"path": path, "config": None, "tokenizer": None, "freeze": [],
                                             "lora": cfg.model.lora.model_copy(update={"enabled": False})})
        rm_cfg = cfg.model_copy(update={"model": model})
        # HF's sequence-classification forward refuses batches without a pad id; its own
        # pooling (rightmost non-pad id) is not used (see compute_rm_score).
        pad = load_hf_config(model).get_text_config().pad_token_id
        self.cfg = rm_cfg
        self.runtime = runtime
        self.engine = InferEngine(rm_cfg, runtime, task="sequence_classification", num_labels=1,
                                  pad_token_id=0 if pad is None else pad)
        head = getattr(self.engine.model, "score", None)
        if not isinstance(head, torch.nn.Module):
            raise ConfigError("rl.reward.model", f"{path!r} loads as {type(self.engine.model).__name__}, "
                              "which has no `score` head", "use a decoder model with a *ForSequenceClassification class")
        self._head = head

    @torch.no_grad()
    def compute_rm_score(self, batch: Batch) -> Batch:
        """Scores of this rank's rows: tensor ``rm_scores`` ``(B,)`` fp32.

        `batch`: ``input_ids``, ``attention_mask`` (and ``position_ids``, else
        `default_position_ids`) ``(B, T)``; every row needs a real token. The score is
        the head's output at the row's last real token (the last 1 of
        ``attention_mask``), whatever padding surrounds it. HF's own pooling takes the
        rightmost token whose id differs from the pad id, which is the wrong token when
        a real token has the pad id (tokenizers with pad == eos), so the per-token head
        output is read instead. ``train.micro_batch_size`` rows per forward.
        """
        keys = ["input_ids", "attention_mask"] + (["position_ids"] if "position_ids" in batch.tensors else [])
        data = batch.select(tensor_keys=keys, array_keys=[], meta_keys=[])
        ids, mask = data.tensors["input_ids"], data.tensors["attention_mask"]
        if ids.dim() != 2 or mask.shape != ids.shape:
            raise ValueError(f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be "
                             "(batch, seq)")
        real = mask.bool()
        if real.numel() and not real.any(-1).all():
            raise ValueError(f"rows {(~real.any(-1)).nonzero().flatten().tolist()} have no real token "
                             "(attention_mask all 0)")
        self.engine.model.eval()

        def run(ids, mask, pos):
            last = mask.shape[1] - 1 - mask.bool().flip(-1).int().argmax(-1)  # the last 1 of each row
            per_token = self._per_token(ids, mask, pos)
            return {"rm_scores": per_token.gather(1, last[:, None])}

        scores = forward_by_micro_batch(run, ids, mask, data.tensors.get("position_ids"),
                                        self.cfg.train.micro_batch_size, self.runtime.device)["rm_scores"]
        return Batch(tensors={"rm_scores": scores[:, 0]})

    def _per_token(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        """The head's output at every position, ``(b, T)`` fp32 (read by a forward hook on
        the head, since the model returns only its pooled output)."""
        seen: list[torch.Tensor] = []
        handle = self._head.register_forward_hook(lambda _mod, _args, out: seen.append(out))
        try:
            self.engine.model(input_ids=ids, attention_mask=mask,
                              position_ids=default_position_ids(mask) if pos is None else pos, use_cache=False)
        finally:
            handle.remove()
        assert len(seen) == 1, f"the score head ran {len(seen)} times in one forward"
        return seen[0][..., 0].float()


def with_model_scores(batch: Batch, rm: torch.Tensor) -> Batch:
    """``rl.reward.combine: function``: `batch` with each row's ``extra_info`` a copy that
    holds the reward model's score ``rm`` ``(B,)`` as ``model_score``, for the reward
    function to combine with its own."""
    infos = batch.arrays.get("extra_info", [None] * len(batch))
    merged = np.empty(len(batch), dtype=object)
    merged[:] = [{**(info if isinstance(info, dict) else {}), "model_score": float(s)}
                 for info, s in zip(infos, rm.tolist(), strict=True)]
    return Batch(batch.tensors, {**batch.arrays, "extra_info": merged}, batch.meta)


RAW_PROMPT = "raw_prompt"
"""The array of an RL batch holding each row's prompt as the data gave it (text or chat
messages), which `RewardModelInputs` renders for the reward model."""


class RewardModelInputs:
    """The rows of an RL batch as a reward model with its own tokenizer reads them.

    The policy's tokens mean nothing to a reward model of another family (another
    vocabulary, another chat template), so each row is taken back to text and rendered
    again: the prompt as the data gave it (array `RAW_PROMPT`), the response decoded with
    the policy's tokenizer up to its first eos without special tokens (as a reward function
    reads it, `shardwise.data.rewards.decode_responses`), or a multi-turn row's whole
    conversation (array ``messages``). The pair is rendered as a training pair of
    ``train.objective: reward_model`` is (`shardwise.data.pairs.answer_record`): a text prompt
    and text answer as ``[bos] + prompt + answer + eos``, a chat prompt with the answer as
    the assistant's turn through the reward model's chat template. Not cut: every token the
    policy saw and wrote reaches the reward model.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pad_id = pad_token_id(tokenizer)

    @classmethod
    def needed(cls, path: str | None, policy_tokenizer) -> RewardModelInputs | None:
        """The re-rendering for the reward model in folder `path` when it holds a tokenizer
        whose vocabulary or chat template differs from `policy_tokenizer`'s; None when it
        reads the policy's ids as they are (no model, no tokenizer files of its own, or the
        same tokenizer)."""
        if path is None or not has_tokenizer_files(path):
            return None
        own = load_tokenizer(path)
        if (own.get_vocab() == policy_tokenizer.get_vocab()
                and getattr(own, "chat_template", None) == getattr(policy_tokenizer, "chat_template", None)
                and own.bos_token_id == policy_tokenizer.bos_token_id
                and own.eos_token_id == policy_tokenizer.eos_token_id):
            return None
        return cls(own)

    def records(self, batch: Batch, policy_tokenizer) -> list[dict]:
        """Each row as the training record the reward model reads (see the class)."""
        if RAW_PROMPT not in batch.arrays:
            raise ValueError(f"the batch has no {RAW_PROMPT!r} array to render for the reward model")
        prompts = batch.arrays[RAW_PROMPT]
        multi = batch.arrays.get("messages")
        texts, _ = decode_responses(batch, policy_tokenizer, decode=multi is None)
        uids = batch.arrays.get("uid", [None] * len(batch))
        out = []
        for row in range(len(batch)):
            where = f"rl.reward.model: row {row}" + (f" (prompt {uids[row]})" if uids[row] is not None else "")
            if multi is not None and multi[row] is not None:
                out.append({"messages": [dict(m) for m in multi[row]], "where": where})
            else:
                out.append(answer_record(prompts[row], texts[row], where))
        return out

    def batch(self, batch: Batch, policy_tokenizer) -> Batch:
        """``input_ids`` / ``attention_mask`` ``(B, T)`` of the rows in the reward model's
        tokens (left-padded with its pad id), what `RewardModelWorker.compute_rm_score` takes."""
        encoded = encode_records(self.tokenizer, self.records(batch, policy_tokenizer), UNLIMITED, "last_assistant")
        ids, mask = left_pad([e.ids for e in encoded], self.pad_id)
        return Batch.from_dict({"input_ids": ids, "attention_mask": mask})
