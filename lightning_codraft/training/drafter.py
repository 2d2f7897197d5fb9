"""The training half of the drafter protocol: what ``CoDraftModule`` asks of a drafter (docs/design/drafters.md).

A :class:`DraftTerm` is the drafter's part of the joint objective. The module calls it at four points of a step,
the same on one process, under CP (every tensor is this rank's zigzag shard), on the pipeline's last stage and
under FSDP2:

1. :meth:`DraftTerm.prepare`: the replica's whole batch, before it is cut into microbatches and sharded (a block
   drafter draws its anchors here, per document, so every mesh draws the same);
2. :meth:`DraftTerm.scored_rows`: the rows its loss scores at each of its K positions (the step's denominators,
   ``RLBatch.norm.draft``: ``training.normalize.normalize_step``);
3. :meth:`DraftTerm.inputs`, then :meth:`DraftTerm.objective`: one microbatch's loss (its share of the step's,
   value and gradient: ``training.objective.global_draft_objective``) and its implied verification rounds
   (``training.implied``), from the policy's logits and taps, read detached;
4. :meth:`DraftTerm.reference_implied`: the A/B's frozen reference scored on the same rows.

Which term a draft gets: :func:`draft_term_for` looks the draft's class up in :data:`DRAFT_TERMS` along its MRO
(a subclass of a drafter keeps its term; :func:`register_draft_term` adds or overrides one), unless the module is
given ``draft_term=``. EAGLE-3's term calls the module's own override points (``draft_token_embeds``,
``draft_step_logits``, ``draft_loss``), so subclasses that override them keep working.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_codraft.batch import RLBatch
from lightning_codraft.models.eagle3 import Eagle3Draft
from lightning_codraft.training.draft_loss import DraftLossOutput
from lightning_codraft.training.implied import ReferenceDraft, implied_counts
from lightning_codraft.training.normalize import unroll_scored_rows
from lightning_codraft.training.objective import DraftObjective, global_draft_objective


class DraftTerm(Protocol):
    """What the module needs from a drafter (module docstring); ``module`` is the ``CoDraftModule``."""

    name: str
    """The drafter's type as the recipe names it (``draft.type``)."""
    fsdp_methods: tuple[str, ...]
    """The drafter's methods besides ``forward`` that run its parameters in the step (FSDP2 gathers them around
    each call)."""
    mask_token_id: Optional[int]
    """The policy token whose embedding fills its blocks (``CoDraftModule.block_mask_embedding``; under PP the
    first stage sends it to the last every step), or None. A term holds what it needs of the drafter's shape:
    under PP the drafter lives on the last stage only."""

    def num_positions(self, module: Any) -> int:
        """K: the positions its loss, accuracy metrics and implied rounds have (EAGLE-3's unroll steps, a block's
        proposals)."""
        ...

    def taps(self, module: Any) -> tuple[int, ...]:
        """Policy taps it reads besides tap 0 (the input embeddings)."""
        ...

    def prepare(self, module: Any, batch: RLBatch) -> RLBatch:
        """The replica's whole batch, before it is cut and sharded, with what the drafter's loss needs added."""
        ...

    def scored_rows(self, module: Any, batch: RLBatch, cp_group: Optional[Any]) -> Tensor:
        """``(K,)`` rows of ``batch`` (this rank's shard) its loss scores at each position."""
        ...

    def position_weights(self, module: Any) -> Tensor:
        """``(K,)`` each position's weight in its loss."""
        ...

    def inputs(self, module: Any, taps: dict[int, Tensor], batch: RLBatch) -> Any:
        """What both the live drafter and the reference read from the policy (detached), computed once."""
        ...

    def objective(
        self, module: Any, inputs: Any, logits: Tensor, batch: RLBatch
    ) -> tuple[DraftObjective, Optional[Tensor]]:
        """``(this microbatch's share of the draft objective, its implied rounds (K + 2,) or None)``; runs under
        the grad mode the module sets (no gradient when the drafter is only scored)."""
        ...

    def reference_implied(
        self, module: Any, reference: ReferenceDraft, inputs: Any, logits: Tensor, batch: RLBatch
    ) -> Tensor:
        """``(K + 2,)`` the A/B reference's implied rounds on this microbatch (no gradient)."""
        ...

    def warm_start_loss(self, module: Any, batch: RLBatch, step: int) -> DraftLossOutput:
        """The draft's loss on a whole batch of the policy's samples, the policy run frozen (without gradient): what
        the warm start minimises (``distill.pool.fit_on_pool``); ``step`` varies what the fit draws per pass."""
        ...


class Eagle3Term:
    """EAGLE-3 behind the protocol: K training-time-test unroll steps over the taps (training/draft_loss.py);
    every piece is one of the module's override points, as before the protocol."""

    name = "eagle3"
    fsdp_methods = ("ttt_forward",)
    mask_token_id = None

    def __init__(self, draft: Optional[nn.Module] = None):
        pass

    def num_positions(self, module) -> int:
        return module.config.ttt_steps

    def taps(self, module) -> tuple[int, ...]:
        return tuple(module.configure_taps())

    def prepare(self, module, batch: RLBatch) -> RLBatch:
        return batch

    def scored_rows(self, module, batch: RLBatch, cp_group) -> Tensor:
        return unroll_scored_rows(batch, module.config.ttt_steps, cp_group)

    def position_weights(self, module) -> Tensor:
        return module.draft_step_weights()

    def inputs(self, module, taps: dict[int, Tensor], batch: RLBatch) -> tuple[list[Tensor], list[Tensor]]:
        embeds = module.draft_token_embeds(taps[0].detach(), batch)
        return [taps[t].detach() for t in module.configure_taps()], embeds

    def _implied(self, module, step_logits, d2t, logits: Tensor, batch: RLBatch) -> Tensor:
        dims, c = module.parallel_dims, module.config
        return implied_counts(
            [lg.detach() for lg in step_logits],
            batch,
            d2t=d2t,
            vocab_size=logits.shape[-1],
            temperature=c.temperature,
            cp_group=dims.cp_group,
            dp_group=dims.dp_group,
        )

    def objective(self, module, inputs, logits: Tensor, batch: RLBatch) -> tuple[DraftObjective, Tensor]:
        feats, embeds = inputs
        step_logits = module.draft_step_logits(feats, embeds, batch)
        policy_logits = logits.detach()
        d = global_draft_objective(
            partial(module.draft_loss, policy_logits=policy_logits, batch=batch),
            step_logits,
            module.draft_step_weights(),
            module.parallel_dims.dp_group,
        )
        return d, self._implied(module, step_logits, module.draft.d2t, logits, batch)

    def reference_implied(self, module, reference: ReferenceDraft, inputs, logits: Tensor, batch: RLBatch) -> Tensor:
        feats, embeds = inputs
        step_logits = reference.step_logits(feats, embeds, batch, module.parallel_dims.cp_group)
        return self._implied(module, step_logits, reference.module.d2t, logits, batch)

    def warm_start_loss(self, module, batch: RLBatch, step: int) -> DraftLossOutput:
        taps = module.configure_taps()
        with torch.no_grad():
            out = module.policy(
                batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids, taps=(0, *taps)
            )
        embeds = module.draft_token_embeds(out.taps[0], batch)
        step_logits = module.draft_step_logits(list(out.taps[1:]), embeds, batch)
        return module.draft_loss(step_logits, out.logits.detach(), batch)


DRAFT_TERMS: dict[type, type] = {}
"""Drafter model class -> its :class:`DraftTerm` class (looked up along the draft's MRO)."""


def register_draft_term(model_cls: type, term_cls: type) -> None:
    """Make ``term_cls`` the term of ``model_cls`` and its subclasses (a research drafter, or an override);
    ``term_cls(draft)`` builds it."""
    DRAFT_TERMS[model_cls] = term_cls


def draft_term_for(draft: nn.Module) -> DraftTerm:
    """The term of ``draft``'s class (the nearest registered class on its MRO); EAGLE-3's for a draft of no
    registered class that has EAGLE-3's training forward (``ttt_forward``)."""
    for cls in type(draft).__mro__:
        if cls in DRAFT_TERMS:
            return DRAFT_TERMS[cls](draft)
    if hasattr(draft, "ttt_forward"):
        return Eagle3Term(draft)
    known = ", ".join(sorted(c.__name__ for c in DRAFT_TERMS))
    raise TypeError(
        f"no draft term for a {type(draft).__name__}: it is none of the registered drafters ({known}) and has no "
        f"ttt_forward; register one (training.drafter.register_draft_term) or pass CoDraftModule(draft_term=...)"
    )


register_draft_term(Eagle3Draft, Eagle3Term)
