"""The block drafter's engine (rollout/embedded/block.py) is lossless: greedy output equals plain decoding, coupled
samples equal plain decoding's samples of the same seeds, rejection and coupled samples follow the policy's exact
distributions (with negative controls that must fail)."""

import pytest
import torch
from rollout_helpers import fit_dflash, make_policy, random_prompts
from test_speculative import _distribution_failures, _mutant_coupled_verify, _mutant_rejection_sample

from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.rollout.sampling import sampler
from lightning_codraft.rollout.embedded.adaptive import SpeculationController
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine, block_controller
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def fitted():
    """A tiny policy and a DFlash drafter fitted for a few seconds to its greedy continuations (so rounds accept
    some proposals and reject others: both paths run)."""
    policy = make_policy(seed=1)
    torch.manual_seed(2)
    drafter = DFlashDraft.from_policy(policy, block_size=4, mask_token_id=0)
    prompts = random_prompts(16, policy.config.vocab_size, seed=4)
    return policy, fit_dflash(policy, drafter, prompts), prompts


@pytest.mark.parametrize("batch", [4, 8, 16])
def test_greedy_output_equals_plain_decoding(fitted, batch):
    policy, drafter, fit_set = fitted
    prompts = fit_set[: batch // 2] + random_prompts(batch - batch // 2, policy.config.vocab_size, seed=batch)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 20, temperature=0.0)
    block = BlockSpeculativeEngine(policy, drafter).generate(prompts, 20, temperature=0.0)
    assert [o.token_ids for o in block] == [o.token_ids for o in plain]
    for b, p in zip(block, plain):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(p.logprobs), atol=1e-4, rtol=0)
    stats = sum((o.stats for o in block[1:]), block[0].stats)
    assert 0 < stats.accepted < stats.drafted  # proposals accepted and rejected: both paths ran
    assert stats.acceptance_length > 1.3


def test_coupled_samples_equal_plain_decodings_of_the_same_seeds(fitted):
    policy, drafter, fit_set = fitted
    prompts = fit_set[:4] + random_prompts(4, policy.config.vocab_size, seed=9)
    seeds = list(range(100, 108))
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 20, temperature=1.0, request_seeds=seeds)
    block = BlockSpeculativeEngine(policy, drafter, 2).generate(prompts, 20, temperature=1.0, request_seeds=seeds)
    assert [o.token_ids for o in block] == [o.token_ids for o in plain]


@pytest.mark.parametrize("temperature, sampling", [(0.0, "coupled"), (1.0, "coupled"), (1.0, "rejection")])
def test_batched_rounds_equal_one_request_at_a_time(fitted, temperature, sampling):
    """Requests decoded together (prompts of different lengths, rows finishing at different rounds, a stop token)
    give each request the tokens, log-probabilities and acceptance counts it gets alone: a row's rounds depend on
    its own prompt, seed and proposals only."""
    policy, drafter, fit_set = fitted
    prompts = fit_set[:5] + random_prompts(5, policy.config.vocab_size, seed=11)
    seeds = list(range(300, 310))
    kw = dict(temperature=temperature, request_seeds=seeds)
    probe = BlockSpeculativeEngine(policy, drafter, 3, sampling=sampling).generate(prompts, 18, **kw)
    kw["stop_token_ids"] = [probe[0].token_ids[6]]  # a token some requests emit: they stop early, others go on
    alone = BlockSpeculativeEngine(policy, drafter, 3, sampling=sampling, max_batch_size=1).generate(prompts, 18, **kw)
    together = BlockSpeculativeEngine(policy, drafter, 3, sampling=sampling).generate(prompts, 18, **kw)
    assert len({len(o.token_ids) for o in together}) > 1 and any(o.finish_reason == "stop" for o in together)
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids and t.finish_reason == a.finish_reason
        torch.testing.assert_close(torch.tensor(t.logprobs), torch.tensor(a.logprobs), atol=1e-4, rtol=0)
        assert t.stats.accepted_per_position == a.stats.accepted_per_position
        assert t.stats.proposed_per_position == a.stats.proposed_per_position


def test_a_block_per_request_context_equals_the_shared_context_with_its_mask(fitted):
    """The engine's batched path (one context per block) against the training path (one packed context, a visibility
    mask per block): the same blocks' hidden states."""
    policy, drafter, _ = fitted
    torch.manual_seed(0)
    ctx = torch.randn(2, 9, policy.config.hidden_size)
    lengths = torch.tensor([5, 9])
    block = torch.randn(2, drafter.config.block_size, policy.config.hidden_size)
    positions = torch.arange(9).expand(2, 9)
    per_block = drafter(ctx, positions, block, lengths, positions < lengths[:, None])
    packed = torch.cat([ctx[0, :5], ctx[1]])
    visible = torch.zeros(2, 14, dtype=torch.bool)
    visible[0, :5], visible[1, 5:] = True, True
    shared = drafter(packed, torch.cat([torch.arange(5), torch.arange(9)]), block, lengths, visible)
    torch.testing.assert_close(per_block, shared, atol=1e-5, rtol=1e-5)


def _sampling_engine(sampling):
    policy = make_policy(seed=5, std=0.15, vocab_size=12)
    torch.manual_seed(6)
    return BlockSpeculativeEngine(policy, DFlashDraft.from_policy(policy, block_size=3).eval(), 2, sampling=sampling)


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_block_sampling_is_distributed_as_the_policy(sampling):
    failures, stats, n_bonus = _distribution_failures(_sampling_engine(sampling), 2, 0, 1.0, n=3000)
    assert not failures, failures
    assert 0.02 < stats.acceptance_rate < 0.95 and n_bonus > 30


@pytest.mark.slow  # three more runs of the distribution test (~20 s each): CI's slow set
@pytest.mark.parametrize("sampling,mutation", [("rejection", "accept_with_p"), ("rejection", "residual_is_p"),
                                               ("coupled", "emit_draft_at_mismatch")])
def test_the_distribution_test_catches_a_wrong_rule_in_the_block_engine(monkeypatch, sampling, mutation):
    if sampling == "rejection":
        monkeypatch.setattr(sampler, "rejection_sample", _mutant_rejection_sample(mutation))
    else:
        monkeypatch.setattr(sampler, "lazy_coupled_verify", _mutant_coupled_verify(mutation))
    failures, _, _ = _distribution_failures(_sampling_engine(sampling), 2, 0, 1.0, n=3000)
    assert failures


class _Scripted(SpeculationController):
    """A block controller whose k follows a fixed cycle (0 included: plain rounds); it logs each choice."""

    def __init__(self, cycle, log):
        super().__init__(3, costs=block_controller(3).costs)
        self.cycle, self.log = cycle, log

    def choose(self, estimates, remaining, catch_up_span=0):
        k = self.cycle[sum(1 for e in self.log if e[0] == "choose") % len(self.cycle)]
        self.log.append(("choose", k))
        return k


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_verify_length_chosen_each_round_keeps_the_output_exact(fitted, monkeypatch, temperature):
    """Rounds verifying 0..3 proposals as the controller says (chosen before the round's drafter forward): greedy
    and coupled output equal plain decoding's, and every round proposed what was chosen."""
    policy, drafter, fit_set = fitted
    prompts = fit_set[:3] + random_prompts(3, policy.config.vocab_size, seed=21)
    seeds = list(range(500, 506))
    log = []
    engine = BlockSpeculativeEngine(policy, drafter, 3, adaptive=_Scripted([3, 0, 1, 2, 3, 1], log))
    draw = engine._draw

    def logged(hidden, pending, k, sampler, rn):
        log.append(("propose", k))
        return draw(hidden, pending, k, sampler, rn)

    monkeypatch.setattr(engine, "_draw", logged)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 20, temperature=temperature, request_seeds=seeds)
    got = engine.generate(prompts, 20, temperature=temperature, request_seeds=seeds)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    chosen = [i for i, e in enumerate(log) if e[0] == "choose"]  # (the calibration's forwards come before a choice)
    assert chosen and all(log[i + 1] == ("propose", log[i][1]) for i in chosen)
    stats = sum((o.stats for o in got[1:]), got[0].stats)
    assert stats.plain_rounds > 0 and stats.accepted > 0
    assert {k for e, k in log if e == "choose"} == {0, 1, 2, 3}


def test_the_adaptive_block_engine_decodes_exactly_and_learns_its_costs(fitted):
    """The real controller: greedy and coupled output equal plain decoding's; it measured its rounds."""
    policy, drafter, fit_set = fitted
    prompts = fit_set[:4] + random_prompts(4, policy.config.vocab_size, seed=22)
    seeds = list(range(600, 608))
    engine = BlockSpeculativeEngine(policy, drafter, 3, adaptive=True)
    for temperature in (0.0, 1.0):
        plain = SpeculativeEngine(policy, None, 0).generate(prompts, 24, temperature=temperature, request_seeds=seeds)
        got = engine.generate(prompts, 24, temperature=temperature, request_seeds=seeds)
        assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert not engine.controller.costs.policy_fit.empty and not engine.controller.costs.draft_fit.empty
    assert all(o.stats.round_s > 0 for o in got)
    with pytest.raises(ValueError, match="block_controller"):
        BlockSpeculativeEngine(policy, drafter, 3, adaptive=SpeculationController(3))


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_adaptive_block_sampling_is_distributed_as_the_policy(sampling):
    """The verify length chosen from earlier rounds (the scripted cycle: 0, 1 and 2 proposals) keeps every token's
    distribution the policy's."""
    engine = _sampling_engine(sampling)
    engine.controller = _Scripted([2, 1, 0], [])
    engine.controller.max_k = 2
    failures, stats, _ = _distribution_failures(engine, 2, 0, 1.0, n=3000)
    assert not failures, failures
    assert stats.plain_rounds > 0 and 0.02 < stats.acceptance_rate < 0.95
