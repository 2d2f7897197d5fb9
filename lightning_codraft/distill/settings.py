"""The draft warm start's settings (the recipe's ``draft.warm_start``): which source, what it generates, how it fits
the draft, and which cache key each field enters.

Below the stages that use them (distill/pool.py, distill/stages.py, distill/fit.py, distill/warmstart.py) and the
recipe's sections (config_sections.py), so none of them imports another to name a type. Each class checks itself
(:meth:`check`, also on construction), raising ``ValueError`` naming the field, like every config section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

from lightning_codraft.training.config import DRAFT_LOSSES

AUTO = "auto"
"""Resolved for the device by models/precision.py before any cache key is taken (this module imports no torch: the
recipe's checks run before anything heavy loads)."""
PRECISION_NAMES = ("32-true", AUTO, "bf16-mixed")
"""The precisions a feature pass or a draft fit runs in."""

KEYS = "cache_key"
"""Field-metadata entry naming the earliest warm-start stage whose cache key the field enters."""
CORPUS = "corpus"
"""Stage 1, the policy's sampled responses (``corpus-<key>/``): every later stage's key includes its key."""
FEATURES = "features"
"""Stage 3, the policy's taps and soft targets (``features-<key>/``)."""


def stage_fields(cls: type, stage: str) -> tuple[str, ...]:
    """The fields of dataclass ``cls`` that enter ``stage``'s cache key (their metadata's :data:`KEYS`)."""
    return tuple(f.name for f in fields(cls) if f.metadata.get(KEYS) == stage)


def coerce_floats(obj) -> None:
    """Store each ``float`` / ``Optional[float]`` field of dataclass ``obj`` given as an int as a float: 3480 and
    3480.0 are one setting and must give one cache key (keys hash the settings' JSON, where they differ)."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, int) and not isinstance(v, bool) and "float" in str(f.type):
            setattr(obj, f.name, float(v))


@dataclass
class DraftFitConfig:
    """How :func:`fit_draft` trains (AdamW, linear warm-up then cosine decay)."""

    epochs: float = 2.0
    """Passes over the training documents (fractional allowed); fixes the number of optimizer steps."""
    batch_tokens: int = 4096
    """Tokens per optimizer step (whole documents packed up to this many)."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.05
    """The cosine decays to ``lr * min_lr_ratio``."""
    warmup_frac: float = 0.03
    """Share of the schedule spent in linear warm-up."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip (0 disables)."""
    ttt_steps: int = 4
    """The TTT unroll depth trained (the engine's speculation length K, or fewer: cheaper steps that the last
    proposal steps then generalise to, measured in docs/benchmarks/draft_warmstart.md)."""
    eval_steps: Optional[int] = None
    """Unroll depth of the held-out reports (the engine's K); None: ``ttt_steps``."""
    decay: float = 0.8
    """Unroll step k weighs ``decay ** k`` (EAGLE-3's 0.8)."""
    target_temperature: float = 1.0
    """The loss compares the policy's and the draft's distributions at this temperature (the soft cross-entropy
    of ``softmax(policy / t)`` and ``softmax(draft / t)``; the draft's logits keep the policy's scale). 1.0:
    EAGLE-3's soft targets; the rollouts' temperature (e.g. 0.8) weighs the tokens sampling actually draws, but
    proposed worse on SmolLM2 / GSM8K (docs/design/measurements.md), hence the default."""
    val_docs: int = 32
    """Documents held out of training (the cache's last ones) to measure accuracy as training goes."""
    eval_every: int = 50
    """Optimizer steps between validation reports (and ``on_eval`` calls); the last step always reports."""
    time_budget_s: Optional[float] = None
    """Stop within this many seconds of training and held-out reports (``on_eval`` time excluded); the schedule
    runs on ``max(step share, time share)`` so the learning rate has decayed when the budget ends."""
    seed: int = 0
    """Shuffle order of the documents each epoch."""
    precision: str = "32-true"
    """``"32-true"``, ``"bf16-mixed"`` (fp32 weights and optimizer, the unroll under bf16 autocast: faster where bf16
    matmuls are, with gradients close to fp32's: docs/design/measurements.md) or ``"auto"`` (bf16-mixed where bf16 is
    fast: :func:`~lightning_codraft.models.precision.resolve_precision`)."""
    loss_type: str = "ce"
    """The per-row draft loss (:data:`~lightning_codraft.training.draft_loss.DRAFT_LOSSES`): ``ce`` (EAGLE-3's
    soft cross-entropy), ``tv`` (total variation ``1 - sum min(p, q)``), ``lk_alpha`` / ``lk_lambda`` (LK-style);
    the comparison is docs/benchmarks/draft_fit_ablation.md and docs/benchmarks/cotrain_losses.md."""
    compile: bool = False
    """``torch.compile(dynamic=True)`` the draft layer's q/k/v and output blocks and its final norm while fitting,
    fusing their elementwise work (docs/design/measurements.md); the first batches pay the compilation, the module
    is left as it was."""

    def __post_init__(self):
        coerce_floats(self)
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        for name in ("epochs", "batch_tokens", "lr", "ttt_steps", "target_temperature"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if not 0 <= self.warmup_frac < 1 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"warmup_frac={self.warmup_frac} must be in [0, 1) and min_lr_ratio={self.min_lr_ratio} in [0, 1]"
            )
        if self.loss_type not in DRAFT_LOSSES:
            raise ValueError(f"loss_type={self.loss_type!r} must be one of {DRAFT_LOSSES}")
        if self.precision not in PRECISION_NAMES:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISION_NAMES}")
        if self.val_docs < 0 or self.eval_every < 1:
            raise ValueError(f"val_docs={self.val_docs} must be >= 0 and eval_every={self.eval_every} >= 1")
        if self.eval_steps is not None and self.eval_steps < 1:
            raise ValueError(f"eval_steps={self.eval_steps} must be >= 1 (or None: ttt_steps)")


@dataclass
class WarmStartSettings:
    """What the warm start generates and how it fits (``fit``): the recipe's ``draft.warm_start.corpus``.

    Every field enters the draft's cache key; a field whose metadata names a stage (``KEYS``) also enters that
    stage's key (stages.py reads them from here, so no list of names is written twice).
    """

    num_prompts: int = field(default=512, metadata={KEYS: CORPUS})
    """Training prompts to sample one response each for (at most the task's problems minus the held-out ones)."""
    heldout_prompts: int = field(default=500, metadata={KEYS: CORPUS})
    """The task's last ``heldout_prompts`` problems (``task.samples``) are never trained on; evaluate on them."""
    max_new_tokens: int = field(default=256, metadata={KEYS: CORPUS})
    """Response length cap."""
    temperature: float = field(default=0.8, metadata={KEYS: CORPUS})
    """Sampling temperature of the responses: the rollouts' temperature."""
    top_p: float = field(default=1.0, metadata={KEYS: CORPUS})
    """Nucleus sampling of the responses (the rollouts')."""
    generation_batch: int = field(default=64, metadata={KEYS: CORPUS})
    """Prompts per ``generate`` call."""
    generation_budget_s: Optional[float] = field(default=None, metadata={KEYS: CORPUS})
    """Generation budget in seconds (no batch starts that would end later); None: all ``num_prompts``."""
    time_budget_s: Optional[float] = field(default=None, metadata={KEYS: CORPUS})
    """Wall-time budget of the whole warm start: generation gets ``generation_share`` of it (no batch starts that
    would end later), and the fit what is left after the feature pass (``fit.time_budget_s`` caps it further)."""
    generation_share: float = field(default=0.45, metadata={KEYS: CORPUS})
    """Share of ``time_budget_s`` given to sampling the corpus."""
    generation_dtype: Optional[str] = field(default=None, metadata={KEYS: CORPUS})
    """``"bfloat16"``: sample from a bf16 copy of the policy (as bf16 rollout engines do; faster decoding on a CPU with
    AMX, slower on an AVX2-only one: docs/design/measurements.md); ``"auto"``: bf16 where it is fast, else float32
    (:func:`~lightning_codraft.models.precision.resolve_dtype`); None: the policy as it is. The features and soft
    targets always come from the policy."""
    rebuild_vocab: bool = True
    """Build the draft vocabulary from the corpus' completion-token counts (and re-initialise the draft from the
    policy for it); False keeps the draft's map and weights."""
    feature_dtype: str = field(default="float16", metadata={KEYS: FEATURES})
    """Storage dtype of the cached taps and logits (``"float16"`` or ``"float32"``)."""
    feature_batch_tokens: int = 4096
    """Tokens per policy forward while building the feature cache."""
    capture_features: bool = True
    """Keep the policy's taps and soft targets from the forwards that sample the corpus (when it is sampled in
    this run) instead of a second pass over it: the same features up to the rounding of the decode's shapes, in
    the sampling dtype (``generation_dtype``; ``feature_precision`` then applies only to a corpus loaded from
    the cache), at the cost of spilling them to disk under the cache directory while sampling (~4.6 KB a token at
    H = 576; removed once the feature cache is written)."""
    feature_precision: str = field(default="32-true", metadata={KEYS: FEATURES})
    """``"32-true"``, ``"bf16-mixed"`` (the policy's feature pass under bf16 autocast: faster on a CPU with AMX;
    taps and targets then carry bf16 rounding, unlike the fp32 engine's taps at rollout time) or ``"auto"``
    (bf16-mixed where bf16 is fast). Every ``"auto"`` here and in ``fit.precision`` is resolved for the policy's
    device before the cache keys are taken."""
    calibrate_temperature: bool = True
    """After the fit, sharpen the draft's proposals by the scale of highest implied acceptance at ``temperature``
    on the fit's held-out documents, folded into ``lm_head``
    (:func:`~lightning_codraft.distill.calibration.calibrate_draft_temperature`; lossless, greedy unchanged)."""
    seed: int = field(default=0, metadata={KEYS: CORPUS})
    """Prompt order, sampling and draft initialisation."""
    fit: DraftFitConfig = field(default_factory=DraftFitConfig)
    """How the draft is trained on the cached features."""

    def __post_init__(self):
        if isinstance(self.fit, dict):
            self.fit = DraftFitConfig(**self.fit)
        coerce_floats(self)
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range (``fit.<field>`` for the fit's)."""
        for name in ("num_prompts", "max_new_tokens", "generation_batch", "feature_batch_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.generation_dtype not in (None, AUTO, "bfloat16", "float16", "float32"):
            raise ValueError(
                f"generation_dtype={self.generation_dtype!r} must be None, 'auto', 'bfloat16', 'float16' or 'float32'"
            )
        if self.feature_precision not in (AUTO, "32-true", "bf16-mixed"):
            raise ValueError(f"feature_precision={self.feature_precision!r} must be 'auto', '32-true' or 'bf16-mixed'")
        if not 0 < self.generation_share < 1:
            raise ValueError(f"generation_share={self.generation_share} must be in (0, 1)")
        if self.heldout_prompts < 0 or self.temperature <= 0:
            raise ValueError(
                f"heldout_prompts={self.heldout_prompts} must be >= 0 and temperature="
                f"{self.temperature} > 0 (the warm start samples, like the rollouts)"
            )
        try:
            self.fit.check()
        except ValueError as e:
            raise ValueError(f"fit.{e}") from None


@dataclass
class WarmStartConfig:
    """The draft's warm start before RL: fitted to the policy on the policy's own samples, by one of two sources of
    the same fit (distill/): a small pool sampled in the run (``steps`` optimizer steps, not cached) or, with
    ``corpus`` set, a larger corpus by self-distillation, cached on disk by the policy's weights."""

    steps: int = 200
    """The pool: optimizer steps of the draft on a small pool of the policy's samples (0 = no warm start)."""
    batch_size: int = 32
    """The pool: sequences per step (the pool holds ``min(steps, 8)`` such batches, cycled over)."""
    lr: float = 3e-3
    """The pool: learning rate (AdamW, cosine decay to 10%)."""
    corpus: Optional[WarmStartSettings] = None
    """Self-distillation instead of the pool: the corpus to sample and how the draft is fitted on it
    (:class:`~lightning_codraft.distill.settings.WarmStartSettings`, e.g. ``{num_prompts: 512}``); null: the pool."""
    cache_dir: str = "~/.cache/lightning_codraft/draft_warmstart"
    """Directory of the corpus' caches (corpus, features, draft), keyed by the policy's weights and settings."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range (``corpus.<field>`` for the corpus')."""
        for name, low in (("steps", 0), ("batch_size", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {low}")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0 (a learning rate)")
        if self.corpus is not None:
            try:
                self.corpus.check()
            except ValueError as e:
                raise ValueError(f"corpus.{e}") from None
