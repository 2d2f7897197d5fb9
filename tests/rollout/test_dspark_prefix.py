"""A verify length DSpark's confidence head chooses (rollout/embedded/prefix.py) keeps the block engine exact: greedy
output equals plain decoding with and without the confidence-chosen prefix (fixed threshold and the measured cost
model), and at T = 1 under rejection sampling (where the verify length could matter: coupled samples equal plain
decoding whatever the length) the output passes the chi-square tests, while an ANTICIPATING prefix rule, one that
looks at the drafted tokens before deciding how many to verify, fails them. A head that reads the previous drafted
token is refused."""

import pytest
import torch
from rollout_helpers import make_policy, random_prompts
from test_speculative import _distribution_failures

from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.rollout.embedded.adaptive import SpeculationController
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine, block_controller
from lightning_codraft.rollout.embedded.prefix import threshold_length
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _drafter(policy, block_size=4, seed=3, **heads):
    torch.manual_seed(seed)
    d = DSparkDraft.from_policy(policy, markov_rank=4, block_size=block_size, mask_token_id=0, **heads)
    if d.confidence_head is not None:  # confidences spread over (0, 1): the chosen length varies by round
        d.confidence_head.proj.weight.data.normal_(0, 3.0 / d.config.hidden_size**0.5)
        d.confidence_head.proj.bias.data.fill_(0.5)
    return d.eval()


def test_threshold_length_is_the_longest_prefix_reached_often_enough():
    probs = torch.tensor([[0.9, 0.8, 0.1], [0.7, 0.9, 0.9]])  # mean reach: 0.8, 0.603, 0.1485
    assert threshold_length(probs, 0.5) == 2
    assert threshold_length(probs, 0.7) == 1
    assert threshold_length(probs, 0.95) == 1  # at least one proposal
    assert threshold_length(probs, 0.1) == 3


class _AlwaysDraft(SpeculationController):
    """The block controller with its measured cost model, choosing K every round (a random drafter would make the
    real one stop drafting): the confidence rule then shortens what the cost model says does not pay."""

    def __init__(self, K):
        super().__init__(K, costs=block_controller(K).costs)

    def choose(self, estimates, remaining, catch_up_span=0):
        return self.max_k


@pytest.mark.parametrize("adaptive", [False, True], ids=["threshold", "cost-model"])
def test_greedy_output_equals_plain_decoding_with_the_confidence_prefix(adaptive):
    policy = make_policy(seed=1)
    prompts = random_prompts(6, policy.config.vocab_size, seed=4)
    drafter = _drafter(policy)
    adaptive = _AlwaysDraft(drafter.num_proposals) if adaptive else False
    plain = [o.token_ids for o in SpeculativeEngine(policy, None, 0).generate(prompts, 20, temperature=0.0)]
    fixed = BlockSpeculativeEngine(policy, drafter).generate(prompts, 20, temperature=0.0)
    engine = BlockSpeculativeEngine(policy, drafter, adaptive=adaptive, verify_length="confidence")
    rule, lengths = engine._confident_length, []

    def logged(hidden, remaining):
        lengths.append((hidden.shape[1], rule(hidden, remaining)))
        return lengths[-1][1]

    engine._confident_length = logged
    chosen = engine.generate(prompts, 20, temperature=0.0)
    assert [o.token_ids for o in fixed] == plain
    assert [o.token_ids for o in chosen] == plain
    assert lengths and any(out < k for k, out in lengths)  # the rule shortened some rounds
    if not adaptive:
        assert any(out == k for k, out in lengths)  # and kept others whole


class _Anticipating(BlockSpeculativeEngine):
    """The negative control: it draws the round's proposals, THEN verifies them only if the first is the drafter's
    most likely token (else none: a plain step). The length now depends on the drafted tokens' values."""

    def _draw(self, hidden, pending, k, sampler, rn):
        ids, q = super()._draw(hidden, pending, k, sampler, rn)
        if k and q is not None and int(ids[0, 0]) != int(q[0, 0].argmax()):
            return ids[:, :0], q[:, :0]
        return ids, q


@pytest.mark.parametrize("rule", ["confidence", "anticipating"])
def test_rejection_sampling_stays_the_policys_only_without_anticipation(rule):
    policy = make_policy(seed=5, std=0.15, vocab_size=12)
    drafter = _drafter(policy, block_size=2, seed=6)
    if rule == "confidence":
        engine = BlockSpeculativeEngine(policy, drafter, 2, sampling="rejection", verify_length="confidence",
                                        confidence_threshold=0.45)
        failures, stats, _ = _distribution_failures(engine, 2, 0, 1.0, n=3000)
        assert not failures, failures
        assert 0 < stats.proposed_per_position[1] < stats.proposed_per_position[0]  # lengths 1 and 2 both ran
    else:
        engine = _Anticipating(policy, drafter, 2, sampling="rejection", max_batch_size=1)
        failures, _, _ = _distribution_failures(engine, 2, 0, 1.0, n=1500)
        assert failures  # the chi-square tests see the bias


def test_a_head_that_reads_the_drafted_tokens_cannot_choose_the_length():
    policy = make_policy(seed=1)
    with pytest.raises(ValueError, match="confidence_with_markov"):
        BlockSpeculativeEngine(policy, _drafter(policy, confidence_with_markov=True), verify_length="confidence")
    with pytest.raises(ValueError, match="confidence head"):
        BlockSpeculativeEngine(policy, _drafter(policy, confidence_head=False), verify_length="confidence")
