"""Draft temperature calibration: sharpen a briefly trained draft's proposals, losslessly.

A draft fitted with the soft cross-entropy (a proper scoring rule) is calibrated *on average*: where it has
only partly learned the policy it spreads its mass over the policy's plausible next tokens, so at sampling
temperature ``T`` its proposal distribution ``q = softmax(z / T)`` is flatter than the policy's ``p``. The
acceptance of speculative sampling is the overlap ``sum_v min(p_v, q_v)``; a sharper proposal
``softmax(z / (T * scale))`` with ``scale < 1`` overlaps more where the draft's top choice is usually right.
Any proposal distribution keeps speculative sampling exact (the verifier corrects it), and greedy decoding
(argmax) is unchanged, so the scale is free to choose: :func:`calibrate_draft_temperature` measures the
implied acceptance of each candidate scale on held-out cached rows and folds the best into ``lm_head``
(``lm_head.weight /= scale``), which every engine then serves as it is (the embedded one, vLLM).

The overlap uses the policy distribution restricted to the draft vocabulary (what the feature cache keeps),
over the rows :func:`~lightning_codraft.training.draft_loss.ttt_draft_loss` counts; the chain of K steps is
combined as :func:`~lightning_codraft.distill.fit.implied_acceptance_length` combines accuracies.
A later fit of a folded draft (co-training) starts from the sharper logits; its loss pulls them back towards
calibration over time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_codraft.attention.packing import shift_left_local
from lightning_codraft.distill.cache import OUTSIDE, FeatureCache, pack_batches
from lightning_codraft.distill.fit import DraftFitConfig, draft_unroll, implied_acceptance_length

DEFAULT_SCALES = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)


@dataclass
class TemperatureCalibration:
    """What :func:`calibrate_draft_temperature` measured and chose."""

    scale: float = 1.0
    """The chosen scale (1.0: unchanged); the draft's logits are divided by it."""
    scales: list[float] = field(default_factory=list)
    """The candidate scales, in the order measured."""
    acceptance: list[float] = field(default_factory=list)
    """Implied acceptance length of each candidate scale on the held-out rows."""
    overlap: list[list[float]] = field(default_factory=list)
    """``(S, K)`` mean overlap ``sum_v min(p_v, q_v)`` of each scale and unroll step."""
    rows: int = 0
    """Counted rows of unroll step 0."""


@torch.no_grad()
def draft_overlap(
    draft,
    embed: Callable[[Tensor], Tensor],
    cache: FeatureCache,
    docs: Sequence[int],
    config: DraftFitConfig,
    temperature: float,
    scales: Sequence[float] = DEFAULT_SCALES,
) -> tuple[Tensor, int]:
    """Mean overlap of the policy's and the scaled draft's distributions at ``temperature``.

    Args:
        draft: an :class:`~lightning_codraft.models.Eagle3Draft` of the cache's vocabulary.
        embed: the policy's token embedding, ``(T,)`` ids -> ``(T, H)``.
        cache: the policy's features; ``docs``: the documents to measure on (held out of the fit).
        config: the fit's ``batch_tokens``, ``precision`` and unroll depth (``eval_steps`` or ``ttt_steps``).
        temperature: the rollouts' sampling temperature (> 0).
        scales: candidate scales (> 0); the draft samples from ``softmax(z / (temperature * scale))``.

    Returns:
        ``(S, K)`` mean overlap per scale and unroll step, and the counted rows of step 0.
    """
    if temperature <= 0 or not scales or min(scales) <= 0:
        raise ValueError(f"temperature={temperature} and every scale in {list(scales)} must be > 0")
    K = config.eval_steps or config.ttt_steps
    num, den = torch.zeros(len(scales), K), torch.zeros(K)
    was_training = draft.training
    draft.eval()
    for group in pack_batches(cache.doc_lengths()[list(docs)], config.batch_tokens):
        steps, rows = draft_unroll(draft, embed, cache.batch([docs[i] for i in group]), K, config.precision)
        compact, cu = rows["compact_logits"], rows["cu_seqlens"]
        # as ttt_draft_loss: a row counts where it is a loss row whose policy top-1 is in the draft vocabulary
        counted = rows["loss_mask"] * (compact[:, -1] != OUTSIDE).float()
        p = torch.softmax(compact[:, :-1].float() / temperature, dim=-1)  # once: step k reads rows k + 1 on
        T = p.shape[0]
        for k, z in enumerate(steps):
            w = shift_left_local(counted, cu, k + 1)[: T - k - 1]  # 0 where row i + k + 1 leaves the document
            for s, scale in enumerate(scales):
                q = torch.softmax(z[: T - k - 1] / (temperature * scale), dim=-1)
                num[s, k] += (torch.minimum(p[k + 1 :], q).sum(-1) * w).sum().cpu()
            den[k] += w.sum().cpu()
    draft.train(was_training)
    return num / den.clamp(min=1), int(den[0])


@torch.no_grad()
def calibrate_draft_temperature(
    draft,
    embed: Callable[[Tensor], Tensor],
    cache: FeatureCache,
    docs: Sequence[int],
    config: DraftFitConfig,
    temperature: float,
    scales: Sequence[float] = DEFAULT_SCALES,
    apply: bool = True,
) -> TemperatureCalibration:
    """Choose the scale of highest implied acceptance on ``docs`` (ties: the one nearest 1) and, when ``apply``,
    fold it into ``draft.lm_head`` (arguments as :func:`draft_overlap`; 1.0 is always a candidate)."""
    scales = sorted({1.0, *map(float, scales)}, key=lambda s: (abs(s - 1.0), -s))
    overlap, rows = draft_overlap(draft, embed, cache, docs, config, temperature, scales)
    acceptance = [implied_acceptance_length(row.tolist()) for row in overlap]
    best = max(range(len(scales)), key=lambda i: (acceptance[i], -i)) if rows else 0
    if apply and scales[best] != 1.0:
        draft.lm_head.weight.div_(scales[best])
    return TemperatureCalibration(
        scale=scales[best], scales=scales, acceptance=acceptance, overlap=overlap.tolist(), rows=rows
    )
