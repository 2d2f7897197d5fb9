"""The adaptive speculation controller on its own: expected tokens against enumeration, the choice of k for given
acceptance and costs (high acceptance + cheap verify -> K, no acceptance -> 0, expensive verify -> fewer), a
request whose draft keeps failing stops drafting and is re-probed once its record fades, and the cost fits."""

import itertools

import numpy as np
import pytest

from lightning_codraft.rollout.embedded.adaptive import AdaptiveConfig, SpeculationController, expected_tokens
from lightning_codraft.rollout.embedded.cost_model import CostModel

K = 4


def _enumerated_tokens(rates, remaining, k):
    """Expected emitted tokens of one row by enumerating every accept/reject pattern of its k positions."""
    total = 0.0
    for pattern in itertools.product([True, False], repeat=k):
        p, accepted = 1.0, 0
        for j, ok in enumerate(pattern):
            p *= rates[j] if ok else 1.0 - rates[j]
        for ok in pattern:  # accepted prefix: positions after the first rejection do not count
            if not ok:
                break
            accepted += 1
        total += p * min(accepted + 1, remaining)
    return total


def test_expected_tokens_equals_enumeration():
    rng = np.random.default_rng(0)
    rates = rng.uniform(0, 1, (5, K))
    remaining = np.array([1, 2, 3, 10, 5])
    got = expected_tokens(rates, remaining)
    for k in range(K + 1):
        ref = sum(_enumerated_tokens(rates[b], remaining[b], k) for b in range(5))
        assert got[k] == pytest.approx(ref, rel=1e-12)


def _costs(policy_per_token: float, policy_base: float = 1e-3, draft_step: float = 5e-5,
           catch_up_per_token: float = 1e-6) -> CostModel:
    """A cost model fitted on exact synthetic times: P = base + per_token B S, D = draft_step, C = catch_up_per_token
    B S."""
    costs = CostModel()
    for B in (1, 4, 16, 64):
        for S in range(1, K + 2):
            costs.add("policy", B, S, policy_base + policy_per_token * B * S, anchor=True)
            costs.add("catch_up", B, S, catch_up_per_token * B * S, anchor=True)
        costs.add("draft", B, 1, draft_step, anchor=True)
    costs.sizes = [1, 4, 16, 64]
    return costs


def _controller(costs: CostModel, **config) -> SpeculationController:
    return SpeculationController(K, AdaptiveConfig(**config), costs)


def _observe_rounds(ctl, est, k, accepted, rounds):
    for _ in range(rounds):
        ctl.observe(est, k, np.array(accepted))


def test_cost_model_recovers_an_affine_cost_and_stays_non_negative():
    costs = _costs(policy_per_token=2e-5)
    assert costs.policy(32, 3) == pytest.approx(1e-3 + 2e-5 * 96, rel=1e-4)   # a tiny ridge keeps solves stable
    assert costs.draft_step(7) == pytest.approx(5e-5, rel=1e-4)
    times = costs.round_times(16, K)
    assert times[0] == pytest.approx(1e-3 + 2e-5 * 16, rel=1e-4)
    assert times[2] == pytest.approx(1e-3 + 2e-5 * 48 + 2 * 5e-5 + 1e-6 * 48, rel=1e-4)
    noisy = CostModel()
    for B in (1, 2, 3):              # time falls with B: the fit drops the negative slope instead of going below 0
        noisy.add("rest", B, 1, 1e-3 / B)
    assert all(noisy.rest(B) >= 0 for B in (1, 100, 10_000))


def test_verify_cost_keeps_the_step_from_one_to_two_tokens():
    """A one-token verify takes a cheaper path: the fit keeps the step from S = 1 to 2 apart from the per-token
    slope, so it neither under-prices S = 2 nor over-prices S = 5."""
    costs = CostModel()
    truth = lambda B, S: 1e-3 + 1e-4 * B * S + (3e-4 * B if S > 1 else 0.0)  # noqa: E731
    for B in (8, 16, 32):
        for S in (1, 2, 3, 5):
            costs.add("policy", B, S, truth(B, S), anchor=True)
    for S in (1, 2, 4, 5):
        assert costs.policy(16, S) == pytest.approx(truth(16, S), rel=1e-4)


def test_measured_rounds_move_the_fit():
    costs = _costs(policy_per_token=1e-5)
    before = costs.policy(8, 5)
    for _ in range(400):             # the machine got slower: every measured verify takes 3x the model's time
        costs.add("policy", 8, 5, 3 * before)
    assert costs.policy(8, 5) == pytest.approx(3 * before, rel=0.15)


def test_high_acceptance_and_cheap_verify_draft_k_max():
    ctl = _controller(_costs(policy_per_token=1e-7))
    est = ctl.new_batch(4, ("greedy",))
    _observe_rounds(ctl, est, K, [K] * 4, 20)
    assert ctl.choose(est, np.full(4, 100)) == K


def test_zero_acceptance_draft_nothing():
    ctl = _controller(_costs(policy_per_token=1e-7))
    est = ctl.new_batch(4, ("greedy",))
    _observe_rounds(ctl, est, K, [0] * 4, 20)
    assert ctl.choose(est, np.full(4, 100)) == 0


def test_expensive_verify_shortens_the_proposal():
    """Acceptance 0.8 per position: with verify costing little per token K pays, compute-bound only a short one."""
    est_rates = [0.8] * K
    cheap, dear = _controller(_costs(policy_per_token=1e-7)), _controller(_costs(policy_per_token=3e-5))
    picks = []
    for ctl in (cheap, dear):
        est = ctl.new_batch(64, (1.0, 0, 1.0))
        for _ in range(60):
            accepted = np.random.default_rng(len(picks)).binomial(1, est_rates[0], (64, K)).cumprod(1).sum(1)
            ctl.observe(est, K, accepted)
        picks.append(ctl.choose(est, np.full(64, 100)))
    assert picks[0] == K and 0 < picks[1] < K


def test_a_deferred_catch_up_is_paid_only_where_the_rounds_left_repay_it():
    """A draft that must first catch up on 200 deferred positions a row (the prompts, or plain rounds) resumes when
    the batch has many rounds left to spread that cost over, not for its last rounds; without the deferred catch-up
    those last rounds would draft."""
    ctl = _controller(_costs(policy_per_token=1e-5, catch_up_per_token=2e-6))
    est = ctl.new_batch(16, ("greedy",))
    _observe_rounds(ctl, est, K, [3] * 16, 20)
    many, few = np.full(16, 200), np.full(16, 3)
    assert ctl.choose(est, few) > 0 and ctl.choose(est, many, catch_up_span=200) > 0
    assert ctl.choose(est, few, catch_up_span=200) == 0


def test_the_chain_stops_where_the_drafts_confidence_says_verifying_more_does_not_pay():
    """After each proposal the controller weighs verifying what was drawn against drafting on, predicting each drawn
    proposal's acceptance from its confidence, as measured: confident proposals are drafted to K, a batch of
    hesitant first proposals verifies none (a plain round), a confident first and hesitant second verifies one."""
    ctl = _controller(_costs(policy_per_token=2e-5), use_confidence=True)
    est = ctl.new_batch(16, ("greedy",))
    left = np.full(16, 100)
    sure, unsure = [0.995] * 16, [0.02] * 16
    for _ in range(30):    # measured: sure proposals are accepted, hesitant ones are not
        ctl.observe(est, K, [2] * 16, [sure, sure, unsure, unsure])
    table = est.shared.confidence.rates(est.global_rate())
    assert table[-1] > 0.9 and table[0] < 0.1
    assert ctl.choose(est, left) > 0
    assert ctl.verify_length(est, left, [sure], K) is None                  # draw another
    assert ctl.verify_length(est, left, [sure] * K, K) == K                 # all drawn: verify them all
    assert ctl.verify_length(est, left, [unsure], K) == 0
    assert ctl.verify_length(est, left, [sure, unsure], K) == 1
    assert ctl.verify_length(est, np.full(16, 1), [sure], K) == 0           # nothing left to emit after the step


def test_nothing_left_to_emit_means_no_proposal():
    ctl = _controller(_costs(policy_per_token=1e-7))
    est = ctl.new_batch(3, ("greedy",))
    _observe_rounds(ctl, est, K, [K] * 3, 20)
    assert ctl.choose(est, np.array([1, 1, 1])) == 0        # every row has one token left: the plain step's
    assert ctl.choose(est, np.array([1, 3, 1])) == 2        # one row can use 2 more tokens: 2 positions pay


def test_a_failing_request_stops_drafting_and_is_reprobed_less_and_less():
    ctl = _controller(_costs(policy_per_token=1e-4, draft_step=2e-4), probe_backoff=(4, 32))
    est = ctl.new_batch(1, ("greedy",))
    ks = []
    for _ in range(400):                                     # the draft is rejected whenever it is tried
        k = ctl.choose(est, np.array([1000]))
        ctl.observe(est, k, np.array([0]))
        ks.append(k)
    assert ks[0] > 0                                         # optimistic prior: a new engine drafts
    drafted = sum(k > 0 for k in ks)
    assert drafted < 40, f"drafted in {drafted} of 400 rounds"
    # first round of each re-probe (a probe may take two drafting rounds: one rejected proposal does not yet
    # outweigh the faded record, failed_rate)
    probes = [i for i in range(4, len(ks)) if ks[i] > 0 and not any(ks[i - 4:i])]
    gaps = np.diff(probes)
    assert (np.diff(gaps[:3]) > 0).all() and (gaps[-3:] >= 32).all()  # the waits grow to the longest, stay there
    for _ in range(40):                                      # the draft got good: back to drafting, up to K
        k = ctl.choose(est, np.array([1000]))
        ctl.observe(est, k, np.array([k]))
    assert ctl.choose(est, np.array([1000])) == K
    assert est.shared.backoff == 4                           # ... and the next stop waits the least again


def test_only_a_rejected_draft_waits_before_drafting_again():
    """Drafting that stops because this batch size no longer pays (a 64-row verify of 1 + k tokens costs nearly
    1 + k plain steps) while proposals are mostly accepted does not wait: the 2-row batch drafts on at once.
    Drafting that stops because proposals are rejected does wait (a failed probe)."""
    ctl = _controller(_costs(policy_per_token=3e-4))
    rng = np.random.default_rng(1)
    small = ctl.new_batch(2, ("greedy",))
    for _ in range(12):                                      # each position accepted with probability 0.8
        k = ctl.choose(small, [100, 100])
        ctl.observe(small, k, [min(int(np.argmin(np.append(rng.uniform(size=K) < 0.8, False))), k)
                               for _ in range(2)])
    assert k > 0
    assert ctl.choose(ctl.new_batch(64, ("greedy",)), [100] * 64) == 0
    assert small.shared.hold == 0 and ctl.choose(small, [100, 100]) > 0
    rejected = _controller(_costs(policy_per_token=3e-4))
    est = rejected.new_batch(2, ("greedy",))
    while (k := rejected.choose(est, [100, 100])) > 0:      # every proposal rejected
        rejected.observe(est, k, [0, 0])
    assert est.shared.hold > 0


@pytest.mark.parametrize("per_token,rows,waits", [(1e-6, 1, False), (3e-5, 16, True)])
def test_a_draft_waits_only_if_it_was_accepted_too_rarely_to_pay_at_this_batch_size(per_token, rows, waits):
    """A first proposal accepted every fourth round: where a verify costs about a plain step (batch 1 on a CPU)
    that pays, and drafting that stops (here: one token left) may resume at once; where a verify costs ~1 + k
    steps it does not, and drafting stops and waits out a backoff."""
    ctl = _controller(_costs(policy_per_token=per_token))
    est = ctl.new_batch(rows, ("greedy",))
    held = False
    for i in range(40):
        k = ctl.choose(est, [100] * rows)
        held |= est.shared.hold > 0
        ctl.observe(est, k, [1 if k and i % 4 == 0 else 0] * rows)
    ctl.choose(est, [1] * rows)                              # nothing left to draft for: drafting stops
    assert (held or est.shared.hold > 0) == waits


def test_a_wait_ends_once_the_batch_has_halved():
    """A wait set at 16 rows (every proposal rejected, verify dear) holds while the batch is wider than 8 rows and
    ends once it has narrowed to 8 (the long tail of a batch, where a verify costs less)."""
    ctl = _controller(_costs(policy_per_token=3e-5))
    est = ctl.new_batch(16, ("greedy",))
    while (k := ctl.choose(est, [100] * 16)) > 0:
        ctl.observe(est, k, [0] * 16)
    assert est.shared.hold > 1 and est.shared.hold_batch == 16
    est.select(list(range(9)))
    held = est.shared.hold
    assert ctl.choose(est, [100] * 9) == 0 and est.shared.hold == held - 1
    est.select(list(range(8)))
    ctl.choose(est, [100] * 8)
    assert est.shared.hold == 0


def test_requests_are_weighed_by_their_own_record():
    """Two requests, one always accepted, one never: together the good one makes K pay; once it has finished
    and left the batch, the failing one alone stops drafting (a batch-wide rate would keep it drafting)."""
    ctl = _controller(_costs(policy_per_token=1e-4, draft_step=2e-4))
    est = ctl.new_batch(2, ("greedy",))
    _observe_rounds(ctl, est, K, [K, 0], 20)
    rates = est.rates()
    assert min(rates[0]) > 0.85 and rates[1][0] < 0.15
    assert ctl.choose(est, np.full(2, 100)) == K
    est.select([1])
    assert ctl.choose(est, np.full(1, 100)) == 0
    fresh = ctl.new_batch(1, ("greedy",))                   # a new request starts from the engine-wide rate
    assert fresh.request_rates()[0] == pytest.approx(fresh.global_rate()) and fresh.global_rate() > 0.4


def test_position_profile_ignores_which_rows_reach_deep_positions():
    """Good requests verify 2 positions per round, one poor request (accepting any position with p = 0.5) is
    the only one verifying positions 3 and 4: per position that data says 'deep positions accept half the time',
    but against the rows' own rates positions 3 and 4 are as good as 1 and 2, and a good request is credited so."""
    ctl = _controller(_costs(policy_per_token=1e-7))
    rng = np.random.default_rng(0)
    good, poor = ctl.new_batch(8, ("greedy",)), ctl.new_batch(1, ("greedy",))
    for _ in range(200):
        ctl.observe(good, 2, np.full(8, 2) - (rng.uniform(size=8) < 0.05))
        ctl.observe(poor, K, np.array([int(np.argmin(np.append(rng.uniform(size=K) < 0.5, False)))]))
    profile = good.position_factors()
    assert profile[2:] == pytest.approx([1.0, 1.0], abs=0.2), profile
    assert min(r[K - 1] for r in good.rates()) > 0.75 and max(poor.rates()[0]) < 0.65


def test_sampling_settings_are_estimated_apart():
    ctl = _controller(_costs(policy_per_token=1e-4, draft_step=2e-4))
    greedy = ctl.new_batch(2, ("greedy",))
    _observe_rounds(ctl, greedy, K, [0, 0], 20)
    assert ctl.choose(greedy, np.full(2, 100)) == 0
    sampled = ctl.new_batch(2, (1.0, 0, 1.0))
    assert ctl.choose(sampled, np.full(2, 100)) > 0          # untouched prior for another setting


def test_config_errors():
    with pytest.raises(ValueError, match="global_decay=1.5 must be in"):
        AdaptiveConfig(global_decay=1.5)
    with pytest.raises(ValueError, match="resume_window=0 must be >= 1"):
        AdaptiveConfig(resume_window=0)
    with pytest.raises(ValueError, match=r"probe_backoff=\(8, 4\) must be"):
        AdaptiveConfig(probe_backoff=(8, 4))
    with pytest.raises(ValueError, match="max_k=0 must be >= 1"):
        SpeculationController(0)
    with pytest.raises(ValueError, match="unknown cost block 'verify'"):
        CostModel().add("verify", 1, 1, 1.0)


def test_a_width_where_drafting_really_lost_time_decodes_plainly_but_for_probes():
    """The model predicts drafting pays, yet the measured drafting rounds at this width cost more than their tokens
    at the plain step's price (a 1024-row verify on a CPU): the controller decodes plainly there, with a probe every
    ``explore_every`` choices; rounds that save restore drafting, and every width keeps its own record."""
    costs = _costs(policy_per_token=1e-7)
    costs.add = lambda *a, **k: None  # the fits stay as calibrated: only the realized record moves
    ctl = _controller(costs, explore_every=4)
    est, rem = ctl.new_batch(16, ("greedy",)), np.full(16, 100)
    _observe_rounds(ctl, est, K, [K] * 16, 20)
    assert ctl.choose(est, rem) == K and ctl.realized_saving(16) == 0.0
    plain = costs.round_times(16, 0)[0]
    for _ in range(3):  # 16 rows x (K + 1) tokens: K + 1 plain steps' worth, measured at 10x that
        ctl.observe(est, K, np.array([K] * 16))
        ctl.record_round(16, K, 10 * (K + 1) * plain, 0.0, 0.0)
    assert ctl.realized_saving(16) == pytest.approx(-9 * (K + 1) * plain)
    assert ctl.realized_saving(64) == 0.0
    ks = [ctl.choose(est, rem) for _ in range(8)]
    assert ks.count(0) == 6 and ks[3] > 0 and ks[7] > 0
    for _ in range(30):  # measured below their tokens' plain price: drafting pays again
        ctl.observe(est, K, np.array([K] * 16))
        ctl.record_round(16, K, 0.1 * plain, 0.0, 0.0)
    assert ctl.realized_saving(16) > 0 and ctl.choose(est, rem) > 0
    est64 = ctl.new_batch(64, ("greedy",))
    assert ctl.choose(est64, np.full(64, 100)) > 0   # a width with no record of its own drafts as predicted


def _block_costs(policy_per_token: float, draft_forward: float) -> CostModel:
    """A block drafter's cost model (one drafter forward per proposing round, no catch-up) on exact times."""
    costs = CostModel(one_forward_draft=True)
    for B in (1, 4, 16, 64):
        for S in range(1, K + 2):
            costs.add("policy", B, S, 1e-3 + policy_per_token * B * S, anchor=True)
        costs.add("draft", B, 1, draft_forward, anchor=True)
    costs.sizes = [1, 4, 16, 64]
    return costs


def test_a_block_drafter_pays_its_forward_once_whatever_k():
    costs = _block_costs(policy_per_token=2e-5, draft_forward=4e-4)
    times = costs.round_times(16, K)
    for k in range(1, K + 1):
        assert times[k] == pytest.approx(1e-3 + 2e-5 * 16 * (1 + k) + 4e-4, rel=1e-4)
    assert times[0] == pytest.approx(1e-3 + 2e-5 * 16, rel=1e-4)
    assert costs.round_times(16, K, drafted=1)[0] == pytest.approx(times[0] + 4e-4, rel=1e-4)


def test_a_block_controller_verifies_the_prefix_that_pays():
    """Acceptance falling with the position: a cheap verify takes the whole block, a dear one a short prefix, and a
    drafter forward dearer than what any prefix saves none (the per-token model, with the same numbers, stops
    earlier: it charges the forward once per proposal)."""
    def chosen(policy_per_token, draft_forward, one_forward=True):
        costs = _block_costs(policy_per_token, draft_forward)
        costs.one_forward_draft = one_forward
        ctl = SpeculationController(K, AdaptiveConfig(explore_every=10_000), costs)
        est = ctl.new_batch(8, ("greedy",))
        for _ in range(40):  # position j accepted given j - 1 was: 0.95, 0.8, 0.5, 0.2
            ctl.observe(est, K, [4, 4, 3, 3, 2, 2, 1, 0])
        return ctl.choose(est, [100] * 8)

    assert chosen(1e-6, 1e-4) == K
    assert 0 < chosen(1e-4, 1e-4) < K
    assert chosen(1e-6, 1.0) == 0
    assert chosen(1e-6, 2e-3, one_forward=False) < chosen(1e-6, 2e-3)
