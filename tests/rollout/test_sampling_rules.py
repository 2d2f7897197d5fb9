"""Sampling rules: filtering against a dense reference, greedy verification, the Gumbel-max sample, and the
statistical tests that rejection sampling and Gumbel-coupled verification reproduce the target distribution
(first token, second token, bonus token) with the acceptance their theory predicts (and that the same tests
catch wrong rules). The rules get their noise from torch's generator here, so they are tested apart from the
counter-based noise (tests/rollout/test_noise.py)."""

import math

import pytest
import torch

from rollout_helpers import reference_filter as _reference_filter

from lightning_codraft.rollout.sampling.rules import (
    SamplingParams,
    filter_logits,
    greedy_verify,
    gumbel_argmax,
    lazy_coupled_verify,
    rejection_sample,
    sampling_logprobs,
)


def coupled_verify(target_logprobs, gumbel, draft_ids):
    """The coupled rule on whole noise (the reference lazy_coupled_verify must equal): greedy verification of the
    policy's Gumbel-argmax samples."""
    return greedy_verify(gumbel_argmax(target_logprobs, gumbel), draft_ids)


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


def _gumbel(shape, g):
    """Standard Gumbel noise from torch's generator, written from the definition: -log(E), E ~ Exp(1)."""
    return -torch.empty(shape, dtype=torch.float64).exponential_(1.0, generator=g).log()


def test_gumbel_argmax_distribution():
    g = torch.Generator().manual_seed(1)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3]).expand(100_000, 4)
    counts = torch.bincount(gumbel_argmax(probs.log(), _gumbel(probs.shape, g)), minlength=4).float() / 100_000
    assert counts[1] == 0
    assert torch.allclose(counts, probs[0], atol=0.01)


# ---------------------------------------------------------------- the statistical tests

V, K, N = 6, 3, 200_000
CHI2_CRIT = 25.7  # chi-square, 5 degrees of freedom, p = 1e-4


def _synthetic(seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(K + 1, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2.0 * torch.randn(K, V, generator=g, dtype=torch.float64), -1)
    q[0, 1] = 0.0  # a token the draft never proposes: only reachable through the residual
    q = q / q.sum(-1, keepdim=True)
    return p, q


def _rejection_round(p, q, g, rule=rejection_sample):
    """N rounds of rejection sampling with drafts drawn from q: (draft (N, K), accepted (N,), next (N,))."""
    draft = torch.multinomial(q, N, replacement=True, generator=g).T.contiguous()  # (N, K)
    pp, qq = p.expand(N, K + 1, V), q.expand(N, K, V)
    u = torch.rand(N, K, generator=g, dtype=torch.float64)
    accepted, nxt = rule(pp, qq, draft, u, lambda a: _gumbel((N, V), g))
    return draft, accepted, nxt


def _coupled_round(p, q, g, rule=coupled_verify):
    """N rounds of Gumbel-coupled verification: the draft proposes argmax(log q + G) with the policy's noise."""
    noise = _gumbel((N, K + 1, V), g)
    draft = gumbel_argmax(q.log(), noise[:, :K])
    accepted, nxt = rule(p.log().expand(N, K + 1, V), noise, draft)
    return draft, accepted, nxt


def _emitted(draft, accepted, nxt, t):
    """Token t (0-based) of each round's output, -1 where the round emitted fewer tokens."""
    out = torch.where(accepted > t, draft[:, min(t, K - 1)], nxt)
    return torch.where(accepted >= t, out, -1)


def _chi2(samples, probs):
    counts = torch.bincount(samples, minlength=len(probs)).double()
    expected = probs.double() * len(samples)
    return float(((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum())


def _wrong_accept_if_p_ge_q(p, q, draft, u, next_noise):
    """Wrong: deterministic acceptance when p(d) >= q(d), else residual."""
    p_d = p[:, :K].gather(2, draft[..., None])[..., 0]
    q_d = q.gather(2, draft[..., None])[..., 0]
    acc = torch.cumprod((p_d >= q_d).long(), 1).sum(1)
    rows = torch.arange(len(draft))
    pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)
    res = (p[rows, acc] - pad[rows, acc]).clamp_min(0)
    return acc, gumbel_argmax(res.log(), next_noise(acc))


def _wrong_resample_from_p(p, q, draft, u, next_noise):
    """Wrong: correct acceptance test, but after a rejection sample from p instead of the residual."""
    p_d = p[:, :K].gather(2, draft[..., None])[..., 0]
    q_d = q.gather(2, draft[..., None])[..., 0]
    acc = torch.cumprod((u * q_d <= p_d).long(), 1).sum(1)
    rows = torch.arange(len(draft))
    return acc, gumbel_argmax(p[rows, acc].log(), next_noise(acc))


def _wrong_coupled_emit_draft(logp, noise, draft):
    """Wrong: at the first mismatch emit the draft's token instead of the policy's sample."""
    acc, nxt = coupled_verify(logp, noise, draft)
    return acc, torch.where(acc < K, draft.gather(1, acc.clamp_max(K - 1)[:, None])[:, 0], nxt)


def _wrong_coupled_bonus_from_previous(logp, noise, draft):
    """Wrong: the bonus token scored with p_{K-1} instead of p_K."""
    acc, nxt = coupled_verify(logp, noise, draft)
    return acc, torch.where(acc == K, gumbel_argmax(logp[:, K - 1], noise[:, K]), nxt)


def test_rejection_sampling_first_token_is_distributed_as_target():
    p, q = _synthetic()
    first = _emitted(*_rejection_round(p, q, torch.Generator().manual_seed(0)), 0)
    assert _chi2(first, p[0]) < CHI2_CRIT
    assert torch.bincount(first, minlength=V)[1] > 0  # the residual reaches tokens the draft never proposes


@pytest.mark.parametrize("wrong_rule", [_wrong_accept_if_p_ge_q, _wrong_resample_from_p])
def test_statistical_test_catches_wrong_acceptance_rules(wrong_rule):
    p, q = _synthetic()
    first = _emitted(*_rejection_round(p, q, torch.Generator().manual_seed(0), wrong_rule), 0)
    assert _chi2(first, p[0]) > 10 * CHI2_CRIT


def test_rejection_sampling_acceptance_rate_matches_theory():
    """P(accept position 0) = sum_x min(p(x), q(x)) = 1 - TV(p, q)."""
    p, q = _synthetic()
    _, accepted, _ = _rejection_round(p, q, torch.Generator().manual_seed(3))
    rate = (accepted > 0).double().mean().item()
    assert abs(rate - torch.minimum(p[0], q[0]).sum().item()) < 0.005


def test_rejection_sampling_identical_distributions_accept_everything():
    p, _ = _synthetic()
    g = torch.Generator().manual_seed(4)
    draft = torch.multinomial(p[:K], 1000, replacement=True, generator=g).T.contiguous()
    u = torch.rand(1000, K, generator=g, dtype=torch.float64)
    accepted, nxt = rejection_sample(p.expand(1000, K + 1, V), p[:K].expand(1000, K, V), draft, u,
                                     lambda a: _gumbel((1000, V), g))
    assert accepted.tolist() == [K] * 1000
    assert _chi2(nxt, p[K]) < 4 * CHI2_CRIT  # the bonus token comes from p_K


def test_coupled_tokens_are_distributed_as_target():
    """Every emitted token is the policy's own Gumbel-max sample: tokens 1 and 2 follow p_0 and p_1 (p does not
    depend on the prefix here), and the bonus after K accepted proposals follows p_K."""
    p, q = _synthetic()
    draft, accepted, nxt = _coupled_round(p, q, torch.Generator().manual_seed(5))
    for t in (0, 1):
        tokens = _emitted(draft, accepted, nxt, t)
        assert _chi2(tokens[tokens >= 0], p[t]) < CHI2_CRIT, t
    bonus = nxt[accepted == K]
    assert len(bonus) > 1000 and _chi2(bonus, p[K]) < CHI2_CRIT
    assert torch.bincount(_emitted(draft, accepted, nxt, 0), minlength=V)[1] > 0   # q(1) = 0 is still emitted


@pytest.mark.parametrize("wrong_rule", [_wrong_coupled_emit_draft, _wrong_coupled_bonus_from_previous])
def test_statistical_test_catches_wrong_coupled_rules(wrong_rule):
    p, q = _synthetic()
    draft, accepted, nxt = _coupled_round(p, q, torch.Generator().manual_seed(5), wrong_rule)
    first, bonus = _emitted(draft, accepted, nxt, 0), nxt[accepted == K]
    assert max(_chi2(first, p[0]), _chi2(bonus, p[K])) > 10 * CHI2_CRIT


def test_coupled_acceptance_matches_the_gumbel_coupling():
    """P(argmax(log q + G) == argmax(log p + G)) = sum_x 1 / sum_y max(p_y / p_x, q_y / q_x), between
    (1 - TV) / (1 + TV) and rejection sampling's 1 - TV."""
    p, q = _synthetic(seed=7)
    _, accepted, _ = _coupled_round(p, q, torch.Generator().manual_seed(6))
    rate = (accepted > 0).double().mean().item()
    p0, q0 = p[0], q[0]
    ratio = torch.maximum(p0[None, :] / p0[:, None], q0[None, :] / q0[:, None].clamp_min(1e-300))  # [x, y]
    exact = float((1.0 / ratio.sum(1)).sum())
    tv = 0.5 * float((p0 - q0).abs().sum())
    assert abs(rate - exact) < 0.005
    assert (1 - tv) / (1 + tv) - 1e-9 <= exact <= 1 - tv + 1e-9


def test_coupled_identical_distributions_accept_everything():
    p, _ = _synthetic()
    g = torch.Generator().manual_seed(8)
    noise = _gumbel((1000, K + 1, V), g)
    draft = gumbel_argmax(p[:K].log(), noise[:, :K])
    accepted, nxt = coupled_verify(p.log().expand(1000, K + 1, V), noise, draft)
    assert accepted.tolist() == [K] * 1000
    assert torch.equal(nxt, gumbel_argmax(p[K].log(), noise[:, K]))


@pytest.mark.parametrize("k", [0, 1, 4])
def test_lazy_coupled_verify_equals_coupled_verify_and_draws_only_reached_positions(k):
    """The lazy rule returns coupled_verify's accepted counts and tokens, and asks for a position's noise only for
    the rows whose proposals all matched before it (row b reaches position j iff accepted_b >= j)."""
    g = torch.Generator().manual_seed(k)
    B, Vs = 600, 6
    logp = torch.log_softmax(2.0 * torch.randn(B, k + 1, Vs, generator=g), -1)
    noise = _gumbel((B, k + 1, Vs), g)
    near = torch.log_softmax(logp + 0.3 * torch.randn(B, k + 1, Vs, generator=g), -1)   # a draft close to p
    draft = gumbel_argmax(near[:, :k], noise[:, :k])
    asked = []

    def gumbel_at(rows, j):
        asked.append((j, rows.clone()))
        return noise[rows, j]

    accepted, nxt = lazy_coupled_verify(logp, gumbel_at, draft)
    ref_accepted, ref_nxt = coupled_verify(logp, noise, draft)
    assert torch.equal(accepted, ref_accepted) and torch.equal(nxt, ref_nxt)
    if k:
        assert 0 < int((accepted == 0).sum()) and 0 < int((accepted == k).sum())   # both outcomes occur
    for j, rows in asked:
        assert torch.equal(rows, torch.nonzero(accepted >= j)[:, 0])
    assert sum(len(r) for _, r in asked) == int((accepted + 1).sum())
