"""The draft's side of a speculative round (rollout/speculative.py): chain proposals, catch up on verified positions,
and resume after deferred work.

The draft's KV cache holds, for each live row, the draft keys of the positions it has caught up on. ``b.h_last`` /
``b.dl_last`` (the draft's output at the row's last caught-up position) seed the next proposal chain. Work an
adaptive engine defers (the prompts until the first drafting round, the k = 0 rounds since drafting stopped) is kept
on the :class:`~lightning_codraft.rollout.batch.LiveRows` and done by :func:`resume` when drafting starts again.
"""

from __future__ import annotations

from typing import Callable

import torch

from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder
from lightning_codraft.rollout.batch import LiveRows, Taps
from lightning_codraft.rollout.sampler import RoundNoise, TokenSampler


def propose(pdec: PolicyDecoder, ddec: DraftDecoder, b: LiveRows, k: int, sampler: TokenSampler, rn: RoundNoise,
            stop: Callable[[list[list[float]]], int | None] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None, list[list[float]]]:
    """Chain-draft up to k tokens from the step-0 output ``b.h_last`` (B, H), ``b.dl_last`` (B, Vd).

    Args:
        stop: with it, each proposal's confidence is measured and, after each proposal, ``stop(confidences)``
            (``(n, B)`` of the n drawn so far) says how many of them to verify, or None to draft another
            (the adaptive controller's :meth:`~lightning_codraft.rollout.adaptive.SpeculationController.verify_length`);
            without it all k are drawn and verified.

    Returns:
        draft_ids: (B, n) the target-vocabulary ids to verify (n <= k); draft_probs: (B, n, V) their target-space
        q (rejection sampling only, else None); confidences: ``(drawn, B)`` host floats of every proposal drawn
        (empty without ``stop``).
    """
    ids, probs, confidences = [], [], []
    hidden, logits, dcache = b.h_last, b.dl_last, b.dcache
    start = dcache.lengths  # a decoder step replaces the lengths tensor, never mutates it
    keep = k
    for j in range(k):
        d, q, conf = sampler.draw(logits, rn, j, confidence=stop is not None)
        ids.append(d)
        if q is not None:
            probs.append(q)
        if stop is not None:
            confidences.append(conf.tolist())
            n = stop(confidences)
            if n is not None:
                keep = n
                break
        if j + 1 < k:
            hidden, logits = ddec.step(hidden[:, None], pdec.embed(d[:, None]), dcache)
            hidden, logits = hidden[:, 0], logits[:, 0]
    dcache.lengths = start
    ids, probs = ids[:keep], probs[:keep]
    draft_ids = torch.stack(ids, dim=1) if ids else b.pending.new_zeros(len(b.pending), 0)
    return draft_ids, sampler.target_probs(probs) if probs else None, confidences


def catch_up(pdec: PolicyDecoder, ddec: DraftDecoder, b: LiveRows, taps: Taps, next_ids: torch.Tensor,
             last: torch.Tensor, new_lengths: torch.Tensor) -> None:
    """Draft forward at verified positions with the policy's taps; its output at index ``last`` becomes
    ``b.h_last`` / ``b.dl_last``.

    taps: 3 tensors (B, S, H); next_ids: (B, S) token following each position; last: (B,) index to read.
    The draft cache keeps the keys of the verified positions and ends at policy length ``new_lengths``.
    """
    b.h_last, b.dl_last = ddec.step(ddec.fuse(taps), pdec.embed(next_ids), b.dcache, logit_rows=last)
    b.dcache.lengths = new_lengths - b.doff


def resume(pdec: PolicyDecoder, ddec: DraftDecoder, b: LiveRows, window: int) -> None:
    """Catch the draft up on what was deferred: the prompts (a batch's first drafting round) and the k = 0 rounds
    since it last drafted: all of them, or with more than ``window`` the last ``window``, written right after the
    draft's cached positions (the skipped ones are left out: the draft keeps the prompt and the recent tokens, its
    slots lag the policy's positions by ``b.doff``)."""
    if b.prompt is not None:
        taps, nxt, lens = b.prompt
        b.prompt = None
        b.h_last, b.dl_last = ddec.step(ddec.fuse(taps), pdec.embed(nxt), b.dcache, logit_rows=lens - 1)
        b.dcache.lengths = lens
    if not b.backlog:
        return
    taps = tuple(torch.cat([e[0][i] for e in b.backlog], dim=1) for i in range(3))
    nxt = torch.cat([e[1] for e in b.backlog], dim=1)
    if nxt.shape[1] > window:
        b.doff = b.doff + (nxt.shape[1] - window)
        taps, nxt = tuple(t[:, -window:] for t in taps), nxt[:, -window:]
    last = torch.full_like(b.length, nxt.shape[1] - 1)
    catch_up(pdec, ddec, b, taps, nxt, last, b.length)
    b.backlog = []
