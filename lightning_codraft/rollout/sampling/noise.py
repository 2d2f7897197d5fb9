"""Counter-based sampling noise: every random number the engine uses is a hash of (request seed, position, purpose, id).

A rollout drawn with this noise is a pure function of its request's seed, its prompt and the weights: which
other requests share its batch, how the batch is chunked, the order of the requests and (with coupled sampling,
rollout/sampling/sampler.py) the speculation lengths change nothing, so rollouts spread over any number of ranks are the
rollouts of one process.

**The hash** is SplitMix64's finaliser ``mix64`` (Steele, Lea, Flood 2014; the ``splitmix64`` of Vigna's
xoroshiro reference), in wrapping int64 torch ops, so its bits and the uniforms are the same on every device (the
Gumbel noise then goes through float32 ``log1p`` / ``log``, whose last bit may differ between device libraries)::

    row     = mix64(seed + (purpose + 1) * G)             # (B,)     one stream per request and purpose
    stream  = mix64(row + (t + 1) * G)                    # (B, S)   one per output position t
    bits    = mix64(stream + (id + 1) * G)                # (B, S, N) SplitMix64's sequence over the ids
    U       = float32(bits & (2**63 - 1)) * 2**-63        # in (0, 1), clamped to [2**-64, 1 - 2**-24]

with ``G = 0x9E3779B97F4A7C15`` (the golden-ratio increment). Each (request, position, purpose) stream starts at
a pseudo-random point of SplitMix64's sequence; two streams share values only if their starts lie within N steps
(probability ~2N / 2**64 per pair). The uniform is the float32 nearest to a 63-bit fraction: every float32 below 1
down to ~2**-39 is reached with its own probability, so its low mantissa bits are uniform and its relative
resolution near 0 is float32's (the common ``m * 2**-24`` leaves the low mantissa bits of every value below 1/2 at
zero; tests/rollout/test_noise.py shows the difference). Exponential and Gumbel noise use ``E = -log1p(-U)``, whose
small values (the ones that decide which rare token wins an exponential race) keep that resolution.

Cost: about 20 elementwise int64 / float32 ops per element of the ``(B, S, N)`` block, in chunks of ``_CHUNK``
elements that stay in cache, plus a fixed cost per call (~35 small torch ops) that dominates small blocks
(figures: docs/design/measurements.md).

**Seeds.** Every request has a 63-bit seed: the caller's ``request_seeds[i]``, or ``request_seed(seed, i)`` for a
call-wide ``seed`` (:func:`resolve_request_seeds`).
"""

from __future__ import annotations

import numbers
import secrets
from collections.abc import Callable, Sequence

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_CHUNK = 1 << 16  # elements per hashed block: two int64 buffers of 512 KiB stay in L2


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``x``."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


_G, _S1, _S2 = _signed(_GOLDEN), _signed(_M1), _signed(_M2)

TOKEN, DRAFT, ACCEPT = 0, 1, 2
"""Purposes: TOKEN draws the policy's token at a position (and, coupled, the draft's proposal there), DRAFT the
draft's own proposal under rejection sampling, ACCEPT the uniform of the rejection test."""


def mix64_int(x: int) -> int:
    """SplitMix64's finaliser on a Python int (mod 2**64), the definition the tensor version follows."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _M1) & _MASK64
    x = ((x ^ (x >> 27)) * _M2) & _MASK64
    return x ^ (x >> 31)


def request_seed(seed: int, index: int) -> int:
    """Seed of request ``index`` of a call made with ``seed``: ``mix64(mix64(seed) + (index + 1) * G) >> 1``.

    Args:
        seed: any int (taken mod 2**64).
        index: the request's position in the call (>= 0).

    Returns:
        A seed in ``[0, 2**63)``; distinct (seed, index) pairs give unrelated seeds.
    """
    return mix64_int(mix64_int(seed) + (int(index) + 1) * _GOLDEN) >> 1


def resolve_request_seeds(num_requests: int, seed: int | None, request_seeds: Sequence[int] | None) -> list[int]:
    """Every request's seed for a ``generate`` call (the rule every engine follows).

    Args:
        num_requests: B, requests in the call.
        seed: call-wide seed: request i gets ``request_seed(seed, i)``; None (and no ``request_seeds``): a fresh
            random seed per call.
        request_seeds: B per-request seeds in ``[0, 2**63)`` (request i's samples then depend only on
            ``request_seeds[i]``, its prompt and the weights); exclusive with ``seed``.

    Returns:
        B seeds in ``[0, 2**63)``.
    """
    if request_seeds is None:
        if seed is None:
            seed = secrets.randbits(64)
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
            raise ValueError(f"seed={seed!r} must be an int or None")
        return [request_seed(int(seed), i) for i in range(num_requests)]
    if seed is not None:
        raise ValueError(
            f"got both seed={seed} and request_seeds; pass one: request_seeds fixes each request's "
            "samples, seed derives them as request_seed(seed, i)"
        )
    seeds = list(request_seeds)
    if len(seeds) != num_requests:
        raise ValueError(f"request_seeds has {len(seeds)} entries for {num_requests} prompts; pass one seed per prompt")
    for i, s in enumerate(seeds):
        if not isinstance(s, numbers.Integral) or isinstance(s, bool) or not 0 <= int(s) < 1 << 63:
            raise ValueError(
                f"request_seeds[{i}]={s!r} must be an int in [0, 2**63); derive seeds with "
                "lightning_codraft.rollout.sampling.noise.request_seed(seed, index)"
            )
    return [int(s) for s in seeds]


def seed_tensor(seeds: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """(B,) int64 tensor of request seeds."""
    return torch.tensor([_signed(int(s)) for s in seeds], dtype=torch.long, device=device)


def _mix64_(z: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser in place on int64 ``z`` (any shape), with ``tmp`` (same shape) as scratch.

    int64 multiplication wraps like uint64's (two's complement); ``>>`` on int64 shifts in the sign, so each
    logical shift masks the top bits off.
    """
    for shift, mul in ((30, _S1), (27, _S2), (31, None)):
        torch.bitwise_right_shift(z, shift, out=tmp)
        tmp.bitwise_and_((1 << (64 - shift)) - 1)
        z.bitwise_xor_(tmp)
        if mul is not None:
            z.mul_(mul)
    return z


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser of int64 ``x`` (a new tensor; the bits of ``mix64_int`` as int64)."""
    z = x.to(torch.long, copy=True)
    return _mix64_(z, torch.empty_like(z))


class CounterNoise:
    """The counter-based noise of a batch of requests (one seed per row).

    Args:
        seeds: (B,) int64 request seeds (:func:`seed_tensor`).

    Rows leave with :meth:`select`; each purpose's per-row key is hashed once and kept.
    """

    def __init__(self, seeds: torch.Tensor, _rows: dict[int, torch.Tensor] | None = None):
        self.seeds = seeds.long()
        self._rows = {} if _rows is None else _rows

    def select(self, rows: torch.Tensor) -> CounterNoise:
        """The noise of rows ``rows`` ((B',) indices) only."""
        return CounterNoise(self.seeds[rows], {p: r[rows] for p, r in self._rows.items()})

    def streams(self, positions: torch.Tensor, purpose: int) -> torch.Tensor:
        """(B, S) int64 stream key of each (row, position) for ``purpose``, from positions (B, S)."""
        if purpose not in self._rows:
            self._rows[purpose] = mix64(self.seeds + _signed((purpose + 1) * _GOLDEN))
        z = self._rows[purpose][:, None] + (positions.long() + 1) * _G
        return _mix64_(z, torch.empty_like(z))

    def uniform(
        self,
        positions: torch.Tensor,
        purpose: int,
        ids: torch.Tensor | None = None,
        transform: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Counter-based uniforms ``U(seed_b, positions[b, s], purpose, ids[n])`` in (0, 1).

        Args:
            positions: (B, S) int64 output positions (0 = the first generated token).
            purpose: TOKEN, DRAFT or ACCEPT.
            ids: (N,) int64 token ids (an id's noise does not depend on which other ids are drawn); None: one
                value per (row, position).
            transform: optional in-place map applied to each float32 block (how :meth:`gumbel` stays chunked).

        Returns:
            (B, S, N) float32 (N = 1 when ``ids`` is None); a pure function of (seed, position, purpose, id).
        """
        device = self.seeds.device
        if ids is None:
            ids = torch.zeros(1, dtype=torch.long, device=device)
        streams = self.streams(positions, purpose).reshape(-1, 1)  # (B*S, 1)
        steps = (ids.long() + 1) * _G  # (N,) wraps like uint64
        count, n_ids = streams.shape[0], ids.shape[0]
        out = torch.empty(count, n_ids, dtype=torch.float32, device=device)
        rows = max(1, _CHUNK // max(1, n_ids))
        z = torch.empty(min(rows, count), n_ids, dtype=torch.long, device=device)
        tmp = torch.empty_like(z)
        for r0 in range(0, count, rows):
            n = min(rows, count - r0)
            zb, ob = z[:n], out[r0 : r0 + n]
            torch.add(streams[r0 : r0 + n], steps, out=zb)
            _mix64_(zb, tmp[:n])
            zb.bitwise_and_((1 << 63) - 1)  # 63 random bits, >= 0
            ob.copy_(zb).mul_(2.0**-63)  # the nearest float32
            ob.clamp_(2.0**-64, 1.0 - 2.0**-24)
            if transform is not None:
                transform(ob)
        return out.reshape(*positions.shape, n_ids)

    def gumbel(self, positions: torch.Tensor, purpose: int, ids: torch.Tensor) -> torch.Tensor:
        """Counter-based standard Gumbel noise ``G = -log(-log1p(-U))`` (:meth:`uniform`'s arguments).

        ``argmax_v(log p(v) + G[..., v])`` is distributed as p (the Gumbel-max trick); two distributions scored
        with the same noise are coupled.

        Returns:
            (B, S, N) float32 noise.
        """
        return self.uniform(positions, purpose, ids, transform=_neg_log_exponential_)


def _neg_log_exponential_(u: torch.Tensor) -> None:
    """U -> -log(E) in place, E = -log1p(-U) ~ Exp(1): a standard Gumbel variate."""
    u.neg_().log1p_().neg_().log_().neg_()
