"""The embedded engine's cost model: seconds per round block, measured on this machine, as functions of the batch.

:class:`CostModel` holds least-squares fits (:class:`_LinearFit`, local in the batch size B) of the blocks of a
speculative round: the policy's verify forward of B rows x S tokens with the sampling math,
drafting one token (a chained draft step and its sampling), the draft's catch-up over S verified positions, and
the rest of the round. :meth:`CostModel.calibrate` times forwards on the engine's live caches when no batch size within a
factor 2 was timed; every round's measured blocks then keep the fits current (rollout/embedded/adaptive.py uses them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import contextmanager

import numpy as np
import torch

from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.rollout.sampling.noise import CounterNoise
from lightning_codraft.rollout.sampling.rules import sampling_logprobs
from lightning_codraft.rollout.sampling.sampler import TokenSampler


def clock(device: torch.device) -> float:
    """Seconds for timing round blocks: ``time.perf_counter()`` after the device's queued work (CUDA kernels run
    asynchronously); on a CPU device with one intra-op thread, the calling thread's CPU time (``time.thread_time()``).

    With one thread every block runs on the calling thread, so its CPU time is the block's cost, and time the core
    spends on other processes (a shared machine) is not charged to whichever block it happened to interrupt: with
    wall time, the tiny-cpu policy at batch 16 on 2 cores shared by 3 jobs chose a mean k of 3.7, 4.0 and 0.04 in
    three repeats of the same batch (acceptance ~4.5 at K=4); with CPU time 4.0 every time
    (docs/benchmarks/rollout.md). More threads: wall time (the work of the other threads counts through it).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time()
    return time.perf_counter()


class RoundClock:
    """The time blocks of one decode round, for the cost model: ``with clock.block("policy"): ...``.

    Blocks of the same name add up (the verify's noise and its forward are both the policy's); :meth:`rest` is the
    round's time outside every block (bookkeeping), :meth:`restart` moves the round's start (e.g. after a
    calibration that is not the round's cost). Readings are :func:`clock`'s.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.spent: dict[str, float] = {}
        self.last = 0.0
        """Seconds of the last block that ended."""
        self.start = clock(device)

    def restart(self) -> None:
        self.start = clock(self.device)

    @contextmanager
    def block(self, name: str):
        t0 = clock(self.device)
        try:
            yield self
        finally:
            self.last = clock(self.device) - t0
            self.spent[name] = self.spent.get(name, 0.0) + self.last

    def __getitem__(self, name: str) -> float:
        return self.spent.get(name, 0.0)

    def rest(self) -> float:
        """Seconds since the start not spent in any block."""
        return clock(self.device) - self.start - sum(self.spent.values())

    def elapsed(self) -> float:
        """Seconds since the start."""
        return clock(self.device) - self.start


def width_bin(B: float) -> int:
    """The half-octave bin of a batch of B rows (what the fits pool, and what the controller's realized record keys)."""
    return round(2 * math.log2(max(B, 1.0)))


class _LinearFit:
    """Least-squares fit of a time as a non-negative combination of features whose second one is the batch size
    B, local in B (a CPU matmul's cost per row is not one constant from 1 row to 64): points are pooled into
    half-octave bins of B, and a fit for B weighs bin i by ``exp(-(octaves from B)^2 / 2)``. Measured points
    fade by ``1 - 1/history`` per newer point; calibration points stay until dropped. Sufficient statistics per
    bin, so adding a point is O(1) and a solve (cached per bin until 32 more points arrived) is a 3x3 system."""

    def __init__(self, num_features: int, history: int):
        self.anchors: list[tuple[tuple[float, ...], float]] = []
        self._n, self._decay, self._clock = num_features, 1.0 - 1.0 / history, 0
        self._bins: dict[int, list] = {}  # bin -> [xtx, xty, clock of last update] (measured points)
        self._anchor_bins: dict[int, list] = {}
        self._solved: dict[int, tuple[float, ...]] = {}
        self._stale = 0

    @property
    def empty(self) -> bool:
        return not self._bins and not self._anchor_bins

    def _accumulate(self, bins: dict[int, list], x: tuple[float, ...], t: float, decay: float = 1.0) -> None:
        n = self._n
        entry = bins.setdefault(width_bin(x[1]), [[0.0] * (n * n), [0.0] * n, self._clock])
        f = decay ** (self._clock - entry[2])
        xtx, xty = entry[0], entry[1]
        for i in range(n):
            xty[i] = xty[i] * f + x[i] * t
            for j in range(n):
                xtx[i * n + j] = xtx[i * n + j] * f + x[i] * x[j]
        entry[2] = self._clock

    def add(self, features: tuple[float, ...], seconds: float, anchor: bool = False) -> None:
        if anchor:
            self.anchors.append((tuple(features), float(seconds)))
            self._accumulate(self._anchor_bins, features, seconds)
            self._solved = {}
            return
        self._clock += 1
        self._accumulate(self._bins, features, seconds, self._decay)
        self._stale += 1
        if self._stale >= 32:
            self._solved, self._stale = {}, 0

    def drop_anchors(self, keep=lambda features: False) -> None:
        """Forget the calibration points except those whose features satisfy ``keep``."""
        self.anchors = [(x, t) for x, t in self.anchors if keep(x)]
        self._anchor_bins, self._solved = {}, {}
        for x, t in self.anchors:
            self._accumulate(self._anchor_bins, x, t)

    def predict(self, B: int, S: int | None = None) -> float:
        """Seconds at B rows (and S tokens per row): ``c0 + c1 B (+ c2 B S)`` with the coefficients for B."""
        c = self.coef(B)
        return c[0] + c[1] * B + (c[2] * B * S if S is not None else 0.0)

    def coef(self, B: int) -> tuple[float, ...]:
        """The fit's coefficients for batches of B rows (zeros before any point)."""
        q = width_bin(B)
        if self.empty:
            return (0.0,) * self._n
        if q not in self._solved:
            A, b = np.zeros((self._n, self._n)), np.zeros(self._n)
            for bins, fading in ((self._bins, True), (self._anchor_bins, False)):
                for i, (xtx, xty, last) in bins.items():
                    w = math.exp(-0.5 * ((i - q) / 2) ** 2) * (self._decay ** (self._clock - last) if fading else 1)
                    A += w * np.array(xtx).reshape(self._n, self._n)
                    b += w * np.array(xty)
            A += np.eye(self._n) * 1e-9 * max(np.trace(A), 1e-30)  # ridge: a feature never varied stays 0
            keep, coef = list(range(self._n)), np.zeros(self._n)
            while keep:  # active set: drop features whose weight comes out negative
                sol = np.linalg.solve(A[np.ix_(keep, keep)], b[keep])
                if (sol >= 0).all():
                    coef[keep] = sol
                    break
                keep.pop(int(np.argmin(sol)))
            self._solved[q] = tuple(float(c) for c in coef)
        return self._solved[q]


class CostModel:
    """Seconds per round block of this engine on this machine, as functions of rows B and tokens S per row.

    ``policy(B, S)``: verify forward + sampling math, ``a + b B + c B S + d B [S > 1]`` (a one-token query takes
    another attention path than a longer one, so the step from 1 to 2 tokens is fitted apart from the per-token
    slope); ``draft_step(B)``: drafting one token, a chained draft step with its sampling (``a + b B``); ``catch_up(B, S)``: draft forward over S verified positions (``a + b B + c B S``);
    ``rest(B)``: the round's remaining work (``a + b B``).

    A block drafter (DFlash) proposes a round's tokens in ONE forward over its whole block and reads the verify
    forward's taps instead of catching up: with ``one_forward_draft`` the draft fit is the seconds of that forward
    (and its draws), charged once to every round that proposes, and no catch-up is charged.

    Args:
        history: memory of each fit, in measured points (see :class:`_LinearFit`).
        one_forward_draft: the drafter proposes a round's tokens in one forward (a block drafter).
    """

    def __init__(self, history: int = 128, one_forward_draft: bool = False):
        self.one_forward_draft = bool(one_forward_draft)
        self.policy_fit = _LinearFit(4, history)
        self.catch_up_fit = _LinearFit(3, history)
        self.draft_fit, self.rest_fit = _LinearFit(2, history), _LinearFit(2, history)
        self.sizes: list[int] = []  # batch sizes the calibration timed

    def policy(self, B: int, S: int) -> float:
        c = self.policy_fit.coef(B)
        return c[0] + c[1] * B + c[2] * B * S + (c[3] * B if S > 1 else 0.0)

    def draft_step(self, B: int) -> float:
        return self.draft_fit.predict(B)

    def catch_up(self, B: int, S: int) -> float:
        return self.catch_up_fit.predict(B, S)

    def rest(self, B: int) -> float:
        return self.rest_fit.predict(B)

    def plain_seconds(self, B: int, tokens: float) -> float:
        """What plain decoding at B rows spends on ``tokens`` tokens: ``tokens`` row-steps at a plain round's
        predicted seconds over B (the price of a drafting round's tokens, rollout/embedded/round.py and adaptive.py)."""
        return self.round_times(B, 0)[0] * tokens / B

    def round_times(self, B: int, max_k: int, drafted: int = 0) -> list[float]:
        """Predicted seconds of a round of B rows verifying k = 0..K proposals (index k), ``drafted`` of them already
        drawn (their drafting counts in every k, also in a round that then verifies fewer)."""
        base, step = self.rest(B), self.draft_step(B)
        if self.one_forward_draft:  # one draft forward proposes any k; the taps come with the verify
            times = [self.policy(B, 1) + base + (step if drafted else 0.0)]
            times += [self.policy(B, 1 + k) + base + step for k in range(1, max_k + 1)]
            return [max(t, 1e-9) for t in times]
        times = [self.policy(B, 1) + base + drafted * step]
        for k in range(1, max_k + 1):
            times.append(self.policy(B, 1 + k) + base + max(k, drafted) * step + self.catch_up(B, 1 + k))
        return [max(t, 1e-9) for t in times]

    def add(self, block: str, B: int, S: int, seconds: float, anchor: bool = False) -> None:
        """Record a measured block: ``"policy"`` / ``"catch_up"`` (B rows x S tokens), ``"draft"`` (one step of
        B rows) or ``"rest"``; ``anchor`` marks calibration points (kept until the next calibration)."""
        if block == "policy":
            fit, features = self.policy_fit, (1.0, float(B), float(B * S), float(B) if S > 1 else 0.0)
        elif block == "catch_up":
            fit, features = self.catch_up_fit, (1.0, float(B), float(B * S))
        elif block in ("draft", "rest"):
            fit, features = getattr(self, f"{block}_fit"), (1.0, float(B))
        else:
            raise ValueError(f"unknown cost block {block!r}; expected policy, catch_up, draft or rest")
        fit.add(features, seconds, anchor)

    def needs_calibration(self, B: int) -> bool:
        """True when no calibration timed a batch size within a factor 2 of B."""
        return not any(_near(s, B) for s in self.sizes)

    def start_calibration(self, sizes: list[int]) -> None:
        """Forget the calibration points of batch sizes near ``sizes``; the caller then adds new ones with
        ``anchor=True``."""
        self.sizes = [s for s in self.sizes if not any(_near(s, n) for n in sizes)] + list(sizes)
        for fit in (self.policy_fit, self.draft_fit, self.catch_up_fit, self.rest_fit):
            fit.drop_anchors(lambda f: not any(_near(f[1], n) for n in sizes))

    def calibrate(
        self,
        pdec: PolicyDecoder,
        ddec: DraftDecoder,
        pcache: KVCache,
        dcache: KVCache,
        pending: torch.Tensor,
        taps: Sequence[int],
        sampler: TokenSampler,
        max_k: int,
    ) -> None:
        """Time verify forwards (1..K+1 tokens per row, with the sampling math), draft catch-ups and a draft
        step with its sampling, on the live caches: their first B and B/2 rows, lengths untouched (what the
        forwards write lies past every row's length and is overwritten before it is read).

        Args:
            pdec, ddec: the engine's decoders.
            pcache, dcache: the batch's policy and draft caches (B rows).
            pending: ``(B,)`` each row's next token (the forwards' input).
            taps: the draft's policy tap ids.
            sampler: the call's token sampler (its verify and proposal math are timed, on noise of its own).
            max_k: K, the longest proposal (verify forwards of 1 and K+1 tokens per row are timed).
        """
        device = pending.device
        for n, S, ids, tapped, noise, at in self._timed_verifies(pdec, pcache, pending, taps, sampler, max_k):
            if S in (1, max_k + 1):
                seconds, _ = _fastest(device, _catch_up_once, pdec, ddec, dcache, tapped, ids)
                self.add("catch_up", n, S, seconds, anchor=True)
            if S == max_k + 1:
                hidden = ddec.fuse(tuple(t[:, :1] for t in tapped))
                rn = sampler.start_round(noise, at, 1)  # a round's noise is timed with its verify
                seconds, _ = _fastest(device, _draft_step_once, pdec, ddec, dcache, hidden, pending[:n], sampler, rn)
                self.add("draft", n, 1, seconds, anchor=True)

    def calibrate_block(
        self,
        pdec: PolicyDecoder,
        pcache: KVCache,
        pending: torch.Tensor,
        taps: Sequence[int],
        sampler: TokenSampler,
        max_k: int,
        propose,
    ) -> None:
        """:meth:`calibrate` for a block drafter (``one_forward_draft``): verify forwards of 1..K+1 tokens per row and
        the drafter's one proposing forward, on the first B and B/2 rows of the live cache.

        Args:
            propose: ``propose(n)`` runs the drafter's forward over the first n rows' blocks, with the draws of a
                round of ``max_k`` proposals.
            (the others as :meth:`calibrate`)
        """
        if not self.one_forward_draft:
            raise RuntimeError("calibrate_block times a block drafter: build the CostModel with one_forward_draft=True")
        for n, S, *_ in self._timed_verifies(pdec, pcache, pending, taps, sampler, max_k):
            if S == max_k + 1:
                self.add("draft", n, 1, _fastest(pending.device, propose, n)[0], anchor=True)

    def _timed_verifies(self, pdec, pcache: KVCache, pending: torch.Tensor, taps, sampler: TokenSampler, max_k: int):
        """Start a calibration at the batch's B and B/2 rows and record its verify forwards of 1..K+1 tokens per row;
        after each, yield ``(n, S, ids, taps, noise, at)`` (rows, tokens, the forward's input and taps, the noise) for
        the caller to time its drafter's blocks there."""
        B, device = int(pending.shape[0]), pending.device
        sizes = sorted({B, max(1, (B + 1) // 2)})
        self.start_calibration(sizes)
        for n in sizes:
            noise, at = CounterNoise(torch.arange(n, device=device)), torch.zeros(n, dtype=torch.long, device=device)
            for S in range(1, max_k + 2):
                ids = pending[:n, None].expand(n, S)
                seconds, tapped = _fastest(device, _verify_once, pdec, pcache, ids, taps, sampler, noise, at)
                self.add("policy", n, S, seconds, anchor=True)
                yield n, S, ids, tapped, noise, at


def _fastest(device: torch.device, fn, *args, repeats: int = 3):
    """Seconds of ``fn(*args)``, the fastest of ``repeats`` runs but the first (which warms caches and the
    allocator), and what its last run returned."""
    times = []
    for _ in range(repeats):
        t0 = clock(device)
        out = fn(*args)
        times.append(clock(device) - t0)
    return min(times[1:]), out


def _verify_once(pdec, pcache, ids, taps, sampler: TokenSampler, noise, at):
    """A verify of ``ids`` (n, S) on the first n rows of ``pcache`` (a fresh view each run: its lengths untouched):
    the policy's forward and the sampling math; the forward's taps."""
    params = sampler.params
    logits, tapped = pdec.forward(ids, pcache.select(ids.shape[0]), taps)
    lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
    q = None
    if sampler.uses_draft_probs:
        q = torch.full(
            (ids.shape[0], ids.shape[1] - 1, sampler.vocab_size), 1.0 / sampler.vocab_size, device=ids.device
        )
    sampler.verify(lp, ids[:, 1:], q, sampler.start_round(noise, at, ids.shape[1] - 1))
    return tapped


def _catch_up_once(pdec, ddec, dcache, tapped, ids):
    """The EAGLE-3 draft's catch-up over a verify's positions (the first n rows of ``dcache``, a fresh view)."""
    return ddec.step(ddec.fuse(tapped), pdec.embed(ids), dcache.select(ids.shape[0]))


def _draft_step_once(pdec, ddec, dcache, hidden, pending, sampler: TokenSampler, rn):
    """One chained EAGLE-3 draft step and its draw (the first n rows of ``dcache``, a fresh view)."""
    _, logits = ddec.step(hidden, pdec.embed(pending[:, None]), dcache.select(pending.shape[0]))
    sampler.draw(logits[:, 0], rn, 0)


def _near(a: float, b: float) -> bool:
    """Batch sizes within a factor 2 of each other."""
    return a / 2 <= b <= 2 * a
