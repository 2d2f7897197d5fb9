"""The per-chunk state of the embedded engine's decode loop, and its decode dtypes.

:class:`LiveRows` holds the live rows of one ``SpeculativeEngine.generate`` chunk and everything indexed by them
(caches, pending tokens, lengths, the draft's step-0 output, deferred catch-ups, acceptance estimates, noise);
:meth:`LiveRows.keep` drops finished rows from all of it at once (rollout/embedded/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.models.precision import AUTO, resolve_dtype
from lightning_codraft.rollout.embedded.adaptive import AcceptanceEstimates
from lightning_codraft.rollout.sampling.noise import CounterNoise

Taps = tuple[torch.Tensor, ...]


@dataclass
class LiveRows:
    """The live rows of one ``generate`` chunk and everything indexed by them."""

    active: list[int]  # original index of each live row
    emitted: list[int]  # tokens emitted so far per row
    budget: list[int]  # tokens each row may emit
    pcache: KVCache
    dcache: KVCache | None
    pending: torch.Tensor  # (B,) emitted token not yet fed to the policy
    length: torch.Tensor  # (B,) tokens in the policy cache
    doff: torch.Tensor  # (B,) draft cache slot = policy position - doff (positions skipped by round.resume)
    h_last: torch.Tensor | None  # (B, H) draft output at position length - 1 (stale while a catch-up is deferred)
    dl_last: torch.Tensor | None  # (B, Vd) its logits
    backlog: list[tuple[Taps, torch.Tensor]]  # k = 0 rounds whose draft catch-up is deferred: taps, next ids
    estimates: AcceptanceEstimates | None
    noise: CounterNoise  # the rows' counter-based noise (their seeds)
    out_pos: torch.Tensor  # (B,) output position of the pending token's successor (tokens emitted so far)
    prompt: tuple[Taps, torch.Tensor, torch.Tensor] | None = None
    """The prompts' draft catch-up, deferred until the first drafting round (adaptive engines: a batch that never
    drafts never runs its draft over the prompts): taps ``(B, P, H)`` each, next ids ``(B, P)``, lengths ``(B,)``."""

    def catch_up_span(self, window: int) -> int:
        """Positions a row's draft still has to catch up on before it can propose (0: none): the deferred prompt's
        padded width plus the deferred rounds (at most ``window`` of them)."""
        return (0 if self.prompt is None else self.prompt[1].shape[1]) + min(len(self.backlog), window)

    def reserve(self, slots: int) -> None:
        """Grow both caches to hold ``slots`` slots a row (:meth:`KVCache.reserve`; the draft's slots never
        exceed the policy's)."""
        self.pcache.reserve(slots)
        if self.dcache is not None:
            self.dcache.reserve(slots)

    def keep(self, rows: list[int]) -> None:
        """Keep ``rows`` (an order :meth:`KVCache.compact` accepts), slot ``i`` taking row ``rows[i]``."""
        sel = torch.tensor(rows, device=self.pending.device)
        self.active, self.emitted, self.budget = (
            [xs[i] for i in rows] for xs in (self.active, self.emitted, self.budget)
        )
        self.pcache = self.pcache.compact(rows)
        self.dcache = None if self.dcache is None else self.dcache.compact(rows)
        self.pending, self.length, self.doff = self.pending[sel], self.length[sel], self.doff[sel]
        self.noise, self.out_pos = self.noise.select(sel), self.out_pos[sel]
        if self.h_last is not None:
            self.h_last, self.dl_last = self.h_last[sel], self.dl_last[sel]
        self.backlog = [(tuple(t[sel] for t in taps), nxt[sel]) for taps, nxt in self.backlog]
        if self.prompt is not None:
            taps, nxt, lens = self.prompt
            self.prompt = (tuple(t[sel] for t in taps), nxt[sel], lens[sel])
        if self.estimates is not None:
            self.estimates.select(rows)


DECODE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decode_dtype(dtype: torch.dtype | str | None, device: torch.device | str = "cpu") -> torch.dtype | None:
    """A decode dtype from its name or itself (None stays None; ``"auto"``: bfloat16 where it is fast on
    ``device``, else float32, see :func:`~lightning_codraft.models.precision.resolve_dtype`); anything else is a
    clear error."""
    if dtype is None or dtype in DECODE_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and (dtype in DECODE_DTYPES or dtype == AUTO):
        return DECODE_DTYPES[resolve_dtype(dtype, device)]
    raise ValueError(f"dtype={dtype!r} must be None, 'auto' or one of {sorted(DECODE_DTYPES)} (or the torch dtype)")
