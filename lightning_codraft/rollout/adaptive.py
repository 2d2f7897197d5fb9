"""Adaptive speculation length: how many draft tokens a round of the embedded engine should verify.

Each round the engine asks :meth:`SpeculationController.choose` for ``k`` in ``0..K`` (0 = a plain step) and tells
:meth:`SpeculationController.observe` what was accepted. The choice maximises expected tokens per second::

    k* = argmax_k  sum_b E_b(k) / T(B, k)
    E_b(k) = 1 + sum_{j <= min(k, r_b - 1)} prod_{i <= j} a_{b,i}        (r_b: tokens row b may still emit)
    T(B, k) = P(B, 1 + k) + R(B) + [k > 0] (k D(B) + C(B, 1 + k))

- ``a_{b,i}``: request b's conditional acceptance rate at draft position i (accepted given positions < i were),
  from its own decayed counts shrunk towards the engine-wide estimate of the same sampling setting
  (:class:`AcceptanceEstimates`). The engine-wide counts fade every round, and an unobserved position borrows the
  previous position's rate, so a draft that stopped being used is re-probed once its bad record has faded.
- ``P`` (policy verify forward of B rows x S tokens, with the sampling math), ``D`` (drafting one token: a chained
  draft step and its sampling),
  ``C`` (the draft catch-up over the verified positions) and ``R`` (the rest of a round) are least-squares fits
  (:class:`CostModel`) of times measured on this machine: timed forwards on the live caches when the model has
  no data near the batch size (:meth:`SpeculationController.calibrate`), then every round's measured blocks.

The batch shares one k: the verify forward is padded to ``1 + k`` tokens per row, so a row verifying fewer
positions saves no time; a request whose draft keeps failing adds ~1 token per round to ``sum_b E_b(k)`` whatever
k is, so a batch of such requests stops drafting (k = 0), and the engine then also skips the draft's catch-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.rollout.sampling import SamplingParams, sample_from_probs, sampling_logprobs


@dataclass
class AdaptiveConfig:
    """Knobs of the adaptive speculation controller (defaults suit every engine measured so far)."""

    prior_acceptance: float = 0.7
    """Conditional acceptance assumed at draft position 1 before anything is observed (optimistic: a new engine
    drafts, and so measures its draft). Position i > 1 borrows position i - 1's estimate."""
    global_prior_weight: float = 2.0
    """Pseudo-observations of that prior in the engine-wide estimate of each position (with ``global_decay``
    it sets the least rate a never-accepted draft is credited with: 0.7 * 2 / (2 + 100) = 1.4% at batch 1)."""
    request_prior_weight: float = 2.0
    """Pseudo-observations of the engine-wide estimate in each request's own; a new request starts there."""
    global_decay: float = 0.99
    """Per-round factor on the engine-wide counts (half-life ~70 rounds): old evidence fades, so the estimate
    follows a changing draft and a draft that stopped being used is re-probed."""
    request_decay: float = 0.9
    """Per-round factor on a request's own counts: its estimate follows its last ~10 rounds."""
    untried_decay: float = 0.95
    """Extra per-round factor on the engine-wide counts of the positions a round did not verify (j >= k): a
    position left untried drifts back to its prior within ~15 rounds, so a proposal length that looked bad
    once is tried again."""
    cost_history: int = 128
    """Memory of each cost term's fit, in measured rounds (older rounds weigh less by exp(-age / this));
    calibration points are kept besides."""
    recalibrate_every: int = 1000
    """Rounds after which the timed calibration forwards are repeated (load on the machine changes)."""
    probe_backoff: tuple[int, int] = (4, 64)
    """(first, longest) number of rounds drafting stays off after it stopped paying; the wait doubles each time
    drafting stops again within ``first`` rounds (a failed re-probe) and resets once drafting lasts ``first``
    rounds, so a draft that never pays costs a probe every ``longest`` rounds at most."""
    resume_window: int = 32
    """While k = 0 the draft's catch-up is deferred; when drafting resumes after more plain rounds than this, the
    draft catches up on the last ``resume_window`` positions only (it keeps what it had cached before, e.g. the
    prompt, and skips the positions between)."""

    def __post_init__(self) -> None:
        for name in ("prior_acceptance", "global_decay", "request_decay", "untried_decay"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"AdaptiveConfig.{name}={value} must be in (0, 1]")
        for name in ("global_prior_weight", "request_prior_weight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AdaptiveConfig.{name}={getattr(self, name)} must be > 0")
        for name, low in (("cost_history", 8), ("recalibrate_every", 1), ("resume_window", 1)):
            if int(getattr(self, name)) < low:
                raise ValueError(f"AdaptiveConfig.{name}={getattr(self, name)} must be >= {low}")
        first, longest = self.probe_backoff
        if not 0 <= first <= longest:
            raise ValueError(f"AdaptiveConfig.probe_backoff={self.probe_backoff} must be (first, longest) with "
                             "0 <= first <= longest")


def rows_of(cache: KVCache, rows: torch.Tensor | int) -> KVCache:
    """``cache`` restricted to ``rows`` (B',) (a copy), or to its first ``rows`` rows (views, own lengths)."""
    if isinstance(rows, int):
        return KVCache(k=[t[:rows] for t in cache.k], v=[t[:rows] for t in cache.v], lengths=cache.lengths[:rows])
    return KVCache(k=[t.index_select(0, rows) for t in cache.k], v=[t.index_select(0, rows) for t in cache.v],
                   lengths=cache.lengths.index_select(0, rows))


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work (CUDA kernels run asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def expected_tokens(rates: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Expected tokens a batch emits in one round, for every speculation length.

    Args:
        rates: ``(B, K)`` conditional acceptance rate of each request at draft positions 1..K, in [0, 1].
        remaining: ``(B,)`` tokens each request may still emit (>= 1); tokens past it are discarded.

    Returns:
        ``(K + 1,)``: entry k is ``sum_b 1 + sum_{j <= min(k, r_b - 1)} prod_{i <= j} rates[b, i]``.
    """
    B, K = rates.shape
    reach = np.cumprod(rates, axis=1)                                   # P(draft position j accepted)
    if remaining.min() <= K:                                            # rows that cannot use every position
        reach[np.arange(1, K + 1)[None, :] >= remaining[:, None]] = 0.0
    out = np.empty(K + 1)
    out[0] = 0.0
    np.cumsum(reach.sum(axis=0), out=out[1:])
    return out + B


class _LinearFit:
    """Least-squares fit of a time as a non-negative combination of features, over the calibration points plus
    the measured points with exponential forgetting (sufficient statistics in Python floats: an update costs a
    few microseconds; the solve runs after every 16 updates)."""

    def __init__(self, num_features: int, history: int):
        self.anchors: list[tuple[tuple[float, ...], float]] = []
        self._n, self._decay = num_features, 1.0 - 1.0 / history
        self._xtx = [[0.0] * num_features for _ in range(num_features)]
        self._xty = [0.0] * num_features
        self._coef: tuple[float, ...] | None = None
        self._stale = 0
        self.empty = True

    def add(self, features: tuple[float, ...], seconds: float, anchor: bool = False) -> None:
        self.empty = False
        if anchor:
            self.anchors.append((tuple(features), float(seconds)))
            self._coef = None
            return
        d = self._decay
        for i, xi in enumerate(features):
            row = self._xtx[i]
            for j, xj in enumerate(features):
                row[j] = row[j] * d + xi * xj
            self._xty[i] = self._xty[i] * d + xi * seconds
        self._stale += 1

    def drop_anchors(self, keep=lambda features: False) -> None:
        """Forget the calibration points except those whose features satisfy ``keep``."""
        self.anchors = [(x, t) for x, t in self.anchors if keep(x)]
        self._coef = None

    def coef(self) -> tuple[float, ...]:
        if self._coef is None or self._stale >= 16:
            A, b = np.array(self._xtx), np.array(self._xty)
            for x, t in self.anchors:
                x = np.array(x)
                A += np.outer(x, x)
                b += x * t
            A += np.eye(self._n) * 1e-9 * max(np.trace(A), 1e-30)   # ridge: a feature never varied stays 0
            keep = list(range(self._n))
            coef = np.zeros(self._n)
            while keep:  # active set: drop features whose weight comes out negative
                sol = np.linalg.solve(A[np.ix_(keep, keep)], b[keep])
                if (sol >= 0).all():
                    coef[keep] = sol
                    break
                keep.pop(int(np.argmin(sol)))
            self._coef, self._stale = tuple(float(c) for c in coef), 0
        return self._coef


class CostModel:
    """Seconds per round block of this engine on this machine, as functions of rows B and tokens S per row.

    ``policy(B, S)``: verify forward + sampling math (``a + b B + c B S``); ``draft_step(B)``: drafting one token,
    a chained draft step with its sampling (``a + b B``); ``catch_up(B, S)``: draft forward over S verified positions
    (``a + b B + c B S``); ``rest(B)``: the round's remaining work (``a + b B``).
    """

    def __init__(self, history: int = 128):
        self.policy_fit, self.catch_up_fit = _LinearFit(3, history), _LinearFit(3, history)
        self.draft_fit, self.rest_fit = _LinearFit(2, history), _LinearFit(2, history)
        self.sizes: list[int] = []   # batch sizes the calibration timed

    def policy(self, B: int, S: int) -> float:
        return _affine(self.policy_fit, B, S)

    def draft_step(self, B: int) -> float:
        return _affine(self.draft_fit, B)

    def catch_up(self, B: int, S: int) -> float:
        return _affine(self.catch_up_fit, B, S)

    def rest(self, B: int) -> float:
        return _affine(self.rest_fit, B)

    def round_times(self, B: int, max_k: int) -> list[float]:
        """Predicted seconds of a round of B rows drafting k = 0..K tokens (index k)."""
        p, c = _coef(self.policy_fit, 3), _coef(self.catch_up_fit, 3)
        d, r = _coef(self.draft_fit, 2), _coef(self.rest_fit, 2)
        fixed = p[0] + p[1] * B + r[0] + r[1] * B
        step, catch = d[0] + d[1] * B, c[0] + c[1] * B
        times = [fixed + p[2] * B]
        for k in range(1, max_k + 1):
            times.append(fixed + p[2] * B * (1 + k) + k * step + catch + c[2] * B * (1 + k))
        return [max(t, 1e-9) for t in times]

    def add(self, block: str, B: int, S: int, seconds: float, anchor: bool = False) -> None:
        """Record a measured block: ``"policy"`` / ``"catch_up"`` (B rows x S tokens), ``"draft"`` (one step of
        B rows) or ``"rest"``; ``anchor`` marks calibration points (kept until the next calibration)."""
        if block in ("policy", "catch_up"):
            fit, features = getattr(self, f"{block}_fit"), (1.0, float(B), float(B * S))
        elif block in ("draft", "rest"):
            fit, features = getattr(self, f"{block}_fit"), (1.0, float(B))
        else:
            raise ValueError(f"unknown cost block {block!r}; expected policy, catch_up, draft or rest")
        fit.add(features, seconds, anchor)

    def needs_calibration(self, B: int) -> bool:
        """True when no calibration timed a batch size within a factor 2 of B."""
        return not any(_near(s, B) for s in self.sizes)

    def start_calibration(self, sizes: list[int], replace: bool) -> None:
        """Forget the calibration points of batch sizes near ``sizes`` (all of them if ``replace``); the caller
        then adds the new ones with ``anchor=True``."""
        self.sizes = list(sizes) if replace else [s for s in self.sizes if not any(_near(s, n) for n in sizes)] + sizes
        for fit in (self.policy_fit, self.draft_fit, self.catch_up_fit, self.rest_fit):
            fit.drop_anchors(lambda f: not replace and not any(_near(f[1], n) for n in sizes))


def _coef(fit: _LinearFit, n: int) -> tuple[float, ...]:
    return (0.0,) * n if fit.empty else fit.coef()


def _affine(fit: _LinearFit, B: int, S: int | None = None) -> float:
    """``c0 + c1 B (+ c2 B S)`` with the fit's coefficients (0 before any point)."""
    c = _coef(fit, 2 if S is None else 3)
    return c[0] + c[1] * B + (c[2] * B * S if S is not None else 0.0)


def _near(a: float, b: float) -> bool:
    """Batch sizes within a factor 2 of each other."""
    return a / 2 <= b <= 2 * a


@dataclass
class _Setting:
    """Engine-wide state of one sampling setting: decayed counts per draft position and the probe backoff."""

    acc: list[float]    # (K,) accepted at position j (given positions < j were)
    tried: list[float]  # (K,) verified at position j
    backoff: int        # rounds drafting stays off the next time it stops paying
    hold: int = 0       # rounds left in the current wait
    run: int = 0        # consecutive drafting rounds up to the previous one


def _outcome_tables(K: int) -> tuple[np.ndarray, np.ndarray]:
    """``tried[k, a]`` / ``accepted[a]``: (K,) float masks of the positions verified / accepted in a round that
    proposed k tokens and accepted a (position j is verified when j <= a, j < k; accepted when j < a)."""
    j, a = np.arange(K)[None, :], np.arange(K + 1)[:, None]
    accepted = (j < a).astype(np.float64)                               # (K+1, K)
    tried = np.stack([((j < k) & (j <= a)).astype(np.float64) for k in range(K + 1)])   # (K+1, K+1, K)
    return tried, accepted


class AcceptanceEstimates:
    """Per-request conditional acceptance counts of one batch, shrunk towards the engine-wide counts.

    Args:
        num_requests: rows of the batch.
        shared: the engine-wide state of this sampling setting (updated in place).
        config: prior weights and decays.
    """

    def __init__(self, num_requests: int, shared: _Setting, config: AdaptiveConfig):
        self.shared, self.config = shared, config
        K = len(shared.acc)
        self.acc, self.tried = np.zeros((num_requests, K)), np.zeros((num_requests, K))
        self._tried_mask, self._acc_mask = _outcome_tables(K)

    def global_rates(self) -> list[float]:
        """``(K,)`` engine-wide conditional rates; position i's prior is position i - 1's estimate."""
        c, prior, out = self.config, self.config.prior_acceptance, []
        for a, t in zip(self.shared.acc, self.shared.tried):
            prior = (a + c.global_prior_weight * prior) / (t + c.global_prior_weight)
            out.append(prior)
        return out

    def rates(self) -> np.ndarray:
        """``(B, K)`` each request's conditional rates."""
        m = self.config.request_prior_weight
        return (self.acc + m * np.array(self.global_rates())) / (self.tried + m)

    def observe(self, k: int, accepted: np.ndarray) -> None:
        """Decay every count one round, then add a round in which every row proposed k and accepted ``accepted``
        (``(B,)`` ints in ``[0, k]``): position j was tried if j <= accepted + 1, accepted if j <= accepted."""
        c, sh = self.config, self.shared
        self.acc *= c.request_decay
        self.tried *= c.request_decay
        t_sum = a_sum = (0.0,) * len(sh.acc)
        if k:
            t_mask, a_mask = self._tried_mask[k][accepted], self._acc_mask[accepted]   # (B, K) each
            self.tried += t_mask
            self.acc += a_mask
            t_sum, a_sum = t_mask.sum(axis=0).tolist(), a_mask.sum(axis=0).tolist()
        for j in range(len(sh.acc)):     # untried positions (j >= k) fade faster
            f = c.global_decay * (c.untried_decay if j >= k else 1.0)
            sh.acc[j] = sh.acc[j] * f + a_sum[j]
            sh.tried[j] = sh.tried[j] * f + t_sum[j]

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (requests that finished leave the batch)."""
        self.acc, self.tried = self.acc[rows], self.tried[rows]


class SpeculationController:
    """Chooses each round's speculation length from acceptance estimates and a cost model (module docstring).

    Args:
        max_k: K, the most draft tokens a round may verify.
        config: the controller's knobs.
        costs: a cost model (None: an empty one, filled by the engine's calibration and measured rounds).

    The engine-wide acceptance counts are kept per sampling setting (temperature, top-k, top-p): greedy and
    sampled decoding accept very differently.
    """

    def __init__(self, max_k: int, config: AdaptiveConfig | None = None, costs: CostModel | None = None):
        if int(max_k) < 1:
            raise ValueError(f"max_k={max_k} must be >= 1 (the engine's num_speculative_tokens)")
        self.max_k = int(max_k)
        self.config = config or AdaptiveConfig()
        self.costs = costs or CostModel(self.config.cost_history)
        self.rounds_since_calibration = 0
        self._settings: dict[tuple, _Setting] = {}
        self._checked_size: int | None = None   # needs_calibration's last batch size and answer
        self._near_calibration = False

    def new_batch(self, num_requests: int, sampling_key: tuple) -> AcceptanceEstimates:
        """Estimates for a new batch of requests decoded with the given sampling setting."""
        if sampling_key not in self._settings:
            self._settings[sampling_key] = _Setting([0.0] * self.max_k, [0.0] * self.max_k,
                                                    self.config.probe_backoff[0])
        return AcceptanceEstimates(num_requests, self._settings[sampling_key], self.config)

    def needs_calibration(self, batch_size: int) -> bool:
        """True when the cost model has no timed forwards near ``batch_size``, or its last ones are stale."""
        if batch_size != self._checked_size:
            self._checked_size, self._near_calibration = batch_size, not self.costs.needs_calibration(batch_size)
        return not self._near_calibration or self.rounds_since_calibration >= self.config.recalibrate_every

    def start_calibration(self, sizes: list[int]) -> None:
        """The engine is about to time forwards of these batch sizes (see :meth:`CostModel.start_calibration`)."""
        stale = self.rounds_since_calibration >= self.config.recalibrate_every
        self.costs.start_calibration(sizes, replace=stale)
        self._checked_size = None
        if stale:
            self.rounds_since_calibration = 0

    def choose(self, estimates: AcceptanceEstimates, remaining: np.ndarray) -> int:
        """k in ``0..K`` maximising expected tokens per second for this batch (``remaining``: ``(B,)``), or 0
        while drafting waits out its backoff after it stopped paying."""
        st = estimates.shared
        if st.hold > 0:
            st.hold -= 1
            return 0
        times = self.costs.round_times(len(remaining), self.max_k)
        tokens = expected_tokens(estimates.rates(), np.asarray(remaining)).tolist()
        k = max(range(self.max_k + 1), key=lambda i: tokens[i] / times[i])
        first, longest = self.config.probe_backoff
        if k == 0 and st.run > 0:          # drafting stopped paying: wait, longer each time a probe fails
            st.hold, st.backoff = st.backoff, min(2 * st.backoff, longest)
        st.run = st.run + 1 if k > 0 else 0
        if st.run >= first:                # drafting lasted: the next stop waits the least again
            st.backoff = first
        return k

    def observe(self, estimates: AcceptanceEstimates, k: int, accepted: np.ndarray) -> None:
        """Record a round's outcome (``accepted``: ``(B,)`` accepted draft tokens per row)."""
        estimates.observe(k, accepted)
        self.rounds_since_calibration += 1

    def record_round(self, batch_size: int, k: int, policy_s: float, draft_s: float, rest_s: float) -> None:
        """Measured seconds of a round's verify block, its k-token proposal and the rest of the round."""
        self.costs.add("policy", batch_size, 1 + k, policy_s)
        if k:
            self.costs.add("draft", batch_size, 1, draft_s / k)
        self.costs.add("rest", batch_size, 1, rest_s)

    def calibrate(self, pdec: PolicyDecoder, ddec: DraftDecoder, pcache: KVCache, dcache: KVCache,
                  pending: torch.Tensor, taps: Sequence[int], params: SamplingParams) -> None:
        """Time verify forwards (1 and K+1 tokens per row, with the sampling math), draft catch-ups and a draft
        step with its sampling, on the live caches: their first B and B/2 rows, lengths untouched (what the
        forwards write lies past every row's length and is overwritten before it is read).

        Args:
            pdec, ddec: the engine's decoders.
            pcache, dcache: the batch's policy and draft caches (B rows).
            pending: ``(B,)`` each row's next token (the forwards' input).
            taps: the draft's policy tap ids.
            params: the call's sampling parameters.
        """
        B, device = int(pending.shape[0]), pending.device
        generator = torch.Generator(device=device).manual_seed(0)   # the call's sampling stream stays untouched
        sizes = sorted({B, max(1, (B + 1) // 2)})
        self.start_calibration(sizes)
        lp = lambda logits: sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)  # noqa: E731
        for n in sizes:
            for S in (1, self.max_k + 1):
                ids = pending[:n, None].expand(n, S)
                for rep in range(2):  # the first run of a shape warms caches and the allocator: keep the second
                    t0 = clock(device)
                    logits, tapped = pdec.forward(ids, rows_of(pcache, n), taps)
                    lp(logits)
                    t1 = clock(device)
                    ddec.step(ddec.fuse(tapped), pdec.embed(ids), rows_of(dcache, n))
                    if rep:
                        self.costs.add("policy", n, S, t1 - t0, anchor=True)
                        self.costs.add("catch_up", n, S, clock(device) - t1, anchor=True)
            hidden = ddec.fuse(tuple(t[:, :1] for t in tapped))
            for rep in range(2):
                t0 = clock(device)
                _, logits = ddec.step(hidden, pdec.embed(pending[:n, None]), rows_of(dcache, n))
                if params.greedy:
                    torch.argmax(logits[:, 0], dim=-1)
                else:
                    sample_from_probs(lp(logits[:, 0]).exp(), generator)
                if rep:
                    self.costs.add("draft", n, 1, clock(device) - t0, anchor=True)
