"""DSpark inside CoDraftModule (one process): the term equals DeepSpec's loss (training/dspark_loss.py's transcribed
definition) computed by hand on the step's anchors, values and gradients of every head; its logged probabilistic
acceptance is DeepSpec's; and its implied rounds replay greedy verification of proposals drawn through the Markov
head. (It never moves the policy's gradients and does not depend on num_microbatches: test_dflash_module.py.)"""

import copy

import pytest
import torch
from codraft_fixtures import VOCAB, concat_batches, make_batch, make_dspark_models

from lightning_codraft.batch import RLBatch
from lightning_codraft.training.dflash_loss import context_visibility
from lightning_codraft.training.dflash_term import draw_anchors
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
    policy, drafter = copy.deepcopy(module.policy), copy.deepcopy(module.draft)
    drafter.zero_grad(set_to_none=True)
    anchors = torch.nonzero(draw_anchors(batch, 5)).flatten()
    K = drafter.config.block_size
    with torch.no_grad():
        fw = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids, taps=(1, 2, 3))
        embeds = policy.embed(drafter.block_ids(batch.input_ids[anchors]))
    visible = context_visibility(batch.cu_seqlens, anchors, batch.num_rows)
    pos = batch.position_ids
    hidden = drafter(drafter.context(list(fw.taps)), pos, embeds, pos[anchors], visible)
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


def _greedy_block(policy, drafter, ids, anchor):
    """The drafter's greedy proposals for the block anchored at ``anchor``: each position's argmax of its base logits
    plus the Markov bias of the proposal before it (the anchor's token for the first)."""
    t = torch.tensor(ids)
    cu, pos = torch.tensor([0, len(ids)], dtype=torch.int32), torch.arange(len(ids))
    with torch.no_grad():
        taps = policy(t, cu_seqlens=cu, position_ids=pos, taps=tuple(drafter.config.taps)).taps
        emb = policy.embed(drafter.block_ids(t[anchor : anchor + 1]))
        vis = context_visibility(cu, torch.tensor([anchor]), len(ids))
        h = drafter(drafter.context(list(taps)), pos, emb, pos[anchor : anchor + 1], vis)  # every row proposes
        prev, out = ids[anchor], []
        for k in range(h.shape[1]):
            step = drafter.block_logits(h[:, k : k + 1], policy.lm_head.weight, torch.tensor([[prev]]))
            prev = int(step[0, 0].argmax())
            out.append(prev)
        return out


def test_implied_rounds_replay_greedy_verification_through_the_markov_head():
    module = _module(temperature=0.0)
    policy, drafter = module.policy, module.draft
    g, prompts, outs = torch.Generator().manual_seed(3), [], []
    for _ in range(8):  # completions that follow the drafter's first proposal often
        ids = torch.randint(1, VOCAB - 1, (4,), generator=g).tolist()
        prompts.append(ids[:])
        for _ in range(20):
            if float(torch.rand((), generator=g)) < 0.7:
                ids.append(_greedy_block(policy, drafter, ids, len(ids) - 1)[0])
            else:
                ids.append(int(torch.randint(1, VOCAB - 1, (), generator=g)))
        outs.append(ids[4:])
    batch = RLBatch.pack(prompts, outs, [[0.0] * 20] * 8, [1.0] * 8)
    out = module(batch)
    K, rounds, accepted = drafter.config.block_size, 0, 0
    cu = batch.cu_seqlens.long().tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        rows = [i for i in range(s, e) if batch.loss_mask[i] > 0]
        i, last = rows[0], rows[-1]
        while i < last:
            a = i + 1
            proposals = _greedy_block(policy, drafter, batch.input_ids[s:e].tolist(), a - s)
            n = 0
            while n < K and a + n < e and proposals[n] == batch.target_ids[a + n]:
                n += 1
            emitted = min(n + 1, last - i)
            rounds, accepted, i = rounds + 1, accepted + emitted - 1, i + emitted
    assert rounds > 0 and accepted >= rounds / 2, (rounds, accepted)
    assert float(out.metrics["draft/implied_acceptance"]) == pytest.approx(1 + accepted / rounds, rel=1e-6)
