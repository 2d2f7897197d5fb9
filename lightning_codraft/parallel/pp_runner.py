"""The pipelined step: this rank's policy stage under a GPipe / 1F1B schedule, taps shipped by the TapChannel, and
the caller's loss function on the last stage.

One :class:`PipelineRunner` per rank holds that rank's :class:`~lightning_codraft.parallel.pipeline.PolicyStage`,
its schedules (``torch.distributed.pipelining``) and a :class:`~lightning_codraft.parallel.tap_channel.TapChannel`.
The runner knows no loss: :meth:`PipelineRunner.step` takes ``loss_fn(logits, taps, batch) -> (loss, record)``,
the SAME function the single-stage step calls (torchtitan hands one ``loss_fn`` to both paths), so an objective
changed in a subclass changes under PP too. For every microbatch ``m`` the last stage calls it with the policy
logits of ``m``, the taps the TapChannel delivered for ``m`` (tap ``l`` = the hidden state entering layer ``l``;
tap 0 is the token embeddings) and the microbatch, and back-propagates ``loss`` through the schedule
(``scale_grads=False``): each microbatch's loss is its share of the step's objective (its weights divide by the
whole step's counts), so the step's objective is the sum over microbatches, exactly what one process accumulating
the same ``M`` microbatches computes. The ``record`` of every microbatch (detached statistics) is
returned on every stage.

Under CP every microbatch is this rank's zigzag shard (``cu_seqlens`` global). With tied embeddings the
embedding gradient of the first and the last stage is summed here. Reducing gradients over the data-parallel
ranks is the strategy's job.

Public API (what ``training.module.CoDraftModule`` calls)::

    runner = PipelineRunner(policy, stage=pp_rank, num_stages=pp, pp_group=..., tap_group=..., cp_group=None,
                            tap_ids=(0, *draft_taps), schedule="1f1b", layers_per_stage=None)
    runner.parameters()                     # this stage's policy parameters
    records = runner.step(microbatches, loss_fn)   # RLBatch shards, one token count; records on every stage
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_codraft.batch import RLBatch
from lightning_codraft.parallel.pipeline import MicrobatchMeta, PolicyStage, StageLayout, build_schedule
from lightning_codraft.parallel.tap_channel import TapChannel

#: ``loss_fn(logits (T, V), taps {tap id: (T, H)}, microbatch) -> (scalar loss, record)``
LossFn = Callable[[Tensor, Mapping[int, Tensor], RLBatch], tuple[Tensor, Any]]


class PipelineRunner:
    """This rank's stage of the pipelined policy and the step that runs a loss function over it.

    Args:
        policy: the policy (only this stage's modules are used here; the others may already be pruned, see
            :func:`~lightning_codraft.parallel.pipeline.prune_unowned`).
        stage: this rank's pipeline stage.
        num_stages: pipeline stages ``pp``.
        pp_group: the pipeline group of this (dp, cp) coordinate (group rank == stage); ``None`` iff pp == 1.
        tap_group: a separate group over the same ranks for the TapChannel; ``None`` iff pp == 1.
        cp_group: the context-parallel group (ring attention), or ``None``.
        tap_ids: taps the last stage's loss function receives (ship ``0`` for the token embeddings); ``()``
            ships none.
        schedule: ``"1f1b"`` (needs microbatches >= stages) or ``"gpipe"``.
        layers_per_stage: decoder layers of every stage; ``None`` balances (extra layers to the first stages).
    """

    max_cached_schedules = 1
    """Schedules kept for distinct ``(M, T)``: each holds receive buffers for all M microbatches, so keeping more
    than the current one would hold several steps' worth of activations; RL batches vary in length."""

    def __init__(
        self,
        policy: nn.Module,
        *,
        stage: int,
        num_stages: int,
        pp_group: Optional[Any],
        tap_group: Optional[Any],
        cp_group: Optional[Any] = None,
        tap_ids: Sequence[int] = (),
        schedule: str = "1f1b",
        layers_per_stage: Optional[Sequence[int]] = None,
    ):
        self.layout = StageLayout.split(policy.num_layers, num_stages, layers_per_stage)
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} is outside [0, {num_stages})")
        if num_stages > 1 and tap_group is not None and tap_group is pp_group:
            raise ValueError("tap_group must be a process group of its own, not the pipeline's pp_group")
        self.policy, self.schedule_name = policy, schedule
        self.stage, self.num_stages = stage, num_stages
        self.is_last = stage == num_stages - 1
        self.pp_group, self.cp_group = pp_group, cp_group
        self.tap_ids = tuple(sorted({int(t) for t in tap_ids}))
        self.channel = TapChannel(self.layout.tap_owners(self.tap_ids), stage, num_stages, tap_group)
        self.stage_module = PolicyStage(
            policy,
            self.layout,
            stage,
            cp_group=cp_group,
            tap_sink=self.channel.send if self.tap_ids else None,
            tap_ids=self.tap_ids,
        )
        self.tied = bool(getattr(policy.config, "tie_word_embeddings", False)) and num_stages > 1
        self._schedules: dict[tuple[int, int], Any] = {}
        self._mbs: list[RLBatch] = []
        self._loss_fn: Optional[LossFn] = None
        self._records: list[Any] = []
        self._tap_bytes_before = 0
        self.activation_dtype: Optional[torch.dtype] = None
        """dtype of the activations between stages and of the taps; None: the stage parameters' dtype. The
        strategy sets it to FSDP2's compute dtype under mixed precision (the masters stay fp32)."""

    def parameters(self) -> list[nn.Parameter]:
        """This stage's policy parameters."""
        return list(self.stage_module.parameters())

    # ----- the step -----

    def _schedule(
        self,
        num_microbatches: int,
        tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        backward: bool = True,
        out: Optional[tuple[int, torch.dtype]] = None,
    ):
        key = (num_microbatches, tokens, backward, out)
        if key not in self._schedules:
            if len(self._schedules) >= self.max_cached_schedules:  # RL batches vary in length: bound the memory
                self._schedules.pop(next(iter(self._schedules)))
            self._schedules[key] = build_schedule(
                self.stage_module,
                self.pp_group,
                num_microbatches,
                tokens,
                self.schedule_name if backward else "gpipe",
                loss_fn=self._schedule_loss if backward else None,
                dtype=dtype,
                device=device,
                out_width=out[0] if out else None,
                out_dtype=out[1] if out else None,
            )
        return self._schedules[key]

    def _schedule_loss(self, logits: Tensor, mb: Tensor) -> Tensor:
        """Last stage: ``loss_fn(logits, taps, batch)``, a share of the step's objective, for microbatch
        ``m = mb[0]``."""
        m = int(mb.reshape(-1)[0])
        taps = self.channel.receive(m) if self.tap_ids else {}
        loss, record = self._loss_fn(logits, taps, self._mbs[m])
        self._records.append(record)
        return loss

    @staticmethod
    def _check(microbatches: Sequence[RLBatch]) -> int:
        if len(microbatches) == 0:
            raise ValueError("step() needs at least one microbatch")
        tokens = {mb.num_rows for mb in microbatches}
        if len(tokens) != 1:
            raise ValueError(
                f"microbatches have different token counts {sorted(tokens)}; the pipeline sends "
                f"fixed-shape activations: pad every whole microbatch with RLBatch.pad_to(...) to one "
                f"length before sharding"
            )
        return tokens.pop()

    def step(self, microbatches: Sequence[RLBatch], loss_fn: LossFn) -> list[Any]:
        """Run forward and backward of all microbatches through the pipeline; gradients accumulate in ``.grad``.

        Args:
            microbatches: ``M`` batches of this rank (zigzag shards under CP, ``cu_seqlens`` global), all with
                the same number of rows. Every stage passes the same list (stages read ``cu_seqlens`` and
                ``position_ids``, the first stage ``input_ids``, the last stage's ``loss_fn`` the rest).
            loss_fn: ``loss_fn(logits (T, V), taps, microbatch) -> (loss, record)``, called on the last stage
                once per microbatch, in order; ``loss`` is this rank's share of the microbatch's objective.

        Returns:
            The ``M`` records, in microbatch order, on every stage (broadcast from the last).
        """
        rows = self._check(microbatches)
        num_mb = len(microbatches)
        own = next(self.stage_module.parameters())
        dtype, device = self.activation_dtype or own.dtype, own.device
        schedule = self._schedule(num_mb, rows, dtype, device)
        self._mbs, self._loss_fn, self._records = list(microbatches), loss_fn, []
        self.stage_module.set_microbatches(
            [MicrobatchMeta(mb.cu_seqlens.to(device), mb.position_ids.to(device)) for mb in microbatches]
        )
        self._tap_bytes_before = self.channel.bytes_sent
        window = self.num_stages if self.schedule_name == "1f1b" else None  # GPipe runs every forward first
        self.channel.begin(num_mb, (rows, self.policy.config.hidden_size), dtype, device, window=window)
        mb_index = torch.arange(num_mb, device=device)
        try:
            if self.stage_module.is_first:
                ids = torch.stack([mb.input_ids.to(device) for mb in microbatches])
                schedule.step(
                    ids,
                    mb=mb_index,
                    target=mb_index if self.is_last else None,
                    losses=[] if self.is_last else None,
                    return_outputs=False,
                )
            elif self.is_last:
                schedule.step(mb=mb_index, target=mb_index, losses=[], return_outputs=False)
            else:
                schedule.step(mb=mb_index, return_outputs=False)
        finally:
            self.channel.finish()
            self._mbs, self._loss_fn = [], None
        if self.tied:
            self._sum_tied_embedding_grads()
        records = self._records
        if self.num_stages > 1:
            box = [records if self.is_last else None]
            dist.broadcast_object_list(box, group=self.pp_group, group_src=self.num_stages - 1)
            records = box[0]
        self._records = []
        return records

    @torch.no_grad()
    def forward(
        self, microbatches: Sequence[RLBatch], reduce: Optional[tuple[Callable[[Tensor, RLBatch], Tensor], int]] = None
    ) -> Optional[list[Tensor]]:
        """A forward-only pass of the pipeline (e.g. the reference policy): the logits of every microbatch.

        Args:
            microbatches: as for :meth:`step` (every stage passes the same list).
            reduce: ``(fn, width)``: the last stage returns ``fn(logits (T, V), microbatch) -> (T, width)`` float32
                per microbatch instead of its logits, computed as each microbatch leaves the pipeline (the schedule
                keeps every microbatch's output until the step ends: reduce to keep M x T x width, not M x T x V).

        Returns:
            On the last stage ``M`` tensors ``(T, V)`` (or ``(T, width)``); None on the other stages.
        """
        rows = self._check(microbatches)
        num_mb = len(microbatches)
        own = next(self.stage_module.parameters())
        out = (reduce[1], torch.float32) if reduce is not None else None
        schedule = self._schedule(num_mb, rows, self.activation_dtype or own.dtype, own.device, backward=False, out=out)
        self.stage_module.set_microbatches(
            [MicrobatchMeta(mb.cu_seqlens.to(own.device), mb.position_ids.to(own.device)) for mb in microbatches]
        )
        if reduce is not None and self.is_last:
            fn = reduce[0]
            self.stage_module.head_fn = lambda logits, m: fn(logits, microbatches[m]).to(torch.float32)
        mb_index = torch.arange(num_mb, device=own.device)
        try:
            if self.stage_module.is_first:
                ids = torch.stack([mb.input_ids.to(own.device) for mb in microbatches])
                result = schedule.step(ids, mb=mb_index, return_outputs=self.is_last)
            else:
                result = schedule.step(mb=mb_index, return_outputs=self.is_last)
        finally:
            self.stage_module.head_fn = None
        return list(result.split(rows)) if self.is_last else None

    @property
    def tap_bytes_last_step(self) -> int:
        """Bytes this rank sent on the TapChannel in the last step."""
        return self.channel.bytes_sent - self._tap_bytes_before

    def _sum_tied_embedding_grads(self) -> None:
        """Tied ``embed_tokens`` / ``lm_head``: add the first and the last stage's gradients on both.

        Under FSDP2 each rank adds its local shard: the two stages shard the same weight the same way over their
        dp x cp ranks, so rank j of one stage holds the rows rank j of the other holds.
        """
        if not (self.stage_module.is_first or self.is_last):
            return
        stage = self.stage_module
        weight = stage.embed_tokens.weight if stage.is_first else stage.lm_head.weight  # the one shared tensor
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        grad = weight.grad.to_local() if isinstance(weight.grad, DTensor) else weight.grad
        peer = self.num_stages - 1 if self.stage_module.is_first else 0
        mine, other = grad.detach().clone().contiguous(), torch.empty_like(grad)
        ops = [
            dist.P2POp(dist.isend, mine, group=self.pp_group, group_peer=peer),
            dist.P2POp(dist.irecv, other, group=self.pp_group, group_peer=peer),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        grad.add_(other)
