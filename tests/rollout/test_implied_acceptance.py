"""Implied acceptance (training/implied.py) against the engine that decodes: exactly equal where it must be (greedy,
fixed K, a deterministic draft: every round, accepted count and per-position count), and equal in expectation at
T=1 under rejection sampling (a z-test over many rollouts, with a negative control that the same test rejects)."""

import math

import pytest
import torch
from rollout_helpers import fit_draft, fit_prompts, make_policy, random_prompts

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rl.experience import Rollout, build_rl_batch
from lightning_codraft.rollout import AcceptanceStats, SpeculativeEngine
from lightning_codraft.training.implied import RoundCounts, row_acceptance, walk_rounds

K = 4


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair():
    policy = make_policy()
    torch.manual_seed(3)
    draft = fit_draft(policy, Eagle3Draft.from_policy(policy), fit_prompts(24, policy.config.vocab_size),
                      gen_len=24, steps=100)
    return policy, draft


def _step_logits(policy, draft, batch):
    with torch.no_grad():
        taps = (0, *draft.config.taps)
        out = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids, taps=taps)
        embeds = [batch.shift_left(out.taps[0], k + 1) for k in range(K)]
        steps = draft.ttt_forward(list(out.taps[1:]), embeds, batch.cu_seqlens, batch.position_ids)
    return [lg for lg, _ in steps]


def _decode_and_score(policy, draft, prompts, gen_len, temperature, seed, stops=()):
    engine = SpeculativeEngine(policy, draft, K, sampling="rejection")
    outs = engine.generate(prompts, gen_len, temperature=temperature, seed=seed, stop_token_ids=stops)
    batch = build_rl_batch([Rollout(p, o.token_ids, o.logprobs, group=i) for i, (p, o) in enumerate(zip(prompts, outs))],
                           [0.0] * len(outs))
    logits = _step_logits(policy, draft, batch)
    return outs, batch, logits


def _implied(batch, logits, temperature, d2t, vocab):
    accept = row_acceptance(logits, batch.target_ids, batch.old_logprobs, batch.cu_seqlens, d2t, vocab, temperature)
    return accept, walk_rounds(accept, batch.loss_mask, batch.cu_seqlens)


@pytest.mark.parametrize("stops", [(), (5, 9)], ids=["length", "stop_tokens"])
def test_greedy_implied_acceptance_is_the_engines_exactly(pair, stops):
    policy, draft = pair
    prompts = fit_prompts(24, policy.config.vocab_size) + random_prompts(8, policy.config.vocab_size, seed=4)
    outs, batch, logits = _decode_and_score(policy, draft, prompts, 24, 0.0, 0, stops)
    accept, implied = _implied(batch, logits, 0.0, draft.d2t, policy.config.vocab_size)
    stats = sum((o.stats for o in outs), AcceptanceStats())
    assert set(accept.unique().tolist()) <= {0.0, 1.0}
    assert stats.draft_steps > 50 and 0 < stats.accepted < K * stats.draft_steps  # neither trivial nor perfect
    assert implied.rounds == stats.draft_steps
    assert implied.accepted == stats.accepted
    assert implied.per_position == [float(n) for n in stats.accepted_per_position]
    assert implied.acceptance_length == pytest.approx(stats.acceptance_length, abs=1e-12)
    # per sequence as well: the walk is the engine's round for round
    for i, o in enumerate(outs):
        lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        one = walk_rounds(accept[:, lo:hi], batch.loss_mask[lo:hi], torch.tensor([0, hi - lo], dtype=torch.int32))
        assert (one.rounds, one.accepted) == (o.stats.draft_steps, o.stats.accepted), i


def test_a_draft_that_proposes_something_else_is_rejected_everywhere(pair):
    policy, draft = pair
    prompts = fit_prompts(8, policy.config.vocab_size)
    outs, batch, logits = _decode_and_score(policy, draft, prompts, 16, 0.0, 0)
    wrong = [-lg for lg in logits]  # the least likely token instead of the most likely
    _, implied = _implied(batch, wrong, 0.0, draft.d2t, policy.config.vocab_size)
    assert implied.accepted == 0 and implied.acceptance_length == 1.0


def _z(measured: list[float], implied: list[float]) -> float:
    d = torch.tensor(measured, dtype=torch.float64) - torch.tensor(implied, dtype=torch.float64)
    return float(d.mean() / (d.std() / math.sqrt(d.numel())))


def test_at_temperature_one_implied_acceptance_is_the_engines_in_expectation(pair):
    """Per sequence: the engine's accepted count minus the implied expectation given the same tokens has mean 0 (a
    z-test over 480 rollouts); the negative control (acceptance ``q(x)``: forgetting that ``x`` was emitted with
    probability ``p(x)``) fails the same test."""
    policy, draft = pair
    V = policy.config.vocab_size
    prompts = fit_prompts(24, V)
    measured, implied, control = [], [], []
    for seed in range(20):
        outs, batch, logits = _decode_and_score(policy, draft, prompts, 20, 1.0, seed)
        accept, _ = _implied(batch, logits, 1.0, draft.d2t, V)
        wrong = row_acceptance(logits, batch.target_ids, torch.zeros_like(batch.old_logprobs), batch.cu_seqlens,
                               draft.d2t, V, 1.0)
        for i, o in enumerate(outs):
            lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
            cu = torch.tensor([0, hi - lo], dtype=torch.int32)
            right = walk_rounds(accept[:, lo:hi], batch.loss_mask[lo:hi], cu)
            bad = walk_rounds(wrong[:, lo:hi], batch.loss_mask[lo:hi], cu)
            measured.append(o.stats.accepted)
            implied.append(right.accepted)
            control.append(bad.accepted)
    assert sum(measured) > 0.2 * K * len(measured)  # the draft is useful at T=1: the test has power
    z_right, z_control = _z(measured, implied), _z(measured, control)
    print(f"measured {sum(measured) / len(measured):.3f} accepted per sequence, implied "
          f"{sum(implied) / len(implied):.3f} (z {z_right:+.2f}), control {sum(control) / len(control):.3f} "
          f"(z {z_control:+.2f})")
    assert abs(z_right) < 3.5
    assert abs(z_control) > 3.5


def test_round_counts_sum_and_rates():
    a = RoundCounts(10.0, 12.0, [6.0, 4.0, 2.0])
    assert a.acceptance_length == pytest.approx(2.2)
    assert a.position_rates == pytest.approx([0.6, 4 / 6, 0.5])
    assert RoundCounts.from_tensor(a.as_tensor()) == a
    assert math.isnan(RoundCounts(0.0, 0.0, [0.0]).acceptance_length)


def test_walk_of_probabilities_by_hand():
    """One completion of 3 tokens after the prefill's, K = 2, every proposal accepted with probability 1/2: the
    expected rounds and accepted tokens by enumeration."""
    accept = torch.full((2, 6), 0.5)
    mask = torch.tensor([0, 1, 1, 1, 1, 0.0])  # prompt row 0 .. last completion row 4
    c = walk_rounds(accept, mask, torch.tensor([0, 6], dtype=torch.int32))
    # round 1 at 3 left: a=0 (1/2) -> 2 left; a=1 (1/4) -> 1 left; a=2 (1/4) -> 0 left, accepted 2
    # from 2 left: a=0 (1/2) -> 1 left; a>=1 (1/2) -> done, accepted 1.  from 1 left: one round, accepted 0.
    rounds = 1 + 0.5 * (1 + 0.5 * 1) + 0.25 * 1
    accepted = 0.25 * 1 + 0.25 * 2 + 0.5 * (0.5 * 1)
    assert c.rounds == pytest.approx(rounds) and c.accepted == pytest.approx(accepted)
