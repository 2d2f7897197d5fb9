"""Decode-time forwards over KV caches: the interface the rollout engine calls, and its fast fused implementation.

Two interfaces, each with two implementations (the fused ones in models/fused_decode.py):

- :class:`PolicyDecoder` (``allocate_cache``, ``embed``, ``forward``): :class:`FusedPolicyDecoder` computes what
  ``Policy.forward(ids, kv_cache=...)`` computes, from the policy's own parameters, with fewer ops per layer;
  :class:`ModulePolicyDecoder` calls the module's ``forward(ids, kv_cache=, taps=)`` itself.
- :class:`DraftDecoder` (``allocate_cache``, ``fuse``, ``step``): :class:`FusedDraftDecoder` computes what
  ``Eagle3Draft.step`` computes; :class:`ModuleDraftDecoder` calls the module's ``fuse`` / ``step``.

``Policy.decoder(capacity)`` and ``Eagle3Draft.decoder(capacity)`` return the fused decoder (subclasses inherit
it) unless their parameters are not plain tensors (DTensor shards) or a subclass changed the decode math (an
overridden ``fuse`` / ``step`` / ``forward``, a swapped layer: :func:`custom_decode_math`), then the module path, so
the draft that generates is always the draft that trains. :func:`policy_decoder`
and :func:`draft_decoder` ask any module for its ``decoder``; modules without one (wrappers, other
implementations of the engine's contract) get the module path.

At rollout sizes a decode step is bound by per-op overhead (Python dispatch and small kernels), not FLOPs. The
fused decoders read the weights at construction (build one per ``generate`` call, after any weight update) and:

- run q/k/v and gate/up projections as one matmul each (weights concatenated once per construction);
- gather RoPE cos/sin from a table built once for every cache slot (the same elementwise values the modules
  compute per step) and rotate q and k together;
- build the attention mask, cache slots and positions once per forward, shared by all layers;
- check capacity once per forward instead of in every layer;
- compute logits only at the rows the caller needs (``logit_rows``);
- on CPU, multiply by weights packed once for oneDNN (models/packed_linear.py) and attend to a whole cache
  grown in blocks rather than copy a slice of it (``attention.cached.attended_slots``).

Caches are :class:`~lightning_codraft.models.kv_cache.KVCache` objects (same layout, same ``lengths``
semantics) whatever the implementation. Fused values equal the module path up to floating-point reassociation
of the fused matmuls (fp32: ~1e-6); tests/models/test_decode.py compares both with a full recompute.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from lightning_codraft.models.fused_decode import Taps, _FusedMath, gather_rows
from lightning_codraft.models.kv_cache import KVCache


@runtime_checkable
class PolicyDecoder(Protocol):
    """Decode forwards of a policy over :class:`KVCache` objects (see the module docstring)."""

    def allocate_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache of ``batch_size`` rows and ``capacity`` slots, in the parameters' dtype and device."""
        ...

    def embed(self, ids: Tensor) -> Tensor:
        """ids ``(...)`` -> ``(..., H)`` token embeddings."""
        ...

    def forward(
        self, ids: Tensor, cache: KVCache, taps: Sequence[int] | None = None, logit_rows: Tensor | None = None
    ) -> tuple[Tensor, Taps | None]:
        """S new tokens per row at positions ``cache.lengths[b] + arange(S)``; the cache advances by S.

        Args:
            ids: ``(B, S)`` token ids.
            cache: the policy's cache (one entry per layer), written in place.
            taps: tap ids to capture (tap ``l`` = hidden state entering layer ``l``; ``L`` = last layer's output).
            logit_rows: ``(B,)`` one position per row to compute logits at (None: every position).

        Returns:
            logits ``(B, S, V)``, or ``(B, V)`` with ``logit_rows``; the taps, each ``(B, S, H)``, in the order
            asked (None when not asked).
        """
        ...


@runtime_checkable
class DraftDecoder(Protocol):
    """Decode forwards of an EAGLE-3 draft over one-layer :class:`KVCache` objects."""

    def allocate_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty one-layer cache, in the parameters' dtype and device."""
        ...

    def fuse(self, taps: Taps) -> Tensor:
        """Three ``(B, S, H)`` policy taps -> ``(B, S, H)`` draft hidden input ``fc(cat(taps))``."""
        ...

    def step(
        self, hidden: Tensor, embeds: Tensor, cache: KVCache, logit_rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """One draft step over S positions per row; the cache advances by S.

        Args:
            hidden: ``(B, S, H)`` hidden input (fused taps or a previous step's output).
            embeds: ``(B, S, H)`` policy embeddings of the token following each position.
            cache: the draft's one-layer cache, written in place.
            logit_rows: ``(B,)`` one position per row to return (None: every position).

        Returns:
            hidden_out ``(B, S, H)`` and logits ``(B, S, Vd)``, or ``(B, H)`` and ``(B, Vd)`` with ``logit_rows``.
        """
        ...


def plain_parameters(module: nn.Module) -> bool:
    """True when every parameter is a plain tensor (not a DTensor shard or another tensor subclass)."""
    return all(type(p) in (torch.Tensor, nn.Parameter) for p in module.parameters())


def custom_decode_math(module: nn.Module, base: type, methods: Sequence[str]) -> list[str]:
    """What of ``module``'s decode math is not ``base``'s: the names in ``methods`` its class overrides, and
    submodules of classes from outside this package and ``torch.nn`` (a swapped layer). The fused decoders
    re-implement the base class's math, so a module with any of these must decode through its own methods."""
    changed = [name for name in methods if getattr(type(module), name) is not getattr(base, name)]
    changed += [
        f"{name} ({type(m).__name__})"
        for name, m in module.named_modules()
        if name and not type(m).__module__.startswith(("lightning_codraft.models.", "torch.nn."))
    ]
    return changed


def _make_decoder(module: nn.Module, capacity: int, dtype: torch.dtype | None, fallback, kind: str):
    """``module.decoder(capacity[, dtype=])`` when the module has one, else ``fallback(module)``; a ``dtype`` other
    than the parameters' needs a decoder that casts (the fused ones), else a clear error."""
    make = getattr(module, "decoder", None)
    if dtype is None or dtype == next(module.parameters()).dtype:
        return make(capacity) if callable(make) else fallback(module)
    dec = make(capacity, dtype=dtype) if callable(make) else None
    if not isinstance(dec, _FusedMath):
        raise ValueError(
            f"decoding a {type(module).__name__} in {dtype} needs its fused {kind} decoder (plain-tensor "
            f"parameters of a Policy / Eagle3Draft or a subclass); this module decodes through its own "
            f"forward, in its parameters' dtype {next(module.parameters()).dtype}: cast the module "
            "instead, or decode in that dtype"
        )
    return dec


def policy_decoder(policy: nn.Module, capacity: int, dtype: torch.dtype | None = None) -> PolicyDecoder:
    """``policy.decoder(capacity)`` when the module has one, else a :class:`ModulePolicyDecoder`; ``dtype``: decode
    in this dtype (a cast copy of the weights, taken now; None: the parameters' own)."""
    return _make_decoder(policy, capacity, dtype, ModulePolicyDecoder, "policy")


def draft_decoder(draft: nn.Module, capacity: int, dtype: torch.dtype | None = None) -> DraftDecoder:
    """``draft.decoder(capacity)`` when the module has one, else a :class:`ModuleDraftDecoder`; ``dtype`` as in
    :func:`policy_decoder`."""
    return _make_decoder(draft, capacity, dtype, ModuleDraftDecoder, "draft")


def _cache_like(module: nn.Module, config, num_layers: int, batch_size: int, capacity: int) -> KVCache:
    """A cache shaped from a HF-style ``config`` (``num_key_value_heads``, ``head_dim``), like ``module``'s params."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or int(config.hidden_size) // heads)
    p = next(module.parameters())
    return KVCache.allocate(num_layers, batch_size, kv_heads, head_dim, capacity, p.dtype, p.device)


# ---------------------------------------------------------------------------------------------- module path
class ModulePolicyDecoder:
    """:class:`PolicyDecoder` through the module's own ``forward(ids, kv_cache=, taps=)`` and ``embed``.

    Args:
        policy: any module with that ``forward``, ``embed`` and a HF-style ``config``.
    """

    def __init__(self, policy: nn.Module):
        self.module = policy

    def allocate_cache(self, batch_size: int, capacity: int) -> KVCache:
        allocate = getattr(self.module, "allocate_kv_cache", None)
        if callable(allocate):
            return allocate(batch_size, capacity)
        c = self.module.config
        return _cache_like(self.module, c, int(c.num_hidden_layers), batch_size, capacity)

    def embed(self, ids: Tensor) -> Tensor:
        return self.module.embed(ids)

    def forward(
        self, ids: Tensor, cache: KVCache, taps: Sequence[int] | None = None, logit_rows: Tensor | None = None
    ) -> tuple[Tensor, Taps | None]:
        out = self.module(ids, kv_cache=cache, taps=taps)
        return gather_rows(out.logits, logit_rows), out.taps


class ModuleDraftDecoder:
    """:class:`DraftDecoder` through the module's own ``fuse`` and ``step(hidden, embeds, kv_cache)``.

    Args:
        draft: any module with that ``fuse`` / ``step`` and a HF-style ``config``.
    """

    def __init__(self, draft: nn.Module):
        self.module = draft

    def allocate_cache(self, batch_size: int, capacity: int) -> KVCache:
        allocate = getattr(self.module, "allocate_kv_cache", None)
        if callable(allocate):
            return allocate(batch_size, capacity)
        return _cache_like(self.module, self.module.config, 1, batch_size, capacity)

    def fuse(self, taps: Taps) -> Tensor:
        return self.module.fuse(taps)

    def step(
        self, hidden: Tensor, embeds: Tensor, cache: KVCache, logit_rows: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        out, logits = self.module.step(hidden, embeds, cache)
        return gather_rows(out, logit_rows), gather_rows(logits, logit_rows)
