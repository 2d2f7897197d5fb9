"""Experience: group rollouts, GRPO advantages, and packing into the next-token-aligned RL batch.

The batch is a :class:`~lightning_codraft.batch.RLBatch` (docs/design/interfaces.md, "The RL training batch"):
packed (documents = prompt + completion of one sample, each padded to a multiple of ``2 * cp``) and NEXT-TOKEN
ALIGNED, so row ``t`` carries what the logits at row ``t`` are scored against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_codraft.batch import RLBatch


@dataclass
class Rollout:
    """One sampled completion of one prompt.

    Attributes:
        prompt_ids: the prompt's token ids.
        completion_ids: generated token ids (including a generated stop token, if any).
        logprobs: log-probability of each generated token under the sampling policy, ``len == len(completion_ids)``.
        group: index of the prompt this sample belongs to (samples of a group share the prompt).
        reward: the scalar reward, filled by the loop.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    group: int
    reward: float = 0.0
    extra: dict = field(default_factory=dict)


def group_advantages(
    rewards: Tensor, eps: float = 1e-6, scale: bool = True, std: str = "population", valid: Tensor | None = None
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (when ``scale``).

    Computed in float64, so a group of equal rewards gets exactly 0 whatever the value (in float32 the mean of eight
    0.7s is one ulp off and, divided by a one-ulp std + eps, every sample would get +0.056).

    Args:
        rewards: ``(P, G)`` rewards, ``G`` completions of each of ``P`` prompts.
        eps: added to the std so a group of equal rewards gets advantage 0, not NaN.
        scale: divide by the group std (GRPO); False gives the mean-centred "Dr. GRPO" variant.
        std: ``population`` (divide by G) or ``sample`` (Bessel's correction, G - 1: TRL's and verl's choice; our
            ``population`` advantages are theirs times ``sqrt(G / (G - 1))``).
        valid: ``(P, G)`` bool, the samples that count (e.g. those whose reward did not fail); the others get
            advantage 0 and are left out of their group's mean and std. None: all.

    Returns:
        ``(P, G)`` float32 advantages.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (P, G) with G >= 2 completions per prompt, got {tuple(rewards.shape)}")
    if std not in ("population", "sample"):
        raise ValueError(f"std={std!r} must be 'population' or 'sample'")
    r = rewards.to(torch.float64)
    valid = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.to(torch.bool)
    if valid.shape != r.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)} but rewards {tuple(r.shape)}")
    if not bool(torch.isfinite(r[valid]).all()):
        raise ValueError(f"rewards must be finite, got {r[valid][~torch.isfinite(r[valid])].tolist()[:4]} among them")
    w = valid.to(torch.float64)
    n = w.sum(dim=1, keepdim=True)
    r = torch.where(valid, r, torch.zeros_like(r))
    mean = (r * w).sum(dim=1, keepdim=True) / n.clamp(min=1)
    adv = (r - mean) * w
    # a group whose counted rewards are all equal is exactly 0 (its mean may be one ulp off the value in float64)
    first = r.gather(1, valid.to(torch.int64).argmax(dim=1, keepdim=True))
    equal = ((r == first) | ~valid).all(dim=1, keepdim=True)
    adv = torch.where(equal, torch.zeros_like(adv), adv)
    if scale:
        dof = (n - 1 if std == "sample" else n).clamp(min=1)
        adv = adv / (((adv.square() * w).sum(dim=1, keepdim=True) / dof).sqrt() + eps)
    return adv.to(torch.float32)


def build_rl_batch(
    rollouts: Sequence[Rollout],
    advantages: Sequence[float],
    cp: int = 1,
    pad_id: int = 0,
    ref_logprobs: Sequence[Sequence[float]] | None = None,
) -> RLBatch:
    """Pack rollouts into the next-token-aligned :class:`~lightning_codraft.batch.RLBatch` (whole, unsharded).

    Args:
        rollouts: the samples, each with a non-empty prompt and completion.
        advantages: one scalar per rollout.
        cp: context-parallel size; every document is padded to a multiple of ``2 * cp``.
        pad_id: token id for padding and for ``target_ids`` rows that predict nothing.
        ref_logprobs: optional per-rollout reference log-probs of each completion token.
    """
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    return RLBatch.pack(
        [r.prompt_ids for r in rollouts],
        [r.completion_ids for r in rollouts],
        [r.logprobs for r in rollouts],
        advantages,
        ref_logprobs=ref_logprobs,
        multiple_of=2 * cp,
        pad_id=pad_id,
    )


def sft_batch(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], cp: int = 1, pad_id: int = 0
) -> RLBatch:
    """The same next-token-aligned packed batch for supervised warm-up (loss on completion rows only).

    Advantages are 1 and old log-probs 0 on completion rows.
    """
    return RLBatch.pack(
        prompts,
        completions,
        [[0.0] * len(c) for c in completions],
        [1.0] * len(prompts),
        multiple_of=2 * cp,
        pad_id=pad_id,
    )
