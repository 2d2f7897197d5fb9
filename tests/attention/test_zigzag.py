import pytest
import torch
import torch.distributed as dist
from attn_reference import random_cu
from distributed import run_distributed

from lightning_codraft.attention import shift_left, shift_left_local, zigzag_shard, zigzag_unshard


def test_zigzag_layout_matches_definition():
    cu = random_cu([8, 16])
    x = torch.arange(24)
    # cp=2: 4 chunks per doc; rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2
    assert zigzag_shard(x, cu, 0, 2).tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert zigzag_shard(x, cu, 1, 2).tolist() == [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_round_trip(cp):
    cu = random_cu([2 * cp * 3, 2 * cp, 2 * cp * 5])
    x = torch.randn(int(cu[-1]), 3, 2)
    parts = [zigzag_shard(x, cu, r, cp) for r in range(cp)]
    assert all(p.shape[0] == x.shape[0] // cp for p in parts)
    assert torch.equal(zigzag_unshard(parts, cu, cp), x)


def test_zigzag_errors():
    with pytest.raises(ValueError, match="document 1 has length 6.*multiple of 2\\*cp=4.*multiple_of=4"):
        zigzag_shard(torch.zeros(14), random_cu([8, 6]), 0, 2)
    with pytest.raises(ValueError, match="rank 2 is outside a CP group of size 2"):
        zigzag_shard(torch.zeros(8), random_cu([8]), 2, 2)
    with pytest.raises(ValueError, match="got 1 shards for world_size=2"):
        zigzag_unshard([torch.zeros(4)], random_cu([8]), 2)


def _shift_worker(rank, world_size):
    out = []
    cu = random_cu([4 * world_size, 2 * world_size * 3, 2 * world_size * 2])
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 1000, (int(cu[-1]), 2), generator=g)
    group = dist.group.WORLD
    for shift in range(0, 3):
        for fill in (0, -1):
            y = shift_left(zigzag_shard(x, cu, rank, world_size), cu, shift, group=group, fill=fill)
            ref = zigzag_shard(shift_left_local(x, cu, shift, fill=fill), cu, rank, world_size)
            out.append(bool(torch.equal(y, ref)))
    # bool and float tensors, and autograd inputs do not crash
    mask = x[:, 0] % 3 == 0
    yb = shift_left(zigzag_shard(mask, cu, rank, world_size), cu, 1, group=group)
    out.append(yb.dtype == torch.bool and bool(torch.equal(
        yb, zigzag_shard(shift_left_local(mask, cu, 1, fill=False), cu, rank, world_size))))
    xf = zigzag_shard(x.float(), cu, rank, world_size).requires_grad_()
    shift_left(xf.detach(), cu, 1, group=group)
    # shifts longer than the shortest chunk (2 rows here) take several hops
    for shift in (3, 5, 4 * world_size + 1):
        y = shift_left(zigzag_shard(x, cu, rank, world_size), cu, shift, group=group, fill=-7)
        out.append(bool(torch.equal(y, zigzag_shard(shift_left_local(x, cu, shift, fill=-7), cu, rank, world_size))))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_shift_left_under_cp_equals_local(world_size):
    results = run_distributed(_shift_worker, world_size=world_size)
    for r, res in enumerate(results):
        assert all(res), f"rank {r}: {res}"
