"""DSpark's loss terms (training/dspark_loss.py) equal a direct, position-by-position transcription of DeepSpec's
definitions (decay-weighted CE, the L1 distance of the two distributions, BCE of the confidence head against
1 - L1 / 2, the probabilistic acceptance 1 + sum of cumulative products), in values and gradients (rtol 1e-5)."""

import math

import pytest
import torch

from lightning_codraft.training.dspark_loss import dspark_loss


def transcription(draft, policy, targets, valid, conf, gamma, alphas):
    """DeepSpec's definitions, one position at a time."""
    N, B, _ = draft.shape
    ce_num = l1_num = conf_num = den = 0.0
    taus, acc = [], [[0.0] * B for _ in range(N)]
    for n in range(N):
        for b in range(B):
            if not valid[n, b]:
                continue
            w = math.exp(-b / gamma) if gamma else 1.0
            p, q = torch.softmax(draft[n, b], -1), torch.softmax(policy[n, b].detach(), -1)
            ce_num = ce_num + w * -torch.log_softmax(draft[n, b], -1)[targets[n, b]]
            l1 = sum((p[v] - q[v]).abs() for v in range(p.numel()))
            l1_num = l1_num + w * l1
            a = min(max(1.0 - 0.5 * float(l1.detach()), 0.0), 1.0)
            acc[n][b] = a
            s = torch.sigmoid(conf[n, b])
            conf_num = conf_num + w * -(a * torch.log(s) + (1 - a) * torch.log(1 - s))
            den += w
        if any(valid[n, b] for b in range(B)):
            prod, tau = 1.0, 1.0
            for b in range(B):
                prod *= acc[n][b] if valid[n, b] else 0.0
                tau += prod
            taus.append(tau)
    ce, l1, cf = ce_num / den, l1_num / den, conf_num / den
    return alphas[0] * ce + alphas[1] * l1 + alphas[2] * cf, ce, l1, cf, sum(taus) / len(taus)


@pytest.mark.parametrize("gamma", [None, 4.0])
def test_each_term_and_the_acceptance_equal_the_transcription(gamma):
    g = torch.Generator().manual_seed(0)
    N, B, V = 3, 5, 11
    draft = torch.randn(N, B, V, generator=g, dtype=torch.float64).requires_grad_()
    policy = torch.randn(N, B, V, generator=g, dtype=torch.float64)
    conf = torch.randn(N, B, generator=g, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, V, (N, B), generator=g)
    valid = torch.ones(N, B, dtype=torch.bool)
    valid[1, 3:] = False
    valid[2] = False  # a block past its document
    got = dspark_loss(draft, policy, targets, valid, conf, gamma=gamma)
    want = transcription(draft, policy, targets, valid, conf, gamma, (0.1, 0.9, 1.0))
    for a, b in zip((got.loss, got.ce, got.l1, got.confidence, got.acceptance), want):
        torch.testing.assert_close(a.double(), torch.as_tensor(b, dtype=torch.float64), rtol=1e-5, atol=1e-7)
    gd = torch.autograd.grad(got.loss, (draft, conf))
    wd = torch.autograd.grad(want[0], (draft, conf))
    for a, b in zip(gd, wd):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-8)


def test_the_policy_gets_no_gradient_and_shapes_are_checked():
    policy = torch.randn(2, 3, 5, requires_grad=True)
    terms = dspark_loss(torch.randn(2, 3, 5, requires_grad=True), policy, torch.zeros(2, 3, dtype=torch.long),
                        torch.ones(2, 3, dtype=torch.bool), torch.randn(2, 3))
    terms.loss.backward()
    assert policy.grad is None
    with pytest.raises(ValueError, match="expected"):
        dspark_loss(torch.randn(2, 3, 5), torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.long),
                    torch.ones(2, 3, dtype=torch.bool))
