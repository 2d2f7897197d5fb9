"""SpeculativeEngine, fixed K and adaptive: greedy output identical to plain decoding; coupled sampling identical
token for token whatever the draft, K, adaptivity, chunking, batch composition and request order; sampling (coupled
and rejection) distributed as the policy (with negative controls: wrong acceptance / residual / bonus rules and
position-blind noise injected into the engine fail the same test); log-probs equal to recomputed ones; acceptance
of fitted vs random drafts; stop/length handling; errors."""

import math

import pytest
import torch
from rollout_helpers import fit_draft, fit_prompts, make_policy, random_prompts, reference_filter

from lightning_codraft.models import Eagle3Draft, KVCache
from lightning_codraft.rollout import AcceptanceStats, RolloutEngine, RolloutError, SpeculativeEngine
from lightning_codraft.rollout.sampling import noise, sampler
from lightning_codraft.rollout.embedded.adaptive import AdaptiveConfig, SpeculationController
from lightning_codraft.rollout.embedded.cost_model import CostModel
from lightning_codraft.rollout.sampling.noise import request_seed
from lightning_codraft.rollout.sampling.rules import gumbel_argmax, lazy_coupled_verify


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


class _Scripted(SpeculationController):
    """Draws each round's k from a fixed cycle (any k sequence must leave the output exact); no timing."""

    def __init__(self, max_k, schedule, resume_window=8):
        # resume_window shorter than the runs of k = 0; every round verifies the scheduled k (no confidence stop)
        super().__init__(max_k, AdaptiveConfig(resume_window=resume_window, use_confidence=False))
        self.schedule, self.calls = list(schedule), 0

    def needs_calibration(self, batch_size):
        return False

    def choose(self, estimates, remaining, catch_up_span=0):
        self.calls += 1
        return self.schedule[(self.calls - 1) % len(self.schedule)]


class _PinnedCosts(CostModel):
    """A cost model that measures nothing: a verify costs the same for every k and a draft step a tenth of it.
    The real controller then chooses from its acceptance estimates alone, the same way on every machine (with
    measured times a slow machine may find drafting never pays for a model this small, and never draft)."""

    def round_times(self, B, max_k, drafted=0):
        return [1.0 + 0.1 * max(k, drafted) for k in range(max_k + 1)]

    def needs_calibration(self, B):
        return False

    def add(self, block, B, S, seconds, anchor=False):
        pass


def _adaptive(mode, k):
    """The engine's ``adaptive`` argument for a test mode: fixed K, the real controller on pinned costs (its
    acceptance estimates, backoff and exploration choose k; the timed path is tested with ``adaptive=True``
    below), or a scripted one that mixes every k in 0..K with runs of k = 0 longer than the resume window (the
    draft then skips positions)."""
    return {"fixed": False, "adaptive": SpeculationController(k, costs=_PinnedCosts()),
            "scripted": _Scripted(k, [k, 0, 1] + [0] * 20 + [k, k - 1, 0, 0, k])}[mode]


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


@pytest.mark.parametrize("k", [0, 4])
def test_caches_grow_in_blocks_and_stay_exact(policy, fitted, monkeypatch, k):
    """Long generations: the caches start at the prompts' size and grow block by block (each growth copies
    them), and the tokens still equal the dense recompute's."""
    grown = []
    reserve = KVCache.reserve

    def spy(self, slots, block=32):
        before = self.capacity
        reserve(self, slots, block)
        if self.capacity > before:
            grown.append(self.capacity)

    monkeypatch.setattr(KVCache, "reserve", spy)
    draft, fit_set = fitted
    prompts = fit_set[:2] + random_prompts(2, policy.config.vocab_size, seed=11)
    outs = SpeculativeEngine(policy, draft if k else None, k, max_batch_size=2).generate(prompts, 100, temperature=0.0)
    for p, o in zip(prompts, outs):
        assert o.token_ids == _dense_greedy(policy, p, 100)
    assert len(set(grown)) >= 3                                          # several growths really happened


@pytest.mark.parametrize("mode", ["fixed", "adaptive", "scripted"])
def test_one_row_batches_equal_plain_greedy(policy, fitted, mode):
    """engine_batch_size 1 (the RL recipes' setting): one-row caches take their own geometry path."""
    draft, fit_set = fitted
    prompts = fit_set[:4] + random_prompts(4, policy.config.vocab_size, seed=9)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 40, temperature=0.0)
    engine = SpeculativeEngine(policy, draft, 4, max_batch_size=1, adaptive=_adaptive(mode, 4))
    outs = engine.generate(prompts, 40, temperature=0.0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]
    assert AcceptanceStats.total(o.stats for o in outs[:4]).acceptance_length > 1.5  # the draft path is exercised


@pytest.mark.parametrize("mode", ["fixed", "adaptive", "scripted"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_plain(policy, fitted, k, mode):
    draft_fit, fit_set = fitted
    prompts = random_prompts(16, policy.config.vocab_size, seed=2) + fit_set[:8]
    stop = (7,)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 40, temperature=0.0, stop_token_ids=stop)
    for draft in (Eagle3Draft.from_policy(policy).eval(), draft_fit):
        engine = SpeculativeEngine(policy, draft, k, adaptive=_adaptive(mode, k))
        outs = engine.generate(prompts, 40, temperature=0.0, stop_token_ids=stop)
        for o, r in zip(outs, plain):
            assert o.token_ids == r.token_ids
            assert o.finish_reason == r.finish_reason
            assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
    assert any(r.finish_reason == "stop" for r in plain)  # the stop path is exercised


@pytest.mark.parametrize("mode", ["fixed", "scripted"])
@pytest.mark.parametrize("k", [3, 5])
def test_rows_finishing_at_different_rounds(policy, fitted, k, mode):
    """Same-length prompts, some well drafted (finish early, overshoot their budget in the last round) and
    some not: the frozen rows must stay within the caches while the others keep decoding."""
    draft, fit_set = fitted
    prompts = fit_set[:6] + [p[:4] for p in random_prompts(30, policy.config.vocab_size, lo=4, seed=8)][:6]
    for n in (21, 23):
        plain = SpeculativeEngine(policy, None, 0).generate(prompts, n, temperature=0.0)
        outs = SpeculativeEngine(policy, draft, k, adaptive=_adaptive(mode, k)).generate(prompts, n, temperature=0.0)
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


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
@pytest.mark.parametrize("temperature,top_k,top_p,batch", [(1.0, 0, 1.0, None), (0.7, 5, 0.9, None),
                                                           (1.0, 0, 1.0, 1)])
def test_logprobs_equal_recomputed(policy, fitted, temperature, top_k, top_p, batch, sampling):
    draft, _ = fitted
    prompts = random_prompts(6, policy.config.vocab_size, seed=4)
    outs = SpeculativeEngine(policy, draft, 3, max_batch_size=batch, sampling=sampling).generate(
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


def _exact_conditionals(policy, prompt, n_tokens, temperature, top_k, top_p):
    """Exact filtered distributions of generated token t+1 given every possible t-token prefix, t < n_tokens, by
    enumerating the (small) vocabulary: list of (V**t, V) float64 tables, prefixes in lexicographic order."""
    V = policy.config.vocab_size
    tables = []
    for t in range(n_tokens):
        prefixes = [prompt + [(i // V ** (t - 1 - j)) % V for j in range(t)] for i in range(V ** t)]
        with torch.no_grad():
            logits = policy(torch.tensor(prefixes)).logits[:, -1].double() / temperature
        rows = []
        for row in logits.tolist():
            keep = reference_filter(row, top_k, top_p)
            w = [math.exp(x) if kp else 0.0 for x, kp in zip(row, keep)]
            rows.append([x / sum(w) for x in w])
        tables.append(torch.tensor(rows, dtype=torch.float64))
    return tables


def _marginals(tables):
    """(V,) marginal of each generated token from the conditional tables."""
    out, joint = [], torch.ones(1, dtype=torch.float64)        # joint: P(prefix) over the V**t prefixes
    for table in tables:
        out.append((joint[:, None] * table).sum(0))
        joint = (joint[:, None] * table).reshape(-1)
    return out


def _chi2_crit(df, z=4.265):
    """Upper 1e-5 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(groups):
    """Chi-square of observed token counts against expected probabilities, summed over independent groups.

    groups: (counts (V,), probs (V,)) pairs; cells expecting < 5 are pooled per group. Returns (stat, df), or
    raises when a token of probability 0 was observed."""
    stat, df = 0.0, 0
    for counts, probs in groups:
        assert counts[probs == 0].sum() == 0, "a token with zero probability was sampled"
        expected = probs * counts.sum()
        big = expected >= 5
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        keep = exp > 0
        stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
        df += int(keep.sum()) - 1
    return stat, max(df, 1)


def _distribution_failures(engine, k, top_k, top_p, n=6000):
    """Sample K+2 tokens n times from one prompt; check each token's marginal, the joint of the first two tokens
    and, over the rows whose first round accepted all k drafts, the bonus token's conditional distribution given
    its prefix. Returns the failed checks (empty when the engine samples exactly from the policy) and the
    acceptance statistics."""
    policy, prompt, V = engine.policy, [3, 1, 4], engine.vocab_size
    n_tok = k + 2
    outs = engine.generate([prompt] * n, n_tok, temperature=0.9, top_k=top_k, top_p=top_p, seed=123)
    tables = _exact_conditionals(policy, prompt, n_tok, 0.9, top_k, top_p)
    failures = []
    for t, probs in enumerate(_marginals(tables)):
        counts = torch.bincount(torch.tensor([o.token_ids[t] for o in outs]), minlength=V).double()
        stat, df = _chi2([(counts, probs)])
        if stat > _chi2_crit(df):
            failures.append(f"token {t + 1}: chi2={stat:.1f} > {_chi2_crit(df):.1f}")
    pairs = torch.tensor([o.token_ids[0] * V + o.token_ids[1] for o in outs])
    joint = (tables[0][0][:, None] * tables[1]).reshape(-1)            # P(token 1 = a, token 2 = b) at a * V + b
    stat, df = _chi2([(torch.bincount(pairs, minlength=V * V).double(), joint)])
    if stat > _chi2_crit(df):
        failures.append(f"tokens 1 and 2 jointly: chi2={stat:.1f} > {_chi2_crit(df):.1f}")
    # one drafting round that accepted all k: tokens 2..k+1 are drafts, token k+2 is the bonus from p_k. The
    # prefixes are many, so test the randomised probability integral transform of each bonus token under its
    # own conditional (tokens in decreasing probability): uniform on [0, 1) exactly when the bonus follows p_k
    bonus = [o.token_ids for o in outs if o.stats.draft_steps == 1 and o.stats.accepted == k == o.stats.drafted]
    g = torch.Generator().manual_seed(0)
    pit = []
    for ids in bonus:
        probs = tables[k + 1][sum(x * V ** (k - j) for j, x in enumerate(ids[:-1]))]
        assert probs[ids[-1]] > 0, "a bonus token with zero probability was sampled"
        order = torch.argsort(probs, descending=True, stable=True)
        rank = int((order == ids[-1]).nonzero())
        below = float(probs[order[:rank]].sum())
        pit.append(below + float(probs[ids[-1]]) * float(torch.rand((), generator=g, dtype=torch.float64)))
    if bonus:
        bins = 10
        counts = torch.bincount((torch.tensor(pit) * bins).long().clamp_max(bins - 1), minlength=bins).double()
        stat, df = _chi2([(counts, torch.full((bins,), 1.0 / bins, dtype=torch.float64))])
        if stat > _chi2_crit(df):
            failures.append(f"bonus token after {len(bonus)} fully accepted rounds: chi2={stat:.1f} > "
                            f"{_chi2_crit(df):.1f}")
    return failures, AcceptanceStats.total(o.stats for o in outs), len(bonus)


def _sampling_setup():
    policy = make_policy(seed=5, std=0.15, vocab_size=12)
    return policy, Eagle3Draft.from_policy(policy).eval()


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
@pytest.mark.parametrize("mode", ["fixed", "adaptive", "scripted"])
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (6, 0.85)])
def test_speculative_sampling_is_distributed_as_the_policy(top_k, top_p, mode, sampling):
    """Tokens 1..K+2 (token 1 from the prefill, the rest accepted drafts, the policy's samples at a mismatch
    (coupled) or residual draws (rejection), bonus draws from p_k, or plain draws from p_0 in k = 0 rounds) follow
    the policy's exact filtered marginals, tokens 1 and 2 its joint, and the bonus token after a fully accepted
    round its conditional given the prefix."""
    policy, draft = _sampling_setup()
    k = 2
    engine = SpeculativeEngine(policy, draft, k, adaptive=_adaptive(mode, k), sampling=sampling)
    failures, stats, n_bonus = _distribution_failures(engine, k, top_k, top_p)
    assert not failures, failures
    if mode == "fixed":
        assert 0.02 < stats.acceptance_rate < 0.95  # both the accept and the mismatch paths are exercised
        assert n_bonus > 50                           # the bonus check is exercised
    assert stats.draft_steps > 0


def _mutant_rejection_sample(mutation):
    """``rejection_sample`` with one deliberate error, written from the definition."""

    def sample(target_probs, draft_probs, draft_ids, uniforms, next_noise):
        B, k = draft_ids.shape
        rows = torch.arange(B)
        if k == 0:
            zero = torch.zeros(B, dtype=torch.long)
            return zero, gumbel_argmax(target_probs[:, 0].log(), next_noise(zero))
        p_d = target_probs[:, :k].gather(2, draft_ids[..., None])[..., 0]
        q_d = draft_probs.gather(2, draft_ids[..., None])[..., 0]
        ok = (uniforms <= p_d) if mutation == "accept_with_p" else (uniforms * q_d <= p_d)   # right: min(1, p/q)
        accepted = torch.cumprod(ok.long(), dim=1).sum(1)
        p_next = target_probs[rows, accepted]
        if mutation == "bonus_from_p_k_minus_1":                                          # right: p_k
            p_next = torch.where((accepted == k)[:, None], target_probs[:, k - 1], p_next)
        q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted]
        residual = p_next if mutation == "residual_is_p" else (p_next - q_next).clamp_min(0)  # right: (p - q)+
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
        return accepted, gumbel_argmax(residual.log(), next_noise(accepted))

    return sample


def _mutant_coupled_verify(mutation):
    """``lazy_coupled_verify`` (what the sampler calls) with one deliberate error."""

    def verify(logprobs, gumbel_at, draft_ids):
        accepted, nxt = lazy_coupled_verify(logprobs, gumbel_at, draft_ids)
        k = draft_ids.shape[1]
        if mutation == "emit_draft_at_mismatch" and k:       # right: the policy's own sample
            nxt = torch.where(accepted < k, draft_ids.gather(1, accepted.clamp_max(k - 1)[:, None])[:, 0], nxt)
        if mutation == "bonus_from_p_k_minus_1" and k:       # right: scored with p_k
            every = torch.arange(len(draft_ids))
            nxt = torch.where(accepted == k, gumbel_argmax(logprobs[:, k - 1], gumbel_at(every, k)), nxt)
        return accepted, nxt

    return verify


def _position_blind(streams):
    """Wrong noise: the same at every position (tokens of a sequence become dependent)."""
    return lambda self, positions, purpose: streams(self, torch.zeros_like(positions), purpose)


@pytest.mark.parametrize("sampling,mutation", [
    ("rejection", "none"), ("rejection", "accept_with_p"), ("rejection", "residual_is_p"),
    ("rejection", "bonus_from_p_k_minus_1"), ("coupled", "none"), ("coupled", "emit_draft_at_mismatch"),
    ("coupled", "bonus_from_p_k_minus_1"), ("coupled", "position_blind_noise")])
def test_the_distribution_test_catches_a_wrong_rule(monkeypatch, sampling, mutation):
    """Negative controls: the engine with a wrong acceptance rule, residual or bonus distribution, or noise that
    ignores the position, injected, fails the distribution test above (and the mutant harnesses themselves,
    unmutated, pass it)."""
    policy, draft = _sampling_setup()
    if mutation == "position_blind_noise":
        monkeypatch.setattr(noise.CounterNoise, "streams", _position_blind(noise.CounterNoise.streams))
    elif sampling == "rejection":
        monkeypatch.setattr(sampler, "rejection_sample", _mutant_rejection_sample(mutation))
    else:
        monkeypatch.setattr(sampler, "lazy_coupled_verify", _mutant_coupled_verify(mutation))
    failures, _, _ = _distribution_failures(SpeculativeEngine(policy, draft, 2, sampling=sampling), 2, 0, 1.0)
    assert bool(failures) == (mutation != "none"), failures


@pytest.mark.parametrize("mode", ["adaptive", "scripted"])
def test_adaptive_stats_count_what_was_proposed(policy, fitted, mode):
    draft, fit_set = fitted
    prompts = random_prompts(8, policy.config.vocab_size, seed=3) + fit_set[:8]
    outs = SpeculativeEngine(policy, draft, 4, adaptive=_adaptive(mode, 4)).generate(prompts, 40, temperature=1.0,
                                                                                    seed=2)
    total = AcceptanceStats.total(o.stats for o in outs)
    for o in outs:   # a round emits 1 + accepted tokens, the last one fewer when the budget cuts it
        assert len(o.token_ids) <= 1 + o.stats.accepted + o.stats.policy_forwards
    for s in [total] + [o.stats for o in outs]:
        assert s.draft_steps + s.plain_rounds == s.policy_forwards
        assert s.proposed_per_position[0] == s.draft_steps and sum(s.proposed_per_position) == s.drafted
        assert sum(s.accepted_per_position) == s.accepted <= s.drafted
        assert all(a <= n for a, n in zip(s.accepted_per_position, s.proposed_per_position))
    if mode == "scripted":
        assert total.plain_rounds > 0 and 0 < total.mean_k < 4


def test_adaptive_engine_stops_drafting_with_a_useless_draft(policy):
    """A random draft is never accepted greedily on random prompts: after the first rounds the adaptive engine
    decodes plainly (and the output is still plain greedy decoding)."""
    prompts = random_prompts(8, policy.config.vocab_size, seed=11)
    engine = SpeculativeEngine(policy, Eagle3Draft.from_policy(policy).eval(), 4, adaptive=True)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 40, temperature=0.0)
    outs = engine.generate(prompts, 40, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    total = AcceptanceStats.total(o.stats for o in outs)
    assert total.plain_rounds > 0.8 * total.policy_forwards, total.as_dict()


def test_draft_resume_after_plain_rounds_keeps_acceptance(policy, fitted):
    """After more k = 0 rounds than the resume window, the draft catches up on the last positions only: on
    prompts it was fitted to, its proposals are still accepted."""
    draft, fit_set = fitted
    # the rounds after the plain ones must fit the 24-token budget: proposals past it are not counted as accepted
    engine = SpeculativeEngine(policy, draft, 3, adaptive=_Scripted(3, [3] + [0] * 10 + [3] * 10, resume_window=4))
    outs = engine.generate(fit_set[:8], 24, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in SpeculativeEngine(policy, None, 0).generate(
        fit_set[:8], 24, temperature=0.0)]
    total = AcceptanceStats.total(o.stats for o in outs)
    # 10 plain rounds, window 4: the draft skips 6 positions of context and its first proposal is still accepted in
    # most rounds (later positions are cut by the budget at the end of the sequences, and not counted past it)
    assert total.draft_steps > 8 and total.accepted_per_position[0] > 0.7 * total.draft_steps, total.as_dict()
    assert total.acceptance_length > 2.0, total.as_dict()


def test_adaptive_engine_runs_the_draft_over_the_prompts_only_when_it_drafts(policy, fitted, monkeypatch):
    """An adaptive engine defers the draft's pass over the prompts to the batch's first drafting round: a batch that
    never drafts never runs the draft; one that starts drafting after plain rounds catches up on its prompts then
    (acceptance as high as from the start) and stays exact."""
    draft, fit_set = fitted
    steps = []
    original = Eagle3Draft.decoder

    def counting_decoder(self, *args, **kwargs):
        dec = original(self, *args, **kwargs)
        step = dec.step
        dec.step = lambda *a, **kw: steps.append(a[0].shape[:2]) or step(*a, **kw)
        return dec

    monkeypatch.setattr(Eagle3Draft, "decoder", counting_decoder)
    plain = SpeculativeEngine(policy, None, 0).generate(fit_set[:8], 24, temperature=0.0)
    never = SpeculativeEngine(policy, draft, 3, adaptive=_Scripted(3, [0])).generate(fit_set[:8], 24, temperature=0.0)
    assert [o.token_ids for o in never] == [o.token_ids for o in plain] and steps == []
    late = SpeculativeEngine(policy, draft, 3, adaptive=_Scripted(3, [0] * 4 + [3] * 30, resume_window=8))
    outs = late.generate(fit_set[:8], 24, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert steps[0] == (8, max(len(p) for p in fit_set[:8])) and steps[1] == (8, 4)   # prompts, then 4 plain rounds
    total = AcceptanceStats.total(o.stats for o in outs)
    assert total.draft_steps > 8 and total.acceptance_length > 0.7 * 4, total.as_dict()


def _recording(ctl):
    """``ctl`` with its choices recorded: a list of ``[k chosen, k verified]`` per round."""
    rounds = []
    choose, observe = ctl.choose, ctl.observe
    ctl.choose = lambda *a, **kw: rounds.append([choose(*a, **kw)]) or rounds[-1][0]
    ctl.observe = lambda est, k, acc, conf=None: rounds[-1].append(k) or observe(est, k, acc, conf)
    return rounds


@pytest.mark.parametrize("sampling,temperature", [("coupled", 0.0), ("coupled", 1.0), ("rejection", 1.0)])
def test_the_drafts_confidence_stops_the_chain_where_the_tokens_do_not_depend_on_it(policy, fitted, sampling,
                                                                                     temperature):
    """Greedy, once the controller has measured that the draft's hesitant proposals fail and its sure ones pass, some
    rounds verify fewer proposals than the k chosen (random prompts' hesitant proposals) and others all of them
    (its fit set), and the tokens are plain decoding's. Under rejection sampling a length chosen after seeing the
    proposals would bias the samples, so there every round verifies the k it chose. Coupled at T=1 the tokens are
    plain decoding's too (the policy's own samples, whatever is verified)."""
    draft, fit_set = fitted
    prompts = random_prompts(8, policy.config.vocab_size, seed=5) + fit_set[:8]
    ctl = SpeculationController(4, AdaptiveConfig(use_confidence=True), costs=_PinnedCosts())
    for key in (("greedy",), ("coupled", 1.0, 0, 1.0), ("rejection", 1.0, 0, 1.0)):
        primed = ctl.new_batch(16, key)
        for _ in range(30):
            ctl.observe(primed, 4, [2] * 16, [[0.99] * 16, [0.99] * 16, [0.01] * 16, [0.01] * 16])
    rounds = _recording(ctl)
    kw = dict(temperature=temperature, seed=3)
    engine = SpeculativeEngine(policy, draft, 4, adaptive=ctl, sampling=sampling)
    outs = engine.generate(prompts, 40, **kw)
    plain = SpeculativeEngine(policy, None, 0, sampling=sampling).generate(prompts, 40, **kw)
    if sampling == "coupled":
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    if temperature == 0.0:
        stopped = sum(1 for chosen, verified in rounds if verified < chosen)
        full = sum(1 for chosen, verified in rounds if verified == chosen > 0)
        assert stopped > 0 and full > 0, rounds
    if sampling == "rejection":
        assert all(verified == chosen for chosen, verified in rounds) and any(c for c, _ in rounds), rounds


def test_seed_reproducible(policy, fitted):
    draft, _ = fitted
    prompts = random_prompts(4, policy.config.vocab_size, seed=6)
    eng = SpeculativeEngine(policy, draft, 3)
    a = eng.generate(prompts, 12, temperature=1.0, seed=11)
    b = eng.generate(prompts, 12, temperature=1.0, seed=11)
    c = eng.generate(prompts, 12, temperature=1.0, seed=12)
    assert _tokens(a) == _tokens(b)
    assert _tokens(a) != _tokens(c)


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_coupled_rollouts_are_a_function_of_seed_and_prompt(policy, fitted, temperature, top_k, top_p):
    """With the same request seeds, every engine emits the same tokens (and log-probs) as plain decoding: fixed
    K = 2 / 4, adaptive and scripted k, one-row and 5-row chunks, a random draft, rejection mode without a draft,
    the requests reversed, or mixed among other requests; a call-wide seed is request_seed(seed, i)."""
    draft, fit_set = fitted
    prompts = random_prompts(6, policy.config.vocab_size, seed=12) + fit_set[:6]
    seeds = [request_seed(99, i) for i in range(len(prompts))]
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=(7,))
    ref = SpeculativeEngine(policy, None, 0).generate(prompts, 40, request_seeds=seeds, **kw)
    engines = [SpeculativeEngine(policy, draft, 2), SpeculativeEngine(policy, draft, 4),
               SpeculativeEngine(policy, draft, 4, adaptive=True),
               SpeculativeEngine(policy, draft, 4, adaptive=_adaptive("scripted", 4)),
               SpeculativeEngine(policy, draft, 4, max_batch_size=1),
               SpeculativeEngine(policy, draft, 3, max_batch_size=5),
               SpeculativeEngine(policy, Eagle3Draft.from_policy(policy).eval(), 3),
               SpeculativeEngine(policy, None, 0, sampling="rejection")]
    accepted = 0
    for engine in engines:
        outs = engine.generate(prompts, 40, request_seeds=seeds, **kw)
        assert _tokens(outs) == _tokens(ref)
        for o, r in zip(outs, ref):
            assert o.finish_reason == r.finish_reason
            assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        accepted += sum(o.stats.accepted for o in outs)
    assert accepted > 30    # proposals were accepted: the coupled verification is exercised
    order = list(reversed(range(len(prompts))))
    rev = SpeculativeEngine(policy, draft, 4).generate([prompts[i] for i in order], 40,
                                                       request_seeds=[seeds[i] for i in order], **kw)
    assert _tokens(rev[::-1]) == _tokens(ref)
    others = random_prompts(5, policy.config.vocab_size, seed=13)
    mixed = SpeculativeEngine(policy, draft, 4, max_batch_size=4).generate(
        others[:2] + prompts[:3] + others[2:], 40, request_seeds=[1, 2] + seeds[:3] + [3, 4, 5], **kw)
    assert _tokens(mixed[2:5]) == _tokens(ref[:3])
    assert _tokens(SpeculativeEngine(policy, draft, 2).generate(prompts, 40, seed=99, **kw)) == _tokens(ref)
    other_seed = SpeculativeEngine(policy, None, 0).generate(prompts, 40, seed=98, **kw)
    assert sum(a != b for a, b in zip(_tokens(other_seed), _tokens(ref))) > len(prompts) // 2


def test_rejection_rollouts_do_not_depend_on_the_batch(policy, fitted):
    """Rejection sampling with a fixed K: the same request seeds give the same tokens in any chunking and order
    (its samples still depend on K: the draft's proposals are part of them)."""
    draft, fit_set = fitted
    prompts = random_prompts(4, policy.config.vocab_size, seed=14) + fit_set[:4]
    seeds = list(range(100, 100 + len(prompts)))
    ref = SpeculativeEngine(policy, draft, 3, sampling="rejection").generate(prompts, 30, request_seeds=seeds)
    outs = SpeculativeEngine(policy, draft, 3, sampling="rejection", max_batch_size=3).generate(
        prompts[::-1], 30, request_seeds=seeds[::-1])
    assert _tokens(outs[::-1]) == _tokens(ref)
    assert AcceptanceStats.total(o.stats for o in ref).accepted > 10


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
    with pytest.raises(ValueError, match="both seed=1 and request_seeds"):
        eng.generate([[1]], 2, seed=1, request_seeds=[1])
    with pytest.raises(ValueError, match="request_seeds has 1 entries for 2 prompts"):
        eng.generate([[1], [2]], 2, request_seeds=[1])
    with pytest.raises(ValueError, match="sampling='gumbel' must be one of"):
        SpeculativeEngine(policy, draft, 2, sampling="gumbel")


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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bfloat16_engine_matches_plain_bfloat16_decoding(policy, fitted, temperature):
    """``dtype="bfloat16"`` decodes from a bf16 copy of the weights (the module stays fp32). Speculative decoding,
    fixed and adaptive, then gives exactly plain bf16 decoding's tokens and log-probs: on CPU a verify forward of
    1 + k tokens a row computes each row's logits bit for bit as k + 1 one-token steps do (packed linear weights
    give a row the same result whatever the number of rows; the grouped attention's result does not depend on the
    masked slots it spans; prefill attends to its own width whatever the cache's capacity). This tiny random
    policy is chaotic in bf16 (its plain bf16 and fp32 greedy outputs agree on few prompts), so any rounding
    difference between a verify and a plain step would show. (Another ``max_batch_size`` groups the prompts'
    prefill differently, and the CPU flash kernel's rounding depends on the padded width: the same bf16 policy
    sampled, not the same tokens.)"""
    draft, fit_set = fitted
    prompts = random_prompts(8, policy.config.vocab_size, seed=21) + fit_set[:8]
    kw = dict(temperature=temperature, seed=5)
    plain = SpeculativeEngine(policy, None, 0, dtype="bfloat16").generate(prompts, 40, **kw)
    fp32 = SpeculativeEngine(policy, None, 0).generate(prompts, 40, **kw)
    assert sum(o.token_ids != r.token_ids for o, r in zip(plain, fp32)) >= 4  # it does decode in another dtype
    for engine in (SpeculativeEngine(policy, draft, 4, dtype=torch.bfloat16),
                   SpeculativeEngine(policy, draft, 3, dtype="bfloat16"),
                   SpeculativeEngine(policy, draft, 4, dtype="bfloat16", adaptive=_adaptive("adaptive", 4))):
        outs = engine.generate(prompts, 40, **kw)
        for o, r in zip(outs, plain):
            assert o.token_ids == r.token_ids and o.logprobs == r.logprobs
        if temperature == 0.0:  # the draft still works in bf16: accepted on the prompts it was fitted to
            assert AcceptanceStats.total(o.stats for o in outs[8:]).acceptance_length > 1.5
    assert next(policy.parameters()).dtype == torch.float32


def test_engine_dtype_is_validated(policy):
    with pytest.raises(ValueError, match="dtype='int8' must be None, 'auto' or one of"):
        SpeculativeEngine(policy, None, 0, dtype="int8")


def test_the_adaptive_engine_prices_what_plain_decoding_would_have_spent(policy, fitted):
    """``AcceptanceStats.plain_s``: a plain round is its own measure, a drafting round's tokens are priced at the
    cost model's plain step for the batch; a fixed engine has no cost model and measures no saving."""
    draft, fit_set = fitted
    prompts = fit_set[:4]
    fixed = SpeculativeEngine(policy, draft, 4, max_batch_size=1).generate(prompts, 24, temperature=0.0)
    assert all(o.stats.plain_s == 0.0 and math.isnan(o.stats.saving_s) for o in fixed)
    plain = SpeculativeEngine(policy, draft, 4, max_batch_size=2, adaptive=_Scripted(4, [0])).generate(
        prompts, 24, temperature=0.0)
    for o in plain:
        assert o.stats.round_s > 0 and o.stats.plain_s == pytest.approx(o.stats.round_s, rel=1e-12)
    # pinned costs price a plain round at 1 s at every batch: at batch 1 each token of a drafting round costs 1 s
    outs = SpeculativeEngine(policy, draft, 4, max_batch_size=1, adaptive=_adaptive("adaptive", 4)).generate(
        prompts, 24, temperature=0.0)
    for o in outs:
        assert o.stats.plain_rounds == 0 and o.stats.plain_s == pytest.approx(len(o.token_ids) - 1)  # the first token is the prefill's
        assert o.stats.saving_s == pytest.approx(len(o.token_ids) - 1 - o.stats.round_s) and o.stats.saving_s > 0
    total = AcceptanceStats.total(o.stats for o in outs)
    assert total.plain_s == pytest.approx(sum(o.stats.plain_s for o in outs))
    assert total.round_s == pytest.approx(sum(o.stats.round_s for o in outs))
