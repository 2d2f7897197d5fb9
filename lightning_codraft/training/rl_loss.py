"""GRPO / PPO clipped-surrogate policy loss: a weighted sum over the tokens of a distributed batch.

Every quantity is row-local (the RL batch is next-token aligned, docs/design/interfaces.md), so under
context or data parallelism each rank scores its own rows. The weights are the step's global ones
(``training.normalize.normalize_step``: token, sequence or constant aggregation, one denominator for the whole step), so
a sharded or microbatched run equals the single-process run exactly; without them the loss is the token mean over ALL
masked tokens of the batch (its count all-reduced).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_codraft.parallel.collectives import reduced


def token_logprobs(logits: Tensor, target_ids: Tensor) -> Tensor:
    """Log-probability of each row's target token.

    Args:
        logits: ``(T, V)`` policy logits of this rank's rows.
        target_ids: ``(T,)`` int64 next tokens (row ``t`` is scored against ``target_ids[t]``).

    Returns:
        ``(T,)`` fp32 ``log softmax(logits)[t, target_ids[t]]``.
    """
    if logits.shape[:-1] != target_ids.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target_ids {tuple(target_ids.shape)} disagree on rows")
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, target_ids.long().unsqueeze(-1)).squeeze(-1)


def policy_gradient_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: Optional[float] = None,
    ref_logprobs: Optional[Tensor] = None,
    kl_coef: float = 0.0,
    group: Optional[Any] = None,
    loss_weight: Optional[Tensor] = None,
    dual_clip: Optional[float] = None,
    num_tokens: Optional[float] = None,
    is_weight: Optional[Tensor] = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO / GRPO clipped surrogate (+ optional k3 KL to a reference policy), a weighted sum over tokens.

    Per token ``t``: ``r = exp(logprobs - old_logprobs)``,
    ``pg = max(-A r, -A clip(r, 1 - clip_eps, 1 + clip_eps_high))`` (with ``dual_clip = c`` and ``A < 0``, verl's
    dual clip ``pg = min(pg, -A c)``) and, when ``kl_coef > 0``, ``kl = exp(ref - logp) - (ref - logp) - 1``
    (Schulman's k3, unbiased and >= 0). The loss is ``sum_t w_t (pg_t + kl_coef kl_t)``: with ``loss_weight`` given,
    ``w`` is it (the step's global weights, ``training.normalize.normalize_step``: no count crosses ranks and the
    loss is this microbatch's share of the step's objective); without, ``w_t = mask_t / sum mask`` with the sum over
    every rank of ``group`` (the token mean of this batch).

    Args:
        logprobs: ``(T,)`` log-prob of each row's target under the current policy (differentiable).
        old_logprobs: ``(T,)`` log-prob under the sampling policy.
        advantages: ``(T,)`` advantage of the row's sample (0 off-mask).
        loss_mask: ``(T,)`` 1 on scored (completion) rows, 0 elsewhere.
        clip_eps: lower clip range ``eps`` (ratio >= 1 - eps).
        clip_eps_high: upper clip range (DAPO "clip higher"); ``None`` uses ``clip_eps``.
        ref_logprobs: ``(T,)`` reference-policy log-probs; required when ``kl_coef > 0``.
        kl_coef: weight of the KL penalty.
        group: process group over which the batch is split (the flattened dp x cp group), or ``None``.
        loss_weight: ``(T,)`` per-row weights of the objective (0 off-mask), or None for the token mean.
        dual_clip: verl's ``clip_ratio_c`` (> 1): caps the loss of a negative-advantage token at ``-A c``; None: off.
        num_tokens: the step's completion tokens over every rank and microbatch (``RLBatch.norm.tokens``): the
            token-mean statistics are then this batch's share of the step's; None: this batch's own token means.
        is_weight: ``(T,)`` the decoupled objective's off-policy weights (training/off_policy.py, detached: each
            token's clipped surrogate is multiplied by it, ``old_logprobs`` then being the proximal policy's), or
            None.

    Returns:
        ``(loss, stats)``. ``loss`` is THIS rank's share (the sum of ``loss`` over ``group`` is the objective,
        value and gradient); a data-parallel wrapper that AVERAGES gradients over ``group`` needs
        ``loss * group_size``. ``stats`` holds detached global sums: ``loss`` and ``pg_loss`` with the loss's
        weights ``w``; ``kl``, ``clip_frac``, ``ratio`` and ``approx_kl`` as **token means** whatever the
        aggregation (TRL's ``kl`` / ``clip_ratio/region_mean``, verl's ``pg_clipfrac``: docs/rl.md); and
        ``num_tokens`` (scored rows).
    """
    tensors = dict(
        old_logprobs=old_logprobs,
        advantages=advantages,
        loss_mask=loss_mask,
        loss_weight=loss_weight,
        is_weight=is_weight,
    )
    _check_loss_inputs(logprobs, tensors, clip_eps, clip_eps_high, kl_coef, dual_clip, ref_logprobs)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)  # at least fp32 for the ratio
    mask = loss_mask.to(dtype)
    logprobs_f = logprobs.to(dtype)
    log_ratio = logprobs_f - old_logprobs.to(dtype)
    pg, clipped = clipped_surrogate(
        log_ratio, advantages.to(dtype), clip_eps, clip_eps if clip_eps_high is None else clip_eps_high, dual_clip
    )
    if is_weight is not None:  # the off-policy weight of a stale rollout's token (decoupled objective)
        pg = pg * is_weight.detach().to(dtype)
    kl = k3_kl(logprobs_f, ref_logprobs, grad=kl_coef > 0) if ref_logprobs is not None else torch.zeros_like(pg)
    per_token = pg + kl_coef * kl if ref_logprobs is not None and kl_coef > 0 else pg
    if loss_weight is None:  # the token mean of this batch: its count crosses ranks before the loss
        weight = mask / reduced(mask.detach().sum(), group).clamp(min=1.0)
    else:  # the step's global weights: the count is only a statistic, reduced with the others
        weight = loss_weight.detach().to(dtype)
    loss = (per_token * weight).sum()
    return loss, _loss_stats(per_token, pg, kl, clipped, log_ratio, weight, mask, num_tokens, group)


@torch.no_grad()
def _loss_stats(per_token, pg, kl, clipped, log_ratio, weight, mask, num_tokens, group) -> dict[str, Tensor]:
    """:func:`policy_gradient_loss`'s statistics, global sums over ``group``: ``loss`` and ``pg_loss`` with the loss's
    weights, the others as token means (over ``num_tokens``, the step's completion tokens, when given)."""
    per_tok = mask / (num_tokens if num_tokens is not None else reduced(mask.sum(), group).clamp(min=1.0))
    sums = torch.stack(
        [
            (per_token * weight).sum(),
            (pg * weight).sum(),
            (kl * per_tok).sum(),
            (clipped * per_tok).sum(),
            (torch.exp(log_ratio) * per_tok).sum(),
            (0.5 * log_ratio.square() * per_tok).sum(),
            mask.sum(),
        ]
    )
    return dict(zip(("loss", "pg_loss", "kl", "clip_frac", "ratio", "approx_kl", "num_tokens"), reduced(sums, group)))


def clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, clip_eps: float, clip_eps_high: float, dual_clip: Optional[float] = None
) -> tuple[Tensor, Tensor]:
    """The per-token PPO clipped surrogate (verl's ``compute_policy_loss_vanilla`` before its aggregation).

    Args:
        log_ratio: ``(T,)`` ``log pi_theta - log pi_old`` (differentiable).
        advantages: ``(T,)`` per-token advantages.
        clip_eps, clip_eps_high: the ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``.
        dual_clip: verl's ``clip_ratio_c``: a negative-advantage token's loss is capped at ``-A c``; None: off.

    Returns:
        ``(pg, clipped)``: ``(T,)`` per-token losses ``max(-A r, -A clip(r))`` and ``(T,)`` 1.0 where the clipped
        branch is the larger (detached).
    """
    ratio = torch.exp(log_ratio)
    pg_unclipped = -advantages * ratio
    pg_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    if dual_clip is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    return pg, (pg_clipped > pg_unclipped).detach().to(pg.dtype)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, grad: bool = True) -> Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per token: ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, >= 0).

    Args:
        logprobs: ``(T,)`` the current policy's log-probs (at least fp32).
        ref_logprobs: ``(T,)`` the reference policy's.
        grad: False: a statistic only (the difference is detached).
    """
    delta = ref_logprobs.to(logprobs.dtype) - logprobs
    if not grad:
        delta = delta.detach()
    return torch.exp(delta) - delta - 1.0


def _check_loss_inputs(logprobs, tensors: dict, clip_eps, clip_eps_high, kl_coef, dual_clip, ref_logprobs) -> None:
    """:func:`policy_gradient_loss`'s argument checks (shapes, ranges), raising ``ValueError``."""
    shape = logprobs.shape
    for name, t in tensors.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logprobs has {tuple(shape)}; all are (T,) rows")
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise ValueError(f"clip ranges must be >= 0, got clip_eps={clip_eps}, clip_eps_high={clip_eps_high}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip={dual_clip} must be > 1 (verl's clip_ratio_c, e.g. 3.0) or None")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logprobs (T,) from the reference policy")


def greedy_agreement(
    logits: Tensor,
    ref_greedy: Tensor,
    loss_mask: Tensor,
    group: Optional[Any] = None,
    num_tokens: Optional[float] = None,
) -> Tensor:
    """Share of completion rows where the policy's and the reference's most likely next token agree.

    A drift measure next to the KL (``policy_gradient_loss``'s ``kl`` stat): 1 for a policy equal to the reference,
    lower as greedy continuations diverge.

    Args:
        logits: ``(T, V)`` policy logits of this rank's rows.
        ref_greedy: ``(T,)`` int64 the reference's argmax at each row.
        loss_mask: ``(T,)`` 1 on completion rows.
        group: the process group the rows are spread over (dp x cp); the mean is global.
        num_tokens: the step's completion rows over every microbatch (``RLBatch.norm.tokens``): the result is then
            this batch's share of the step's agreement (shares of a step's microbatches add up); None: this
            batch's own mean.

    Returns:
        A 0-dim float32 tensor in [0, 1] (NaN when no rank has a completion row).
    """
    mask = loss_mask.to(torch.float32)
    agree = (logits.argmax(-1) == ref_greedy).to(torch.float32)
    sums = reduced(torch.stack([(agree * mask).sum(), mask.sum()]), group)
    return sums[0] / (sums[1] if num_tokens is None else num_tokens)
