"""TokenSampler (rollout/sampling/sampler.py): which noise each rule gets. A draft over part of the vocabulary proposes with
the noise of its target ids (so a draft equal to the policy on its vocabulary proposes exactly the policy's sample
whenever that sample lies in it); rejection sampling's q lands on the target ids; greedy needs no noise."""

import torch

from lightning_codraft.rollout.sampling.noise import CounterNoise, seed_tensor
from lightning_codraft.rollout.sampling.sampler import TokenSampler
from lightning_codraft.rollout.sampling.rules import SamplingParams, gumbel_argmax, sampling_logprobs

V, B = 12, 4000
INDEX = torch.tensor([1, 3, 4, 6, 7, 9, 10, 11])   # draft id -> target id


def _setup(mode, temperature=0.8):
    sampler = TokenSampler(SamplingParams(max_new_tokens=4, temperature=temperature), mode, V, INDEX)
    logits = 2.0 * torch.randn(B, 2, V, generator=torch.Generator().manual_seed(0))   # (B, k+1, V) policy logits
    return sampler, logits, CounterNoise(seed_tensor(range(B))), torch.arange(B) % 7    # rows at various positions


def test_coupled_draft_proposes_with_the_noise_of_its_target_ids():
    sampler, logits, noise, pos = _setup("coupled")
    lp = sampling_logprobs(logits, 0.8)
    rn = sampler.start_round(noise, pos, 1)
    token = noise.gumbel(pos[:, None] + torch.arange(2), 0, torch.arange(V))   # (B, 2, V) TOKEN noise
    d, q, _ = sampler.draw(logits[:, 0, INDEX], rn, 0)   # the policy restricted to the draft vocabulary
    y = gumbel_argmax(lp[:, 0], token[:, 0])             # the policy's own sample at the proposed position
    inside = torch.isin(y, INDEX)
    assert q is None and torch.isin(d, INDEX).all()
    assert torch.equal(d[inside], y[inside])
    assert 0.3 < float(inside.double().mean()) < 0.95
    accepted, nxt = sampler.verify(lp, d[:, None], None, rn)
    assert torch.equal(accepted, inside.long())
    assert torch.equal(nxt, torch.where(inside, gumbel_argmax(lp[:, 1], token[:, 1]), y))
    rows = torch.arange(0, B, 3)
    assert torch.equal(sampler.token_noise(rn, 1, INDEX, rows), token[rows, 1][:, INDEX])


def test_rejection_draft_distribution_in_target_ids():
    sampler, logits, noise, pos = _setup("rejection")
    rn = sampler.start_round(noise, pos, 1)
    d, q, _ = sampler.draw(logits[:, 0, INDEX], rn, 0)
    assert torch.isin(d, INDEX).all() and rn.draft is not None and rn.accept is not None
    assert torch.allclose(q, torch.softmax(logits[:, 0, INDEX] / 0.8, -1))
    q_target = sampler.target_probs([q])
    assert q_target.shape == (B, 1, V)
    assert torch.equal(q_target[:, 0, INDEX], q) and float(q_target.sum(-1).sub(1).abs().max()) < 1e-5
    outside = torch.ones(V, dtype=torch.bool)
    outside[INDEX] = False
    assert float(q_target[:, 0, outside].abs().max()) == 0.0


def test_greedy_uses_no_noise():
    sampler, logits, noise, pos = _setup("coupled", temperature=0.0)
    rn = sampler.start_round(noise, pos, 1)
    assert rn.draft is None and rn.accept is None
    d, _, _ = sampler.draw(logits[:, 0, INDEX], rn, 0)
    assert torch.equal(d, INDEX[logits[:, 0, INDEX].argmax(-1)])
    assert torch.equal(sampler.first(logits[:, 0], noise, pos), logits[:, 0].argmax(-1))


def test_confidence_is_the_proposals_probability_under_the_distribution_it_was_drawn_from():
    draft_logits = 2.0 * torch.randn(B, len(INDEX), generator=torch.Generator().manual_seed(1))
    draft_id = {int(t): i for i, t in enumerate(INDEX)}
    for mode, temperature in (("coupled", 0.0), ("coupled", 0.8), ("rejection", 0.8)):
        sampler, _, noise, pos = _setup(mode, temperature)
        p = sampler.draw(draft_logits, sampler.start_round(noise, pos, 1), 0, confidence=True)
        q = torch.softmax(draft_logits / (temperature or 1.0), -1)
        picked = torch.tensor([draft_id[int(t)] for t in p.ids])
        assert torch.allclose(p.confidence, q.gather(1, picked[:, None])[:, 0])
        if temperature == 0.0:
            assert torch.equal(picked, draft_logits.argmax(-1))
        assert sampler.draw(draft_logits, sampler.start_round(noise, pos, 1), 0).confidence is None
