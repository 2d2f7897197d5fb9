"""With a draft vocabulary smaller than the policy's, the draft accuracy and the acceptance length it implies are
what greedy verification measures: a row whose policy top-1 the draft cannot propose is a rejection. Checked on a
deterministic case (policy and draft fixed) against verification run through the draft's decode step (the
engine's math, over a KV cache), with K = 1, where the implied acceptance 1 + acc_0 is exactly the mean tokens per
verified round started at a scored row."""

import pytest
import torch
from codraft_fixtures import make_batch, make_models

from lightning_codraft.training import CoDraftModule


def _verify_greedily(policy, draft, batch):
    """Per scored row: 1 when the draft's decode-step proposal equals the policy's argmax over the FULL vocabulary."""
    with torch.no_grad():
        out = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids,
                     taps=draft.config.taps)
        accepted, oov = [], []
        cu = batch.cu_seqlens.tolist()
        for s, e in zip(cu[:-1], cu[1:]):
            n = int(batch.valid[s:e].sum())
            taps = [t[s:s + n - 1].unsqueeze(0) for t in out.taps]
            embeds = policy.embed(batch.input_ids[s + 1:s + n]).unsqueeze(0)  # x_{i+1}, fed at row i
            cache = draft.allocate_kv_cache(1, n)
            _, logits = draft.step(draft.fuse(taps), embeds, cache)
            proposal = draft.draft_to_target(logits[0].argmax(-1))
            for i in range(n - 1):
                j = s + i + 1  # the policy row whose distribution row i's proposal is verified against
                if batch.draft_targets[j] == 0:
                    continue
                top = int(out.logits[j].argmax())
                accepted.append(float(int(proposal[i]) == top))
                oov.append(float(not bool(draft.t2d[top])))
    return torch.tensor(accepted), torch.tensor(oov)


def test_implied_acceptance_equals_greedy_verification_with_a_small_draft_vocabulary():
    policy, draft = make_models(draft_vocab=24)  # half the policy's 48 tokens
    batch = make_batch(9, num_docs=4)
    module = CoDraftModule(policy, draft, ttt_steps=1, policy_lr=0.0, draft_lr=1e-2)
    optimizer, _ = module.build_optimizer()
    for _ in range(30):  # fit the draft to this batch so that it agrees with the policy on some rows
        optimizer.zero_grad()
        module(batch).loss.backward()
        optimizer.step()
    policy.eval(), draft.eval()
    with torch.no_grad():
        out = module(batch)
    accepted, oov = _verify_greedily(policy, draft, batch)
    assert oov.mean() > 0.1  # the case exercises out-of-vocabulary top-1s
    assert float(out.metrics["draft/oov_share"]) == pytest.approx(float(oov.mean()), abs=1e-6)
    assert float(out.metrics["draft/acc_step0"]) == pytest.approx(float(accepted.mean()), abs=1e-6)
    assert float(out.metrics["draft/top1_acceptance"]) == pytest.approx(1 + float(accepted.mean()), abs=1e-6)
    # the old conditional figure (in-vocabulary rows only) would overstate it by 1 / (1 - oov share)
    conditional = float(accepted.sum() / (1 - oov).sum())
    assert conditional > float(out.metrics["draft/acc_step0"]) + 0.01
