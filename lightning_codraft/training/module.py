"""CoDraftModule: a LightningModule holding the policy and the EAGLE-3 draft, trained by one joint loss.

``L = L_rl + lambda * L_draft`` with ONE backward. The draft reads only detached tensors of the policy: its tap
hidden states, its logits (the soft targets) and its token embeddings (tap 0) of the shifted ids; so the draft term
moves only draft parameters and the RL term only policy parameters. Both losses divide by the whole step's global counts
(every microbatch, dp replica and CP shard: ``training.normalize.normalize_step``), so the same user code gives the same
update on one process or on any (dp, pp, cp) mesh and any ``num_microbatches``. One step, as data::

    RLBatch (whole replica batch)  -> split into M microbatches -> [PP: padded to one length] -> zigzag shard
      -> policy forward (ring attention; taps 0 + the draft's)   [PP: the pipeline stages; TapChannel]
      -> objective(logits, taps, microbatch):  rl_loss + lambda * draft_loss   <- one function, every schedule
      -> backward -> after_backward (PP gradient reduction, norms, clipping) -> optimizer (2 groups) -> schedulers

Research subclasses override :meth:`rl_loss`, :meth:`draft_loss`, :meth:`configure_taps`,
:meth:`draft_token_embeds` or :meth:`draft_step_logits`; :meth:`objective` calls them on a single stage and on the
pipeline's last stage alike. The optimizer and schedule come from :meth:`build_optimizer` (training/module_optim.py);
the optimizer step is ``training.step.optimizer_step``, shared with Fabric.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, Optional

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_codraft.batch import RLBatch
from lightning_codraft.models.vocab import check_vocabularies
from lightning_codraft.parallel.parallel_dims import ParallelDims
from lightning_codraft.parallel.pp_runner import PipelineRunner
from lightning_codraft.training import dflash_term, dspark_term  # noqa: F401  (register the block drafters' terms)
from lightning_codraft.training.config import CoDraftModuleConfig
from lightning_codraft.training.draft_loss import DraftLossOutput, ttt_draft_loss
from lightning_codraft.training.drafter import DraftTerm, draft_term_for
from lightning_codraft.training.implied import ReferenceDraft
from lightning_codraft.training.metrics import check_metric_names
from lightning_codraft.training.module_optim import OptimizationHooks
from lightning_codraft.training.module_parallel import ParallelHooks
from lightning_codraft.training.normalize import doc_index, normalize_step
from lightning_codraft.training.objective import CoDraftStepOutput, MicrobatchRecord, step_metrics, unroll_weights
from lightning_codraft.training.off_policy import correction_stats, importance_weights
from lightning_codraft.training.rl_loss import greedy_agreement, policy_gradient_loss, token_logprobs
from lightning_codraft.training.step import NonFiniteGuard, optimizer_step

PROGRESS_BAR = ("loss", "draft/top1_acceptance")
"""The metrics ``training_step`` shows in Lightning's progress bar (the joint loss, the draft's implied acceptance
length on the step's batch)."""


class CoDraftModule(OptimizationHooks, ParallelHooks, LightningModule):
    """Policy + EAGLE-3 draft with the joint objective ``L_rl + lambda * L_draft`` (one backward).

    Args:
        policy: the target model (``lightning_codraft.models.Policy`` or anything with its packed forward,
            ``num_layers`` and ``default_taps``).
        draft: the EAGLE-3 draft (``lightning_codraft.models.Eagle3Draft``: ``ttt_forward``, ``d2t``, ``t2d``).
        config: hyper-parameters; keyword overrides of its fields are accepted too.
        reference: a frozen reference policy for the KL term (``kl_coef > 0``), e.g. a copy of the initial policy;
            the strategy shards it like the policy, and its log-probs are computed here for batches that do not
            carry ``ref_logprobs``. None: batches must carry them when ``kl_coef > 0``.
        draft_term: the drafter's part of the objective (training/drafter.py); None: the one registered for the
            draft's class (EAGLE-3's, DFlash's).
    """

    def __init__(
        self,
        policy: nn.Module,
        draft: nn.Module,
        config: Optional[CoDraftModuleConfig] = None,
        *,
        reference: Optional[nn.Module] = None,
        draft_term: Optional[DraftTerm] = None,
        **overrides: Any,
    ):
        super().__init__()
        if not isinstance(policy, nn.Module) or not isinstance(draft, nn.Module):
            raise TypeError(
                f"CoDraftModule needs a policy and a draft nn.Module, got policy="
                f"{type(policy).__name__}, draft={type(draft).__name__}"
            )
        renamed = {"policy_warmup_steps": "policy_lr_warmup_steps", "draft_warmup_steps": "draft_lr_warmup_steps"}
        for old in set(overrides) & set(renamed):  # "warm-up" alone names the SFT and draft phases before RL
            raise TypeError(f"CoDraftModule({old}=...) is now {renamed[old]} (the learning rate's warm-up)")
        self.config = replace(config or CoDraftModuleConfig(), **overrides)
        check_vocabularies(policy, draft)
        self.policy = policy
        self.draft = draft
        self.draft_term: DraftTerm = draft_term if draft_term is not None else draft_term_for(draft)
        """The drafter's part of the objective (training/drafter.py)."""
        self.reference = None if reference is None else reference.requires_grad_(False).eval()
        self.automatic_optimization = False
        self.parallel_dims = ParallelDims()
        self.grad_average_size = 1
        """Ranks over which the strategy's wrapper AVERAGES gradients; the loss is scaled by it."""
        self.sharding = "ddp"
        """How the strategy shards the module over dp x cp: ``"fsdp"`` (FSDP2 reduces the gradients) or ``"ddp"``."""
        self.pipeline: Optional[PipelineRunner] = None
        """This rank's pipeline stage runner under pp > 1 (set by :meth:`configure_parallel`)."""
        self.ref_pipeline: Optional[PipelineRunner] = None
        """The reference policy's pipeline stage runner under pp > 1 (forward only)."""
        self.released_bytes = 0
        """Bytes of parameters this rank dropped under PP (the other stages' slices)."""
        self.train_draft_this_step = True
        """False skips the draft's update in the coming optimizer step (its loss is still scored; its gradients are
        dropped, so AdamW leaves the draft and its moments untouched). Set both flags alike on every rank."""
        self.run_draft_this_step = self.score_reference_this_step = True
        """False runs no draft at all this step (the adaptive schedule's off steps), resp. no A/B reference either
        (its idle steps)."""
        self.reference_draft: Optional[ReferenceDraft] = None
        """The A/B's frozen reference draft (:meth:`set_reference_draft`), scored beside the draft on every batch."""
        self.live_position_rates: Optional[Tensor] = None
        """``(K,)`` the draft's implied acceptance rate per position, last step it ran (``acceptance`` weights)."""
        self.stage_mask_embedding: Optional[Tensor] = None
        """Under PP, on the last stage: the policy's embedding of a block drafter's mask token, this step's."""
        self._stage_binding: Optional[tuple] = None  # (pp, stage, layers_per_stage) once pruned to a stage
        self.nonfinite_guard = NonFiniteGuard(self.config.max_nonfinite_steps)
        """Skips steps with a non-finite loss or gradient; stops after ``max_nonfinite_steps`` in a row."""
        if not self.config.trains_draft:
            self.draft.requires_grad_(False)

    # ---------------------------------------------- the step, in call order: forward -> microbatches -> objective
    def forward(self, batch: RLBatch | Mapping[str, Tensor]) -> CoDraftStepOutput:
        """The joint loss of one RL batch of this dp replica (under PP: the whole pipelined forward + backward).

        Args:
            batch: this dp replica's whole :class:`~lightning_codraft.batch.RLBatch` (or its dict layout); it is
                cut into ``num_microbatches`` and zigzag-sharded here when the mesh has cp > 1.

        Returns:
            :class:`CoDraftStepOutput`; its ``loss`` is ready for ``backward`` (``None`` under PP, where the
            schedule already ran the backward).
        """
        microbatches = self._with_reference(self._microbatches(self.normalize(RLBatch.coerce(batch))))
        loss = None
        if self.pipeline is not None:
            if self.draft_term.mask_token_id is not None and self.config.runs_draft:
                self.share_mask_embedding()
            records = self.pipeline.step(microbatches, self.objective)
        else:
            taps, records, losses = self._tap_ids(), [], []
            for mb in microbatches:
                out = self.policy(
                    mb.input_ids,
                    cu_seqlens=mb.cu_seqlens,
                    position_ids=mb.position_ids,
                    taps=taps,
                    cp_group=self.parallel_dims.cp_group,
                )
                mb_loss, record = self.objective(out.logits, dict(zip(taps or (), out.taps or ())), mb)
                losses.append(mb_loss)
                records.append(record)
            loss = sum(losses) * self.grad_average_size  # each microbatch's loss is its share of the step
        metrics, counts = step_metrics(records)
        if "draft/implied_rate0" in metrics:
            K = self.draft_term.num_positions(self)
            self.set_live_position_rates([metrics[f"draft/implied_rate{k}"] for k in range(K)])
        return CoDraftStepOutput(
            loss=loss,
            metrics=metrics,
            draft_counts=counts,
            microbatch_losses=[float(r.metrics["loss"]) for r in records],
        )

    def normalize(self, batch: RLBatch) -> RLBatch:
        """The replica's batch with the step's global loss weights and denominators (``RLBatch.loss_weight``,
        ``RLBatch.norm``), one all-reduce over dp: ``training.normalize.normalize_step``. Every rank calls it.
        A whole batch first gets what the drafter's loss needs (:meth:`DraftTerm.prepare`: a block drafter's
        anchors)."""
        c, dims, term = self.config, self.parallel_dims, self.draft_term
        if not batch.is_sharded:
            batch = term.prepare(self, batch)
        return normalize_step(
            batch,
            c.loss_aggregation,
            term.num_positions(self),
            max_new_tokens=c.max_new_tokens,
            dp_group=dims.dp_group,
            cp_group=dims.cp_group,
            scored_rows=partial(term.scored_rows, self),
        )

    def _microbatches(self, batch: RLBatch) -> list[RLBatch]:
        """This rank's microbatches: ``num_microbatches`` of whole documents (one length under PP), CP-sharded."""
        dims, M = self.parallel_dims, self.config.num_microbatches
        if batch.is_sharded:
            if M != 1 or self.pipeline is not None:
                raise ValueError(
                    f"a batch already sharded over cp cannot be cut into num_microbatches={M} or "
                    f"pipelined; pass the replica's whole batch"
                )
            return [batch]
        mbs = batch.split(M)
        if self.pipeline is not None:  # fixed-shape pipeline activations: pad to one multiple of 2*cp
            m = 2 * dims.cp
            length = -(-max(mb.num_tokens for mb in mbs) // m) * m
            mbs = [mb.pad_to(length) for mb in mbs]
        return [mb.shard(dims.cp_rank, dims.cp) for mb in mbs]

    def _with_reference(self, microbatches: list[RLBatch]) -> list[RLBatch]:
        """Fill ``ref_logprobs`` (and, when tracking drift, ``ref_greedy``) from the reference policy where the KL
        term or the drift metrics need them and the batch has none."""
        c, drift = self.config, self.config.track_drift
        if c.kl_coef <= 0 and not drift:
            return microbatches
        if all(mb.ref_logprobs is not None and (mb.ref_greedy is not None or not drift) for mb in microbatches):
            return microbatches
        if self.reference is None:
            need = f"kl_coef={c.kl_coef} > 0" if c.kl_coef > 0 else "track_drift=True"
            raise ValueError(
                f"{need} needs batch.ref_logprobs or a reference policy: "
                f"CoDraftModule(policy, draft, ..., reference=copy.deepcopy(policy))"
            )

        def scored(logits: Tensor, mb: RLBatch) -> Tensor:  # (T, 2): the target's log-prob, the argmax id
            return torch.stack([self.sampled_logprobs(logits, mb.target_ids).float(), logits.argmax(-1).float()], -1)

        if self.ref_pipeline is not None:  # the last stage reduces each microbatch's logits as they come out
            rows = self.ref_pipeline.forward(microbatches, reduce=(scored, 2)) or [None] * len(microbatches)
        else:
            rows = []
            with torch.no_grad():
                for mb in microbatches:  # one microbatch's logits alive at a time
                    rows.append(
                        scored(
                            self.reference(
                                mb.input_ids,
                                cu_seqlens=mb.cu_seqlens,
                                position_ids=mb.position_ids,
                                cp_group=self.parallel_dims.cp_group,
                            ).logits,
                            mb,
                        )
                    )
        return [
            mb
            if r is None
            else replace(mb, ref_logprobs=r[:, 0] * mb.loss_mask, ref_greedy=r[:, 1].long() if drift else mb.ref_greedy)
            for mb, r in zip(microbatches, rows)
        ]

    def _tap_ids(self) -> Optional[tuple[int, ...]]:
        """Taps the objective reads: 0 (the token embeddings) and the drafter's (:meth:`configure_taps` for
        EAGLE-3); None without a draft."""
        return (0, *self.draft_term.taps(self)) if self.config.runs_draft else None

    def objective(self, logits: Tensor, taps: Mapping[int, Tensor], batch: RLBatch) -> tuple[Tensor, MicrobatchRecord]:
        """One microbatch's ``L_rl + lambda * L_draft``: the function every schedule calls.

        Args:
            logits: ``(T, V)`` policy logits of this rank's rows.
            taps: tap id -> ``(T, H)`` policy hidden states; holds 0 and :meth:`configure_taps` when the draft runs.
            batch: this rank's microbatch.

        Returns:
            ``(loss, record)``: ``loss`` is this rank's share of the step's objective that this microbatch carries
            (differentiable; the shares of every microbatch and rank add up to the step's objective); ``record``
            its detached global statistics, shares too. A batch without ``norm`` is normalised as a whole step.
        """
        c = self.config
        if batch.norm is None:
            batch = self.normalize(batch)
        rl, rl_stats = self.rl_loss(self.sampled_logprobs(logits, batch.target_ids), batch)
        metrics = {f"policy/{k}": v.detach() for k, v in rl_stats.items()}
        if batch.ref_greedy is not None:
            metrics["drift/greedy_agreement"] = greedy_agreement(
                logits.detach(), batch.ref_greedy, batch.loss_mask, self.parallel_dims.dp_cp_group, batch.norm.tokens
            )
        value, loss = rl_stats["loss"].detach(), rl
        run = c.runs_draft and self.run_draft_this_step
        reference = self.reference_draft if self.score_reference_this_step else None
        if not run and reference is None:
            metrics["loss"] = value
            return loss, MicrobatchRecord(metrics)
        if c.sample_every > 1:  # the draft's share of the step: every n-th sample (whole documents, any CP shard)
            batch, rows = batch.every_nth_document(c.sample_every)
            logits, taps = logits[rows], {t: x[rows] for t, x in taps.items()}
        term, record = self.draft_term, MicrobatchRecord(metrics)
        inputs = term.inputs(self, taps, batch)
        if reference is not None:  # the A/B: the frozen reference on the same policy features
            record.reference_implied = term.reference_implied(self, reference, inputs, logits, batch)
        if run:
            with torch.set_grad_enabled(c.trains_draft and torch.is_grad_enabled()):
                d, record.implied = term.objective(self, inputs, logits, batch)
            record.draft_correct, record.draft_total, record.draft_in_vocab = d.correct, d.total, d.in_vocab
            metrics["draft/loss"] = d.loss.detach().float()
            metrics.update({f"draft/loss_step{k}": d.per_step[k] for k in range(d.per_step.numel())})
            metrics.update({f"draft/{name}": v for name, v in d.extras.items()})
            if c.trains_draft:
                loss = loss + c.draft_loss_weight * d.loss
                value = value + c.draft_loss_weight * d.loss.detach()
        metrics["loss"] = value
        return loss, record

    # ------------------------------------------------------------------ override points and the draft's live state
    def configure_taps(self) -> tuple[int, ...]:
        """Policy tap ids feeding the draft (``tap l`` = hidden state entering layer ``l``)."""
        if self.config.taps is not None:
            return tuple(self.config.taps)
        draft_taps = getattr(getattr(self.draft, "config", None), "taps", None)
        if draft_taps:
            return tuple(draft_taps)
        return tuple(self.policy.default_taps)

    def sampled_logprobs(self, logits: Tensor, target_ids: Tensor) -> Tensor:
        """``(T,)`` log-probs of ``target_ids`` under the rollouts' sampling distribution ``softmax(logits / T)``."""
        t = self.config.temperature
        return token_logprobs(logits if t in (0.0, 1.0) else logits / t, target_ids)

    def rl_loss(self, logprobs: Tensor, batch: RLBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """RL loss of this rank's rows: PPO / GRPO clipped surrogate weighted by ``batch.loss_weight``.

        Args:
            logprobs: ``(T,)`` log-prob of ``batch.target_ids`` under the current policy (differentiable).
            batch: this rank's microbatch (its zigzag shard under CP).

        Returns:
            ``(loss, stats)``: loss = this rank's share of the step's objective (the sum over dp x cp ranks and
            microbatches is the objective); stats are this microbatch's global shares of the step's values.
        """
        c, tokens = self.config, None if batch.norm is None else max(batch.norm.tokens, 1.0)
        old, iw = batch.old_logprobs, None
        if c.off_policy is not None:  # decoupled: the ratio against the proximal policy (this step's weights)
            old = logprobs.detach()
            iw = importance_weights(
                old,
                batch.old_logprobs,
                batch.loss_mask,
                doc_index(batch),
                batch.num_docs,
                c.off_policy,
                self.parallel_dims.cp_group,
            )
        loss, stats = policy_gradient_loss(
            logprobs,
            old,
            batch.advantages,
            batch.loss_mask,
            clip_eps=c.clip_eps,
            clip_eps_high=c.clip_eps_high,
            ref_logprobs=batch.ref_logprobs,
            kl_coef=c.kl_coef,
            num_tokens=tokens,
            group=self.parallel_dims.dp_cp_group,
            loss_weight=batch.loss_weight,
            dual_clip=c.dual_clip,
            is_weight=None if iw is None else iw.weight,
        )
        if iw is not None:
            group = self.parallel_dims.dp_cp_group
            stats.update(correction_stats(iw, logprobs, batch.old_logprobs, batch.loss_mask, tokens, group))
        return loss, stats

    def draft_token_embeds(self, embeds: Tensor, batch: RLBatch) -> list[Tensor]:
        """The draft's token inputs: the policy's embeddings shifted left by ``k + 1`` within documents, k < K.

        Args:
            embeds: ``(T, H)`` detached policy embeddings of this rank's rows (tap 0).
            batch: this rank's microbatch.

        Returns:
            K tensors ``(T, H)``: entry k holds the embedding of ``x_{i+1+k}`` at row ``i`` (0 past the document).
        """
        group = self.parallel_dims.cp_group
        return [batch.shift_left(embeds, k + 1, group=group) for k in range(self.config.ttt_steps)]

    def draft_step_logits(self, taps: Sequence[Tensor], token_embeds: Sequence[Tensor], batch: RLBatch) -> list[Tensor]:
        """Run the draft's K training-time-test steps on detached policy features.

        Args:
            taps: the policy's hidden states at :meth:`configure_taps`, each ``(T, H)``, detached.
            token_embeds: K tensors ``(T, H)`` from :meth:`draft_token_embeds`.
            batch: this rank's microbatch.

        Returns:
            K tensors ``(T, Vd)``: the draft logits of each unroll step.
        """
        steps = self.draft.ttt_forward(
            list(taps), list(token_embeds), batch.cu_seqlens, batch.position_ids, cp_group=self.parallel_dims.cp_group
        )
        return [logits for logits, _ in steps]

    def draft_loss(self, step_logits: Sequence[Tensor], policy_logits: Tensor, batch: RLBatch) -> DraftLossOutput:
        """Draft TTT loss: soft cross-entropy of each step against the detached policy (EAGLE-3), over CP.

        Args:
            step_logits: K tensors ``(T, Vd)`` from :meth:`draft_step_logits`.
            policy_logits: ``(T, V)`` detached policy logits (the soft targets).
            batch: this rank's microbatch (``batch.norm.draft``: the step's scored rows, each step's divisor; without
                ``norm`` the batch's own).
        """
        c = self.config
        return ttt_draft_loss(
            list(step_logits),
            policy_logits,
            batch.cu_seqlens,
            batch.draft_targets,
            self.draft.d2t,
            self.draft.t2d,
            decay=c.ttt_decay,
            group=self.parallel_dims.cp_group,
            denominators=None if batch.norm is None else batch.norm.draft,
            loss_type=c.loss_type,
            step_weights=self.draft_step_weights(),
        )

    def draft_step_weights(self) -> Tensor:
        """``(K,)`` weight of each unroll step in the draft loss (``config.position_weights``)."""
        return unroll_weights(
            self.config.position_weights, self.config.ttt_decay, self.config.ttt_steps, self.live_position_rates
        )

    def block_mask_embedding(self) -> Tensor:
        """``(H,)`` the policy's embedding of a block drafter's mask token, detached (under PP the last stage holds
        the copy the first stage sent this step: ``ParallelHooks``)."""
        if self.pipeline is not None:
            return self.stage_mask_embedding
        ids = torch.tensor([self.draft_term.mask_token_id], device=self.policy.lm_head.weight.device)
        return self.policy.embed(ids)[0].detach()

    def set_live_position_rates(self, rates: Sequence[float | Tensor]) -> None:
        """Set :attr:`live_position_rates` (a position never reached counts 0); empty: unchanged."""
        if len(rates):
            self.live_position_rates = torch.tensor([float(r) for r in rates]).nan_to_num(0.0)

    def set_reference_draft(self, draft: Optional[nn.Module]) -> None:
        """Score a frozen copy of ``draft`` (whole, unsharded) beside the live draft on every batch; None: stop."""
        self.reference_draft = None if draft is None else ReferenceDraft(draft)

    # ------------------------------------------------------------------ the Trainer path
    def training_step(self, batch: RLBatch, batch_idx: int = 0) -> Tensor:
        """Trainer path (manual optimisation): ``training.step.optimizer_step``, then log the metrics."""
        metrics = optimizer_step(self, self, batch, self.optimizers(), self.lr_schedulers(), self.manual_backward)
        for name, value in metrics.items():  # the logger's default (logged where there is one, no warning if none)
            self.log(name, value.float(), on_step=True, prog_bar=name in PROGRESS_BAR, batch_size=1, sync_dist=False)
        return metrics["loss"]

    def on_fit_start(self) -> None:
        """Refuse a callback that monitors a renamed metric, naming its new name (before any step runs)."""
        check_metric_names([getattr(c, "monitor", None) for c in self.trainer.callbacks], "a Trainer callback")
