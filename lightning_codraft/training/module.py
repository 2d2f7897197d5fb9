"""CoDraftModule: a LightningModule holding the policy and the EAGLE-3 draft, trained by one joint loss.

``L = L_rl + lambda * L_draft`` with ONE backward. The draft reads only detached tensors of the policy: its tap
hidden states, its logits (the soft targets) and its embeddings of the shifted token ids; so the draft term
moves only draft parameters and the RL term only policy parameters. Both losses are token means over the
whole global batch (every dp replica and CP shard), so the same user code gives the same update on one
process or on any (dp, pp, cp) mesh.

Used from the Trainer (``trainer.fit(module, dataloader)``: manual optimisation inside ``training_step``) and
from Fabric (:func:`lightning_codraft.fabric.fabric_training_step`). One step, as data::

    batch (next-token aligned RL batch, docs/design/interfaces.md)
      -> zigzag shard over CP (cu_seqlens stays global)
      -> policy forward (taps captured, cp_group ring attention)       -> rl_loss(logprobs, batch)
      -> draft.ttt_forward(detached taps, detached shifted embeddings)  -> draft_loss(step logits, policy logits)
      -> (L_rl + lambda L_draft) * grad_average_size  -> backward  -> optimizer (2 param groups) -> schedulers

Research subclasses override :meth:`rl_loss`, :meth:`draft_loss`, :meth:`configure_taps`,
:meth:`draft_step_logits` or :meth:`draft_token_embeds`. Under pipeline parallelism (pp > 1) the step is run by
``lightning_codraft.parallel.pp_step.PipelineCoDraft``: :meth:`rl_loss` and :meth:`draft_loss` are still called
(on the last stage, per microbatch), while the draft's inputs are the pipeline's (the draft's configured taps,
shipped by the TapChannel, and the shifted embeddings rebuilt from tap 0), so the other three overrides do not
apply there.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_codraft.parallel.parallel_dims import ParallelDims
from lightning_codraft.parallel.pipeline import release_unowned
from lightning_codraft.parallel.strategy_core import (is_sharded, merge_microbatch_stats, reduce_gradients,
                                                       shard_batch, split_microbatches)
from lightning_codraft.training.rl_loss import policy_gradient_loss, token_logprobs


@dataclass
class CoDraftModuleConfig:
    """Hyper-parameters of the joint RL + draft objective and its optimiser."""

    draft_loss_weight: float = 1.0
    """lambda in ``L = L_rl + lambda * L_draft``; 0 trains the policy only (the draft is still scored)."""
    freeze_draft: bool = False
    """Keep the draft fixed (baseline: a warm-started draft that drifts away from the policy)."""
    score_draft: bool = True
    """Run the draft (without gradient) to log its accuracy when it is not trained; False skips it entirely."""
    ttt_steps: int = 3
    """K: training-time-test unroll depth of the draft loss."""
    ttt_decay: float = 0.8
    """Weight ratio between consecutive unroll steps (step k weighs decay**k)."""
    clip_eps: float = 0.2
    """PPO / GRPO lower clip range."""
    clip_eps_high: Optional[float] = None
    """Upper clip range (DAPO clip-higher); None = clip_eps."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (needs ``ref_logprobs`` in the batch when > 0)."""
    policy_lr: float = 1e-5
    """Peak learning rate of the policy parameter group."""
    draft_lr: float = 1e-4
    """Peak learning rate of the draft parameter group."""
    weight_decay: float = 0.0
    """AdamW weight decay of both groups."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    policy_warmup_steps: int = 0
    """Linear warm-up steps of the policy learning rate."""
    draft_warmup_steps: int = 0
    """Linear warm-up steps of the draft learning rate."""
    schedule: str = "constant"
    """After warm-up: ``constant`` or ``cosine`` (to 0 at ``total_steps``)."""
    total_steps: int = 0
    """Optimizer steps of the run, used by the cosine schedule (0 with ``constant``)."""
    grad_clip: Optional[float] = None
    """Clip each group's global gradient norm to this value; None = no clipping."""
    taps: Optional[tuple[int, ...]] = None
    """Policy tap ids feeding the draft; None = the draft's configured taps, else the policy's defaults."""
    num_microbatches: int = 1
    """M: each replica's batch is cut into M microbatches of whole documents; the objective is the mean over
    microbatches of the token-mean losses (the pipeline schedule's unit; set it equal on every mesh)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule under pp > 1: ``1f1b`` (needs num_microbatches >= pp) or ``gpipe``."""
    layers_per_stage: Optional[tuple[int, ...]] = None
    """Decoder layers of every pipeline stage; None balances them."""

    def __post_init__(self) -> None:
        if self.draft_loss_weight < 0:
            raise ValueError(f"draft_loss_weight (lambda)={self.draft_loss_weight} must be >= 0; "
                             f"use 0 to train the policy only")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps={self.ttt_steps} must be >= 1")
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule={self.schedule!r} must be 'constant' or 'cosine'")
        if self.schedule == "cosine" and self.total_steps < 1:
            raise ValueError(f"schedule='cosine' needs total_steps >= 1, got {self.total_steps}")
        for name in ("policy_lr", "draft_lr", "weight_decay", "kl_coef", "clip_eps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches={self.num_microbatches} must be >= 1")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be > 0 or None")

    @property
    def trains_draft(self) -> bool:
        return self.draft_loss_weight > 0 and not self.freeze_draft


@dataclass
class CoDraftStepOutput:
    """What one forward of the joint objective produced.

    Attributes:
        loss: the scalar to back-propagate on this rank (its share of the global loss, already multiplied by
            ``grad_average_size``); ``None`` when the pipeline schedule already ran the backward.
        metrics: detached global scalars for logging (same value on every rank).
        draft_counts: ``(correct (K,), total (K,))`` global per-step counts, or None when the draft did not run.
    """

    loss: Optional[Tensor]
    metrics: dict[str, Tensor] = field(default_factory=dict)
    draft_counts: Optional[tuple[Tensor, Tensor]] = None


@dataclass
class DraftObjective:
    """The draft loss as a token mean over the whole dp x cp batch.

    Attributes:
        loss: scalar whose VALUE is the global loss and whose gradient is this rank's share of its gradient.
        per_step: ``(K,)`` detached global mean soft cross-entropy per unroll step.
        correct: ``(K,)`` global count of rows whose draft top-1 equals the policy top-1.
        total: ``(K,)`` global count of scored rows.
    """

    loss: Tensor
    per_step: Tensor
    correct: Tensor
    total: Tensor


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by ``scale[0]``, a factor known only after the forward."""

    @staticmethod
    def forward(ctx, x: Tensor, scale: list) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale[0], None


def _sum_over(x: Tensor, group: Optional[Any]) -> Tensor:
    if group is None:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


class CoDraftModule(LightningModule):
    """Policy + EAGLE-3 draft with the joint objective ``L_rl + lambda * L_draft`` (one backward).

    Args:
        policy: the target model (``lightning_codraft.models.Policy`` or anything with its packed forward,
            ``embed`` and ``default_taps``).
        draft: the EAGLE-3 draft (``lightning_codraft.models.Eagle3Draft``: ``ttt_forward``, ``d2t``, ``t2d``).
        config: hyper-parameters; keyword overrides of its fields are accepted too.
    """

    def __init__(self, policy: nn.Module, draft: nn.Module, config: Optional[CoDraftModuleConfig] = None,
                 **overrides: Any):
        super().__init__()
        if not isinstance(policy, nn.Module) or not isinstance(draft, nn.Module):
            raise TypeError(f"CoDraftModule needs a policy and a draft nn.Module, got policy="
                            f"{type(policy).__name__}, draft={type(draft).__name__}")
        self.config = replace(config or CoDraftModuleConfig(), **overrides)
        self._check_vocabularies(policy, draft)
        self.policy = policy
        self.draft = draft
        self.automatic_optimization = False
        self.parallel_dims = ParallelDims()
        self.grad_average_size = 1
        if not self.config.trains_draft:
            self.draft.requires_grad_(False)
        self._step_metrics: dict[str, Tensor] = {}
        self._pipeline = None  # PipelineCoDraft under pp > 1 (set by configure_parallel)
        self._owned: set[str] = set()
        self._released_for: Optional[tuple] = None  # (pp, stage, layers_per_stage) once other stages are released
        self.released_bytes = 0
        """Bytes of parameters this rank moved to the ``meta`` device under PP (other stages' slices)."""

    @staticmethod
    def _check_vocabularies(policy: nn.Module, draft: nn.Module) -> None:
        pv = getattr(getattr(policy, "config", None), "vocab_size", None)
        dv = getattr(getattr(draft, "config", None), "vocab_size", None)
        t2d = getattr(draft, "t2d", None)
        if pv is not None and dv is not None and pv != dv:
            raise ValueError(f"mismatched vocabularies: the policy has vocab_size={pv} but the draft was built for "
                             f"vocab_size={dv}; build the draft with Eagle3Draft.from_policy(policy)")
        if pv is not None and isinstance(t2d, Tensor) and t2d.numel() != pv:
            raise ValueError(f"mismatched vocabularies: draft.t2d has {t2d.numel()} entries but the policy has "
                             f"vocab_size={pv}; rebuild the draft vocabulary mapping for this policy")

    # ------------------------------------------------------------------ parallel plumbing
    def configure_parallel(self, dims: ParallelDims, grad_average_size: int = 1) -> None:
        """Called by the strategy core with the mesh, before optimizers are built.

        Args:
            dims: the (dp, pp, cp) layout with its groups.
            grad_average_size: ranks over which a DDP wrapper AVERAGES gradients (the loss is scaled by it).

        Under PP this rank keeps only its pipeline stage in memory: the embeddings on the first stage, its
        decoder layers, the final norm, ``lm_head`` and the draft on the last (with tied embeddings the first
        and the last stage both hold the shared weight). Every other parameter is moved to the ``meta`` device
        (names stay), so optimizers and checkpoints hold this stage's slice only. The module is then bound to
        this stage: configuring it again for another stage or mesh raises.
        """
        layout = (dims.pp, dims.pp_rank, self.config.layers_per_stage) if dims.pp_enabled else None
        if self._released_for is not None and layout != self._released_for:
            pp, stage, sizes = self._released_for
            raise ValueError(f"this CoDraftModule holds only pipeline stage {stage} of pp={pp} (layers_per_stage="
                             f"{sizes}; the other parameters were released to the meta device), so it cannot be "
                             f"configured for pp={dims.pp} stage {dims.pp_rank}; build a fresh module for the new "
                             f"mesh and load a checkpoint into it")
        self.parallel_dims = dims
        self.grad_average_size = int(grad_average_size)
        self._pipeline = None
        if not dims.pp_enabled:
            return
        from lightning_codraft.parallel.pp_step import PipelineCoDraft, PipelineConfig

        c = self.config
        run_draft = c.trains_draft or c.score_draft
        draft_taps = tuple(int(t) for t in self.draft.config.taps)
        if run_draft and tuple(self.configure_taps()) != draft_taps:
            raise ValueError(f"under pp={dims.pp} the pipeline ships the draft's own taps {draft_taps} through the "
                             f"TapChannel, but configure_taps() returns {tuple(self.configure_taps())}; build the "
                             f"draft with Eagle3Draft.from_policy(policy, taps=...) instead of overriding the taps")
        self._pipeline = PipelineCoDraft(
            self.policy, self.draft if (dims.is_last_stage and run_draft) else None, stage=dims.pp_rank,
            num_stages=dims.pp, pp_group=dims.pp_group, tap_group=dims.tap_group, cp_group=dims.cp_group,
            loss_group=dims.dp_cp_group, rl_loss_fn=self._pipeline_rl_loss, draft_loss_fn=self._pipeline_draft_loss,
            config=PipelineConfig(schedule=c.pp_schedule, layers_per_stage=c.layers_per_stage, ttt_steps=c.ttt_steps,
                                  draft_weight=c.draft_loss_weight if c.trains_draft else 0.0,
                                  draft_decay=c.ttt_decay))
        owned = {id(p) for p in self._pipeline.parameters()}
        for p in self.parameters():
            if id(p) not in owned:
                p.requires_grad_(False)
        if not c.trains_draft:
            self.draft.requires_grad_(False)
        self._owned = {n for n, p in self.named_parameters(remove_duplicate=False) if id(p) in owned}
        self.released_bytes += release_unowned(self, self._pipeline.parameters())
        self._released_for = layout

    def _apply(self, fn, recurse: bool = True):
        """``.to()`` / ``.cpu()`` / ``.half()``: parameters released to ``meta`` stay there (only their dtype
        follows), the materialised ones move as usual (Lightning moves the module to the CPU at teardown)."""
        if self._released_for is None:
            return super()._apply(fn, recurse)
        slots = [(m, n, p) for m in self.modules() for n, p in m._parameters.items() if p is not None and p.is_meta]
        for m, n, _ in slots:
            m._parameters[n] = None  # nn.Module._apply skips None entries
        try:
            out = super()._apply(fn, recurse)
        finally:
            renewed: dict[int, nn.Parameter] = {}
            for m, n, p in slots:
                if id(p) not in renewed:
                    dtype = fn(torch.empty(0, dtype=p.dtype)).dtype
                    renewed[id(p)] = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=False)
                m._parameters[n] = renewed[id(p)]
        return out

    def owned_state_dict(self) -> dict[str, Tensor]:
        """The state this rank is responsible for: everything without PP, this stage's slice under PP."""
        sd = self.state_dict()
        if self._pipeline is None:
            return sd
        params = {n for n, _ in self.named_parameters(remove_duplicate=False)}
        keep_draft_buffers = self.parallel_dims.is_last_stage
        return {k: v for k, v in sd.items()
                if k in self._owned or (k not in params and (keep_draft_buffers or not k.startswith("draft.")))}

    def full_state_dicts(self) -> tuple[Optional[dict[str, Tensor]], Optional[dict[str, Tensor]]]:
        """Full HF-named ``(policy_state, draft_state)`` for a rollout engine; a collective under PP.

        Without PP every rank holds everything and gets both dicts. Under PP each rank holds only its stage, so
        the owned slices are gathered over the pipeline group to its first stage (``pp_rank == 0``), which
        gets the full dicts; the other stages get ``(None, None)``. Call on every rank. ``draft_state`` is
        None when the module has no draft.
        """
        dims = self.parallel_dims
        own = {k: v.detach() for k, v in self.owned_state_dict().items()}
        if self._pipeline is not None and dims.pp > 1:
            parts: Optional[list] = [None] * dims.pp if dims.pp_rank == 0 else None
            dist.gather_object(own, parts, group=dims.pp_group, group_dst=0)
            if dims.pp_rank != 0:
                return None, None
            own = {k: v for part in parts for k, v in part.items()}
        policy = {k[len("policy."):]: v for k, v in own.items() if k.startswith("policy.")}
        draft = {k[len("draft."):]: v for k, v in own.items() if k.startswith("draft.")}
        return policy, (draft if self.draft is not None else None)

    # ------------------------------------------------------------------ override points
    def configure_taps(self) -> tuple[int, ...]:
        """Policy tap ids feeding the draft (``tap l`` = hidden state entering layer ``l``)."""
        if self.config.taps is not None:
            return tuple(self.config.taps)
        draft_taps = getattr(getattr(self.draft, "config", None), "taps", None)
        if draft_taps:
            return tuple(draft_taps)
        return tuple(self.policy.default_taps)

    def rl_loss(self, logprobs: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """RL loss of this rank's rows: PPO / GRPO clipped surrogate, token mean over the dp x cp batch.

        Args:
            logprobs: ``(T,)`` log-prob of ``batch["target_ids"]`` under the current policy (differentiable).
            batch: this rank's (sharded) RL batch.

        Returns:
            ``(loss, stats)``: loss = this rank's share (the sum over dp x cp is the global mean).
        """
        c = self.config
        return policy_gradient_loss(
            logprobs, batch["old_logprobs"], batch["advantages"], batch["loss_mask"], clip_eps=c.clip_eps,
            clip_eps_high=c.clip_eps_high, ref_logprobs=batch.get("ref_logprobs"), kl_coef=c.kl_coef,
            group=self.parallel_dims.dp_cp_group)

    def draft_token_embeds(self, batch: dict[str, Tensor]) -> list[Tensor]:
        """Detached policy embeddings of the ids shifted left by ``k + 1`` within each document, k < K.

        Returns:
            K tensors ``(T, H)`` of this rank's rows: entry k embeds ``x_{i+1+k}`` for row ``i``.
        """
        cp_group = self.parallel_dims.cp_group
        ids = batch["input_ids"]
        out = []
        with torch.no_grad():
            for k in range(self.config.ttt_steps):
                if cp_group is None:
                    from lightning_codraft.attention.packing import shift_left_local

                    shifted = shift_left_local(ids, batch["cu_seqlens"], k + 1, fill=0)
                else:
                    from lightning_codraft.attention import shift_left

                    shifted = shift_left(ids, batch["cu_seqlens"], k + 1, group=cp_group, fill=0)
                out.append(self.policy.embed(shifted).detach())
        return out

    def draft_step_logits(self, taps: Sequence[Tensor], batch: dict[str, Tensor]) -> list[Tensor]:
        """Run the draft's K training-time-test steps on detached policy features.

        Args:
            taps: the policy's hidden states at :meth:`configure_taps`, each ``(T, H)``, detached.
            batch: this rank's (sharded) RL batch.

        Returns:
            K tensors ``(T, Vd)``: the draft logits of each unroll step.
        """
        embeds = self.draft_token_embeds(batch)
        steps = self.draft.ttt_forward(list(taps), embeds, batch["cu_seqlens"], batch["position_ids"],
                                       cp_group=self.parallel_dims.cp_group)
        return [logits for logits, _ in steps]

    def draft_loss(self, step_logits: Sequence[Tensor], policy_logits: Tensor, batch: dict[str, Tensor]):
        """Draft TTT loss: soft cross-entropy of each step against the detached policy (EAGLE-3).

        Args:
            step_logits: K tensors ``(T, Vd)`` from :meth:`draft_step_logits`.
            policy_logits: ``(T, V)`` detached policy logits (the soft targets).
            batch: this rank's (sharded) RL batch.

        Returns:
            ``lightning_codraft.training.draft_loss.DraftLossOutput`` reduced over the CP group.
        """
        from lightning_codraft.training.draft_loss import ttt_draft_loss

        mask = batch.get("draft_mask")
        if mask is None:
            mask = batch["valid"].float()
        return ttt_draft_loss(list(step_logits), policy_logits, batch["cu_seqlens"], mask, self.draft.d2t,
                              self.draft.t2d, decay=self.config.ttt_decay, group=self.parallel_dims.cp_group)

    # ------------------------------------------------------------------ the joint objective
    def forward(self, batch: dict[str, Tensor]) -> CoDraftStepOutput:
        """Compute the joint loss of one RL batch of this dp replica (under PP: run the pipelined step).

        Args:
            batch: the next-token aligned RL batch; per-token tensors ``(T,)`` of this dp replica (cut into
                ``num_microbatches`` and zigzag-sharded here when the mesh has cp > 1) and the GLOBAL
                ``cu_seqlens``.

        Returns:
            :class:`CoDraftStepOutput`; its ``loss`` is ready for ``backward`` (``None`` under PP, where the
            schedule already ran the backward).
        """
        dims = self.parallel_dims
        M = self.config.num_microbatches
        if self._pipeline is not None:
            return self._pipeline_forward(batch)
        if is_sharded(batch, dims):
            if M != 1:
                raise ValueError(f"a batch already sharded over cp cannot be cut into num_microbatches={M}; "
                                 f"pass the replica's whole batch")
            microbatches = [batch]
        else:
            microbatches = [shard_batch(mb, dims) for mb in split_microbatches(batch, M)]
        outs = [self._microbatch_objective(mb) for mb in microbatches]
        loss = sum(o[0] for o in outs) / M
        metrics = merge_microbatch_stats([o[1] for o in outs])
        counts = None
        if outs[0][2] is not None:
            counts = (sum(o[2][0] for o in outs), sum(o[2][1] for o in outs))
            self._count_metrics(metrics, *counts)
        return CoDraftStepOutput(loss=loss * self.grad_average_size, metrics=metrics, draft_counts=counts)

    def _microbatch_objective(self, batch):
        c = self.config
        dims = self.parallel_dims
        run_draft = c.trains_draft or c.score_draft
        out = self.policy(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], position_ids=batch["position_ids"],
                          taps=self.configure_taps() if run_draft else None, cp_group=dims.cp_group)
        logprobs = token_logprobs(out.logits, batch["target_ids"])
        rl, rl_stats = self.rl_loss(logprobs, batch)
        metrics = {f"policy/{k}": v.detach() for k, v in rl_stats.items()}
        total_value = rl_stats["loss"].detach()
        loss, counts = rl, None
        if run_draft:
            with torch.set_grad_enabled(c.trains_draft and torch.is_grad_enabled()):
                step_logits = self.draft_step_logits([t.detach() for t in out.taps], batch)
                d = self._draft_objective(step_logits, out.logits.detach(), batch)
            metrics["draft/loss"] = d.loss.detach().float()
            for k in range(d.per_step.numel()):
                metrics[f"draft/loss_step{k}"] = d.per_step[k]
            counts = (d.correct, d.total)
            if c.trains_draft:
                loss = loss + c.draft_loss_weight * d.loss
                total_value = total_value + c.draft_loss_weight * d.loss.detach()
        metrics["loss"] = total_value
        return loss, metrics, counts

    @staticmethod
    def _count_metrics(metrics: dict, correct: Tensor, total: Tensor) -> None:
        acc = correct.float() / total.float().clamp(min=1)
        for k in range(acc.numel()):
            metrics[f"draft/acc_step{k}"] = acc[k]
        metrics["draft/acceptance_length"] = 1 + torch.cumprod(acc, 0).sum()

    def _draft_objective(self, step_logits: Sequence[Tensor], policy_logits: Tensor, batch) -> DraftObjective:
        """:meth:`draft_loss` (a token mean over the CP group) made a token mean over dp x cp.

        Each step's gradient is rescaled in the backward by ``total_cp[k] / total_global[k]``, a factor known
        only once the dp all-reduce of the counts ran; the value is the global per-step mean, weighted.
        """
        K = len(step_logits)
        scales = [[1.0] for _ in range(K)]  # filled below, read by the backward
        step_logits = [_ScaleGrad.apply(lg, scales[k]) if lg.requires_grad else lg
                       for k, lg in enumerate(step_logits)]
        out = self.draft_loss(step_logits, policy_logits, batch)
        total_cp = out.total.to(torch.float64)
        num_cp = out.per_step_loss.to(torch.float64) * total_cp.clamp(min=1)
        packed = _sum_over(torch.stack([num_cp, total_cp, out.correct.to(torch.float64)]),
                           self.parallel_dims.dp_group)
        num, total, correct = packed[0], packed[1], packed[2]
        for k in range(K):
            scales[k][0] = float(total_cp[k].clamp(min=1) / total[k].clamp(min=1))
        per_step = (num / total.clamp(min=1)).float()
        weights = self.config.ttt_decay ** torch.arange(K, dtype=torch.float32)
        value = (weights * per_step).sum()
        local = out.loss + (value.to(out.loss) - out.loss).detach()
        return DraftObjective(loss=local, per_step=per_step, correct=correct.float(), total=total.float())

    # ----- the pipelined step (pp > 1): the schedule calls these on the last stage, per microbatch
    def _pipeline_rl_loss(self, logprobs, old_logprobs, advantages, loss_mask, ref_logprobs=None, group=None):
        batch = {"old_logprobs": old_logprobs, "advantages": advantages, "loss_mask": loss_mask}
        if ref_logprobs is not None:
            batch["ref_logprobs"] = ref_logprobs
        return self.rl_loss(logprobs, batch)

    def _pipeline_draft_loss(self, step_logits, policy_logits, cu_seqlens, loss_mask, d2t, t2d, decay=0.8,
                             group=None) -> DraftObjective:
        return self._draft_objective(step_logits, policy_logits, {"cu_seqlens": cu_seqlens, "draft_mask": loss_mask})

    def _pipeline_forward(self, batch) -> CoDraftStepOutput:
        from lightning_codraft.parallel.pp_step import pad_microbatches

        dims = self.parallel_dims
        if is_sharded(batch, dims):
            raise ValueError("under pp > 1 pass the replica's whole batch: it is cut into microbatches, padded to "
                             "one length and sharded over cp here")
        mbs = pad_microbatches(split_microbatches(batch, self.config.num_microbatches), multiple_of=2 * dims.cp)
        out = self._pipeline.step([shard_batch(mb, dims) for mb in mbs])
        metrics = {**{f"policy/{k}": v for k, v in out.rl_stats.items()}, "loss": out.loss, "policy/loss": out.rl_loss}
        c = self.config
        counts = None
        if c.trains_draft or c.score_draft:
            metrics["draft/loss"] = out.draft_loss
            counts = (out.draft_correct, out.draft_total)
            self._count_metrics(metrics, *counts)
            if not c.trains_draft:
                metrics["loss"] = out.rl_loss
        return CoDraftStepOutput(loss=None, metrics=metrics, draft_counts=counts)

    # ------------------------------------------------------------------ optimisation
    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups: ``policy`` and (when trained) ``draft``, each with its own LR."""
        c = self.config
        groups = [{"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad],
                   "lr": c.policy_lr}]
        if c.trains_draft:
            groups.append({"name": "draft", "params": [p for p in self.draft.parameters() if p.requires_grad],
                           "lr": c.draft_lr})
        return groups

    def lr_lambda(self, group_name: str):
        """The schedule multiplier of group ``group_name`` as a function of the optimizer step."""
        c = self.config
        warmup = c.policy_warmup_steps if group_name == "policy" else c.draft_warmup_steps

        def fn(step: int) -> float:
            if warmup > 0 and step < warmup:
                return (step + 1) / warmup
            if c.schedule == "cosine":
                progress = min(1.0, (step - warmup) / max(1, c.total_steps - warmup))
                return 0.5 * (1.0 + math.cos(math.pi * progress))
            return 1.0

        return fn

    def build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """One AdamW with two parameter groups (policy, draft) and one LambdaLR with a schedule per group.

        Call after the strategy set the module up, so that under PP only this stage's parameters are held.
        """
        c = self.config
        groups = self.param_groups()
        optimizer = torch.optim.AdamW(groups, betas=c.betas, eps=c.adam_eps, weight_decay=c.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [self.lr_lambda(g["name"]) for g in groups])
        return optimizer, scheduler

    def configure_optimizers(self):
        """Trainer hook: :meth:`build_optimizer`, the scheduler stepped every optimizer step."""
        optimizer, scheduler = self.build_optimizer()
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def after_backward(self) -> dict[str, Tensor]:
        """Finish the gradients (PP reduction over dp x cp), clip, and return ``grad_norm/{policy,draft}``."""
        dims = self.parallel_dims
        if dims.pp_enabled:
            reduce_gradients([p for p in self.parameters() if p.requires_grad], dims.dp_cp_group)
        out = {}
        for name, module in (("policy", self.policy), ("draft", self.draft)):
            if name == "draft" and not self.config.trains_draft:
                continue
            grads = [p.grad for p in module.parameters() if p.grad is not None and p.requires_grad]
            sq = torch.zeros((), dtype=torch.float32)
            for g in grads:
                sq = sq + g.detach().float().pow(2).sum()
            norm = _sum_over(sq, dims.pp_group).sqrt()  # every stage joins, with or without a slice of `module`
            if self.config.grad_clip is not None:
                coef = (self.config.grad_clip / (norm + 1e-6)).clamp(max=1.0)
                for g in grads:
                    g.mul_(coef.to(g.dtype))
            out[f"grad_norm/{name}"] = norm
        return out

    def training_step(self, batch: dict[str, Tensor], batch_idx: int = 0) -> Tensor:
        """Trainer path (manual optimisation): joint loss, one backward, optimizer and scheduler step."""
        optimizer = self.optimizers()
        scheduler = self.lr_schedulers()
        optimizer.zero_grad(set_to_none=True)
        out = self(batch)
        if out.loss is not None:
            self.manual_backward(out.loss)
        metrics = {**out.metrics, **self.after_backward()}
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        self.log_dict({k: v.float() for k, v in metrics.items()}, on_step=True, prog_bar=False, logger=True,
                      batch_size=1, sync_dist=False)
        self._step_metrics = metrics
        return metrics["loss"]

    def state_for_checkpoint(self) -> dict[str, Any]:
        """Hyper-parameters recorded next to the weights."""
        return {"config": asdict(self.config)}
