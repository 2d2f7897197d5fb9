"""Sampling utilities: filtering against a dense reference, greedy verification, and the statistical
test that speculative rejection sampling reproduces the target distribution (and that the same test
catches wrong acceptance rules)."""

import math

import pytest
import torch

from rollout_helpers import reference_filter as _reference_filter

from lightning_codraft.rollout.sampling import (
    SamplingParams,
    filter_logits,
    greedy_verify,
    rejection_sample,
    sample_from_probs,
    sampling_logprobs,
)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.5), (4, 0.8), (1, 0.9), (0, 0.05)])
def test_filter_logits_matches_reference(top_k, top_p):
    logits = torch.randn(5, 11)
    out = filter_logits(logits, top_k, top_p)
    for row_in, row_out in zip(logits.tolist(), out.tolist()):
        expected = _reference_filter(row_in, top_k, top_p)
        assert [x > -math.inf for x in row_out] == expected
        assert all(a == b for a, b, k in zip(row_in, row_out, expected) if k)


def test_sampling_logprobs_temperature_and_greedy():
    logits = torch.randn(3, 7)
    assert torch.allclose(sampling_logprobs(logits, 0.0), torch.log_softmax(logits, -1))
    assert torch.allclose(sampling_logprobs(logits, 0.5), torch.log_softmax(logits / 0.5, -1))
    lp = sampling_logprobs(logits, 1.0, top_k=2)
    assert torch.allclose(lp.exp().sum(-1), torch.ones(3))
    assert (lp > -math.inf).sum(-1).tolist() == [2, 2, 2]


def test_sampling_params_errors():
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(max_new_tokens=1, temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="top_k=-2"):
        SamplingParams(max_new_tokens=1, top_k=-2)


def test_greedy_verify():
    target = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [7, 2, 3, 4], [1, 2, 3, 5]])
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    accepted, nxt = greedy_verify(target, draft)
    assert accepted.tolist() == [3, 1, 0, 3]
    assert nxt.tolist() == [4, 9, 7, 5]


def test_sample_from_probs_distribution():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(100_000, 4)
    counts = torch.bincount(sample_from_probs(probs, g), minlength=4).float() / 100_000
    assert counts[1] == 0
    assert torch.allclose(counts, probs[0], atol=0.01)


# ---------------------------------------------------------------- the statistical test

V, K, N = 6, 3, 200_000
CHI2_CRIT = 25.7  # chi-square, 5 degrees of freedom, p = 1e-4


def _synthetic(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(K + 1, V, generator=g), -1)
    q = torch.softmax(2.0 * torch.randn(K, V, generator=g), -1)
    q[0, 1] = 0.0  # a token the draft never proposes: only reachable through the residual
    q = q / q.sum(-1, keepdim=True)
    return p, q


def _first_tokens(rule, p, q, seed=0):
    """Sample N speculative rounds and return the first emitted token of each."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()  # (N, K)
    pp, qq = p.expand(N, K + 1, V), q.expand(N, K, V)
    accepted, nxt = rule(pp, qq, draft, g)
    first = torch.where(accepted > 0, draft[:, 0], nxt)
    return first


def _chi2(samples, probs):
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum())


def _wrong_accept_if_p_ge_q(p, q, draft, g):
    """Wrong: deterministic acceptance when p(d) >= q(d), else residual."""
    p_d = p[:, :K].gather(2, draft[..., None])[..., 0]
    q_d = q.gather(2, draft[..., None])[..., 0]
    acc = torch.cumprod((p_d >= q_d).long(), 1).sum(1)
    rows = torch.arange(len(draft))
    pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    res = (p[rows, acc] - pad[rows, acc]).clamp_min(0)
    return acc, torch.multinomial(res, 1, generator=g)[:, 0]


def _wrong_resample_from_p(p, q, draft, g):
    """Wrong: correct acceptance test, but after a rejection sample from p instead of the residual."""
    p_d = p[:, :K].gather(2, draft[..., None])[..., 0]
    q_d = q.gather(2, draft[..., None])[..., 0]
    u = torch.rand(p_d.shape, generator=g)
    acc = torch.cumprod((u * q_d <= p_d).long(), 1).sum(1)
    rows = torch.arange(len(draft))
    return acc, torch.multinomial(p[rows, acc], 1, generator=g)[:, 0]


def test_rejection_sampling_first_token_is_distributed_as_target():
    p, q = _synthetic()
    first = _first_tokens(rejection_sample, p, q)
    assert _chi2(first, p[0]) < CHI2_CRIT
    assert torch.bincount(first, minlength=V)[1] > 0  # the residual reaches tokens the draft never proposes


@pytest.mark.parametrize("wrong_rule", [_wrong_accept_if_p_ge_q, _wrong_resample_from_p])
def test_statistical_test_catches_wrong_acceptance_rules(wrong_rule):
    p, q = _synthetic()
    assert _chi2(_first_tokens(wrong_rule, p, q), p[0]) > 10 * CHI2_CRIT


def test_rejection_sampling_acceptance_rate_matches_theory():
    """P(accept position 0) = sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    p, q = _synthetic()
    g = torch.Generator().manual_seed(3)
    draft = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()
    accepted, _ = rejection_sample(p.expand(N, K + 1, V), q.expand(N, K, V), draft, g)
    rate = (accepted > 0).double().mean().item()
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 0.005


def test_rejection_sampling_identical_distributions_accept_everything():
    p, _ = _synthetic()
    g = torch.Generator().manual_seed(4)
    draft = torch.multinomial(p[:K], 1000, replacement=True, generator=g).T.contiguous()
    accepted, nxt = rejection_sample(p.expand(1000, K + 1, V), p[:K].expand(1000, K, V), draft, g)
    assert accepted.tolist() == [K] * 1000
    assert _chi2(nxt, p[K]) < 4 * CHI2_CRIT  # the bonus token comes from p_K
