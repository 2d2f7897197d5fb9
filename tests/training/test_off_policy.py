"""The decoupled off-policy objective (training/off_policy.py): every ratio is exactly 1 when the behaviour policy is
the current one (and the loss and gradients are then today's), a stale rollout's weights equal
``min(pi_prox / pi_behave, C)`` computed by hand at each level (token, sequence, geometric mean; rejection; veto),
and the module's gradients equal the by-hand weighted policy gradient."""

import dataclasses
import math

import pytest
import torch
from codraft_fixtures import concat_batches, make_batch, make_models

from lightning_codraft.training.module import CoDraftModule
from lightning_codraft.training.normalize import doc_index
from lightning_codraft.training.off_policy import OffPolicyCorrection, importance_weights
from lightning_codraft.training.rl_loss import policy_gradient_loss


def _batch():
    return concat_batches([make_batch(70 + r, num_docs=3, max_len=20) for r in range(2)])


def _module(**kw):
    policy, draft = make_models(seed=3)
    return CoDraftModule(policy, draft, draft_loss_weight=0.0, **kw)


def _current_logprobs(module, batch):
    """The trainer's own log-probs of the batch's targets (what a behaviour policy equal to it would report)."""
    with torch.no_grad():
        out = module.policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids)
        return module.sampled_logprobs(out.logits, batch.target_ids) * batch.loss_mask


def _grads(module, batch):
    module.zero_grad()
    out = module(batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}


def test_ratios_are_exactly_one_when_the_behaviour_policy_is_the_current_one():
    module = _module(off_policy=OffPolicyCorrection())
    batch = _batch()
    batch = dataclasses.replace(batch, old_logprobs=_current_logprobs(module, batch))
    out, decoupled = _grads(module, batch)
    m = out.metrics
    assert float(m["policy/is_weight"]) == pytest.approx(1.0, abs=1e-12)  # token mean of the weights: all 1
    assert float(m["policy/is_weight_max"]) == 1.0 and float(m["policy/is_truncated"]) == 0.0
    assert float(m["policy/is_masked"]) == 0.0 and float(m["policy/mismatch_kl"]) == 0.0
    today = _module()  # the same weights, today's loss against the sampling policy: equal when it is the current one
    today.load_state_dict(module.state_dict())
    out0, plain = _grads(today, batch)
    assert float(out0.loss.detach()) == float(out.loss.detach())
    for name, g in plain.items():
        assert torch.equal(g, decoupled[name]), name


def test_without_the_correction_the_loss_is_todays():
    """``off_policy=None`` (a synchronous run) is the PPO ratio against the engine's log-probs, not the decoupled
    one: on a batch whose behaviour log-probs are stale the two differ."""
    batch = _batch()
    a, b = _module(), _module(off_policy=OffPolicyCorrection())
    b.load_state_dict(a.state_dict())
    la, lb = a(batch).loss, b(batch).loss
    assert not torch.equal(la, lb)


def _docs():
    """Two documents of 4 and 3 completion rows (a prompt row each), with known log ratios."""
    cu = torch.tensor([0, 5, 9])
    mask = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1, 1], dtype=torch.float32)
    log_ratio = torch.tensor([0.0, 0.2, 1.5, -0.1, 0.3, 0.0, -2.0, 0.1, -0.5]) * mask
    behave = -torch.rand(9, generator=torch.Generator().manual_seed(0)) * mask
    prox = behave + log_ratio
    idx = torch.repeat_interleave(torch.arange(2), cu[1:] - cu[:-1])
    return prox, behave, mask, idx, log_ratio


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_the_weights_equal_a_by_hand_computation(level):
    prox, behave, mask, idx, log_ratio = _docs()
    iw = importance_weights(prox, behave, mask, idx, 2, OffPolicyCorrection(is_cap=2.0, is_level=level))
    lr = log_ratio.double().tolist()
    seq = [sum(lr[1:5]), sum(lr[6:9])]
    expect = []
    for t in range(9):
        d = 0 if t < 5 else 1
        x = {"token": lr[t], "sequence": seq[d], "geometric": seq[d] / (4 if d == 0 else 3)}[level]
        expect.append(min(math.exp(x), 2.0) * float(mask[t]))
    torch.testing.assert_close(iw.weight.double(), torch.tensor(expect, dtype=torch.float64), rtol=1e-6, atol=1e-7)
    assert float(iw.masked.sum()) == 0.0
    if level == "token":  # exp(1.5) > 2: one token truncated; the others below the cap
        assert iw.truncated.tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0]


def test_rejection_and_veto_mask_by_hand():
    prox, behave, mask, idx, _ = _docs()
    token = importance_weights(prox, behave, mask, idx, 2, OffPolicyCorrection(mask="token", mask_threshold=3.0))
    assert token.masked.tolist() == [0, 0, 1, 0, 0, 0, 1, 0, 0]  # |log r| > log 3 = 1.0986: 1.5 and -2.0
    geo = importance_weights(prox, behave, mask, idx, 2, OffPolicyCorrection(mask="geometric", mask_threshold=1.5))
    # geometric means: doc 0 exp(1.9 / 4) = 1.61 > 1.5, doc 1 exp(-2.4 / 3) = 0.45 < 1 / 1.5: both out
    assert geo.masked.tolist() == mask.tolist() and float(geo.weight.abs().sum()) == 0.0
    veto = importance_weights(prox, behave, mask, idx, 2, OffPolicyCorrection(veto=0.2))  # exp(-2) = 0.135 < 0.2
    assert veto.masked.tolist() == [0, 0, 0, 0, 0, 0, 1, 1, 1]
    assert veto.weight[6:].abs().sum() == 0 and veto.weight[1:5].min() > 0


def test_the_gradient_is_the_weighted_policy_gradient():
    """d loss / d logp_t = -w_t A_t weight_t (the ratio against the proximal policy is 1, unclipped)."""
    prox, behave, mask, idx, _ = _docs()
    logp = prox.clone().requires_grad_(True)
    adv = torch.linspace(-1, 1, 9) * mask
    weight = mask / mask.sum()
    iw = importance_weights(logp, behave, mask, idx, 2, OffPolicyCorrection())
    loss, _ = policy_gradient_loss(logp, logp.detach(), adv, mask, loss_weight=weight, is_weight=iw.weight)
    loss.backward()
    torch.testing.assert_close(logp.grad, -iw.weight * adv * weight, rtol=1e-6, atol=1e-8)
    assert not torch.equal(iw.weight, mask)  # a stale rollout: ratios other than 1


def test_a_stale_rollout_is_corrected_in_the_module():
    """The module's gradients under the correction equal autograd of the by-hand objective
    ``-sum_t w_t A_t weight_t logp_t`` with ``w = min(exp(logp - behave), 2)``."""
    module = _module(off_policy=OffPolicyCorrection())
    batch = _batch()
    current = _current_logprobs(module, batch)
    stale = (current + 0.3 * torch.randn(current.shape, generator=torch.Generator().manual_seed(1))) * batch.loss_mask
    batch = dataclasses.replace(batch, old_logprobs=stale)
    out, got = _grads(module, batch)
    assert float(out.metrics["policy/is_weight"]) != pytest.approx(1.0)
    norm = module.normalize(batch)
    module.zero_grad()
    o = module.policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids)
    logp = module.sampled_logprobs(o.logits, batch.target_ids)
    w = torch.clamp(torch.exp(logp.detach() - stale), max=2.0) * batch.loss_mask
    (-(w * batch.advantages * norm.loss_weight * logp).sum()).backward()
    for name, p in module.policy.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7)
    assert 1.0 < float(out.metrics["policy/is_weight_max"]) <= 2.0


def _cp_worker(rank, world_size, level, mask):
    import torch.distributed as dist

    prox, behave, full_mask, idx, _ = _docs()
    corr = OffPolicyCorrection(is_level=level, mask=mask, mask_threshold=3.0, veto=0.2)
    mine = torch.arange(9)[torch.arange(9) % world_size == rank]  # each document's rows spread over the ranks
    iw = importance_weights(prox[mine], behave[mine], full_mask[mine], idx[mine], 2, corr, dist.group.WORLD)
    return mine.tolist(), iw.weight.tolist(), iw.masked.tolist()


@pytest.mark.parametrize("level, mask", [("sequence", "geometric"), ("geometric", "sequence")])
def test_sequence_weights_under_cp_equal_one_process(level, mask):
    """A document's rows spread over 2 CP ranks: its per-document sums are all-reduced, so every row's weight and mask
    equal the one-process ones (without the all-reduce both cases fail: checked)."""
    from distributed import run_distributed

    prox, behave, mask_, idx, _ = _docs()
    one = importance_weights(prox, behave, mask_, idx, 2,
                             OffPolicyCorrection(is_level=level, mask=mask, mask_threshold=3.0, veto=0.2))
    for rows, weight, masked in run_distributed(_cp_worker, world_size=2, args=(level, mask)):
        torch.testing.assert_close(torch.tensor(weight), one.weight[rows], rtol=1e-6, atol=1e-7)
        assert masked == one.masked[rows].tolist()
