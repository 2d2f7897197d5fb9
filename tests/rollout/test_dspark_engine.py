"""The block engine drafts with a DSpark drafter (models/dspark.py): each proposal drawn from its position's logits
biased by the Markov head from the token drawn before it, with that distribution's q kept for verification, so
greedy output equals plain decoding and coupled samples equal plain decoding of the same seeds; the Markov head
changes the proposals (a zero head proposes as the same backbone without one)."""

import pytest
import torch
from rollout_helpers import make_policy, random_prompts

from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _drafter(policy, kind="vanilla", sample_from_anchor=True):
    torch.manual_seed(3)
    d = DSparkDraft.from_policy(policy, markov_rank=8, markov_head_type=kind, block_size=4, mask_token_id=0,
                                sample_from_anchor=sample_from_anchor)
    for p in d.markov_head.parameters():
        p.data.mul_(20.0)  # a bias strong enough to change proposals
    return d.eval()


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_greedy_and_coupled_outputs_equal_plain_decoding(kind):
    policy = make_policy(seed=1)
    prompts = random_prompts(6, policy.config.vocab_size, seed=4)
    engine = BlockSpeculativeEngine(policy, _drafter(policy, kind))
    plain = SpeculativeEngine(policy, None, 0)
    assert [o.token_ids for o in engine.generate(prompts, 16, temperature=0.0)] == \
        [o.token_ids for o in plain.generate(prompts, 16, temperature=0.0)]
    seeds = list(range(100, 106))
    got = engine.generate(prompts, 16, temperature=1.0, request_seeds=seeds)
    want = plain.generate(prompts, 16, temperature=1.0, request_seeds=seeds)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["next-token", "at-position"])
def test_the_markov_head_changes_the_proposals(sample_from_anchor):
    """A zero Markov head proposes as the backbone alone: DSpark without a head in the next-token layout (B
    proposals a block), DFlash itself in the at-position layout (B - 1)."""
    policy = make_policy(seed=1)
    prompts = random_prompts(6, policy.config.vocab_size, seed=5)
    dspark = _drafter(policy, sample_from_anchor=sample_from_anchor)
    if sample_from_anchor:
        plain = DSparkDraft.from_policy(policy, markov_rank=0, confidence_head=False, block_size=4, mask_token_id=0)
    else:
        plain = DFlashDraft.from_policy(policy, block_size=4, mask_token_id=0)
    plain.load_state_dict({k: v for k, v in dspark.state_dict().items() if k in plain.state_dict()})
    assert dspark.num_proposals == plain.num_proposals == (4 if sample_from_anchor else 3)
    stats = lambda d: [o.stats.accepted_per_position for o in  # noqa: E731
                       BlockSpeculativeEngine(policy, d.eval()).generate(prompts, 16, temperature=0.0)]
    assert len(stats(dspark)[0]) == dspark.num_proposals
    assert stats(dspark) != stats(plain)
    for p in dspark.markov_head.parameters():
        p.data.zero_()
    assert stats(dspark) == stats(plain)


@pytest.mark.parametrize("sampling", ["coupled", "rejection"])
def test_dspark_sampling_is_distributed_as_the_policy(sampling):
    """Rejection sampling needs each proposal's own (Markov-biased) distribution: a wrong q fails the chi-square."""
    from test_speculative import _distribution_failures

    policy = make_policy(seed=5, std=0.15, vocab_size=12)
    torch.manual_seed(6)
    d = DSparkDraft.from_policy(policy, markov_rank=4, block_size=3, mask_token_id=0)
    for p in d.markov_head.parameters():
        p.data.mul_(2.0)
    engine = BlockSpeculativeEngine(policy, d.eval(), 2, sampling=sampling)
    failures, stats, n_bonus = _distribution_failures(engine, 2, 0, 1.0, n=3000)
    assert not failures, failures
    assert 0.02 < stats.acceptance_rate < 0.95 and n_bonus > 30


def test_the_bucketed_refit_pushes_both_heads():
    """A refit of a trained drafter into an engine's own copy (rollout/refit: buckets, checksums verified) moves the
    Markov and confidence heads with the backbone: the engine then proposes as one built on the trained drafter."""
    import copy

    from lightning_codraft.rollout.refit.sync import WeightSync

    policy = make_policy(seed=1)
    prompts = random_prompts(6, policy.config.vocab_size, seed=5)
    trained = _drafter(policy)
    stale = copy.deepcopy(trained)
    for p in stale.parameters():
        p.data.normal_(0, 0.1)
    engine = BlockSpeculativeEngine(policy, stale, verify_length="confidence")
    WeightSync(engine, lambda: (None, trained.state_dict()), bucket_bytes=4 * 2**10)(1, force=True)
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "confidence_head.proj.bias"):
        assert torch.equal(stale.state_dict()[name], trained.state_dict()[name]), name
    want = BlockSpeculativeEngine(policy, trained, verify_length="confidence").generate(prompts, 16, temperature=0.0)
    got = engine.generate(prompts, 16, temperature=0.0)
    assert [o.stats.accepted_per_position for o in got] == [o.stats.accepted_per_position for o in want]
    assert engine.weight_versions["draft"] == 1
