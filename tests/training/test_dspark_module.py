"""DSpark inside CoDraftModule (one process): the term equals DeepSpec's loss (training/dspark_loss.py's transcribed
definition) computed by hand on the step's anchors, values and gradients of every head, and its logged probabilistic
acceptance is DeepSpec's. (It never moves the policy's gradients, does not depend on num_microbatches and its implied
rounds replay greedy verification through the Markov head: test_dflash_module.py.)"""


import pytest
import torch
from codraft_fixtures import block_forward_by_hand, concat_batches, make_batch, make_dspark_models

from lightning_codraft.training.dspark_loss import dspark_loss
from lightning_codraft.training.dspark_term import DSparkTerm
from lightning_codraft.training.module import CoDraftModule


def _batch():
    return concat_batches([make_batch(40 + r, num_docs=3, max_len=20) for r in range(2)])


def _module(M=1, heads=None, **kw):
    policy, drafter = make_dspark_models(block_size=4, **(heads or {}))
    return CoDraftModule(policy, drafter, num_microbatches=M, block_anchors=5, **kw)


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def _by_hand(module, batch, alphas=(0.1, 0.9, 1.0)):
    """DeepSpec's loss on the step's blocks, in its next-token layout: block row k of the anchor at a predicts
    x_{a+k+1} (the target of policy row a + k) with the Markov bias of x_{a+k}, for k = 0 .. B - 1."""
    policy, drafter, anchors, fw, hidden = block_forward_by_hand(module, batch, 5)
    K = drafter.config.block_size
    cu = batch.cu_seqlens.long()
    ends = cu[torch.searchsorted(cu, anchors, right=True)]
    rows = anchors[:, None] + torch.arange(K)  # the policy row of block position k + 1
    safe = rows.clamp(max=batch.num_rows - 1)
    valid = (rows < ends[:, None]) & (batch.draft_targets[safe] > 0)
    prev = batch.input_ids[safe]
    logits = drafter.block_logits(hidden, policy.lm_head.weight, prev)
    conf = drafter.confidence_logits(hidden, prev)
    terms = dspark_loss(logits, fw.logits[safe], batch.target_ids[safe], valid, conf, gamma=4.0,
                        ce_weight=alphas[0], l1_weight=alphas[1], confidence_weight=alphas[2])
    terms.loss.backward()
    return terms, drafter


@pytest.mark.parametrize("heads", [{}, {"markov_head_type": "gated"}, {"confidence_head": False}],
                         ids=["vanilla", "gated", "no-confidence"])
def test_the_term_equals_deepspec_loss_by_hand(heads):
    module, batch = _module(heads=heads, dspark_ce_weight=0.3, dspark_l1_weight=0.5, dspark_confidence_weight=2.0), _batch()
    assert isinstance(module.draft_term, DSparkTerm)
    out = module(batch)
    out.loss.backward()
    got = {n: g for n, g in _grads(module).items() if n.startswith("draft.")}
    ref, drafter = _by_hand(module, batch, (0.3, 0.5, 2.0))
    m = out.metrics
    for key, want in (("draft/loss", ref.loss), ("draft/ce", ref.ce), ("draft/l1", ref.l1),
                      ("draft/prob_acceptance", ref.acceptance)):
        assert float(m[key]) == pytest.approx(float(want.detach()), rel=1e-5), key
    if heads.get("confidence_head", True):
        assert float(m["draft/confidence_loss"]) == pytest.approx(float(ref.confidence.detach()), rel=1e-5)
        assert 1.0 <= float(m["draft/predicted_acceptance"]) <= 4.0
    else:
        assert "draft/predicted_acceptance" not in m
    named = {f"draft.{n}" for n, p in drafter.named_parameters() if p.grad is not None}
    assert set(got) == named and any("markov_head" in n for n in named)
    assert any("confidence_head" in n for n in named) == heads.get("confidence_head", True)
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(got[f"draft.{n}"], p.grad, rtol=1e-5, atol=1e-7)
