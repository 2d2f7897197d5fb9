"""The EAGLE-3 draft vocabulary: the most frequent target tokens, and the two maps between id spaces.

Conventions (vLLM / SpecForge):

- ``d2t``: ``(Vd,)`` int64 offsets, ``target_id = draft_id + d2t[draft_id]``.
- ``t2d``: ``(V,)`` bool, True on the target ids that have a draft id.

Draft ids enumerate the chosen target ids in increasing target-id order, so ``d2t`` is non-negative and
non-decreasing and ``t2d.nonzero()`` lists the same ids as ``arange(Vd) + d2t``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def build_vocab_mapping(token_counts: Tensor, draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """Choose the ``draft_vocab_size`` most frequent target tokens and build ``(d2t, t2d)``.

    Ties in frequency are broken towards the smaller target id, so the result is deterministic.

    Args:
        token_counts: ``(V,)`` non-negative counts (or frequencies) of every target token in a corpus.
        draft_vocab_size: Vd, number of target tokens the draft can propose, ``1 <= Vd <= V``.

    Returns:
        ``d2t`` ``(Vd,)`` int64 with ``target_id = draft_id + d2t[draft_id]``, and ``t2d`` ``(V,)`` bool.
    """
    counts = torch.as_tensor(token_counts)
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(
            f"token_counts must be a non-empty 1-D tensor of length vocab_size, got shape {tuple(counts.shape)}"
        )
    vocab_size = counts.numel()
    if not 1 <= int(draft_vocab_size) <= vocab_size:
        raise ValueError(f"draft_vocab_size={draft_vocab_size} must be in [1, vocab_size={vocab_size}]")
    counts = counts.detach().to("cpu", torch.float64)
    if bool((counts < 0).any()) or not bool(torch.isfinite(counts).all()):
        raise ValueError(
            f"token_counts must be finite and non-negative; got min {counts.min().item()} max {counts.max().item()}"
        )
    # stable sort on -count keeps equal counts in increasing id order
    order = torch.sort(-counts, stable=True).indices[: int(draft_vocab_size)]
    chosen = torch.sort(order).values
    d2t = chosen - torch.arange(chosen.numel(), dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def count_tokens(token_ids: Tensor, vocab_size: int) -> Tensor:
    """``(V,)`` int64 histogram of ``token_ids`` (any shape), for :func:`build_vocab_mapping`.

    Args:
        token_ids: integer token ids, each in ``[0, vocab_size)``.
        vocab_size: V.
    """
    ids = torch.as_tensor(token_ids).reshape(-1).to(torch.int64)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"token ids must lie in [0, vocab_size={vocab_size}), got range [{int(ids.min())}, {int(ids.max())}]"
        )
    return torch.bincount(ids.cpu(), minlength=vocab_size)


def check_vocabularies(policy: torch.nn.Module, draft: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless ``draft`` was built for ``policy``'s vocabulary (its ``vocab_size`` and ``t2d``)."""
    pv = getattr(getattr(policy, "config", None), "vocab_size", None)
    dv = getattr(getattr(draft, "config", None), "vocab_size", None)
    t2d = getattr(draft, "t2d", None)
    if pv is not None and dv is not None and pv != dv:
        raise ValueError(
            f"mismatched vocabularies: the policy has vocab_size={pv} but the draft was built for "
            f"vocab_size={dv}; build the draft with Eagle3Draft.from_policy(policy)"
        )
    if pv is not None and isinstance(t2d, Tensor) and t2d.numel() != pv:
        raise ValueError(
            f"mismatched vocabularies: draft.t2d has {t2d.numel()} entries but the policy has "
            f"vocab_size={pv}; rebuild the draft vocabulary mapping for this policy"
        )
