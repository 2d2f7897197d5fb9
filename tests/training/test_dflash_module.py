"""DFlash inside CoDraftModule (one process): the block term equals the block loss computed by hand on the same
anchors, never moves the policy's gradients, does not depend on num_microbatches, and its implied rounds equal a
by-hand replay of greedy block verification. The last three for DSpark's term too (its replay draws each proposal
through the Markov head; its loss by hand: test_dspark_module.py)."""


import pytest
import torch
from codraft_fixtures import (
    VOCAB,
    block_forward_by_hand,
    concat_batches,
    make_batch,
    make_dflash_models,
    make_dspark_models,
)

from lightning_codraft.batch import RLBatch
from lightning_codraft.training.dflash_loss import context_visibility, dflash_draft_loss
from lightning_codraft.training.dflash_term import DFlashTerm, draw_anchors
from lightning_codraft.training.module import CoDraftModule


def _batch():
    return concat_batches([make_batch(40 + r, num_docs=3, max_len=20) for r in range(2)])


MODELS = {"dflash": make_dflash_models, "dspark": make_dspark_models}
DSPARK_KEYS = ("draft/l1", "draft/confidence_loss", "draft/prob_acceptance", "draft/predicted_acceptance",
               "draft/confidence_error")


def _module(M=1, kind="dflash", **kw):
    policy, drafter = MODELS[kind](block_size=4)
    return CoDraftModule(policy, drafter, num_microbatches=M, block_anchors=5, **kw)


def _grads(module):
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def test_the_drafter_gets_the_dflash_term_and_anchors_per_document():
    module, batch = _module(), _batch()
    assert isinstance(module.draft_term, DFlashTerm)
    anchors = draw_anchors(batch, 5)
    assert torch.equal(anchors, draw_anchors(batch, 5))  # seeded by the documents' tokens
    cu = batch.cu_seqlens.long().tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        where = batch.draft_targets[s:e] * batch.loss_mask[s:e]  # completion rows that are draft targets
        assert int(anchors[s:e].sum()) == min(5, int((where > 0).sum()))
    assert bool((anchors <= batch.draft_targets * batch.loss_mask).all())
    # a document's anchors do not depend on where it sits in the batch
    first = make_batch(40, num_docs=3, max_len=20)
    assert torch.equal(draw_anchors(first, 5), anchors[: first.num_rows])


def test_block_term_equals_the_block_loss_by_hand():
    module, batch = _module(), _batch()
    out = module(batch)
    out.loss.backward()
    got = {n: g for n, g in _grads(module).items() if n.startswith("draft.")}

    policy, drafter, anchors, fw, hidden = block_forward_by_hand(module, batch, 5)
    ref = dflash_draft_loss(drafter.logits(hidden, policy.lm_head.weight), fw.logits, anchors, batch.cu_seqlens,
                            batch.draft_targets, gamma=4.0)
    ref.loss.backward()
    assert float(out.metrics["draft/loss"]) == pytest.approx(float(ref.loss.detach()), rel=1e-6)
    for k in range(3):
        assert float(out.metrics[f"draft/loss_step{k}"]) == pytest.approx(float(ref.per_step_loss[k]), rel=1e-6)
    assert set(got) == {f"draft.{n}" for n, p in drafter.named_parameters() if p.grad is not None}
    for n, p in drafter.named_parameters():
        torch.testing.assert_close(got[f"draft.{n}"], p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_block_term_never_moves_the_policy_gradients(kind):
    batch = _batch()
    with_draft, without = _module(kind=kind), _module(kind=kind, draft_loss_weight=0.0)
    for m in (with_draft, without):
        m(batch).loss.backward()
    g1, g0 = _grads(with_draft), _grads(without)
    policy_names = [n for n in g1 if n.startswith("policy.")]
    assert policy_names and {n for n in g0 if n.startswith("policy.")} == set(policy_names)
    for n in policy_names:
        assert torch.equal(g1[n], g0[n]), n
    assert any(float(g.abs().sum()) > 0 for n, g in g1.items() if n.startswith("draft."))
    assert not any(n.startswith("draft.") for n in g0)
    if kind == "dspark":
        assert any(float(g.abs().sum()) > 0 for n, g in g1.items() if "markov_head" in n)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize("M", [2, 6])
def test_the_block_term_does_not_depend_on_num_microbatches(M, kind):
    batch = _batch()
    ref, got = _module(1, kind), _module(M, kind)
    r, o = ref(batch), got(batch)
    r.loss.backward()
    o.loss.backward()
    for key in ("loss", "draft/loss", "draft/top1_acceptance", "draft/implied_acceptance",
                *(DSPARK_KEYS if kind == "dspark" else ())):
        assert float(o.metrics[key]) == pytest.approx(float(r.metrics[key]), rel=1e-5), key
    gr, go = _grads(ref), _grads(got)
    assert set(gr) == set(go)
    for n in gr:
        torch.testing.assert_close(go[n], gr[n], rtol=1e-5, atol=1e-7)


def _block_proposals(policy, drafter, ids, anchor):
    """The drafter's greedy proposals for the block anchored at ``anchor`` of one document: DFlash's block rows
    1 .. B - 1 each by its argmax; DSpark's rows 0 .. B - 1 one at a time, each the argmax of its base logits plus
    the Markov bias of the proposal before it (the anchor's token for the first)."""
    t = torch.tensor(ids)
    cu, pos = torch.tensor([0, len(ids)], dtype=torch.int32), torch.arange(len(ids))
    with torch.no_grad():
        taps = policy(t, cu_seqlens=cu, position_ids=pos, taps=tuple(drafter.config.taps)).taps
        emb = policy.embed(drafter.block_ids(t[anchor : anchor + 1]))
        vis = context_visibility(cu, torch.tensor([anchor]), len(ids))
        h = drafter(drafter.context(list(taps)), pos, emb, pos[anchor : anchor + 1], vis)
        if getattr(drafter, "markov_head", None) is None:
            return drafter.logits(h, policy.lm_head.weight)[0, 1:].argmax(-1).tolist()
        prev, out = ids[anchor], []
        for k in range(h.shape[1]):
            step = drafter.block_logits(h[:, k : k + 1], policy.lm_head.weight, torch.tensor([[prev]]))
            prev = int(step[0, 0].argmax())
            out.append(prev)
        return out


def _drafted_batch(policy, drafter, num_docs=8, prompt_len=4, new=20):
    """Completions whose next token is, with probability 0.7, the drafter's first proposal from the block anchored
    at the last token (else a random token): T = 0 rounds then accept often, at rows only the right alignment
    finds."""
    g, prompts, outs = torch.Generator().manual_seed(3), [], []
    for _ in range(num_docs):
        ids = torch.randint(1, VOCAB - 1, (prompt_len,), generator=g).tolist()
        prompts.append(ids[:])
        for _ in range(new):
            if float(torch.rand((), generator=g)) < 0.7:
                ids.append(_block_proposals(policy, drafter, ids, len(ids) - 1)[0])
            else:
                ids.append(int(torch.randint(1, VOCAB - 1, (), generator=g)))
        outs.append(ids[prompt_len:])
    return RLBatch.pack(prompts, outs, [[0.0] * new] * num_docs, [1.0] * num_docs)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_implied_rounds_replay_greedy_block_verification(kind):
    module = _module(kind=kind, temperature=0.0)
    batch = _drafted_batch(module.policy, module.draft)
    out = module(batch)
    K, rounds, accepted = module.draft.num_proposals, 0, 0
    cu = batch.cu_seqlens.long().tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        rows = [i for i in range(s, e) if batch.loss_mask[i] > 0]
        i, last = rows[0], rows[-1]  # the prefill emitted the target of rows[0]; rounds emit the rest
        while i < last:
            a = i + 1
            proposals = _block_proposals(module.policy, module.draft, batch.input_ids[s:e].tolist(), a - s)
            n = 0
            while n < K and a + n < e and proposals[n] == batch.target_ids[a + n]:
                n += 1
            emitted = min(n + 1, last - i)
            rounds, accepted, i = rounds + 1, accepted + emitted - 1, i + emitted
    assert rounds > 0 and accepted >= rounds / 2, (rounds, accepted)  # the drafter accepts: the replay is tested
    assert float(out.metrics["draft/implied_acceptance"]) == pytest.approx(1 + accepted / rounds, rel=1e-6)
