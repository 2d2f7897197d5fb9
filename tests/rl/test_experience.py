import pytest
import torch

from lightning_codraft.rl.experience import Rollout, build_rl_batch, group_advantages, sft_batch


def test_group_advantages_match_definition():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 2.0]])
    adv = group_advantages(r)
    for p in range(3):
        vals = r[p].tolist()
        mean = sum(vals) / 4
        std = (sum((v - mean) ** 2 for v in vals) / 4) ** 0.5
        for g in range(4):
            assert adv[p, g].item() == pytest.approx((vals[g] - mean) / (std + 1e-6), abs=1e-5)
    assert torch.all(adv[1] == 0)
    assert torch.allclose(group_advantages(r, scale=False), r - r.mean(1, keepdim=True))
    with pytest.raises(ValueError, match="G >= 2"):
        group_advantages(torch.ones(3, 1))


def _reference_rows(rollouts, advantages, mult, pad):
    """Dense from the definition: walk every token of every padded document."""
    rows = []
    for r, a in zip(rollouts, advantages):
        doc = r.prompt_ids + r.completion_ids
        m = -(-len(doc) // mult) * mult
        for t in range(m):
            tok = doc[t] if t < len(doc) else pad
            nxt = doc[t + 1] if t + 1 < len(doc) else pad
            gen = len(r.prompt_ids) <= t + 1 < len(doc)  # token t+1 is a completion token
            j = t + 1 - len(r.prompt_ids)
            rows.append((tok, nxt, t, t < len(doc), float(gen), r.logprobs[j] if gen else 0.0, a if gen else 0.0))
    return rows


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_batch_rows_are_next_token_aligned(cp):
    g = torch.Generator().manual_seed(cp)
    rollouts = []
    for i in range(5):
        n_p, n_c = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 12, (1,), generator=g))
        rollouts.append(Rollout(torch.randint(3, 50, (n_p,), generator=g).tolist(),
                                torch.randint(3, 50, (n_c,), generator=g).tolist(),
                                torch.rand(n_c, generator=g).neg().tolist(), group=i // 2))
    adv = [0.5, -1.0, 2.0, 0.0, -0.25]
    b = build_rl_batch(rollouts, adv, cp=cp, pad_id=0)
    ref = _reference_rows(rollouts, adv, 2 * cp, 0)
    T = len(ref)
    assert b.input_ids.shape == (T,) and b.cu_seqlens.dtype == torch.int32
    assert torch.all(b.cu_seqlens % (2 * cp) == 0)
    assert b.input_ids.tolist() == [x[0] for x in ref]
    assert b.target_ids.tolist() == [x[1] for x in ref]
    assert b.position_ids.tolist() == [x[2] for x in ref]
    assert b.valid.tolist() == [x[3] for x in ref]
    assert b.loss_mask.tolist() == [x[4] for x in ref]
    assert torch.allclose(b.old_logprobs, torch.tensor([x[5] for x in ref]))
    assert torch.allclose(b.advantages, torch.tensor([x[6] for x in ref]))
    assert torch.equal(b.draft_mask, b.valid.float())
    assert int(b.loss_mask.sum()) == sum(len(r.completion_ids) for r in rollouts)


def test_ref_logprobs_and_sft_batch():
    r = [Rollout([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], group=0)]
    b = build_rl_batch(r, [1.0], ref_logprobs=[[-1.0, -2.0, -3.0]])
    assert b.ref_logprobs.tolist() == [0.0, -1.0, -2.0, -3.0, 0.0, 0.0]  # padded to 2*cp = 2
    s = sft_batch([[5, 6]], [[7, 8, 9]], cp=2)
    assert s.target_ids.tolist() == [6, 7, 8, 9, 0, 0, 0, 0]
    assert s.loss_mask.tolist() == [0, 1, 1, 1, 0, 0, 0, 0]


def test_batch_errors():
    with pytest.raises(ValueError, match="sample 0 has an empty completion"):
        build_rl_batch([Rollout([1], [], [], 0)], [0.0])
    with pytest.raises(ValueError, match="sample 0 has an empty prompt"):
        build_rl_batch([Rollout([], [1], [0.0], 0)], [0.0])
    with pytest.raises(ValueError, match="2 logprobs for 1 tokens"):
        build_rl_batch([Rollout([1], [2], [0.0, 0.0], 0)], [0.0])
    with pytest.raises(ValueError, match="got 2 advantages for 1 prompts"):
        build_rl_batch([Rollout([1], [2], [0.0], 0)], [0.0, 1.0])


def test_equal_rewards_give_exactly_zero_advantage():
    for value in (0.7, 100.7, 1.0 / 3.0, -2.1):
        assert torch.equal(group_advantages(torch.full((2, 8), value)), torch.zeros(2, 8))


def test_std_conventions():
    r = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    centred = r - r.mean()
    pop = group_advantages(r, eps=0.0)
    sample = group_advantages(r, eps=0.0, std="sample")
    assert torch.allclose(pop, centred / r.std(unbiased=False))
    assert torch.allclose(sample, centred / r.std(unbiased=True))
    assert torch.allclose(pop, sample * (5 / 4) ** 0.5)  # ours = theirs x sqrt(G / (G - 1))
    with pytest.raises(ValueError, match="std="):
        group_advantages(r, std="bessel")
    with pytest.raises(ValueError, match="finite"):
        group_advantages(torch.tensor([[0.0, float("nan")]]))
