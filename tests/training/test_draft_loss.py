import math

import pytest
import torch
from distributed import run_distributed

from lightning_codraft.models.vocab import build_vocab_mapping
from lightning_codraft.training.draft_loss import soft_cross_entropy_sum, ttt_draft_loss


def _reference_loss(step_logits, policy_logits, doc_lengths, loss_mask, chosen, decay):
    """Loop over documents, rows and steps exactly as the definition reads."""
    V = policy_logits.shape[1]
    in_vocab = set(chosen.tolist())
    total_loss = 0.0
    per_step, correct, total = [], [], []
    for k, logits in enumerate(step_logits):
        num, cnt, hits = 0.0, 0, 0
        start = 0
        for n in doc_lengths:
            for i in range(start, start + n):
                j = i + 1 + k
                if j >= start + n or not loss_mask[j]:
                    continue
                cnt += 1  # a scored row: the accuracy and the loss divide by these
                top = int(policy_logits[j].argmax())
                if top not in in_vocab:
                    continue  # a miss (the draft cannot propose it) and no loss term (SpecForge's position mask)
                p = torch.softmax(policy_logits[j, chosen], 0)
                num = num - (p * torch.log_softmax(logits[i], 0)).sum()
                hits += int(chosen[int(logits[i].argmax())]) == top
            start += n
        per_step.append(num / max(cnt, 1))
        correct.append(hits)
        total.append(cnt)
        total_loss = total_loss + decay**k * per_step[-1]
    assert V == policy_logits.shape[1]
    return total_loss, per_step, correct, total


@pytest.mark.parametrize("K,Vd", [(1, 16), (3, 9), (4, 16)])
def test_loss_matches_dense_reference(K, Vd):
    g = torch.Generator().manual_seed(K * 31 + Vd)
    V, lengths = 16, [5, 1, 9, 4]
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    policy_logits = torch.randn(T, V, generator=g) * 3
    loss_mask = torch.rand(T, generator=g) > 0.2
    d2t, t2d = build_vocab_mapping(torch.rand(V, generator=g), Vd)
    chosen = torch.arange(Vd) + d2t
    # make some draft logits agree with the policy so accuracy is not trivially 0
    step_logits = [(torch.randn(T, Vd, generator=g) + 2 * torch.roll(policy_logits[:, chosen], -1 - k, 0))
                   .requires_grad_() for k in range(K)]

    out = ttt_draft_loss(step_logits, policy_logits, cu, loss_mask, d2t, t2d, decay=0.8)
    ref_steps = [s.detach().clone().requires_grad_() for s in step_logits]
    ref, ref_per_step, ref_correct, ref_total = _reference_loss(ref_steps, policy_logits, lengths, loss_mask,
                                                                chosen, 0.8)
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.per_step_loss, torch.stack(ref_per_step).detach(), rtol=1e-5, atol=1e-5)
    assert out.correct.tolist() == [float(c) for c in ref_correct]
    assert out.total.tolist() == [float(c) for c in ref_total]
    assert sum(ref_correct) > 0 and min(ref_total) > 0
    out.loss.backward()
    ref.backward()
    for a, b in zip(step_logits, ref_steps):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_soft_cross_entropy_sum_matches_log_softmax_value_and_gradient(dtype):
    g = torch.Generator().manual_seed(7)
    T, V = 11, 13
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype).requires_grad_()
    target = torch.softmax(torch.randn(T, V, generator=g) * 2, -1)
    weight = (torch.rand(T, generator=g) > 0.3).float() * torch.rand(T, generator=g)
    target[0] = 0.0  # a weight-0 row may hold anything finite: a filled row past a document's end
    weight[0] = 0.0
    out = soft_cross_entropy_sum(logits, target, weight)
    ref_in = logits.detach().clone().requires_grad_()
    ref = (weight * -(target * torch.log_softmax(ref_in.float(), -1)).sum(-1)).sum()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward()
    ref.backward()
    assert logits.grad.dtype == dtype
    torch.testing.assert_close(logits.grad.float(), ref_in.grad.float(), rtol=1e-5, atol=1e-6)
    assert float(logits.grad[0].abs().max()) == 0.0


def test_ties_count_the_first_maximal_token_like_argmax():
    # fp16-cached policy logits and bf16 draft logits tie often; top-1 must be the first maximal id (argmax)
    V, Vd, T = 8, 8, 6
    cu = torch.tensor([0, T], dtype=torch.int32)
    policy_logits = torch.zeros(T, V)
    policy_logits[:, [2, 5]] = 3.0                      # policy top-1 ties between 2 and 5: argmax says 2
    step = torch.zeros(T, Vd)
    step[:, [2, 5]] = 1.0                               # the draft ties the same way: counted a hit
    d2t, t2d = torch.zeros(Vd, dtype=torch.int64), torch.ones(V, dtype=torch.bool)
    out = ttt_draft_loss([step.requires_grad_()], policy_logits, cu, torch.ones(T), d2t, t2d)
    assert out.correct.tolist() == out.total.tolist() == [T - 1.0]
    step2 = torch.zeros(T, Vd)
    step2[:, [5, 7]] = 1.0                              # first maximal draft id 5 != policy's 2: no hit
    out = ttt_draft_loss([step2.requires_grad_()], policy_logits, cu, torch.ones(T), d2t, t2d)
    assert out.correct.tolist() == [0.0]


def test_perfect_draft_has_entropy_loss_and_full_accuracy():
    V, lengths, K = 8, [6, 7], 2
    T = sum(lengths)
    cu = torch.tensor([0, 6, 13], dtype=torch.int32)
    policy_logits = torch.randn(T, V)
    d2t, t2d = build_vocab_mapping(torch.ones(V), V)
    # step k row i sees the policy row i+1+k of its own document
    steps = []
    for k in range(K):
        rows = []
        for s, n in ((0, 6), (6, 7)):
            for i in range(s, s + n):
                rows.append(policy_logits[min(i + 1 + k, s + n - 1)])
        steps.append(torch.stack(rows))
    out = ttt_draft_loss(steps, policy_logits, cu, torch.ones(T), d2t, t2d)
    assert out.accuracy.tolist() == [1.0, 1.0]
    assert out.total.tolist() == [11.0, 9.0]
    entropy = [float(-(torch.softmax(policy_logits[r], 0) * torch.log_softmax(policy_logits[r], 0)).sum())
               for r in range(T)]
    first = [entropy[r] for r in list(range(1, 6)) + list(range(7, 13))]
    torch.testing.assert_close(out.per_step_loss[0], torch.tensor(sum(first) / len(first)))
    assert math.isclose(float(out.loss), float(out.per_step_loss[0] + 0.8 * out.per_step_loss[1]), rel_tol=1e-6)


def test_policy_top1_outside_draft_vocab_is_a_miss_without_a_loss_term():
    V = 6
    cu = torch.tensor([0, 4], dtype=torch.int32)
    policy_logits = torch.full((4, V), -5.0)
    policy_logits[:, 5] = 5.0  # top-1 is token 5 everywhere ...
    d2t, t2d = build_vocab_mapping(torch.tensor([9, 9, 9, 1, 1, 0]), 3)  # ... which the draft lacks
    out = ttt_draft_loss([torch.randn(4, 3, requires_grad=True)], policy_logits, cu, torch.ones(4), d2t, t2d)
    assert out.total.tolist() == [3.0] and out.correct.tolist() == [0.0] and out.in_vocab.tolist() == [0.0]
    assert float(out.loss.detach()) == 0.0
    out.loss.backward()


def test_accuracy_counts_out_of_vocabulary_rows_as_misses():
    """Two scored rows: the draft agrees on the in-vocabulary one; the other's top-1 the draft lacks. Greedy
    verification accepts 1 of 2 first proposals, so the accuracy is 0.5 (the conditional figure would say 1.0)."""
    V = 6
    cu = torch.tensor([0, 3], dtype=torch.int32)
    d2t, t2d = build_vocab_mapping(torch.tensor([9, 9, 9, 1, 1, 0]), 3)  # draft vocabulary: tokens 0, 1, 2
    policy_logits = torch.full((3, V), -5.0)
    policy_logits[1, 1] = 5.0  # row 1: top-1 token 1 (in the draft vocabulary)
    policy_logits[2, 5] = 5.0  # row 2: top-1 token 5 (outside)
    draft_logits = torch.full((3, 3), -5.0)
    draft_logits[0, 1] = 5.0  # row 0 predicts row 1's top-1: a hit
    out = ttt_draft_loss([draft_logits], policy_logits, cu, torch.ones(3), d2t, t2d)
    assert out.total.tolist() == [2.0] and out.correct.tolist() == [1.0] and out.in_vocab.tolist() == [1.0]
    assert out.accuracy.tolist() == [0.5]
    # the loss divides the in-vocabulary row's cross-entropy by both scored rows
    p = torch.softmax(policy_logits[1, :3], 0)
    want = -(p * torch.log_softmax(draft_logits[0], 0)).sum() / 2
    torch.testing.assert_close(out.loss, want)
    # given the step's denominators, the result is this batch's share
    share = ttt_draft_loss([draft_logits], policy_logits, cu, torch.ones(3), d2t, t2d, denominators=torch.tensor([8.]))
    torch.testing.assert_close(share.loss, want * 2 / 8)


def test_errors_name_the_bad_value():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    d2t, t2d = build_vocab_mapping(torch.ones(6), 3)
    pl = torch.randn(4, 6)
    with pytest.raises(ValueError, match="K >= 1"):
        ttt_draft_loss([], pl, cu, torch.ones(4), d2t, t2d)
    with pytest.raises(ValueError, match=r"step_logits\[0\] has shape \(4, 5\)"):
        ttt_draft_loss([torch.randn(4, 5)], pl, cu, torch.ones(4), d2t, t2d)
    with pytest.raises(ValueError, match="does not cover the batch of 4"):
        ttt_draft_loss([torch.randn(4, 3)], pl, torch.tensor([0, 3], dtype=torch.int32), torch.ones(4), d2t, t2d)
    with pytest.raises(ValueError, match="strictly increasing"):
        ttt_draft_loss([torch.randn(4, 3)], pl, torch.tensor([0, 3, 3, 4], dtype=torch.int32), torch.ones(4),
                       d2t, t2d)
    with pytest.raises(ValueError, match=r"t2d has shape \(5,\)"):
        ttt_draft_loss([torch.randn(4, 3)], pl, cu, torch.ones(4), d2t, t2d[:5])


def _cp_worker(rank, world_size):
    import torch.distributed as dist

    from lightning_codraft.attention import zigzag_shard

    g = torch.Generator().manual_seed(5)
    V, Vd, K = 24, 12, 3
    lengths = [8, 12, 16]  # multiples of 2 * cp; every chunk holds >= K rows for the halo shift
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    policy_logits = torch.randn(T, V, generator=g) * 3
    loss_mask = (torch.rand(T, generator=g) > 0.2).float()
    d2t, t2d = build_vocab_mapping(torch.rand(V, generator=g), Vd)
    chosen = torch.arange(Vd) + d2t
    full = [(torch.randn(T, Vd, generator=g) + 2 * torch.roll(policy_logits[:, chosen], -1 - k, 0)).requires_grad_()
            for k in range(K)]
    single = ttt_draft_loss(full, policy_logits, cu, loss_mask, d2t, t2d)
    single.loss.backward()

    shard = lambda x: zigzag_shard(x, cu, rank, world_size)  # noqa: E731
    local = [shard(s.detach()).requires_grad_() for s in full]
    out = ttt_draft_loss(local, shard(policy_logits), cu, shard(loss_mask), d2t, t2d, group=dist.group.WORLD)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), single.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.per_step_loss, single.per_step_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.correct, single.correct) and torch.equal(out.total, single.total)
    assert float(single.correct.sum()) > 0
    for a, s in zip(local, full):  # each rank's gradient is its share of the global gradient
        torch.testing.assert_close(a.grad, shard(s.grad), rtol=1e-5, atol=1e-7)
    return float(out.loss.detach())


def test_loss_under_context_parallelism_equals_single_process():
    losses = run_distributed(_cp_worker, world_size=2, timeout=120)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("kind", ["tv", "lk_alpha", "lk_lambda"])
def test_overlap_losses_value_and_gradient_equal_their_definitions(kind):
    """The closed-form backward of the acceptance losses equals autograd through the direct formula (fp64)."""
    from lightning_codraft.training.draft_loss import LK_ETA, draft_loss_sum

    torch.manual_seed(0)
    z = torch.randn(7, 11, dtype=torch.float64) * 2
    p = torch.softmax(torch.randn(7, 11, dtype=torch.float64) * 2, -1)
    w = torch.rand(7, dtype=torch.float64)
    z1 = z.clone().requires_grad_(True)
    got = draft_loss_sum(z1, p, w, kind)
    got.backward()
    z2 = z.clone().requires_grad_(True)
    q = torch.softmax(z2, -1)
    alpha = torch.minimum(p, q).sum(-1)
    if kind == "tv":
        per_row = 1 - alpha
    elif kind == "lk_alpha":
        per_row = -alpha.log()
    else:
        lam = torch.exp(-LK_ETA * alpha.detach())
        per_row = lam * -(p * torch.log_softmax(z2, -1)).sum(-1) + (1 - lam) * (1 - alpha)
    want = (w * per_row).sum()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-6, atol=1e-9)


def test_tv_loss_of_a_draft_equal_to_its_target_is_zero_and_unknown_losses_are_refused():
    from lightning_codraft.training.draft_loss import draft_loss_sum

    p = torch.softmax(torch.randn(3, 5), -1)
    assert draft_loss_sum(p.log(), p, torch.ones(3), "tv").item() == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="must be one of"):
        draft_loss_sum(p.log(), p, torch.ones(3), "kl")
