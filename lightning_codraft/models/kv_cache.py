"""``KVCache``: a preallocated per-layer key/value cache for batched decoding with ragged row lengths.

Layout: ``k[l]``, ``v[l]`` are ``(B, Hkv, C, D)`` for layer ``l`` (C = capacity), ``lengths`` ``(B,)`` int64
counts the valid slots of each row; slot ``p`` of row ``b`` holds the key/value of the token at absolute
position ``p``. A decode step with ``S`` new tokens per row:

1. ``pos = cache.positions(S)`` -> ``(B, S)`` absolute positions ``lengths[b] + arange(S)``;
2. per layer: ``cache.write(l, k_new, v_new)`` stores ``(B, S, Hkv, D)`` at those slots, then attention reads
   ``cache.k[l]``/``cache.v[l]`` (``attention.cached.cached_attention`` masks slot ``> pos``);
3. ``cache.advance(num_new)`` moves each row on by its own count (default ``S``). Slots written past a row's
   new length (right-padded prefill) are stale and are overwritten by the next step before they become visible.

``truncate(lengths)`` rolls rows back (rejected speculative tokens) without touching the tensors.
``reserve(slots)`` grows the tensors in blocks as rows lengthen: a cache that holds only a block more than its
longest row can be attended whole, which on CPU avoids copying a slice of it in every layer (see
docs/design/rollout.md, "decode attention").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    """Per-layer key/value cache.

    Attributes:
        k: per layer ``(B, Hkv, C, D)`` keys (RoPE already applied).
        v: per layer ``(B, Hkv, C, D)`` values.
        lengths: ``(B,)`` int64 number of valid slots per row.
    """

    k: list[Tensor]
    v: list[Tensor]
    lengths: Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """Zero-filled cache of ``capacity`` slots per row, all rows empty."""
        for name, value in (
            ("num_layers", num_layers),
            ("batch_size", batch_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("capacity", capacity),
        ):
            if value < 1:
                raise ValueError(f"KVCache.allocate: {name}={value} must be >= 1")
        shape = (batch_size, num_kv_heads, capacity, head_dim)
        return cls(
            k=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            v=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
            lengths=torch.zeros(batch_size, dtype=torch.int64, device=device),
        )

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def batch_size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.k[0].shape[2])

    def positions(self, num_tokens: int) -> Tensor:
        """``(B, S)`` int64 absolute positions of ``S = num_tokens`` new tokens per row; checks capacity."""
        need = int(self.lengths.max()) + num_tokens
        if need > self.capacity:
            raise ValueError(
                f"KVCache overflow: a row at length {int(self.lengths.max())} + {num_tokens} new tokens "
                f"needs {need} slots but capacity is {self.capacity}; allocate a larger cache"
            )
        return self.lengths[:, None] + torch.arange(num_tokens, device=self.lengths.device)

    def write(self, layer: int, k_new: Tensor, v_new: Tensor) -> None:
        """Store new keys/values of layer ``layer`` at slots ``positions(S)``.

        Args:
            layer: layer index in ``[0, num_layers)``.
            k_new: ``(B, S, Hkv, D)`` keys of the new tokens (RoPE applied).
            v_new: ``(B, S, Hkv, D)`` values.
        """
        B, S = k_new.shape[:2]
        if B != self.batch_size or k_new.shape[2:] != (self.k[layer].shape[1], self.k[layer].shape[3]):
            raise ValueError(
                f"KVCache.write: k_new {tuple(k_new.shape)} does not fit cache rows (B, Hkv, C, D)="
                f"{tuple(self.k[layer].shape)}; expected (B, S, Hkv, D)"
            )
        slots = self.positions(S)
        rows = torch.arange(B, device=slots.device)[:, None].expand(B, S)
        self.k[layer][rows, :, slots] = k_new.to(self.k[layer].dtype)
        self.v[layer][rows, :, slots] = v_new.to(self.v[layer].dtype)

    def reserve(self, slots: int, block: int = 32) -> None:
        """Hold at least ``slots`` slots per row: if the tensors are shorter, replace them (every layer) by
        tensors of ``slots`` rounded up to a multiple of ``block``, with the old slots copied and the new ones zero.

        Call it on the cache that owns the storage: views from :meth:`select` keep the old tensors.

        Args:
            slots: slots needed (``>= 1``), e.g. the longest row plus the tokens about to be written.
            block: growth granularity (``>= 1``): a growth copies the whole cache, so it should be rare.
        """
        if slots < 1 or block < 1:
            raise ValueError(f"KVCache.reserve: slots={slots} and block={block} must be >= 1")
        old = self.capacity
        if slots <= old:
            return
        new = -(-slots // block) * block
        for tensors in (self.k, self.v):
            for i, t in enumerate(tensors):
                grown = t.new_zeros(t.shape[0], t.shape[1], new, t.shape[3])
                grown[:, :, :old] = t
                tensors[i] = grown

    def advance(self, num_new: Tensor | int) -> None:
        """Grow every row by ``num_new`` (an int or ``(B,)``) slots after all layers have written."""
        num_new = torch.as_tensor(num_new, dtype=torch.int64, device=self.lengths.device).expand(self.batch_size)
        if bool((num_new < 0).any()):
            raise ValueError(f"KVCache.advance: num_new={num_new.tolist()} must be >= 0")
        new = self.lengths + num_new
        if int(new.max()) > self.capacity:
            raise ValueError(f"KVCache.advance: lengths {new.tolist()} exceed capacity {self.capacity}")
        self.lengths = new

    def truncate(self, lengths: Tensor | int) -> None:
        """Roll rows back to ``lengths`` (an int or ``(B,)``), each ``<=`` its current length."""
        lengths = torch.as_tensor(lengths, dtype=torch.int64, device=self.lengths.device).expand(self.batch_size)
        if bool((lengths < 0).any()) or bool((lengths > self.lengths).any()):
            raise ValueError(
                f"KVCache.truncate: lengths {lengths.tolist()} must be in [0, current lengths {self.lengths.tolist()}]"
            )
        self.lengths = lengths.clone()

    def select(self, rows: Tensor | int | slice) -> KVCache:
        """A cache of some rows: ``rows`` (B',) indices (copies), or an int n for the first n rows or a slice of
        rows (views of the same storage, with their own ``lengths``: writing through them writes this cache's
        slots)."""
        if isinstance(rows, (int, slice)):
            rows = slice(0, rows) if isinstance(rows, int) else rows
            return KVCache(k=[t[rows] for t in self.k], v=[t[rows] for t in self.v], lengths=self.lengths[rows])
        return KVCache(
            k=[t.index_select(0, rows) for t in self.k],
            v=[t.index_select(0, rows) for t in self.v],
            lengths=self.lengths.index_select(0, rows),
        )

    def compact(self, rows: Sequence[int]) -> KVCache:
        """Keep ``rows`` (new slot ``i`` holds old row ``rows[i]``) in this cache's own storage, copying only the
        rows that change slot; a batch that drops a few finished rows then moves a few rows, not the whole cache
        (:meth:`select` copies every kept row into new tensors).

        Every row that moves must come from past ``len(rows)`` (:func:`hole_filling_order` gives such an order), so
        no row is overwritten before it is read. Returns views of the first ``len(rows)`` rows; this cache's other
        rows are dropped and it must not be used after.
        """
        rows, B = [int(r) for r in rows], self.batch_size
        n = len(rows)
        moves = [(i, r) for i, r in enumerate(rows) if r != i]
        if n < 1 or len(set(rows)) != n or not all(0 <= r < B for r in rows) or any(r < n for _, r in moves):
            raise ValueError(
                f"KVCache.compact: rows {rows} must be distinct rows of this {B}-row cache, each either "
                f"in its own slot or moved from past slot {n - 1} (use hole_filling_order)"
            )
        if moves:
            dst = torch.tensor([i for i, _ in moves], device=self.lengths.device)
            src = torch.tensor([r for _, r in moves], device=self.lengths.device)
            for t in (*self.k, *self.v):
                t.index_copy_(0, dst, t.index_select(0, src))
        lengths = self.lengths.index_select(0, torch.tensor(rows, device=self.lengths.device))
        return KVCache(k=[t[:n] for t in self.k], v=[t[:n] for t in self.v], lengths=lengths)

    def reset(self) -> None:
        """Empty every row."""
        self.lengths = torch.zeros_like(self.lengths)


def hole_filling_order(live: Sequence[bool]) -> list[int]:
    """The rows to keep of a batch whose rows ``live[i]`` survive, in an order for :meth:`KVCache.compact` that
    moves the fewest rows: live rows among the first ``n = sum(live)`` stay in their slots, and each dead slot
    among those takes a live row from past ``n``.

    Example: ``live = [T, F, T, F, T, T]`` -> ``[0, 5, 2, 4]`` (rows 5 and 4 fill slots 1 and 3).
    """
    live = [bool(x) for x in live]
    n = sum(live)
    movers = [r for r in range(len(live) - 1, n - 1, -1) if live[r]]
    return [r if live[r] else movers.pop(0) for r in range(n)]
