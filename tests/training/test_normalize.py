"""One normalisation for every layout: the step's objective does not depend on how the step is cut into
microbatches, and each aggregation is the peers' definition (GRPO's sequence mean, DAPO's token mean, Dr. GRPO's
constant normaliser), the KL term weighted like the policy term. The multi-process grid is
tests/test_layouts_grid.py."""

import pytest
import torch
from codraft_fixtures import make_batch, make_models

from lightning_codraft.batch import RLBatch
from lightning_codraft.training import CoDraftModule
from lightning_codraft.training.normalize import normalize_step
from lightning_codraft.training.rl_loss import policy_gradient_loss, token_logprobs

L_MAX = 16  # max_new_tokens of the constant aggregation


def _grads(module, batch):
    module.zero_grad(set_to_none=True)
    out = module(batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _module(agg, kl, M, draft_vocab=None):
    return CoDraftModule(*make_models(draft_vocab=draft_vocab), loss_aggregation=agg, kl_coef=kl,
                         num_microbatches=M, max_new_tokens=L_MAX)


def _definition(module, batch: RLBatch, agg: str, kl: float) -> torch.Tensor:
    """The RL objective from its definition: per sample, then over samples (GRPO), or over all tokens."""
    out = module.policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids)
    logp = token_logprobs(out.logits, batch.target_ids)
    cu = batch.cu_seqlens.tolist()
    per_sample_sum, per_sample_mean, tokens = [], [], 0.0
    for s, e in zip(cu[:-1], cu[1:]):
        rows = slice(s, e)
        m = batch.loss_mask[rows]
        if m.sum() == 0:
            continue
        loss, _ = policy_gradient_loss(logp[rows], batch.old_logprobs[rows], batch.advantages[rows], m,
                                       ref_logprobs=batch.ref_logprobs[rows], kl_coef=kl)
        per_sample_mean.append(loss)  # the sample's token mean
        per_sample_sum.append(loss * m.sum())
        tokens += float(m.sum())
    if agg == "sequence":
        return sum(per_sample_mean) / len(per_sample_mean)
    if agg == "token":
        return sum(per_sample_sum) / tokens
    return sum(per_sample_sum) / (len(per_sample_sum) * L_MAX)


@pytest.mark.parametrize("kl", [0.0, 0.1])
@pytest.mark.parametrize("agg", ["token", "sequence", "constant"])
def test_objective_and_every_gradient_are_independent_of_microbatching(agg, kl):
    batch = make_batch(11, num_docs=4)
    ref_out, ref = _grads(_module(agg, kl, 1), batch)
    want = _definition(_module(agg, kl, 1), batch, agg, kl)
    assert float(ref_out.metrics["policy/loss"]) == pytest.approx(float(want.detach()), rel=1e-6, abs=1e-8)
    for M in (2, 4):  # 4 = one sample per microbatch
        out, got = _grads(_module(agg, kl, M), batch)
        assert float(out.metrics["loss"]) == pytest.approx(float(ref_out.metrics["loss"]), rel=1e-6, abs=1e-8)
        assert set(got) == set(ref)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-8, msg=lambda m: f"M={M} {n}: {m}")
        for key in ("policy/clip_frac", "policy/kl", "policy/num_tokens", "draft/loss", "draft/acc_step0"):
            assert float(out.metrics[key]) == pytest.approx(float(ref_out.metrics[key]), rel=1e-6, abs=1e-8), key


def test_sequence_aggregation_weighs_the_kl_per_sample():
    """Two samples of 1 and 3 tokens, zero advantage, a KL only on the 1-token sample: GRPO's sequence mean is
    (kl + 0) / 2; a token mean would give kl / 4."""
    batch = RLBatch.pack([[1, 2], [3, 4]], [[5], [6, 7, 8]], [[-1.0], [-1.0] * 3], [0.0, 0.0])
    batch = RLBatch(**{**batch.row_tensors(), "cu_seqlens": batch.cu_seqlens,
                       "ref_logprobs": batch.loss_mask * 0})
    logp = torch.where(batch.loss_mask > 0, torch.tensor(0.0), torch.tensor(0.0))
    logp[1] = -1.0  # the 1-token sample's only row: delta = ref - logp = 1 -> k3 = e - 2
    kl = torch.e - 2
    seq = normalize_step(batch, "sequence", 1)
    loss, stats = policy_gradient_loss(logp, logp, batch.advantages, batch.loss_mask, ref_logprobs=batch.ref_logprobs,
                                       kl_coef=1.0, loss_weight=seq.loss_weight)
    assert float(loss) == pytest.approx(kl / 2, rel=1e-6)
    token = normalize_step(batch, "token", 1)
    loss, _ = policy_gradient_loss(logp, logp, batch.advantages, batch.loss_mask, ref_logprobs=batch.ref_logprobs,
                                   kl_coef=1.0, loss_weight=token.loss_weight)
    assert float(loss) == pytest.approx(kl / 4, rel=1e-6)
    const = normalize_step(batch, "constant", 1, max_new_tokens=8)
    assert const.norm.rl == 16.0 and float(const.loss_weight.sum()) == pytest.approx(4 / 16)


def test_normalize_step_counts_and_errors():
    batch = make_batch(3, num_docs=3)
    out = normalize_step(batch, "sequence", 3)
    assert out.norm.samples == 3 and out.norm.tokens == float(batch.loss_mask.sum())
    assert float(out.loss_weight.sum()) == pytest.approx(1.0)  # every sample weighs 1/S
    for k in range(3):
        assert float(out.norm.draft[k]) == float(batch.shift_left(batch.draft_targets, k + 1).sum())
    assert normalize_step(out, "token", 3) is out  # already normalised: unchanged
    with pytest.raises(ValueError, match="must be one of"):
        normalize_step(batch, "mean", 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        normalize_step(batch, "constant", 3)
    with pytest.raises(ValueError, match="loss_aggregation='constant'"):
        CoDraftModule(*make_models(), loss_aggregation="constant")


def test_dual_clip_caps_negative_advantage_losses():
    logp = torch.tensor([2.0, 0.0])  # ratio e^2 ~ 7.4 on row 0
    old, mask = torch.zeros(2), torch.ones(2)
    adv = torch.tensor([-1.0, -1.0])
    plain, _ = policy_gradient_loss(logp, old, adv, mask)
    capped, _ = policy_gradient_loss(logp, old, adv, mask, dual_clip=3.0)
    assert float(plain) == pytest.approx((torch.e ** 2 + 1) / 2, rel=1e-6)
    assert float(capped) == pytest.approx((3.0 + 1) / 2, rel=1e-6)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_gradient_loss(logp, old, adv, mask, dual_clip=0.5)
