"""One verification round of the embedded engine, as its definition reads: choose k -> propose -> verify -> emit.

:func:`run_round` advances every live row of a ``SpeculativeEngine.generate`` chunk by one round:

1. **choose** how many tokens to draft (K for a fixed engine; the controller picks 0..K for an adaptive one);
2. **propose** k tokens with the draft (first catching the draft up on positions a deferred round skipped);
3. **verify** them with ONE policy forward over ``[pending token, proposals]`` (``TokenSampler.verify``: the
   accepted prefix and a bonus token, lossless);
4. **catch the draft up** on the verified positions (or defer that when no draft token was proposed);
5. **emit** the accepted tokens and the bonus, up to a stop token or the row's budget.

The per-chunk constants and outputs live in :class:`Chunk`, the round's result in the typed :class:`Verified`
record, its timing in the cost model's :class:`~lightning_codraft.rollout.embedded.cost_model.RoundClock` (what an adaptive
engine's controller learns costs from). docs/design/decoding.md describes the algorithm; the draft's side
(:func:`propose`, :func:`catch_up`, :func:`resume`) is below, the verification rule in rollout/sampling/sampler.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch

from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder
from lightning_codraft.rollout.embedded.batch import LiveRows, Taps
from lightning_codraft.rollout.embedded.cost_model import RoundClock
from lightning_codraft.rollout.engine import AcceptanceStats, ForwardObserver
from lightning_codraft.rollout.sampling.rules import sampling_logprobs
from lightning_codraft.rollout.sampling.sampler import RoundNoise, TokenSampler


def pick(captured: Optional[Taps], ids: Optional[Sequence[int]], want: Optional[Sequence[int]]) -> Optional[Taps]:
    """The captured taps of ids ``want`` (in that order) out of those captured for ``ids``."""
    if captured is None or want is None:
        return None
    where = {t: i for i, t in enumerate(ids)}
    return tuple(captured[where[t]] for t in want)


# ---------------------------------------------------------------- the draft's side of a round
# The draft's KV cache holds, for each live row, the draft keys of the positions it has caught up on; ``b.h_last`` /
# ``b.dl_last`` (its output at the row's last caught-up position) seed the next proposal chain. Work an adaptive
# engine defers (the prompts until the first drafting round, the k = 0 rounds since drafting stopped) is kept on
# the LiveRows and done by ``resume`` when drafting starts again.


def propose(
    pdec: PolicyDecoder,
    ddec: DraftDecoder,
    b: LiveRows,
    k: int,
    sampler: TokenSampler,
    rn: RoundNoise,
    stop: Callable[[list[list[float]]], int | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[list[float]]]:
    """Chain-draft up to k tokens from the step-0 output ``b.h_last`` (B, H), ``b.dl_last`` (B, Vd).

    Args:
        stop: with it, each proposal's confidence is measured and, after each proposal, ``stop(confidences)``
            (``(n, B)`` of the n drawn so far) says how many of them to verify, or None to draft another
            (the adaptive controller's :meth:`~lightning_codraft.rollout.embedded.adaptive.SpeculationController.verify_length`);
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


def catch_up(
    pdec: PolicyDecoder,
    ddec: DraftDecoder,
    b: LiveRows,
    taps: Taps,
    next_ids: torch.Tensor,
    last: torch.Tensor,
    new_lengths: torch.Tensor,
) -> None:
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


@dataclass
class Chunk:
    """What every round of one chunk shares: the decoders, the sampler, the taps, and the rows' outputs."""

    pdec: PolicyDecoder
    ddec: Optional[DraftDecoder]
    sampler: TokenSampler
    controller: Any  # a SpeculationController, or None for a fixed K
    max_k: int  # K
    spare: int  # cache slots a round may write past the committed length
    fwd_taps: Optional[tuple[int, ...]]  # taps each policy forward captures (the draft's and the observer's)
    draft_taps: Optional[tuple[int, ...]]  # the draft's taps (None without a draft)
    observer_taps: tuple[int, ...] = ()
    observer: Optional[ForwardObserver] = None
    requests: Sequence[int] = ()  # row -> the request index the observer knows it by
    stops: frozenset = frozenset()
    tokens: list[list[int]] = field(default_factory=list)  # per original row
    logprobs: list[list[float]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    stats: list[AcceptanceStats] = field(default_factory=list)

    @property
    def drafts(self) -> bool:
        return self.ddec is not None and self.max_k > 0


@dataclass
class Verified:
    """What one round verified, per live row (``B`` rows)."""

    k: int  # draft tokens verified
    drafted: int  # proposals the draft made (> k when a confidence stop cut the chain)
    confidences: Any  # the draft's confidence per proposal (adaptive, confidence stop) or None
    accepted: torch.Tensor  # (B,) accepted proposals
    host_accepted: list[int]  # the same, on the host
    bonus: torch.Tensor  # (B,) the token after the accepted ones (the policy's)
    new_ids: torch.Tensor  # (B, k + 1) accepted proposals, then the bonus at column ``accepted``
    new_lp: torch.Tensor  # (B, k + 1) their log-probabilities under the sampling distribution
    new_length: torch.Tensor  # (B,) policy cache length after the round
    logits: torch.Tensor  # (B, k + 1, V) the verify forward's logits (for the observer)
    taps: Optional[Taps]  # the verify forward's captured taps (chunk.fwd_taps)


def run_round(b: LiveRows, chunk: Chunk, done: list[bool]) -> None:
    """Advance every live row of ``b`` by one round; ``done[i]`` becomes True for a row that finished."""
    clock = RoundClock(b.pending.device)
    b.reserve(int(b.length.max()) + chunk.spare)
    k, remaining, span = _choose_k(b, chunk, clock)
    ctl = chunk.controller
    if k and (b.backlog or b.prompt is not None):  # deferred catch-ups first (adaptive engines only)
        with clock.block("catch_up"):
            resume(chunk.pdec, chunk.ddec, b, ctl.config.resume_window)
        ctl.record_catch_up(len(b.active), span, clock.last)
    with clock.block("policy"):  # rejection sampling draws the round's noise now (timed with the verify)
        rn = chunk.sampler.start_round(b.noise, b.out_pos, k)
    with clock.block("draft"):
        draft_ids, q, confidences, drafted = _propose(b, chunk, k, rn, remaining)
    with clock.block("policy"):
        v = _verify(b, chunk, draft_ids, q, rn, drafted, confidences)
    observed = (b.active, b.length, pick(v.taps, chunk.fwd_taps, chunk.observer_taps)) if chunk.observer else None
    _feed_draft(b, chunk, v, clock)
    emitted = list(b.emitted)
    _emit(b, chunk, v, done)
    b.length, b.pending, b.out_pos = v.new_length, v.bonus, b.out_pos + 1 + v.accepted
    if ctl is not None:
        ctl.observe(b.estimates, v.k, v.host_accepted, v.confidences)
        ctl.record_round(len(b.active), v.k, clock["policy"], clock["draft"], clock.rest(), v.drafted)
        _charge(b, chunk, v.k, clock.elapsed(), emitted)
    if observed is not None:  # after the round's clocks: the observer's time is not the engine's
        active, fed_from, seen_taps = observed
        chunk.observer.decode(
            [chunk.requests[r] for r in active],
            fed_from.tolist(),
            [a + 1 for a in v.host_accepted],
            seen_taps,
            v.logits,
        )


def _charge(b: LiveRows, chunk: Chunk, k: int, seconds: float, emitted_before: list[int]) -> None:
    """Charge the round's ``seconds`` to its rows (:func:`charge_round`)."""
    B = len(b.active)
    charge_round(
        [chunk.stats[r] for r in b.active],
        [e - e0 for e, e0 in zip(b.emitted, emitted_before)],
        seconds,
        None if k == 0 else chunk.controller.costs.plain_seconds(B, 1),
    )


def charge_round(stats: list[AcceptanceStats], emitted: list[int], seconds: float, plain_step: float | None) -> None:
    """Charge a round's ``seconds`` to its B rows (1/B each) beside what plain decoding would have spent on the
    tokens each emitted (:attr:`AcceptanceStats.plain_s`): a plain round (``plain_step`` None) is its own measure, a
    drafting round's tokens are priced at ``plain_step``, the cost model's plain step per row at this batch size."""
    share = seconds / len(stats)
    per_token = share if plain_step is None else plain_step
    for st, n in zip(stats, emitted):
        st.round_s += share
        st.plain_s += per_token * n


def _choose_k(b: LiveRows, chunk: Chunk, clock: RoundClock) -> tuple[int, Optional[list[int]], int]:
    """The round's draft length, the rows' remaining budgets and the deferred catch-up's span it was weighed with."""
    ctl = chunk.controller
    if ctl is None or not chunk.drafts:
        return (chunk.max_k if chunk.drafts else 0), None, 0
    if ctl.needs_calibration(len(b.active)):
        ctl.calibrate(chunk.pdec, chunk.ddec, b.pcache, b.dcache, b.pending, chunk.draft_taps, chunk.sampler)
        clock.restart()  # the calibration is not this round's cost
    span = b.catch_up_span(ctl.config.resume_window)
    remaining = [n - e for n, e in zip(b.budget, b.emitted)]
    return ctl.choose(b.estimates, remaining, catch_up_span=span), remaining, span


def _propose(b: LiveRows, chunk: Chunk, k: int, rn, remaining) -> tuple[torch.Tensor, Any, Any, int]:
    """``(draft_ids (B, k'), q, confidences, drafted)``: k' <= k proposals (a confidence stop may end the chain).

    Rejection sampling corrects proposals drawn from q; a length chosen after seeing them would not be (a sure
    proposal kept, an unsure one dropped), so only greedy and coupled rounds may stop on the draft's confidence."""
    if not k:
        return b.pending.new_zeros(len(b.active), 0), None, None, 0
    ctl, stop = chunk.controller, None
    if ctl is not None and ctl.config.use_confidence and not chunk.sampler.uses_draft_probs:
        stop = partial(ctl.verify_length, b.estimates, remaining, max_k=k)
    draft_ids, q, confidences = propose(chunk.pdec, chunk.ddec, b, k, chunk.sampler, rn, stop)
    return draft_ids, q, confidences, len(confidences) if stop is not None else draft_ids.shape[1]


def _verify(b: LiveRows, chunk: Chunk, draft_ids: torch.Tensor, q, rn, drafted: int, confidences) -> Verified:
    """One policy forward over ``[pending, proposals]``, then the sampler's accept / bonus rule."""
    params = chunk.sampler.params
    logits, taps = chunk.pdec.forward(torch.cat([b.pending[:, None], draft_ids], dim=1), b.pcache, chunk.fwd_taps)
    lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)  # (B, k+1, V)
    accepted, bonus = chunk.sampler.verify(lp, draft_ids, q, rn)
    new_ids = torch.cat([draft_ids, torch.zeros_like(b.pending[:, None])], dim=1)
    new_ids[torch.arange(len(b.active), device=new_ids.device), accepted] = bonus
    new_length = b.length + 1 + accepted
    b.pcache.lengths = new_length
    return Verified(
        k=draft_ids.shape[1],
        drafted=drafted,
        confidences=confidences,
        accepted=accepted,
        host_accepted=accepted.tolist(),
        bonus=bonus,
        new_ids=new_ids,
        new_lp=lp.gather(2, new_ids[..., None]).squeeze(2),
        new_length=new_length,
        logits=logits,
        taps=taps,
    )


def _feed_draft(b: LiveRows, chunk: Chunk, v: Verified, clock: RoundClock) -> None:
    """The draft catches up on the verified positions; a round without proposals defers that (adaptive)."""
    if not chunk.drafts:
        return
    taps = pick(v.taps, chunk.fwd_taps, chunk.draft_taps)
    if v.k:
        span = max(v.host_accepted) + 1
        with clock.block("catch_up"):
            catch_up(
                chunk.pdec,
                chunk.ddec,
                b,
                tuple(t[:, :span] for t in taps),
                v.new_ids[:, :span],
                v.accepted,
                v.new_length,
            )
        if chunk.controller is not None:
            chunk.controller.record_catch_up(len(b.active), span, clock.last)
        return
    b.backlog.append((taps, v.bonus[:, None]))
    if len(b.backlog) > chunk.controller.config.resume_window:  # only the last window is ever used
        b.backlog.pop(0)
        b.doff = b.doff + 1


def _emit(b: LiveRows, chunk: Chunk, v: Verified, done: list[bool]) -> None:
    """Each row keeps its accepted tokens and the bonus, up to the first stop token and its budget."""
    for i, (a, ids_i, lp_i) in enumerate(zip(v.host_accepted, v.new_ids.tolist(), v.new_lp.tolist())):
        r = b.active[i]
        n = min(a + 1, b.budget[i] - b.emitted[i])
        stop_at = next((j for j in range(n) if ids_i[j] in chunk.stops), None)
        if stop_at is not None:
            n = stop_at + 1
            chunk.finish[r] = "stop"
        chunk.tokens[r].extend(ids_i[:n])
        chunk.logprobs[r].extend(lp_i[:n])
        b.emitted[i] += n
        done[i] = stop_at is not None or b.emitted[i] >= b.budget[i]
        chunk.stats[r].record_round(v.k, n - 1)  # proposals accepted past a stop or the budget are not emitted
