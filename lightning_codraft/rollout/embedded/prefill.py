"""Prompt prefill in groups of similar lengths: each group is right-padded to its own longest prompt only.

One padded forward over a whole batch pays for ``B * max_len`` positions; with prompts of very different lengths
(GSM8K under a chat template: 60 to 300 tokens) most of them are padding. The engine sorts each batch's rows by
prompt length (rollout/embedded/speculative.py) and :func:`prefill` runs consecutive rows in groups of at most
``group_tokens`` padded positions and little padding (:func:`prefill_groups`), writing each group's slots
through a view of the shared cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_codraft.models.decode import PolicyDecoder, Taps
from lightning_codraft.models.kv_cache import KVCache


def prefill_groups(
    lengths: Sequence[int], group_tokens: int, max_padding: float = 0.125, min_group_tokens: int = 256
) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` consecutive row ranges covering ``lengths`` (ascending), each of at most
    ``group_tokens`` padded positions ``(stop - start) * lengths[stop - 1]`` (a single row may exceed it).

    A group of at least ``min_group_tokens`` padded positions also closes before a row that would make more than
    ``max_padding`` of its positions padding: the prefill's matmuls are compute-bound at these sizes, so padding
    costs in proportion, while another forward costs about one decode step (GSM8K's 16 long-tail prompts: 2688
    padded positions in one group, 1772 in three, for 1584 prompt tokens).
    """
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"prefill_groups needs ascending prompt lengths, got {list(lengths)}")
    if not 0.0 <= max_padding < 1.0 or min_group_tokens < 0:
        raise ValueError(
            f"prefill_groups: max_padding={max_padding} must be in [0, 1) and min_group_tokens={min_group_tokens} >= 0"
        )
    groups, start, real = [], 0, 0
    for i, n in enumerate(lengths):
        padded = (i + 1 - start) * n
        wasteful = (i - start) * lengths[i - 1] >= min_group_tokens and padded - real - n > max_padding * padded
        if i > start and (padded > group_tokens or wasteful):
            groups.append((start, i))
            start, real = i, 0
        real += n
    if lengths:
        groups.append((start, len(lengths)))
    return groups


def prefill(
    pdec: PolicyDecoder,
    cache: KVCache,
    ids: Tensor,
    lengths: Sequence[int],
    taps: Sequence[int] | None,
    group_tokens: int = 4096,
) -> tuple[Tensor, Taps | None]:
    """Prefill rows sorted by prompt length, group by group (:func:`prefill_groups`).

    Args:
        pdec: the policy's decoder.
        cache: the batch's empty policy cache; each group's slots are written through a view of its rows (the
            caller sets ``cache.lengths`` afterwards).
        ids: ``(B, max_len)`` right-padded prompt ids.
        lengths: the ``B`` prompt lengths, ascending.
        taps: tap ids to capture, or None.
        group_tokens: padded positions per forward at most.

    Returns:
        logits ``(B, V)`` at each row's last prompt position; the taps, each ``(B, max_len, H)`` (zero past a
        group's own width), or None.
    """
    logits, captured = [], None
    for a, b in prefill_groups(list(lengths), group_tokens):
        width = int(lengths[b - 1])
        rows = torch.tensor([int(n) - 1 for n in lengths[a:b]], device=ids.device)
        lg, tp = pdec.forward(ids[a:b, :width], cache.select(slice(a, b)), taps, logit_rows=rows)
        logits.append(lg)
        if tp is not None:
            if captured is None:
                captured = tuple(t.new_zeros(ids.shape[0], ids.shape[1], t.shape[-1]) for t in tp)
            for dst, src in zip(captured, tp):
                dst[a:b, :width] = src
    return torch.cat(logits), captured
