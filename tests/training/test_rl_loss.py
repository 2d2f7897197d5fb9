import math

import pytest
import torch
from distributed import run_distributed

from lightning_codraft.training.rl_loss import policy_gradient_loss, token_logprobs


def _reference(logp, old, adv, mask, eps, eps_high, ref, kl_coef):
    """Written from the definition, one token at a time."""
    total, n = 0.0, 0.0
    for t in range(len(logp)):
        if mask[t] == 0:
            continue
        r = math.exp(logp[t] - old[t])
        pg = max(-adv[t] * r, -adv[t] * min(max(r, 1 - eps), 1 + eps_high))
        kl = 0.0
        if ref is not None:
            d = ref[t] - logp[t]
            kl = math.exp(d) - d - 1
        total += pg + kl_coef * kl
        n += 1
    return total / n


def _inputs(T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(T, generator=g, dtype=torch.float64) * 3)
    old = logp + 0.4 * torch.randn(T, generator=g, dtype=torch.float64)
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    mask = (torch.rand(T, generator=g) > 0.3).double()
    ref = logp + 0.2 * torch.randn(T, generator=g, dtype=torch.float64)
    return logp, old, adv, mask, ref


@pytest.mark.parametrize("eps_high, kl_coef", [(None, 0.0), (0.28, 0.0), (None, 0.1)])
def test_matches_definition_value_and_grad(eps_high, kl_coef):
    logp, old, adv, mask, ref = _inputs()
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_gradient_loss(x, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high,
                                       ref_logprobs=ref if kl_coef else None, kl_coef=kl_coef)
    want = _reference(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2,
                      0.2 if eps_high is None else eps_high, ref.tolist() if kl_coef else None, kl_coef)
    assert loss.item() == pytest.approx(want, rel=1e-9)
    assert stats["loss"].item() == pytest.approx(want, rel=1e-9)
    assert stats["num_tokens"].item() == mask.sum().item()
    loss.backward()
    # finite differences against the reference
    h = 1e-6
    for t in range(len(logp)):
        up, dn = logp.tolist(), logp.tolist()
        up[t] += h
        dn[t] -= h
        args = (old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2 if eps_high is None else eps_high,
                ref.tolist() if kl_coef else None, kl_coef)
        fd = (_reference(up, *args) - _reference(dn, *args)) / (2 * h)
        assert x.grad[t].item() == pytest.approx(fd, abs=1e-6)
    assert mask.sum() < len(mask) and (x.grad[mask == 0] == 0).all()


def test_clip_higher_changes_clipping():
    logp = torch.tensor([0.0, 0.0])
    old = torch.tensor([-0.3, -0.3])  # ratio e^0.3 = 1.35
    adv = torch.tensor([1.0, 1.0])
    mask = torch.ones(2)
    _, s_sym = policy_gradient_loss(logp, old, adv, mask, clip_eps=0.2)
    _, s_high = policy_gradient_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.5)
    assert s_sym["clip_frac"].item() == 1.0 and s_high["clip_frac"].item() == 0.0


def test_token_logprobs():
    logits = torch.randn(5, 7)
    tgt = torch.tensor([0, 3, 6, 2, 2])
    want = torch.stack([torch.log_softmax(logits[i], -1)[tgt[i]] for i in range(5)])
    torch.testing.assert_close(token_logprobs(logits, tgt), want)


def test_errors():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="advantages has shape"):
        policy_gradient_loss(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        policy_gradient_loss(x, x, x, x, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef=-1"):
        policy_gradient_loss(x, x, x, x, kl_coef=-1)


def _split_worker(rank, world_size):
    logp, old, adv, mask, ref = _inputs(T=24, seed=3)
    # uneven mask counts per rank on purpose: token-level, not per-rank, averaging
    sl = slice(rank * 12, (rank + 1) * 12)
    x = logp[sl].clone().requires_grad_(True)
    loss, stats = policy_gradient_loss(x, old[sl], adv[sl], mask[sl], ref_logprobs=ref[sl], kl_coef=0.05,
                                       group=torch.distributed.group.WORLD)
    loss.backward()
    return loss.item(), stats["loss"].item(), x.grad.tolist()  # plain lists: tensors over the queue race process exit


def test_token_level_average_over_group():
    logp, old, adv, mask, ref = _inputs(T=24, seed=3)
    x = logp.clone().requires_grad_(True)
    full, _ = policy_gradient_loss(x, old, adv, mask, ref_logprobs=ref, kl_coef=0.05)
    full.backward()
    res = run_distributed(_split_worker, world_size=2, timeout=120)
    assert sum(r[0] for r in res) == pytest.approx(full.item(), rel=1e-12)
    assert res[0][1] == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(torch.tensor(res[0][2] + res[1][2], dtype=torch.float64), x.grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("aggregation", ["token", "sequence", "constant"])
def test_statistics_are_token_means_under_every_aggregation(aggregation):
    """``kl`` and ``clip_frac`` are TRL's ``global_masked_mean`` (``(x * mask).sum() / mask.sum()``) of the k3 KL and
    of the region-clipped indicator (``r < 1 - eps`` with ``A < 0`` or ``r > 1 + eps_high`` with ``A > 0``), while
    the loss keeps the aggregation's weights (tests/peers holds them against verl's own functions)."""
    from lightning_codraft.batch import RLBatch
    from lightning_codraft.training.normalize import normalize_step

    g = torch.Generator().manual_seed(4)
    lengths = [2, 7, 3]
    adv = [1.0, -0.5, 0.7]
    old = [(-torch.rand(n, generator=g) * 2).tolist() for n in lengths]
    batch = RLBatch.pack([[1]] * 3, [[2] * n for n in lengths], old, adv)
    logp = batch.old_logprobs + 0.6 * torch.randn(batch.num_tokens, generator=g) * batch.loss_mask
    ref = batch.old_logprobs - 0.3 * torch.rand(batch.num_tokens, generator=g)
    batch = normalize_step(batch, aggregation, 1, max_new_tokens=8)
    loss, stats = policy_gradient_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, clip_eps=0.2,
                                       clip_eps_high=0.28, ref_logprobs=ref, loss_weight=batch.loss_weight,
                                       num_tokens=batch.norm.tokens)
    m = batch.loss_mask.float()
    r = torch.exp(logp - batch.old_logprobs)
    clipped = ((r < 0.8) & (batch.advantages < 0)) | ((r > 1.28) & (batch.advantages > 0))
    d = ref - logp
    trl_kl = ((torch.exp(d) - d - 1) * m).sum() / m.sum()
    trl_clip = (clipped.float() * m).sum() / m.sum()
    assert 0 < trl_clip < 1
    torch.testing.assert_close(stats["clip_frac"].float(), trl_clip, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(stats["kl"].float(), trl_kl, rtol=1e-6, atol=1e-7)
    # without the step's count: this batch's own token means, the same numbers here
    _, own = policy_gradient_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, clip_eps=0.2,
                                  clip_eps_high=0.28, ref_logprobs=ref, loss_weight=batch.loss_weight)
    torch.testing.assert_close(own["clip_frac"], stats["clip_frac"])
