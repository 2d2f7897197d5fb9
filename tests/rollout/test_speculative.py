"""SpeculativeEngine: greedy output identical to plain decoding, sampling distributed as the policy, log-probs
equal to recomputed ones, acceptance of fitted vs random drafts, stop/length handling, errors."""

import math

import pytest
import torch
from rollout_helpers import fit_draft, fit_prompts, make_policy, random_prompts, reference_filter

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rollout import AcceptanceStats, RolloutEngine, RolloutError, SpeculativeEngine


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention on a shared CPU


@pytest.fixture(scope="module")
def policy():
    return make_policy()


@pytest.fixture(scope="module")
def fitted(policy):
    """(draft fitted to the policy's greedy continuations of `prompts`, prompts)."""
    torch.manual_seed(3)
    prompts = fit_prompts(24, policy.config.vocab_size)
    draft = fit_draft(policy, Eagle3Draft.from_policy(policy), prompts, gen_len=24, steps=100)
    return draft, prompts


def _dense_greedy(policy, prompt, n):
    """Plain greedy from the definition: full forward over the whole sequence, no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(policy(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_plain_greedy_matches_full_recompute(policy):
    prompts = random_prompts(5, policy.config.vocab_size, seed=1)
    outs = SpeculativeEngine(policy, None, 0).generate(prompts, 12, temperature=0.0)
    assert isinstance(SpeculativeEngine(policy, None, 0), RolloutEngine)
    for p, o in zip(prompts, outs):
        assert o.token_ids == _dense_greedy(policy, p, 12)
        assert o.finish_reason == "length" and len(o.logprobs) == 12


def test_one_row_batches_equal_plain_greedy(policy, fitted):
    """engine_batch_size 1 (the RL recipes' setting): one-row caches take the slice-copy path."""
    draft, fit_set = fitted
    prompts = random_prompts(4, policy.config.vocab_size, seed=9) + fit_set[:4]
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 16, temperature=0.0)
    outs = SpeculativeEngine(policy, draft, 4, max_batch_size=1).generate(prompts, 16, temperature=0.0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]
    assert AcceptanceStats.total(o.stats for o in outs).acceptance_length > 1.5  # the draft path is exercised


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_plain(policy, fitted, k):
    draft_fit, fit_set = fitted
    prompts = random_prompts(16, policy.config.vocab_size, seed=2) + fit_set[:8]
    stop = (7,)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 20, temperature=0.0, stop_token_ids=stop)
    for draft in (Eagle3Draft.from_policy(policy).eval(), draft_fit):
        outs = SpeculativeEngine(policy, draft, k).generate(prompts, 20, temperature=0.0, stop_token_ids=stop)
        for o, r in zip(outs, plain):
            assert o.token_ids == r.token_ids
            assert o.finish_reason == r.finish_reason
            assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert any(r.finish_reason == "stop" for r in plain)  # the stop path is exercised


@pytest.mark.parametrize("k", [3, 5])
def test_rows_finishing_at_different_rounds(policy, fitted, k):
    """Same-length prompts, some well drafted (finish early, overshoot their budget in the last round) and
    some not: the frozen rows must stay within the caches while the others keep decoding."""
    draft, fit_set = fitted
    prompts = fit_set[:6] + [p[:4] for p in random_prompts(30, policy.config.vocab_size, lo=4, seed=8)][:6]
    for n in (21, 23):
        plain = SpeculativeEngine(policy, None, 0).generate(prompts, n, temperature=0.0)
        outs = SpeculativeEngine(policy, draft, k).generate(prompts, n, temperature=0.0)
        assert [o.token_ids for o in outs] == [r.token_ids for r in plain]


def test_acceptance_fitted_draft_near_k_plus_1_random_near_1(policy, fitted):
    draft_fit, prompts = fitted
    k = 3
    fit_stats = AcceptanceStats.total(o.stats for o in SpeculativeEngine(policy, draft_fit, k).generate(
        prompts, 24, temperature=0.0))
    rand_stats = AcceptanceStats.total(o.stats for o in SpeculativeEngine(
        policy, Eagle3Draft.from_policy(policy).eval(), k).generate(prompts, 24, temperature=0.0))
    assert fit_stats.acceptance_length > 0.85 * (k + 1)
    assert rand_stats.acceptance_length < 1.2
    assert fit_stats.drafted == fit_stats.draft_steps * k
    assert len(fit_stats.accepted_per_position) == k
    assert sum(fit_stats.accepted_per_position) == fit_stats.accepted
    rates = fit_stats.per_position_rate()
    assert all(a >= b for a, b in zip(rates, rates[1:]))  # position j accepted only if j-1 was
    # fewer policy forwards per generated token than plain decoding
    tokens = 24 * len(prompts)
    assert fit_stats.policy_forwards < 0.5 * (tokens - len(prompts))


@pytest.mark.parametrize("temperature,top_k,top_p,batch", [(1.0, 0, 1.0, None), (0.7, 5, 0.9, None),
                                                           (1.0, 0, 1.0, 1)])
def test_logprobs_equal_recomputed(policy, fitted, temperature, top_k, top_p, batch):
    draft, _ = fitted
    prompts = random_prompts(6, policy.config.vocab_size, seed=4)
    outs = SpeculativeEngine(policy, draft, 3, max_batch_size=batch).generate(
        prompts, 10, temperature=temperature, top_k=top_k, top_p=top_p, seed=0)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = policy(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1].double()
        for t, (tok, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            row = (logits[t] / temperature).tolist()
            keep = reference_filter(row, top_k, top_p)
            assert keep[tok], "a filtered-out token was sampled"
            z = math.log(sum(math.exp(x) for x, kp in zip(row, keep) if kp))
            assert lp == pytest.approx(row[tok] - z, abs=1e-4)


def _exact_marginals(policy, prompt, temperature, top_k, top_p):
    """Exact distributions of generated tokens 1, 2, 3 by enumerating the (small) vocabulary."""
    V = policy.config.vocab_size

    def dist(prefixes):
        with torch.no_grad():
            logits = policy(torch.tensor(prefixes)).logits[:, -1].double() / temperature
        out = []
        for row in logits.tolist():
            keep = reference_filter(row, top_k, top_p)
            w = [math.exp(x) if kp else 0.0 for x, kp in zip(row, keep)]
            out.append([x / sum(w) for x in w])
        return torch.tensor(out, dtype=torch.float64)

    p1 = dist([prompt])[0]                                                   # (V,)
    p2_given = dist([prompt + [a] for a in range(V)])                        # (V, V)
    p3_given = dist([prompt + [a, b] for a in range(V) for b in range(V)])   # (V*V, V)
    p12 = p1[:, None] * p2_given
    return p1, p12.sum(0), (p12.reshape(-1)[:, None] * p3_given).sum(0)


def _chi2_ok(samples, probs, crit):
    counts = torch.bincount(torch.tensor(samples), minlength=len(probs)).double()
    expected = probs * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    assert counts[probs == 0].sum() == 0, "a token with zero probability was sampled"
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    return stat < crit, stat


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.85)])
def test_speculative_sampling_is_distributed_as_the_policy(top_k, top_p):
    """First three generated tokens (token 1 from the prefill, 2 and 3 from speculative rounds: accepted
    drafts or residual / bonus draws) follow the policy's exact filtered marginals."""
    policy = make_policy(seed=5, std=0.15, vocab_size=12)
    draft = Eagle3Draft.from_policy(policy).eval()
    prompt, n = [3, 1, 4], 6000
    outs = SpeculativeEngine(policy, draft, 2).generate([prompt] * n, 3, temperature=0.9, top_k=top_k,
                                                        top_p=top_p, seed=123)
    stats = AcceptanceStats.total(o.stats for o in outs)
    assert 0.05 < stats.acceptance_rate < 0.95  # both the accept and the residual paths are exercised
    for t, probs in enumerate(_exact_marginals(policy, prompt, 0.9, top_k, top_p)):
        ok, stat = _chi2_ok([o.token_ids[t] for o in outs], probs, crit=40.0)  # <= 12 bins, p ~ 1e-5
        assert ok, f"token {t + 1}: chi2={stat:.1f}"


def test_seed_reproducible(policy, fitted):
    draft, _ = fitted
    prompts = random_prompts(4, policy.config.vocab_size, seed=6)
    eng = SpeculativeEngine(policy, draft, 3)
    a = eng.generate(prompts, 12, temperature=1.0, seed=11)
    b = eng.generate(prompts, 12, temperature=1.0, seed=11)
    c = eng.generate(prompts, 12, temperature=1.0, seed=12)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_context_limit_and_per_sequence_lengths(policy, fitted):
    draft, _ = fitted
    ctx = policy.config.max_position_embeddings
    prompts = [[1] * (ctx - 3), [2, 3], [4] * (ctx - 1)]
    outs = SpeculativeEngine(policy, draft, 3).generate(prompts, 10, temperature=0.0)
    assert [len(o.token_ids) for o in outs] == [3, 10, 1]
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[1].token_ids == _dense_greedy(policy, [2, 3], 10)


def test_update_weights_switches_policy_and_draft(policy, fitted):
    draft, prompts = fitted
    other = make_policy(seed=9)
    eng = SpeculativeEngine(make_policy(seed=0), Eagle3Draft.from_policy(policy).eval(), 3)
    eng.update_weights(other.state_dict(), None)
    out = eng.generate(prompts[:3], 8, temperature=0.0)
    assert [o.token_ids for o in out] == [_dense_greedy(other, p, 8) for p in prompts[:3]]
    eng.update_weights(policy.state_dict(), draft.state_dict())
    stats = AcceptanceStats.total(o.stats for o in eng.generate(prompts, 24, temperature=0.0))
    assert stats.acceptance_length > 0.85 * 4
    with pytest.raises(ValueError, match="missing"):
        eng.update_weights({"lm_head.weight": policy.lm_head.weight}, None)


def test_errors(policy):
    draft = Eagle3Draft.from_policy(policy)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        SpeculativeEngine(policy, draft, -1)
    wide = make_policy(hidden_size=96, num_attention_heads=4)
    with pytest.raises(ValueError, match="hidden_size"):
        SpeculativeEngine(wide, draft, 2)
    big_vocab = make_policy(vocab_size=256)
    with pytest.raises(ValueError, match="vocab"):
        SpeculativeEngine(big_vocab, draft, 2)
    eng = SpeculativeEngine(policy, draft, 2)
    with pytest.raises(ValueError, match="prompts is empty"):
        eng.generate([], 4)
    with pytest.raises(ValueError, match="request 1: prompt is empty"):
        eng.generate([[1], []], 4)
    ctx = policy.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"request 0: prompt has {ctx} tokens"):
        eng.generate([[1] * ctx], 4)
    with pytest.raises(ValueError, match="request 0: token ids must be Python ints, got str"):
        eng.generate([["hello"]], 4)
    with pytest.raises(ValueError, match="token id 128 is outside"):
        eng.generate([[1, 128]], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        eng.generate([[1]], 0)


class _FailingPolicy(torch.nn.Module):
    """Delegates to a policy but raises when token 99 is fed (an engine failure mid-generation)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def embed(self, ids):
        return self.inner.embed(ids)

    def forward(self, ids, **kw):
        if bool((ids == 99).any()):
            raise RuntimeError("simulated kernel failure")
        return self.inner(ids, **kw)


def test_failure_names_the_failing_requests(policy):
    eng = SpeculativeEngine(_FailingPolicy(policy), None, 0, max_batch_size=2)
    with pytest.raises(RolloutError, match=r"requests 2\.\.3 .*simulated kernel failure"):
        eng.generate([[1, 2], [3], [4, 99], [5]], 4, temperature=0.0)
