"""The joint RL + draft training step under pipeline parallelism.

One :class:`PipelineCoDraft` per rank holds that rank's :class:`~lightning_codraft.parallel.pipeline.PolicyStage`,
its GPipe / 1F1B schedule (``torch.distributed.pipelining``) and a
:class:`~lightning_codraft.parallel.tap_channel.TapChannel`. The draft lives on the last stage. For every
microbatch ``m`` the last stage's loss function computes

* the RL loss from the policy logits (``rl_loss_fn``, e.g. ``training.rl_loss.policy_gradient_loss``), and
* the draft's TTT loss (``draft_loss_fn``, e.g. ``training.draft_loss.ttt_draft_loss``) from the taps the
  TapChannel delivered for ``m`` and the DETACHED policy logits, the token embeddings of the shifted ids being
  the shipped tap 0 (``emb(x)``, the hidden state entering layer 0) shifted left by ``k + 1`` inside each
  document, so the last stage needs no copy of the embedding table,

and back-propagates ``(rl_m + draft_weight * draft_m) / M`` through the schedule (``scale_grads=False``). The
objective of a step is therefore ``(1/M) sum_m (rl_m + draft_weight * draft_m)``: exactly what one process
accumulating the same ``M`` microbatches computes. The draft gradient stays on the last stage (taps and logits
are detached); with tied embeddings the embedding gradient of the first and the last stage is summed.

Under CP every microbatch tensor is this rank's zigzag shard (``cu_seqlens`` global); each rank's gradients
are its share, summed over the CP (and DP) group by the strategy, as for the single-stage step.

Public API (what ``parallel/strategy_core.py`` calls)::

    pp = PipelineCoDraft(policy, draft, stage=pp_rank, num_stages=pp, pp_group=..., tap_group=...,
                         cp_group=None, loss_group=None, rl_loss_fn=policy_gradient_loss,
                         draft_loss_fn=ttt_draft_loss, config=PipelineConfig(schedule="1f1b"))
    pp.parameters()                       # this stage's policy parameters (+ the draft's on the last)
    out = pp.step(microbatches)           # list of RL batch dicts (interfaces.md), equal lengths
    out.loss, out.rl_loss, out.draft_loss  # detached global values, on every stage
    pad_microbatches(microbatches, multiple_of=2 * cp)   # before zigzag sharding: one length for all

``tap_group`` must be a process group of its own over the same ranks as ``pp_group``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_codraft.attention.packing import shift_left_local
from lightning_codraft.parallel.pipeline import MicrobatchMeta, PolicyStage, StageLayout, build_schedule
from lightning_codraft.parallel.strategy_core import merge_microbatch_stats
from lightning_codraft.parallel.tap_channel import TapChannel

BATCH_KEYS = ("input_ids", "target_ids", "position_ids", "cu_seqlens", "loss_mask", "old_logprobs", "advantages")
ROW_KEYS = ("input_ids", "target_ids", "position_ids", "valid", "loss_mask", "old_logprobs", "advantages",
            "ref_logprobs", "draft_mask")


@dataclass
class PipelineConfig:
    """How the policy is pipelined and how the two losses combine."""

    schedule: str = "1f1b"
    """``"1f1b"`` (needs microbatches >= stages) or ``"gpipe"``."""
    layers_per_stage: Optional[tuple[int, ...]] = None
    """Explicit decoder-layer count of every stage; ``None`` balances (extra layers to the first stages)."""
    ttt_steps: int = 3
    """Unrolled training-time-test steps ``K`` of the draft loss."""
    draft_weight: float = 1.0
    """Weight of the draft loss in the joint objective ``rl + draft_weight * draft``."""
    draft_decay: float = 0.8
    """Per-step weight ratio of the TTT loss (step ``k`` weighs ``draft_decay ** k``)."""


@dataclass
class PipelineStepOutput:
    """Detached results of one pipelined step, identical on every stage of the pipeline.

    Attributes:
        loss: scalar ``mean_m (rl_m + draft_weight * draft_m)``, global over ``loss_group``.
        rl_loss: scalar mean over microbatches of the RL loss.
        draft_loss: scalar mean over microbatches of the draft TTT loss (0 without a draft).
        draft_correct: ``(K,)`` draft top-1 hits per TTT step, summed over microbatches (zeros without a draft).
        draft_total: ``(K,)`` counted rows per TTT step, summed over microbatches.
        tap_bytes: bytes this rank sent on the TapChannel in the step.
        rl_stats: the ``stats`` of ``rl_loss_fn`` (global over ``loss_group``), each the mean over microbatches,
            except keys ending in ``num_tokens``, which are summed.
    """

    loss: Tensor
    rl_loss: Tensor
    draft_loss: Tensor
    draft_correct: Tensor
    draft_total: Tensor
    tap_bytes: int
    rl_stats: dict[str, Tensor] = field(default_factory=dict)


def _group_size(group: Optional[Any]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _shift_left(x: Tensor, cu_seqlens: Tensor, shift: int, cp_group: Optional[Any]) -> Tensor:
    """``y[i] = x[i + shift]`` inside the document, else 0; on zigzag shards through the CP halo exchange."""
    if _group_size(cp_group) == 1:
        return shift_left_local(x, cu_seqlens, shift, fill=0)
    try:
        from lightning_codraft.attention import shift_left
    except ImportError as e:
        raise RuntimeError("PP x CP needs lightning_codraft.attention.shift_left (the zigzag halo shift) to build "
                           "the draft's shifted token embeddings; it is not available") from e
    return shift_left(x, cu_seqlens, shift, group=cp_group, fill=0)


def pad_microbatches(microbatches: Sequence[Mapping[str, Tensor]], multiple_of: int = 1,
                     pad_id: int = 0) -> list[dict[str, Tensor]]:
    """Pad whole (unsharded) RL microbatches to one token count by appending one padding document.

    The pipeline schedule sends fixed-shape activations, so every microbatch of a step must have the same
    number of tokens. The padding document has ``valid = False`` and every mask, advantage and log-prob 0, so
    it contributes nothing to either loss; attention never crosses documents.

    Args:
        microbatches: RL batch dicts (docs/design/interfaces.md), whole batches (shard AFTER padding).
        multiple_of: padded length multiple (``2 * cp`` under CP).
        pad_id: token id of the padding.

    Returns:
        New dicts, each with ``T_max`` rows (``T_max`` = the largest length rounded up to ``multiple_of``).
    """
    lengths = [int(mb["input_ids"].shape[0]) for mb in microbatches]
    t_max = -(-max(lengths) // multiple_of) * multiple_of
    out = []
    for mb, n in zip(microbatches, lengths):
        pad = t_max - n
        new = dict(mb)
        if pad:
            cu = mb["cu_seqlens"]
            new["cu_seqlens"] = torch.cat([cu, cu.new_tensor([t_max])])
            for key in ROW_KEYS:
                if key not in mb:
                    continue
                t = mb[key]
                if key in ("input_ids", "target_ids"):
                    fill = t.new_full((pad,), pad_id)
                elif key == "position_ids":
                    fill = torch.arange(pad, dtype=t.dtype, device=t.device)
                else:
                    fill = t.new_zeros((pad,))
                new[key] = torch.cat([t, fill])
        out.append(new)
    return out


class PipelineCoDraft:
    """This rank's stage of the pipelined policy, the draft (last stage) and the joint step.

    Args:
        policy: the policy (only this stage's modules are used and trained here; the other stages' parameters
            may already be on the ``meta`` device, see ``pipeline.release_unowned``).
        draft: an :class:`~lightning_codraft.models.Eagle3Draft` on the last stage, ``None`` elsewhere (and
            ``None`` on every stage to pipeline the policy alone).
        stage: this rank's pipeline stage.
        num_stages: pipeline stages ``pp``.
        pp_group: the pipeline group of this (dp, cp) coordinate (group rank == stage); ``None`` iff pp == 1.
        tap_group: a separate group over the same ranks for the TapChannel; ``None`` iff pp == 1.
        cp_group: the context-parallel group (ring attention, draft loss, halo shifts), or ``None``.
        loss_group: group over which the RL batch is split (``rl_loss_fn(group=)``); default ``cp_group``.
        rl_loss_fn: ``rl_loss_fn(logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, group=None)
            -> (loss, stats)`` with ``policy_gradient_loss``'s contract (loss = this rank's share).
        draft_loss_fn: ``draft_loss_fn(step_logits, policy_logits, cu_seqlens, loss_mask, d2t, t2d, decay=,
            group=) -> .loss/.correct/.total`` with ``ttt_draft_loss``'s contract; required with a draft.
        config: :class:`PipelineConfig` (default: 1F1B, balanced split).
    """

    max_cached_schedules = 4
    """Schedules (with their receive buffers) kept for distinct ``(M, T)``; the oldest is dropped beyond this."""

    def __init__(self, policy: nn.Module, draft: Optional[nn.Module] = None, *, stage: int, num_stages: int,
                 pp_group: Optional[Any], tap_group: Optional[Any], cp_group: Optional[Any] = None,
                 loss_group: Optional[Any] = None, rl_loss_fn: Callable[..., tuple[Tensor, Any]],
                 draft_loss_fn: Optional[Callable[..., Any]] = None, config: Optional[PipelineConfig] = None):
        config = PipelineConfig() if config is None else config
        self.layout = StageLayout.split(policy.num_layers, num_stages, config.layers_per_stage)
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} is outside [0, {num_stages})")
        self.is_last = stage == num_stages - 1
        if draft is not None and not self.is_last:
            raise ValueError(f"the draft was given to stage {stage} but it must live on the last stage "
                             f"{num_stages - 1} (where the policy logits are); pass draft=None on other stages")
        if draft is not None and draft_loss_fn is None:
            raise ValueError("a draft needs draft_loss_fn (e.g. lightning_codraft.training.ttt_draft_loss)")
        if num_stages > 1 and tap_group is not None and tap_group is pp_group:
            raise ValueError("tap_group must be a process group of its own, not the pipeline's pp_group")
        if config.ttt_steps < 1:
            raise ValueError(f"ttt_steps={config.ttt_steps} must be >= 1")
        self.policy, self.draft, self.config = policy, draft, config
        self.stage, self.num_stages = stage, num_stages
        self.pp_group, self.cp_group = pp_group, cp_group
        self.loss_group = cp_group if loss_group is None else loss_group
        self.rl_loss_fn, self.draft_loss_fn = rl_loss_fn, draft_loss_fn
        # the draft's taps and tap 0 (the token embeddings); every stage learns the tap ids from one broadcast
        draft_taps = tuple(int(t) for t in draft.config.taps) if draft is not None else ()
        self.draft_taps = self._agree_on_taps(draft_taps)
        channel_taps = (0, *self.draft_taps) if self.draft_taps else ()
        self.channel = TapChannel(self.layout.tap_owners(channel_taps), stage, num_stages, tap_group)
        self.stage_module = PolicyStage(policy, self.layout, stage, cp_group=cp_group,
                                        tap_sink=self.channel.send if channel_taps else None, tap_ids=channel_taps)
        self.tied = bool(getattr(policy.config, "tie_word_embeddings", False)) and num_stages > 1
        self._schedules: dict[tuple[int, int], Any] = {}
        self._mbs: list[Mapping[str, Tensor]] = []
        self._records: list[tuple[Tensor, Tensor, Tensor, Tensor, dict]] = []

    def _agree_on_taps(self, draft_taps: tuple[int, ...]) -> tuple[int, ...]:
        """Tap ids of the draft, broadcast from the last stage so every stage knows what to ship."""
        if self.num_stages == 1:
            return draft_taps
        obj = [draft_taps]
        dist.broadcast_object_list(obj, group=self.pp_group, group_src=self.num_stages - 1)
        taps = tuple(obj[0])
        for t in taps:
            self.layout.tap_owner(t)  # tap layers outside the model raise here, on every stage
        return taps

    def parameters(self) -> list[nn.Parameter]:
        """This stage's policy parameters, then the draft's (last stage)."""
        params = list(self.stage_module.parameters())
        if self.draft is not None:
            params += [p for p in self.draft.parameters()]
        return params

    # ----- the step -----

    def _schedule(self, num_microbatches: int, tokens: int, dtype: torch.dtype, device: torch.device):
        key = (num_microbatches, tokens)
        if key not in self._schedules:
            if len(self._schedules) >= self.max_cached_schedules:  # RL batches vary in length: bound the memory
                self._schedules.pop(next(iter(self._schedules)))
            self._schedules[key] = build_schedule(self.stage_module, self.pp_group, num_microbatches, tokens,
                                                  self.config.schedule, loss_fn=self._loss_fn, dtype=dtype,
                                                  device=device)
        return self._schedules[key]

    def _loss_fn(self, logits: Tensor, mb: Tensor) -> Tensor:
        """Last stage: ``(rl_m + draft_weight * draft_m) / M`` for microbatch ``m = mb[0]``."""
        m = int(mb.reshape(-1)[0])
        batch = self._mbs[m]
        num_mb = len(self._mbs)
        logprobs = torch.log_softmax(logits.float(), dim=-1).gather(
            -1, batch["target_ids"].long().unsqueeze(-1)).squeeze(-1)
        rl, rl_stats = self.rl_loss_fn(logprobs, batch["old_logprobs"], batch["advantages"], batch["loss_mask"],
                                       ref_logprobs=batch.get("ref_logprobs"), group=self.loss_group)
        rl_stats = {k: v.detach() for k, v in dict(rl_stats or {}).items()}
        total = rl
        K = self.config.ttt_steps
        zero = logits.new_zeros(())
        if self.draft is not None:
            taps = self.channel.receive(m)
            cu = batch["cu_seqlens"]
            token_embeds = [_shift_left(taps[0], cu, k + 1, self.cp_group) for k in range(K)]
            steps = self.draft.ttt_forward([taps[t] for t in self.draft_taps], token_embeds, cu,
                                           batch["position_ids"], cp_group=self.cp_group)
            mask = batch.get("draft_mask", batch.get("valid"))
            if mask is None:
                raise ValueError("the draft loss needs 'draft_mask' (or 'valid') in every microbatch")
            out = self.draft_loss_fn([lg for lg, _ in steps], logits.detach(), cu, mask, self.draft.d2t,
                                     self.draft.t2d, decay=self.config.draft_decay, group=self.cp_group)
            total = total + self.config.draft_weight * out.loss
            self._records.append((rl.detach(), out.loss.detach(), out.correct.detach(), out.total.detach(),
                                  rl_stats))
        else:
            self._records.append((rl.detach(), zero.detach(), torch.zeros(K), torch.zeros(K), rl_stats))
        return total / num_mb

    def _check(self, microbatches: Sequence[Mapping[str, Tensor]]) -> int:
        if len(microbatches) == 0:
            raise ValueError("step() needs at least one microbatch")
        tokens = {int(mb["input_ids"].shape[0]) for mb in microbatches}
        if len(tokens) != 1:
            raise ValueError(f"microbatches have different token counts {sorted(tokens)}; the pipeline sends "
                             f"fixed-shape activations: pad them with pad_microbatches(...) before sharding")
        for i, mb in enumerate(microbatches):
            missing = [k for k in BATCH_KEYS if k not in mb]
            if missing:
                raise ValueError(f"microbatch {i} lacks {missing}; see the RL batch format in interfaces.md")
        return tokens.pop()

    def step(self, microbatches: Sequence[Mapping[str, Tensor]]) -> PipelineStepOutput:
        """Run forward and backward of all microbatches through the pipeline; gradients accumulate in ``.grad``.

        Args:
            microbatches: ``M`` RL batch dicts (docs/design/interfaces.md) of this rank (zigzag shards under
                CP, ``cu_seqlens`` global), all with the same token count ``T``. Every stage passes the same
                list (stages read ``cu_seqlens``/``position_ids``; the first ``input_ids``; the last the rest).

        Returns:
            :class:`PipelineStepOutput`, the same on every stage.
        """
        tokens = self._check(microbatches)
        num_mb = len(microbatches)
        own = next(self.stage_module.parameters())  # this stage's own tensor: other stages' may be on meta
        dtype, device = own.dtype, own.device
        schedule = self._schedule(num_mb, tokens, dtype, device)
        self._mbs = list(microbatches)
        self._records = []
        self.stage_module.set_microbatches([MicrobatchMeta(mb["cu_seqlens"].to(device),
                                                           mb["position_ids"].to(device)) for mb in microbatches])
        sent_before = self.channel.bytes_sent
        self.channel.begin(num_mb, (tokens, self.policy.config.hidden_size), dtype, device)
        mb_index = torch.arange(num_mb, device=device)
        try:
            if self.stage_module.is_first:
                ids = torch.stack([mb["input_ids"].to(device) for mb in microbatches])
                schedule.step(ids, mb=mb_index, target=mb_index if self.is_last else None,
                              losses=[] if self.is_last else None, return_outputs=False)
            elif self.is_last:
                schedule.step(mb=mb_index, target=mb_index, losses=[], return_outputs=False)
            else:
                schedule.step(mb=mb_index, return_outputs=False)
        finally:
            self.channel.finish()
        if self.tied:
            self._sum_tied_embedding_grads()
        return self._gather_output(num_mb, self.channel.bytes_sent - sent_before)

    def _sum_tied_embedding_grads(self) -> None:
        """Tied ``embed_tokens`` / ``lm_head``: add the first and the last stage's gradients on both."""
        if not (self.stage_module.is_first or self.is_last):
            return
        stage = self.stage_module
        weight = stage.embed_tokens.weight if stage.is_first else stage.lm_head.weight  # the one shared tensor
        grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
        peer = self.num_stages - 1 if self.stage_module.is_first else 0
        other = torch.empty_like(grad)
        ops = [dist.P2POp(dist.isend, grad.contiguous(), group=self.pp_group, group_peer=peer),
               dist.P2POp(dist.irecv, other, group=self.pp_group, group_peer=peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        weight.grad = grad + other

    def _gather_output(self, num_mb: int, tap_bytes: int) -> PipelineStepOutput:
        """Average the last stage's per-microbatch records, reduce over ``loss_group``, share with all stages."""
        K = self.config.ttt_steps
        stats = torch.zeros(2 + 2 * K, dtype=torch.float64)
        rl_stats: dict[str, float] = {}
        if self.is_last:
            for rl, dl, correct, total, _ in self._records:
                stats[0] += float(rl) / num_mb
                stats[1] += float(dl) / num_mb
                stats[2:2 + K] += correct.double().cpu()
                stats[2 + K:] += total.double().cpu()
            # each microbatch's stats are already global token means over loss_group
            rl_stats = merge_microbatch_stats([{k: float(v) for k, v in r[4].items()} for r in self._records])
            if _group_size(self.loss_group) > 1:  # the RL loss is a per-rank share of the global mean
                rl_share = stats[:1].clone()
                dist.all_reduce(rl_share, group=self.loss_group)
                stats[0] = rl_share[0]
        if self.num_stages > 1:
            dist.broadcast(stats, group=self.pp_group, group_src=self.num_stages - 1)
            box = [rl_stats]  # its keys are the loss function's: only the last stage knows them
            dist.broadcast_object_list(box, group=self.pp_group, group_src=self.num_stages - 1)
            rl_stats = box[0]
        rl, dl = stats[0].float(), stats[1].float()
        return PipelineStepOutput(loss=rl + self.config.draft_weight * dl, rl_loss=rl, draft_loss=dl,
                                  draft_correct=stats[2:2 + K].float(), draft_total=stats[2 + K:].float(),
                                  tap_bytes=tap_bytes,
                                  rl_stats={k: torch.tensor(v, dtype=torch.float32) for k, v in rl_stats.items()})
