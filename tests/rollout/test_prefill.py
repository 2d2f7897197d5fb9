"""Grouped prefill (rollout/embedded/prefill.py): the same logits, taps and cache as one padded forward over the batch."""

import pytest
import torch
from rollout_helpers import make_policy, random_prompts

from lightning_codraft.models.decode import policy_decoder
from lightning_codraft.rollout.embedded.prefill import prefill, prefill_groups


def test_groups_cover_the_rows_within_the_padded_budget():
    lengths = [2, 3, 3, 5, 9, 9, 20]
    groups = prefill_groups(lengths, group_tokens=12)
    assert groups == [(0, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert [r for a, b in groups for r in range(a, b)] == list(range(len(lengths)))
    assert all((b - a) * lengths[b - 1] <= 12 or b - a == 1 for a, b in groups)
    assert prefill_groups(lengths, group_tokens=10**6) == [(0, 7)]
    assert prefill_groups([], 8) == []
    with pytest.raises(ValueError, match="ascending"):
        prefill_groups([3, 2], 8)


def test_groups_close_before_rows_that_would_make_them_mostly_padding():
    lengths = [62, 70, 79, 82, 85, 85, 86, 91, 97, 98, 100, 108, 110, 118, 145, 168]   # GSM8K long-tail prompts
    groups = prefill_groups(lengths, group_tokens=4096)
    assert groups == [(0, 8), (8, 14), (14, 16)]
    padded = sum((b - a) * lengths[b - 1] for a, b in groups)
    assert padded == 1772 < 16 * 168                                   # one group: 2688 positions
    for a, b in groups:                                                # each group within its padding limit
        assert (b - a) * lengths[b - 1] - sum(lengths[a:b]) <= 0.125 * (b - a) * lengths[b - 1]
    assert prefill_groups(lengths, 4096, max_padding=0.99) == [(0, 16)]
    assert prefill_groups([1, 100], 4096) == [(0, 2)]                 # a group under min_group_tokens never closes
    with pytest.raises(ValueError, match="max_padding"):
        prefill_groups(lengths, 4096, max_padding=1.0)


@pytest.mark.parametrize("taps", [None, (0, 1, 2)])
def test_grouped_prefill_equals_one_padded_forward(taps):
    torch.manual_seed(0)
    policy = make_policy()
    prompts = sorted(random_prompts(7, policy.config.vocab_size, lo=1, hi=15, seed=3), key=len)
    lengths = [len(p) for p in prompts]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    with torch.inference_mode():
        pdec = policy_decoder(policy, 32)
        ref_cache, cache = pdec.allocate_cache(len(prompts), 32), pdec.allocate_cache(len(prompts), 32)
        ref_logits, ref_taps = pdec.forward(ids, ref_cache, taps, logit_rows=torch.tensor(lengths) - 1)
        logits, got_taps = prefill(pdec, cache, ids, lengths, taps, group_tokens=20)
    assert len(prefill_groups(lengths, 20)) > 2                        # several groups really ran
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    for layer in range(len(cache.k)):                                  # every prompt slot written as in one forward
        for i, n in enumerate(lengths):
            torch.testing.assert_close(cache.k[layer][i, :, :n], ref_cache.k[layer][i, :, :n], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.v[layer][i, :, :n], ref_cache.v[layer][i, :, :n], rtol=1e-5, atol=1e-5)
    if taps is None:
        assert got_taps is None
    else:
        for got, ref in zip(got_taps, ref_taps):
            for i, n in enumerate(lengths):
                torch.testing.assert_close(got[i, :n], ref[i, :n], rtol=1e-4, atol=1e-4)  # other matmul shapes
