"""Adaptive speculation length: how many draft tokens a round of the embedded engine should verify.

Each round the engine asks :meth:`SpeculationController.choose` for ``k`` in ``0..K`` (0 = a plain step) and tells
:meth:`SpeculationController.observe` what was accepted. The choice maximises expected tokens per second::

    k* = argmax_k  sum_b E_b(k) / T(B, k)
    E_b(k) = 1 + sum_{j <= min(k, r_b - 1)} prod_{i <= j} a_{b,i}        (r_b: tokens row b may still emit)
    T(B, k) = P(B, 1 + k) + R(B) + [k > 0] (k D(B) + C(B, 1 + k))

- ``a_{b,j} = alpha_b m_j``: request b's conditional acceptance rate at draft position j (accepted given
  positions < j were). ``alpha_b`` is the request's own decayed rate over the draft tokens it had verified,
  shrunk towards the engine-wide rate of the same sampling setting; ``m_j`` is an engine-wide position profile
  measured against each row's own rate, so it does not depend on which rows reach deep positions
  (:class:`AcceptanceEstimates`). The engine-wide counts fade every round (faster while the draft is unused), so
  a draft that stopped being used is re-probed once its bad record has faded; the waits between failed
  re-probes (accepted less often than drafting needs to pay at the batch size) double, up to
  ``probe_backoff[1]`` rounds, and end once the batch has halved.
- ``P`` (policy verify forward of B rows x S tokens, with the sampling math), ``D`` (drafting one token: a
  chained draft step and its sampling), ``C`` (the draft catch-up over the verified positions) and ``R`` (the
  rest of a round) are least-squares fits (rollout/embedded/cost_model.py) of times measured on this machine: timed
  forwards on the live caches when the model has no data near the batch size, then every round's blocks.
  Every ``explore_every`` drafting rounds a neighbouring length is verified instead, so the estimates of the
  lengths not chosen stay measured.

The batch shares one k: the verify forward is padded to ``1 + k`` tokens per row, so a row verifying fewer
positions saves no time; a request whose draft keeps failing adds ~1 token per round to ``sum_b E_b(k)`` whatever
k is, so a batch of such requests stops drafting (k = 0). While k = 0 the engine skips the draft's catch-up (and,
until a batch's first drafting round, the draft's pass over the prompts) and pays it when drafting resumes; the
choice counts that one-time cost spread over the rounds the batch has left.

With ``AdaptiveConfig.use_confidence`` (opt-in) the k chosen is the most a round verifies: the engine draws the
proposals one by one and, after each, asks :meth:`SpeculationController.verify_length` whether to verify what it
has or draft on, with each drawn proposal's
acceptance predicted from the draft's confidence in it (rollout/embedded/confidence.py, calibrated as the engine runs). The
draft is well calibrated when greedy (SmolLM2, 58-minute draft, 16 held-out GSM8K prompts at batch 16: proposals
of confidence 0.3 / 0.5 / 0.7 / 0.85 / >= 0.99 accepted 27 / 41 / 63 / 77 / 99% of the time); at T = 1 under
coupled sampling much less (a proposal of confidence < 0.2 is still accepted 34% of the time: two broad
distributions scored with the same noise often agree), which the calibration learns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.rollout.embedded.confidence import ConfidenceCalibration
from lightning_codraft.rollout.embedded.cost_model import CostModel, width_bin
from lightning_codraft.rollout.sampling.sampler import TokenSampler


@dataclass
class AdaptiveConfig:
    """Knobs of the adaptive speculation controller (defaults suit every engine measured so far)."""

    prior_acceptance: float = 0.7
    """Acceptance rate assumed before anything is observed (optimistic: a new engine drafts, and so measures
    its draft)."""
    global_prior_weight: float = 2.0
    """Pseudo-tokens of that prior in the engine-wide rate (with ``global_decay`` it sets the least rate a
    never-accepted draft is credited with: 0.7 * 2 / (2 + 100) = 1.4% when one token is verified per round)."""
    request_prior_weight: float = 2.0
    """Pseudo-tokens of the engine-wide rate in each request's own; a new request starts there."""
    position_prior_weight: float = 8.0
    """Pseudo-observations of ``m_j = 1`` (position j accepts at the rows' overall rate) in the position profile."""
    global_decay: float = 0.99
    """Per-round factor on the engine-wide counts (half-life ~70 rounds): old evidence fades, so the estimate
    follows a changing draft and a draft that stopped being used is re-probed."""
    request_decay: float = 0.9
    """Per-round factor on a request's own counts: its estimate follows its last ~10 rounds."""
    idle_decay: float = 0.95
    """Extra per-round factor on the engine-wide counts in rounds that verify nothing (k = 0): while the draft is
    unused its bad record fades within ~15 rounds (``probe_backoff`` then spaces the re-probes)."""
    cost_history: int = 128
    """Memory of each cost term's fit, in measured rounds (a round weighs exp(-newer rounds / this)); calibration
    points are kept besides."""
    probe_backoff: tuple[int, int] = (4, 64)
    """(first, longest) number of rounds drafting stays off after it stopped because its proposals were accepted
    too rarely (see ``failed_rate``); the wait doubles each time drafting stops so again within ``first`` rounds
    (a failed re-probe) and resets once drafting lasts ``first`` rounds, so a draft that never pays costs a
    probe every ``longest`` rounds at most. A wait ends early when the batch has halved since it began (verify
    is cheaper there: the long tail of a batch). Drafting that stops because it no longer pays for this batch size
    (acceptance fine, verify too dear) is free to resume the next round."""
    explore_every: int = 16
    """Every this many drafting rounds one verifies a token more than the choice (one fewer at K), so the times
    and acceptance of the neighbouring lengths stay measured and a wrong early estimate cannot stick."""
    failed_rate: float = 0.5
    """Drafting that stops counts as failed (see probe_backoff) when the rows' acceptance rates (each request's
    decayed record shrunk towards the engine-wide rate: what the choice used) average below this or below the rate
    at which one proposal a round breaks even at the batch size (from the cost model), whichever is lower: at batch
    1 on a CPU a verify costs about a plain step and a draft accepted 30% of the time still pays, and a single
    unlucky probe does not make a useful draft wait."""
    resume_window: int = 32
    """While k = 0 the draft's catch-up is deferred; when drafting resumes after more plain rounds than this, the
    draft catches up on the last ``resume_window`` positions only (it keeps what it had cached before, e.g. the
    prompt, and skips the positions between)."""
    use_confidence: bool = False
    """Stop a round's proposal chain by the draft's confidence in each proposal: after every proposal the controller
    weighs, with acceptance predicted from the proposals' confidences (rollout/embedded/confidence.py), verifying the ones drawn
    so far against drafting more (:meth:`SpeculationController.verify_length`); the round verifies between 0 and the k
    it chose. Greedy and coupled sampling only, whose tokens do not depend on the proposals: rejection sampling corrects
    proposals drawn from the draft's distribution, and keeping the sure ones while dropping the unsure ones would bias
    it. Off by default: on a CPU it gained nothing and its per-proposal bookkeeping costs time
    (docs/design/measurements.md); it is meant for verifies that are compute-bound at the batch size, where a hesitant
    proposal costs a full row."""
    confidence_prior_weight: float = 8.0
    """Pseudo-proposals per confidence bin at the engine-wide acceptance rate (until a bin has counts of its own it
    predicts what the controller would without confidences)."""
    resume_horizon: int = 16
    """A deferred catch-up (the prompts before a batch's first drafting round, the plain rounds since drafting
    stopped) is charged to the round that resumes drafting spread over the rounds the batch has left, at most this
    many: a catch-up over a wide batch's prompts (64 GSM8K prompts: ~10K draft rows, about two plain steps of
    SmolLM2 on a CPU) is paid only where drafting gains that back within ~16 rounds, not for a re-probe that may
    last one round (64 rounds: the SmolLM2 batch-64, T=1 cell ran 10% slower than plain decoding, its probes
    paying those catch-ups)."""

    realized_decay: float = 0.9
    """Per drafting round, the factor on a batch width's record of what its drafting rounds really saved: each
    round's tokens priced at the cost model's plain step for the width, less the round's measured seconds. Where
    that record is below zero the width decodes plainly whatever the model predicts (a verify of 1024 rows on a CPU
    costs more than the fits of narrower rounds say), but for a probe every ``explore_every`` choices."""

    def __post_init__(self) -> None:
        for name in (
            "prior_acceptance",
            "global_decay",
            "request_decay",
            "idle_decay",
            "failed_rate",
            "realized_decay",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"AdaptiveConfig.{name}={value} must be in (0, 1]")
        for name in ("global_prior_weight", "request_prior_weight", "position_prior_weight", "confidence_prior_weight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AdaptiveConfig.{name}={getattr(self, name)} must be > 0")
        for name, low in (("cost_history", 8), ("resume_window", 1), ("resume_horizon", 1), ("explore_every", 2)):
            if int(getattr(self, name)) < low:
                raise ValueError(f"AdaptiveConfig.{name}={getattr(self, name)} must be >= {low}")
        first, longest = self.probe_backoff
        if not 0 <= first <= longest:
            raise ValueError(
                f"AdaptiveConfig.probe_backoff={self.probe_backoff} must be (first, longest) with 0 <= first <= longest"
            )


def expected_tokens(rates: Sequence[Sequence[float]], remaining: Sequence[int]) -> list[float]:
    """Expected tokens a batch emits in one round, for every speculation length.

    Plain Python: per round this is a few hundred multiplications, cheaper than the NumPy calls would be.

    Args:
        rates: ``(B, K)`` conditional acceptance rate of each request at draft positions 1..K, in [0, 1].
        remaining: ``(B,)`` tokens each request may still emit (>= 1); tokens past it are discarded.

    Returns:
        ``(K + 1,)``: entry k is ``sum_b 1 + sum_{j <= min(k, r_b - 1)} prod_{i <= j} rates[b][i]``.
    """
    K = len(rates[0]) if len(rates) else 0
    reach = [0.0] * (K + 1)  # reach[j]: sum_b P(draft position j accepted)
    for row, r in zip(rates, remaining):
        p = 1.0
        for j in range(min(K, int(r) - 1)):
            p *= row[j]
            reach[j + 1] += p
    out, total = [], float(len(rates))
    for j in range(K + 1):
        total += reach[j]
        out.append(total)
    return out


@dataclass
class _Setting:
    """Engine-wide state of one sampling setting: decayed acceptance counts and the probe backoff."""

    acc: float  # draft tokens accepted
    tried: float  # draft tokens verified (a round accepting a of k verifies min(a + 1, k))
    pos_acc: list[float]  # (K,) accepted at position j
    pos_expected: list[float]  # (K,) what the rows' overall rates predicted there, where position j was verified
    backoff: int  # rounds drafting stays off the next time it stops paying
    hold: int = 0  # rounds left in the current wait
    hold_batch: int = 0  # the batch size when it began (it ends once the batch has halved)
    run: int = 0  # consecutive drafting rounds up to the previous one
    drafting_rounds: int = 0  # for explore_every
    confidence: ConfidenceCalibration | None = None  # acceptance by the draft's confidence (use_confidence only)


class AcceptanceEstimates:
    """Acceptance estimates of one batch: ``a_{b,j} = alpha_b * m_j``.

    ``alpha_b``: request b's rate over every draft token it had verified (decayed), shrunk towards the
    engine-wide rate of the sampling setting (itself shrunk towards ``prior_acceptance``). ``m_j``: how position j
    fares against the rows' overall rates, engine-wide, from the rounds that verified it (accepted there over
    ``sum alpha_b``), 1 until seen. Normalising by each row's own rate keeps the position profile free of which
    rows reach deep positions (rows still decoding in the long tail are the hard ones). Plain Python lists: the
    per-round updates are a few hundred operations.

    Args:
        num_requests: rows of the batch.
        shared: the engine-wide state of this sampling setting (updated in place).
        config: prior weights and decays.
    """

    def __init__(self, num_requests: int, shared: _Setting, config: AdaptiveConfig):
        self.shared, self.config = shared, config
        self.acc, self.tried = [0.0] * num_requests, [0.0] * num_requests
        self._alpha: list[float] | None = None  # request_rates() of the current counts, reused by observe

    def global_rate(self) -> float:
        """The engine-wide rate of this sampling setting."""
        c, sh = self.config, self.shared
        return (sh.acc + c.global_prior_weight * c.prior_acceptance) / (sh.tried + c.global_prior_weight)

    def request_rates(self) -> list[float]:
        """``(B,)`` each request's overall rate ``alpha_b``."""
        if self._alpha is None:
            m = self.config.request_prior_weight
            g = m * self.global_rate()
            self._alpha = [(a + g) / (t + m) for a, t in zip(self.acc, self.tried)]
        return self._alpha

    def position_factors(self) -> list[float]:
        """``(K,)`` the position profile ``m_j``."""
        w = self.config.position_prior_weight
        return [(a + w) / (e + w) for a, e in zip(self.shared.pos_acc, self.shared.pos_expected)]

    def rates(self) -> list[list[float]]:
        """``(B, K)`` each request's conditional rate at each draft position."""
        m = self.position_factors()
        return [[min(alpha * f, 0.999) for f in m] for alpha in self.request_rates()]

    def observe(self, k: int, accepted: Sequence[int]) -> None:
        """Decay every count one round, then add a round in which every row proposed k and accepted
        ``accepted[b]`` in ``[0, k]``: positions ``j <= min(accepted + 1, k)`` were verified, ``j <= accepted``
        accepted."""
        c, sh = self.config, self.shared
        alpha = self.request_rates()
        f, d = c.global_decay * (c.idle_decay if k == 0 else 1.0), c.request_decay
        sh.acc, sh.tried = sh.acc * f, sh.tried * f
        pos_acc, pos_expected = [x * f for x in sh.pos_acc], [x * f for x in sh.pos_expected]
        for b, a in enumerate(accepted):
            verified = min(a + 1, k)
            self.acc[b] = self.acc[b] * d + a
            self.tried[b] = self.tried[b] * d + verified
            sh.acc += a
            sh.tried += verified
            for j in range(verified):
                pos_expected[j] += alpha[b]
            for j in range(a):
                pos_acc[j] += 1.0
        sh.pos_acc, sh.pos_expected = pos_acc, pos_expected
        self._alpha = None

    def select(self, rows: list[int]) -> None:
        """Keep only ``rows`` (requests that finished leave the batch)."""
        self.acc, self.tried = [self.acc[i] for i in rows], [self.tried[i] for i in rows]
        self._alpha = None


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
        self._settings: dict[tuple, _Setting] = {}
        self._checked_size: int | None = None  # needs_calibration's last batch size and answer
        self._near_calibration = False
        self.realized: dict[int, list[float]] = {}  # width bin -> [decayed seconds saved, decayed rounds]
        self._round_tokens, self._round_catch_up, self._vetoes = 0, 0.0, 0

    def new_batch(self, num_requests: int, sampling_key: tuple) -> AcceptanceEstimates:
        """Estimates for a new batch of requests decoded with the given sampling setting."""
        if sampling_key not in self._settings:
            c = self.config
            self._settings[sampling_key] = _Setting(
                0.0,
                0.0,
                [0.0] * self.max_k,
                [0.0] * self.max_k,
                c.probe_backoff[0],
                confidence=ConfidenceCalibration(c.confidence_prior_weight) if c.use_confidence else None,
            )
        return AcceptanceEstimates(num_requests, self._settings[sampling_key], self.config)

    def needs_calibration(self, batch_size: int) -> bool:
        """True when the cost model has no timed forwards of a batch size within a factor 2 of ``batch_size``
        (measured rounds then keep the fits current: the timed points only pin down how a round's time grows
        with the tokens per row, which one batch's rounds, all of one length, cannot)."""
        if batch_size != self._checked_size:
            self._checked_size, self._near_calibration = batch_size, not self.costs.needs_calibration(batch_size)
        return not self._near_calibration

    def choose(self, estimates: AcceptanceEstimates, remaining: Sequence[int], catch_up_span: int = 0) -> int:
        """k in ``0..K`` maximising expected tokens per second for this batch (``remaining``: ``(B,)``), or 0
        while drafting waits out its backoff after it stopped paying. ``catch_up_span``: positions per row the
        draft must catch up on before it proposes (deferred prompts and plain rounds): that one-time cost is
        spread over the rounds the batch has left (at most ``resume_horizon``)."""
        st, B = estimates.shared, len(remaining)
        if st.hold > 0 and 2 * B > st.hold_batch:
            st.hold -= 1
            return 0
        st.hold = 0
        times = self.costs.round_times(B, self.max_k)
        tokens = expected_tokens(estimates.rates(), remaining)
        if catch_up_span > 0:
            once, longest = self.costs.catch_up(B, catch_up_span), max(remaining)
            for k in range(1, self.max_k + 1):
                times[k] += once / max(1.0, min(self.config.resume_horizon, longest * B / tokens[k]))
        k = max(range(self.max_k + 1), key=lambda i: tokens[i] / times[i])
        if k > 0 and self.realized_saving(B) < 0:  # measured at this width: drafting lost time, whatever predicted
            self._vetoes += 1
            if self._vetoes % self.config.explore_every:
                return 0
        first, longest = self.config.probe_backoff
        if k == 0 and st.run > 0:
            needed = min(self.config.failed_rate, max(0.0, times[1] / times[0] - 1.0))  # break-even rate of k = 1
            alpha = estimates.request_rates()
            if sum(alpha) < needed * len(alpha):  # accepted too rarely to pay: wait, longer each time
                st.hold, st.hold_batch, st.backoff = st.backoff, B, min(2 * st.backoff, longest)
        st.run = st.run + 1 if k > 0 else 0
        if st.run >= first:  # drafting lasted: the next failure waits the least again
            st.backoff = first
        if k > 0:
            st.drafting_rounds += 1
            if st.drafting_rounds % self.config.explore_every == 0:
                k = k + 1 if k < self.max_k else k - 1
        return k

    def verify_length(
        self,
        estimates: AcceptanceEstimates,
        remaining: Sequence[int],
        confidences: Sequence[Sequence[float]],
        max_k: int,
    ) -> int | None:
        """After the round drew ``n = len(confidences)`` proposals (``confidences``: ``(n, B)``), how many of them to
        verify, or None to draft another (only while ``n < max_k``).

        The round's k in ``0..max_k`` that maximises expected tokens per second (module docstring), with each drawn
        proposal's conditional acceptance predicted from its confidence (rollout/embedded/confidence.py) instead of the
        request's record, the proposals not yet drawn predicted as in :meth:`choose`, and the n drafting steps
        already taken counted in every k: verify the best k if it is at most n, else draft on.
        """
        n, B, st = len(confidences), len(remaining), estimates.shared
        if st.confidence is None:
            raise RuntimeError("verify_length needs a controller built with AdaptiveConfig(use_confidence=True)")
        table = st.confidence.rates(estimates.global_rate())
        rates = estimates.rates()
        pick = ConfidenceCalibration.bin
        rows = [[table[pick(confidences[j][b])] if j < n else rates[b][j] for j in range(max_k)] for b in range(B)]
        tokens, times = expected_tokens(rows, remaining), self.costs.round_times(B, max_k, drafted=n)
        best = max(range(max_k + 1), key=lambda k: tokens[k] / times[k])
        return best if best <= n or n >= max_k else None

    def realized_saving(self, batch_size: int) -> float:
        """Mean seconds a drafting round at this width (half-octave bins) really saved against plain decoding, over
        its recent drafting rounds (``AdaptiveConfig.realized_decay``); 0 before any was measured."""
        saved, rounds = self.realized.get(width_bin(batch_size), (0.0, 0.0))
        return saved / rounds if rounds else 0.0

    def observe(
        self,
        estimates: AcceptanceEstimates,
        k: int,
        accepted: Sequence[int],
        confidences: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Record a round's outcome (``accepted``: ``(B,)`` accepted draft tokens per row of the k verified;
        ``confidences``: ``(n, B)`` of the n >= k proposals drawn, when measured)."""
        self._round_tokens = sum(min(a, k) + 1 for a in accepted)
        st = estimates.shared
        if st.confidence is not None:
            st.confidence.decay(self.config.global_decay)
            if confidences:
                st.confidence.observe(confidences, accepted, k)
        estimates.observe(k, accepted)

    def record_round(
        self, batch_size: int, k: int, policy_s: float, draft_s: float, rest_s: float, drafted: int | None = None
    ) -> None:
        """Measured seconds of a round's verify block (k proposals verified), its proposal chain (``drafted``
        proposals drawn, default k) and the rest of the round."""
        drafted = k if drafted is None else drafted
        if k > 0:  # what the round really saved: its tokens at the plain step's price, less its measured seconds
            saved = self.costs.plain_seconds(batch_size, self._round_tokens) - (
                policy_s + draft_s + rest_s + self._round_catch_up
            )
            entry = self.realized.setdefault(width_bin(batch_size), [0.0, 0.0])
            d = self.config.realized_decay
            entry[0], entry[1] = entry[0] * d + saved, entry[1] * d + 1.0
        self._round_catch_up = 0.0
        self.costs.add("policy", batch_size, 1 + k, policy_s)
        if drafted:
            self.costs.add("draft", batch_size, 1, draft_s / drafted)
        self.costs.add("rest", batch_size, 1, rest_s)

    def record_catch_up(self, batch_size: int, span: int, seconds: float) -> None:
        """Measured seconds of a draft catch-up over ``span`` verified positions of ``batch_size`` rows."""
        self._round_catch_up += seconds
        self.costs.add("catch_up", batch_size, span, seconds)

    def calibrate(
        self,
        pdec: PolicyDecoder,
        ddec: DraftDecoder,
        pcache: KVCache,
        dcache: KVCache,
        pending: torch.Tensor,
        taps: Sequence[int],
        sampler: TokenSampler,
    ) -> None:
        """Time forwards on the live caches around this batch size (:meth:`CostModel.calibrate`)."""
        self.costs.calibrate(pdec, ddec, pcache, dcache, pending, taps, sampler, self.max_k)
        self._checked_size = None

    def calibrate_block(
        self, pdec: PolicyDecoder, pcache: KVCache, pending: torch.Tensor, taps, sampler, propose
    ) -> None:
        """Time forwards on the live rows of a block engine (:meth:`CostModel.calibrate_block`)."""
        self.costs.calibrate_block(pdec, pcache, pending, taps, sampler, self.max_k, propose)
        self._checked_size = None
