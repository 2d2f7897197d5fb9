"""In-flight weight updates (``EmbeddedWeights.weight_source``): both embedded engines (plain, EAGLE-3 and the block
drafter; the fused decoders of a bf16 engine hold cast copies, rebuilt) take newer weights between rounds. An update to the same weights changes no token and no log-prob (the
decoders are rebuilt, the caches kept); an update to other weights keeps every token before it and moves those after
it; each token carries the version that generated it and ``policy_version`` is the first token's."""

import copy

import pytest
import torch
from rollout_helpers import make_policy, random_prompts

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def engines():
    policy = make_policy(seed=1)
    torch.manual_seed(2)
    return {
        "plain": lambda p: SpeculativeEngine(p, None, 0),
        "eagle3": lambda p: SpeculativeEngine(p, Eagle3Draft.from_policy(policy).eval(), 3),
        "eagle3-bf16": lambda p: SpeculativeEngine(p, Eagle3Draft.from_policy(policy).eval(), 3, dtype=torch.bfloat16),
        "block": lambda p: BlockSpeculativeEngine(p, DFlashDraft.from_policy(policy, block_size=4, mask_token_id=0)),
    }, policy


class Source:
    """Offers ``(versions, policy_state, draft_state)`` at its ``at``-th poll, once."""

    def __init__(self, at: int, policy_state, draft_state, version: int = 1):
        self.at, self.polls, self.version = at, 0, version
        self.states = (policy_state, draft_state)

    def __call__(self, current):
        self.polls += 1
        if self.polls != self.at:
            return None
        assert current["policy"] < self.version
        return ({"policy": self.version, "draft": self.version}, *self.states)


def _run(make, policy, source, prompts):
    engine = make(copy.deepcopy(policy))
    engine.weight_versions.update({"policy": 0, "draft": 0})
    engine.weight_source = source
    draft = None if engine.draft is None else copy.deepcopy(engine.draft.state_dict())
    return engine, engine.generate(prompts, 16, temperature=0.0), draft


@pytest.mark.parametrize("kind", ["plain", "eagle3", "block"])
def test_an_update_to_the_same_weights_changes_nothing_but_the_versions(kind):
    makers, policy = engines()
    prompts = random_prompts(4, policy.config.vocab_size, seed=3)
    _, before, draft = _run(makers[kind], policy, None, prompts)
    engine, after, _ = _run(makers[kind], policy, Source(3, policy.state_dict(), draft), prompts)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    for a, b in zip(after, before):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert engine.weight_versions == {"policy": 1, "draft": 1}
    for o in after:  # the first token's version, then version 1 from the update on
        assert o.policy_version == 0 and o.draft_version == 0 and len(o.token_versions) == len(o.token_ids)
        switch = o.token_versions.index(1) if 1 in o.token_versions else len(o.token_ids)
        assert set(o.token_versions[:switch]) == {0} and set(o.token_versions[switch:]) <= {1}
    assert any(o.version_span == 1 for o in after) and all(o.version_span in (0, 1) for o in after)


@pytest.mark.parametrize("kind", ["plain", "eagle3", "eagle3-bf16", "block"])
def test_an_update_to_other_weights_keeps_the_tokens_before_it(kind):
    makers, policy = engines()
    prompts = random_prompts(4, policy.config.vocab_size, seed=5)
    other = make_policy(seed=9).state_dict()
    _, before, draft = _run(makers[kind], policy, None, prompts)
    engine, after, _ = _run(makers[kind], policy, Source(2, other, draft), prompts)
    moved = 0
    for a, b in zip(after, before):
        switch = a.token_versions.index(1) if a.token_versions and 1 in a.token_versions else len(a.token_ids)
        assert 0 < switch and a.token_ids[:switch] == b.token_ids[:switch]  # generated before the update
        moved += a.token_ids[switch:] != b.token_ids[switch:]
    assert moved > 0  # the new weights decode what follows
    for name, t in engine.policy.state_dict().items():
        assert torch.equal(t, other[name])


def test_without_a_source_no_token_versions():
    makers, policy = engines()
    _, outs, _ = _run(makers["eagle3"], policy, None, random_prompts(2, policy.config.vocab_size, seed=1))
    assert all(o.token_versions is None and o.version_span == 0 and o.policy_version == 0 for o in outs)


@pytest.mark.parametrize("kind", ["eagle3-bf16", "block"])
def test_rows_of_a_later_chunk_decode_wholly_with_the_new_weights(kind):
    """Requests past the engine's batch size start after an update made during an earlier chunk: they decode with
    the new weights from their first token (decoders rebuilt), and say so (version 1 from token 0)."""
    makers, policy = engines()
    prompts = random_prompts(4, policy.config.vocab_size, seed=7)
    other = make_policy(seed=9)
    _, _, draft = _run(makers[kind], policy, None, prompts)
    engine = makers[kind](copy.deepcopy(policy))
    engine.max_batch_size = 2
    engine.weight_versions.update({"policy": 0, "draft": 0})
    engine.weight_source = Source(2, other.state_dict(), draft)
    after = engine.generate(prompts, 16, temperature=0.0)
    fresh = makers[kind](copy.deepcopy(other))
    fresh.max_batch_size = 2  # the same chunks: bf16 numerics follow the batch's shape
    if fresh.draft is not None:
        fresh.draft.load_state_dict(draft)
    want = fresh.generate(prompts, 16, temperature=0.0)
    late = [i for i, o in enumerate(after) if o.token_versions and o.token_versions[0] == 1]
    assert late, "no request started after the update"
    for i in late:
        assert after[i].policy_version == 1 and set(after[i].token_versions) == {1}
        assert after[i].token_ids == want[i].token_ids
