"""Experience: group rollouts, GRPO advantages, and packing into the next-token-aligned RL batch.

The batch format is the one in ``docs/design/interfaces.md`` ("The RL training batch"): every (T,) tensor
is packed (documents = prompt + completion of one sample, each padded to a multiple of ``2 * cp``) and
NEXT-TOKEN ALIGNED, so row ``t`` carries what the logits at row ``t`` are scored against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from lightning_codraft.attention.packing import pack_documents


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


def group_advantages(rewards: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std (when ``scale``).

    Args:
        rewards: ``(P, G)`` rewards, ``G`` completions of each of ``P`` prompts.
        eps: added to the std so a group of equal rewards gets advantage 0, not NaN.
        scale: divide by the group std (GRPO); False gives the mean-centred "Dr. GRPO" variant.

    Returns:
        ``(P, G)`` float32 advantages.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (P, G) with G >= 2 completions per prompt, got {tuple(rewards.shape)}")
    r = rewards.to(torch.float32)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv


def sequence_weighted(advantages: Sequence[float], lengths: Sequence[int]) -> list[float]:
    """Advantages rescaled by ``mean(lengths) / length`` so that a TOKEN-mean loss over the batch equals the
    SEQUENCE-mean loss of GRPO (each sample's tokens averaged first, then the samples): every sample weighs
    the same whatever its length, and long wrong answers no longer outweigh short right ones on the tokens
    they share."""
    if len(advantages) != len(lengths):
        raise ValueError(f"got {len(advantages)} advantages for {len(lengths)} lengths")
    if any(n < 1 for n in lengths):
        raise ValueError(f"every completion needs >= 1 token, got lengths {list(lengths)}")
    mean = sum(lengths) / len(lengths)
    return [a * mean / n for a, n in zip(advantages, lengths)]


def build_rl_batch(rollouts: Sequence[Rollout], advantages: Sequence[float], cp: int = 1,
                   pad_id: int = 0, ref_logprobs: Sequence[Sequence[float]] | None = None) -> dict[str, Tensor]:
    """Pack rollouts into the next-token-aligned RL batch dict.

    For a document ``prompt (n_p tokens) + completion (n_c tokens)`` starting at packed row ``s``, the
    completion token ``j`` sits at row ``s + n_p + j`` and is predicted by the logits of row
    ``s + n_p + j - 1``; that row gets ``target_ids = completion[j]``, ``loss_mask = 1``,
    ``old_logprobs = logprobs[j]`` and the sample's advantage.

    Args:
        rollouts: the samples, each with a non-empty prompt and completion.
        advantages: one scalar per rollout.
        cp: context-parallel size; every document is padded to a multiple of ``2 * cp``.
        pad_id: token id for padding and for ``target_ids`` rows that predict nothing.
        ref_logprobs: optional per-rollout reference log-probs of each completion token (adds ``ref_logprobs``).

    Returns:
        dict with ``input_ids``, ``target_ids``, ``position_ids`` (T,) int64, ``cu_seqlens`` (N+1,) int32,
        ``valid`` (T,) bool, ``loss_mask``, ``old_logprobs``, ``advantages``, ``draft_mask`` (T,) float32 and
        optionally ``ref_logprobs`` (T,) float32.
    """
    if len(rollouts) == 0:
        raise ValueError("build_rl_batch needs at least one rollout")
    if len(advantages) != len(rollouts):
        raise ValueError(f"got {len(advantages)} advantages for {len(rollouts)} rollouts")
    if ref_logprobs is not None and len(ref_logprobs) != len(rollouts):
        raise ValueError(f"got {len(ref_logprobs)} ref_logprobs rows for {len(rollouts)} rollouts")
    if cp < 1:
        raise ValueError(f"cp must be >= 1, got {cp}")
    docs = []
    for i, r in enumerate(rollouts):
        if not r.prompt_ids:
            raise ValueError(f"rollout {i} has an empty prompt")
        if not r.completion_ids:
            raise ValueError(f"rollout {i} has an empty completion; the engine must generate >= 1 token")
        if len(r.logprobs) != len(r.completion_ids):
            raise ValueError(f"rollout {i}: {len(r.logprobs)} logprobs for {len(r.completion_ids)} tokens")
        docs.append(list(r.prompt_ids) + list(r.completion_ids))
    packed = pack_documents(docs, multiple_of=2 * cp, pad_id=pad_id)
    T = packed.num_tokens
    target = torch.full((T,), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(T, dtype=torch.float32)
    old_lp = torch.zeros(T, dtype=torch.float32)
    adv = torch.zeros(T, dtype=torch.float32)
    ref = torch.zeros(T, dtype=torch.float32) if ref_logprobs is not None else None
    starts = packed.cu_seqlens[:-1].tolist()
    for i, (r, s) in enumerate(zip(rollouts, starts)):
        n_p, n_c = len(r.prompt_ids), len(r.completion_ids)
        n = n_p + n_c
        target[s:s + n - 1] = packed.input_ids[s + 1:s + n]
        rows = slice(s + n_p - 1, s + n - 1)
        loss_mask[rows] = 1.0
        old_lp[rows] = torch.tensor(r.logprobs, dtype=torch.float32)
        adv[rows] = float(advantages[i])
        if ref is not None:
            ref[rows] = torch.tensor(ref_logprobs[i], dtype=torch.float32)
    batch = {
        "input_ids": packed.input_ids,
        "target_ids": target,
        "position_ids": packed.position_ids,
        "cu_seqlens": packed.cu_seqlens,
        "valid": packed.valid,
        "loss_mask": loss_mask,
        "old_logprobs": old_lp,
        "advantages": adv,
        "draft_mask": packed.valid.to(torch.float32),
    }
    if ref is not None:
        batch["ref_logprobs"] = ref
    return batch


def sft_batch(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], cp: int = 1,
              pad_id: int = 0) -> dict[str, Tensor]:
    """The same next-token-aligned packed batch for supervised warm-up (loss on completion rows only).

    Advantages are 1 and old log-probs 0 on completion rows, so the keys match :func:`build_rl_batch`.
    """
    rollouts = [Rollout(list(p), list(c), [0.0] * len(c), group=i) for i, (p, c) in
                enumerate(zip(prompts, completions))]
    return build_rl_batch(rollouts, [1.0] * len(rollouts), cp=cp, pad_id=pad_id)
