"""KVCache bookkeeping: ragged positions, writes at each row's own slots, advance, truncate, overflow errors."""

import pytest
import torch

from lightning_codraft.models import KVCache
from lightning_codraft.models.kv_cache import hole_filling_order


def test_write_goes_to_each_rows_next_slots():
    cache = KVCache.allocate(num_layers=2, batch_size=3, num_kv_heads=2, head_dim=4, capacity=8)
    cache.lengths = torch.tensor([0, 3, 5])
    assert torch.equal(cache.positions(2), torch.tensor([[0, 1], [3, 4], [5, 6]]))
    k = torch.randn(3, 2, 2, 4)
    v = torch.randn(3, 2, 2, 4)
    cache.write(1, k, v)
    for b, start in enumerate([0, 3, 5]):
        assert torch.equal(cache.k[1][b, :, start:start + 2], k[b].transpose(0, 1))
        assert torch.equal(cache.v[1][b, :, start:start + 2], v[b].transpose(0, 1))
    assert cache.k[0].abs().sum() == 0                      # other layers untouched
    untouched = torch.ones(3, 8, dtype=torch.bool)
    for b, start in enumerate([0, 3, 5]):
        untouched[b, start:start + 2] = False
    assert (cache.k[1].permute(0, 2, 1, 3)[untouched] == 0).all()


def test_advance_ragged_and_truncate():
    cache = KVCache.allocate(1, 3, 1, 2, capacity=10)
    cache.advance(torch.tensor([4, 1, 0]))
    cache.advance(2)
    assert cache.lengths.tolist() == [6, 3, 2]
    cache.truncate(torch.tensor([5, 3, 0]))
    assert cache.lengths.tolist() == [5, 3, 0]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0, 0]
    assert (cache.num_layers, cache.batch_size, cache.capacity) == (1, 3, 10)


def test_errors():
    cache = KVCache.allocate(1, 2, 1, 2, capacity=4)
    cache.advance(3)
    with pytest.raises(ValueError, match="needs 5 slots but capacity is 4"):
        cache.positions(2)
    with pytest.raises(ValueError, match=r"truncate: lengths \[4, 1\]"):
        cache.truncate(torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="exceed capacity 4"):
        cache.advance(torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="must be >= 0"):
        cache.advance(-1)
    with pytest.raises(ValueError, match="expected \\(B, S, Hkv, D\\)"):
        cache.write(0, torch.zeros(2, 1, 3, 2), torch.zeros(2, 1, 3, 2))
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        KVCache.allocate(1, 1, 1, 2, capacity=0)


def test_select_rows_copies_or_views():
    cache = KVCache.allocate(num_layers=2, batch_size=3, num_kv_heads=1, head_dim=2, capacity=4)
    cache.k[0].copy_(torch.arange(24.0).view(3, 1, 4, 2))
    cache.lengths = torch.tensor([1, 2, 3])
    picked = cache.select(torch.tensor([2, 0]))
    assert picked.lengths.tolist() == [3, 1] and torch.equal(picked.k[0], cache.k[0][[2, 0]])
    picked.k[0].zero_()                                     # a copy: the cache keeps its keys
    assert cache.k[0].abs().sum() > 0
    first = cache.select(2)
    assert first.batch_size == 2 and first.lengths.tolist() == [1, 2]
    first.k[1].fill_(7.0)                                   # views: writes land in the cache's first rows
    assert (cache.k[1][:2] == 7).all() and (cache.k[1][2] == 0).all()


@pytest.mark.parametrize("live", [[1, 0, 1, 0, 1, 1], [0, 0, 1], [1, 1, 1], [0, 1, 0, 1, 1, 0, 0, 1], [1, 0]])
def test_compact_in_place_equals_select_and_moves_only_the_hole_fillers(live):
    live = [bool(x) for x in live]
    cache = KVCache.allocate(num_layers=2, batch_size=len(live), num_kv_heads=2, head_dim=3, capacity=5)
    for t in (*cache.k, *cache.v):
        t.copy_(torch.randn_like(t))
    cache.lengths = torch.arange(len(live)) + 1
    rows = hole_filling_order(live)
    n = sum(live)
    assert sorted(rows) == [i for i, x in enumerate(live) if x]           # exactly the live rows
    assert all(r == i for i, r in enumerate(rows) if live[i])              # live rows in the first n slots stay put
    expected = cache.select(torch.tensor(rows))
    storage = [t.data_ptr() for t in cache.k]
    out = cache.compact(rows)
    assert [t.data_ptr() for t in out.k] == storage                        # the same storage, no new tensors
    assert out.batch_size == n and torch.equal(out.lengths, expected.lengths)
    for a, b in zip((*out.k, *out.v), (*expected.k, *expected.v)):
        assert torch.equal(a, b)


def test_compact_refuses_an_order_that_would_overwrite_a_row_before_reading_it():
    cache = KVCache.allocate(1, 4, 1, 2, capacity=3)
    with pytest.raises(ValueError, match="hole_filling_order"):
        cache.compact([1, 0])                     # row 0 moved to slot 1 after slot 0 took row 1
    with pytest.raises(ValueError, match="distinct"):
        cache.compact([0, 0])
    with pytest.raises(ValueError, match="distinct"):
        cache.compact([0, 7])
    assert hole_filling_order([True, False, True, False, True, True]) == [0, 5, 2, 4]


def test_reserve_grows_in_blocks_and_keeps_every_slot():
    cache = KVCache.allocate(2, 3, 2, 4, 5)
    for t in cache.k + cache.v:
        t.normal_()
    before = [t.clone() for t in cache.k + cache.v]
    cache.lengths = torch.tensor([5, 2, 4])
    cache.reserve(5)                                               # fits: nothing changes
    assert cache.capacity == 5 and all(a is b or torch.equal(a, b) for a, b in zip(cache.k + cache.v, before))
    cache.reserve(6, block=4)
    assert cache.capacity == 8 and cache.lengths.tolist() == [5, 2, 4]
    for t, old in zip(cache.k + cache.v, before):
        assert t.shape == (3, 2, 8, 4) and t.is_contiguous()
        assert torch.equal(t[:, :, :5], old) and not t[:, :, 5:].any()
    cache.reserve(9, block=32)
    assert cache.capacity == 32
    with pytest.raises(ValueError, match="must be >= 1"):
        cache.reserve(0)
