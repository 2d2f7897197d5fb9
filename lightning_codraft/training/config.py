"""The objective's knobs, declared once: the sections the recipe and :class:`CoDraftModuleConfig` share, and the
module's own hyper-parameters (optimiser, draft mode, pipeline cut).

:class:`PolicyLossConfig`, :class:`DraftLossConfig` and :class:`MicrobatchConfig` are the recipe's ``rl.*``,
``draft.*`` and ``parallel.*`` sections' loss and schedule fields (``lightning_codraft.config`` derives its
sections from them) and the bases of :class:`CoDraftModuleConfig`, so a knob has one name, one default, one
docstring and one check; ``lightning_codraft.rl.run.build.module_config`` copies them across by field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

AGGREGATIONS = ("sequence", "token", "constant")
PP_SCHEDULES = ("gpipe", "1f1b")
DRAFT_LOSSES = ("ce", "tv", "lk_alpha", "lk_lambda")  # training/draft_loss.py defines each
POSITION_WEIGHTS = ("decay", "uniform", "acceptance")


def shared_fields(section: Any, base: type) -> dict[str, Any]:
    """The values of ``base``'s fields on ``section`` (a recipe section derived from ``base``)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(base)}


IS_LEVELS = ("token", "sequence", "geometric")
"""Where the truncated weight comes from: the token's own ratio, its sequence's product, or the sequence's
geometric mean."""
MASKS = ("none", "token", "sequence", "geometric")
"""What falls out of the loss where the ratio leaves ``[1 / threshold, threshold]``: nothing, the token, the sequence
(its product of ratios) or the sequence (its geometric mean)."""


@dataclass(frozen=True)
class OffPolicyCorrection:
    """How the decoupled objective weighs a stale rollout's tokens (``rl.off_policy``; training/off_policy.py)."""

    is_cap: float = 2.0
    """C: the off-policy weight ``pi_prox / pi_behave`` is truncated at C (AReaL's and verl's default 2)."""
    is_level: str = "token"
    """Whose ratio the weight is: ``token``, ``sequence`` (product over the sequence) or ``geometric`` (its mean in
    log space)."""
    mask: str = "none"
    """Rejection: ``none``, or mask the ``token`` / ``sequence`` / ``geometric``-mean whose ratio leaves
    ``[1 / mask_threshold, mask_threshold]``."""
    mask_threshold: float = 2.0
    """The rejection band's upper edge (> 1)."""
    veto: Optional[float] = None
    """Mask a whole sequence when any of its tokens' ratios is below this (verl's veto, e.g. 1e-4); None: off."""

    def __post_init__(self) -> None:
        if not self.is_cap >= 1.0:
            raise ValueError(f"is_cap={self.is_cap} must be >= 1 (the truncation of pi_prox / pi_behave)")
        if self.is_level not in IS_LEVELS:
            raise ValueError(f"is_level={self.is_level!r} must be one of {IS_LEVELS}")
        if self.mask not in MASKS:
            raise ValueError(f"mask={self.mask!r} must be one of {MASKS}")
        if not self.mask_threshold > 1.0:
            raise ValueError(f"mask_threshold={self.mask_threshold} must be > 1")
        if self.veto is not None and not 0.0 < self.veto < 1.0:
            raise ValueError(f"veto={self.veto} must be in (0, 1) or None")


@dataclass
class PolicyLossConfig:
    """The RL loss's knobs (the recipe's ``rl`` section holds them)."""

    clip_eps: float = 0.2
    """PPO / GRPO lower clip range."""
    clip_eps_high: Optional[float] = None
    """Upper clip range (DAPO clip-higher); None = clip_eps."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference policy (the policy when RL begins, after the warm-ups; needs
    ``ref_logprobs`` in the batch when > 0)."""
    loss_aggregation: str = "sequence"
    """How the RL loss weighs tokens over the WHOLE step (every microbatch and rank;
    ``training.normalize.normalize_step``): ``sequence`` (GRPO: every sample the same), ``token`` (DAPO: every
    completion token the same) or ``constant`` (Dr. GRPO: token sums divided by samples x ``max_new_tokens``). The
    weight multiplies the KL term too (docs/rl.md)."""
    dual_clip: Optional[float] = None
    """verl's dual clip ``clip_ratio_c`` (> 1, e.g. 3): a negative-advantage token's loss is capped at ``-A c``;
    None = off."""
    off_policy: Optional[OffPolicyCorrection] = None
    """The decoupled objective for rollouts of an older policy (training/off_policy.py: the clipped ratio against the
    proximal policy, the trainer's weights at the step's start, times the truncated weight ``pi_prox / pi_behave``);
    None: today's PPO ratio against the sampling policy (``rl.async_level: 0``; an asynchronous run uses the defaults
    when it is unset)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts: the RL loss (and the reference's log-probs) score tokens under
    ``logits / temperature``, the distribution they were sampled from, so the first, on-policy ratio is 1. Zero
    (greedy rollouts) scores under the plain logits."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of range."""
        for name in ("clip_eps", "kl_coef", "temperature"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.clip_eps_high is not None and self.clip_eps_high < 0:
            raise ValueError(f"clip_eps_high={self.clip_eps_high} must be >= 0 or None")
        if self.loss_aggregation not in AGGREGATIONS:
            raise ValueError(f"loss_aggregation={self.loss_aggregation!r} must be one of {AGGREGATIONS}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip={self.dual_clip} must be > 1 (verl's clip_ratio_c, e.g. 3.0) or None")


@dataclass
class DraftLossConfig:
    """The draft loss's knobs (the recipe's ``draft`` section holds them)."""

    ttt_steps: int = 3
    """K: training-time-test unroll depth of the draft loss."""
    ttt_decay: float = 0.8
    """Weight ratio between consecutive unroll steps (step k weighs decay**k)."""
    loss_type: str = "ce"
    """The draft's per-row loss against the policy: ``ce`` (soft cross-entropy, EAGLE-3), ``tv`` (total variation,
    1 - acceptance), ``lk_alpha`` (-log acceptance) or ``lk_lambda`` (cross-entropy blended into TV as the overlap
    grows): training/draft_loss.py."""
    sample_every: int = 1
    """Run the draft (train it, score it, and the A/B's reference) on every n-th sample of each microbatch only:
    co-training then costs about 1/n of its price, from a noisier gradient (1 = every sample)."""
    position_weights: str = "decay"
    """Weight of unroll step k: ``decay`` (ttt_decay**k), ``uniform`` (1), or ``acceptance`` (the live probability that
    the engine verifies position k at all: the product of the draft's implied acceptance rates of the positions
    before it on the last step it ran, D-PACE-style; decay**k until one is measured). A block drafter's ``decay``
    is DFlash's ``exp(-(k - 1) / block_gamma)``."""
    block_anchors: int = 16
    """A block drafter's (DFlash's) training blocks per document and step, anchored at rows drawn among the
    document's completion rows (where the engine drafts)."""
    block_gamma: Optional[float] = None
    """A block drafter's position decay: position k weighs ``exp(-(k - 1) / gamma)``; None = DFlash's for the
    block size (7 for 16, 5 for 10, 4 for 8)."""
    dspark_ce_weight: float = 0.1
    """``dspark``: weight of the cross-entropy against the rollout's tokens (DeepSpec's 0.1)."""
    dspark_l1_weight: float = 0.9
    """``dspark``: weight of the L1 distance between the drafter's and the policy's distributions (DeepSpec's "TV"
    term, 0.9; it is twice the total variation)."""
    dspark_confidence_weight: float = 1.0
    """``dspark``: weight of the confidence head's BCE against ``1 - L1 / 2`` (DeepSpec's 1.0)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of range."""
        if self.block_anchors < 1:
            raise ValueError(f"block_anchors={self.block_anchors} must be >= 1")
        if self.block_gamma is not None and self.block_gamma <= 0:
            raise ValueError(f"block_gamma={self.block_gamma} must be > 0 or None")
        for name in ("dspark_ce_weight", "dspark_l1_weight", "dspark_confidence_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps={self.ttt_steps} must be >= 1")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay={self.ttt_decay} must be in (0, 1]")
        if self.sample_every < 1:
            raise ValueError(f"sample_every={self.sample_every} must be >= 1")
        if self.loss_type not in DRAFT_LOSSES:
            raise ValueError(f"loss_type={self.loss_type!r} must be one of {DRAFT_LOSSES}")
        if self.position_weights not in POSITION_WEIGHTS:
            raise ValueError(f"position_weights={self.position_weights!r} must be one of {POSITION_WEIGHTS}")


@dataclass
class MicrobatchConfig:
    """How a step's batch is cut and scheduled (the recipe's ``parallel`` section holds them)."""

    num_microbatches: int = 1
    """M: each replica's batch is cut into M microbatches of whole samples (the pipeline schedule's unit); the
    objective does not depend on it: every microbatch's loss divides by the whole step's counts."""
    pp_schedule: str = "gpipe"
    """Pipeline schedule under pp > 1: ``gpipe`` or ``1f1b`` (needs num_microbatches >= pp)."""
    layers_per_stage: Optional[list[int]] = None
    """Decoder layers of every pipeline stage (one count per stage); None balances them."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the field when a value is out of range."""
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches={self.num_microbatches} must be >= 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} must be one of {PP_SCHEDULES}")


@dataclass
class CoDraftModuleConfig(PolicyLossConfig, DraftLossConfig, MicrobatchConfig):
    """Hyper-parameters of the joint RL + draft objective and its optimiser: the shared sections' fields (above)
    and these."""

    draft_loss_weight: float = 1.0
    """lambda in ``L = L_rl + lambda * L_draft``; 0 trains the policy only (the draft is still scored)."""
    freeze_draft: bool = False
    """Keep the draft fixed (baseline: a warm-started draft that drifts away from the policy)."""
    score_draft: bool = True
    """Run the draft (without gradient) to log its accuracy when it is not trained; False skips it entirely."""
    max_new_tokens: Optional[int] = None
    """The completion budget: the ``constant`` aggregation's per-sample divisor (required for it)."""
    track_drift: bool = False
    """Score every batch under the reference policy even when ``kl_coef == 0``: logs ``policy/kl`` (the k3 KL of
    the policy from the reference on the batch's completion tokens) and ``drift/greedy_agreement`` (the share of
    completion rows where both policies' most likely next token agree). Needs a reference policy."""
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
    policy_lr_warmup_steps: int = 0
    """Linear warm-up steps of the policy learning rate."""
    draft_lr_warmup_steps: int = 0
    """Linear warm-up steps of the draft learning rate."""
    schedule: str = "constant"
    """After warm-up: ``constant`` or ``cosine`` (to 0 at ``total_steps``)."""
    total_steps: int = 0
    """Optimizer steps of the run, used by the cosine schedule (0 with ``constant``)."""
    grad_clip: Optional[float] = None
    """Clip each group's global gradient norm to this value; None = no clipping."""
    taps: Optional[tuple[int, ...]] = None
    """Policy tap ids feeding the draft; None = the draft's configured taps, else the policy's defaults."""
    max_nonfinite_steps: int = 3
    """Optimizer steps in a row with a non-finite loss or gradient (each skipped) before training stops."""

    def check(self) -> None:
        """The shared sections' checks, then the module's own (``ValueError`` naming the field)."""
        PolicyLossConfig.check(self)
        DraftLossConfig.check(self)
        MicrobatchConfig.check(self)
        if self.draft_loss_weight < 0:
            raise ValueError(
                f"draft_loss_weight (lambda)={self.draft_loss_weight} must be >= 0; use 0 to train the policy only"
            )
        if self.schedule not in ("constant", "cosine"):
            raise ValueError(f"schedule={self.schedule!r} must be 'constant' or 'cosine'")
        if self.schedule == "cosine" and self.total_steps < 1:
            raise ValueError(f"schedule='cosine' needs total_steps >= 1, got {self.total_steps}")
        for name in ("policy_lr", "draft_lr", "weight_decay"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.max_nonfinite_steps < 1:
            raise ValueError(f"max_nonfinite_steps={self.max_nonfinite_steps} must be >= 1")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be > 0 or None")
        if self.loss_aggregation == "constant" and (self.max_new_tokens is None or self.max_new_tokens < 1):
            raise ValueError(
                f"loss_aggregation='constant' (Dr. GRPO) divides by samples x max_new_tokens; set "
                f"max_new_tokens >= 1, got {self.max_new_tokens}"
            )

    @property
    def trains_draft(self) -> bool:
        """The draft term is in the loss (lambda > 0 and the draft is not frozen)."""
        return self.draft_loss_weight > 0 and not self.freeze_draft

    @property
    def runs_draft(self) -> bool:
        """The draft runs in the step: trained, or scored without gradient."""
        return self.trains_draft or self.score_draft
