import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_codraft.parallel.parallel_dims import ParallelDims


def test_infers_dp_and_lays_out_ranks_row_major():
    dims = ParallelDims(dp=-1, pp=2, cp=2, world_size=8)
    assert dims.dp == 2
    seen = set()
    for rank in range(8):
        d, p, c = dims.coordinates_of(rank)
        assert dims.rank_of(d, p, c) == rank
        assert rank == d * 4 + p * 2 + c
        seen.add((d, p, c))
    assert len(seen) == 8


@pytest.mark.parametrize("kwargs, match", [
    (dict(pp=3, cp=1, world_size=4), "not divisible by pp\\*cp"),
    (dict(pp=2, cp=2, world_size=6), "not divisible by pp\\*cp = 2\\*2 = 4"),
    (dict(dp=3, pp=1, cp=2, world_size=4), "!= world size 4"),
    (dict(pp=0, world_size=4), "pp=0 must be a positive integer"),
])
def test_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_single_process_has_no_groups():
    dims = ParallelDims(world_size=1)
    # no mesh without a process group; an in-process Fabric run earlier in the session (tests/rl) leaves a 1-rank
    # process group behind, and then the mesh exists but every group is still None
    assert (dims.build_mesh("cpu") is None) == (not dist.is_initialized())
    assert dims.dp_group is None and dims.cp_group is None and dims.pp_group is None and dims.dp_cp_group is None
    assert dims.coordinates == (0, 0, 0) and dims.is_first_stage and dims.is_last_stage
    assert dims.replica_group is None and dims.is_replica_lead and dims.replica_ranks() == [0]


def test_replica_is_the_pp_x_cp_block_of_a_dp_rank_lead_first():
    dims = ParallelDims(dp=2, pp=2, cp=2, world_size=8)
    assert dims.replica_size == 4
    assert dims.replica_ranks(0) == [0, 1, 2, 3] and dims.replica_ranks(1) == [4, 5, 6, 7]
    leads = [r for r in range(8) if ParallelDims(dp=2, pp=2, cp=2, world_size=8, rank=r).is_replica_lead]
    assert leads == [dims.rank_of(0, 0, 0), dims.rank_of(1, 0, 0)] == [0, 4]
    with pytest.raises(ValueError, match="dp_rank 2 is outside the 2 data-parallel replicas"):
        dims.replica_ranks(2)


def _mesh_worker(rank, world_size):
    dims = ParallelDims(dp=-1, pp=2, cp=2, world_size=world_size)
    dims.build_mesh("cpu")
    out = {}
    for name in ("dp", "pp", "cp", "dp_cp", "replica"):
        g = dims.group(name)
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=g)
        out[name] = (dist.get_process_group_ranks(g), float(x))
    # the lead is rank 0 of its replica group: a broadcast from group_src=0 reaches the whole pp x cp block
    box = [rank if dims.is_replica_lead else None]
    dist.broadcast_object_list(box, group=dims.replica_group, group_src=0)
    out["lead"] = (dims.is_replica_lead, box[0])
    return dims.coordinates, out, _replica_worker(rank, world_size)


def _replica_worker(rank, world_size):
    dims = ParallelDims(dp=2, pp=2, cp=1, world_size=world_size)
    dims.build_mesh("cpu")
    box = [("from", rank) if dims.is_replica_lead else None]
    dist.broadcast_object_list(box, group=dims.replica_group, group_src=0)
    return dims.is_replica_lead, dist.get_process_group_ranks(dims.replica_group), box[0]


def test_groups_match_layout():
    # world 4 with pp=2, cp=2 -> dp=1: the dp group is trivial (None), the others real
    results = run_distributed(_mesh_worker, world_size=4, timeout=120)
    for rank, (lead, group_ranks, got) in enumerate(r[2] for r in results):  # dp=2 x pp=2: {0, 1} and {2, 3}
        assert lead == (rank in (0, 2))
        assert group_ranks == ([0, 1] if rank < 2 else [2, 3])
        assert got == ("from", 0 if rank < 2 else 2)
    dims = ParallelDims(pp=2, cp=2, world_size=4)
    for rank, (coords, out, _) in enumerate(results):
        assert coords == dims.coordinates_of(rank)
        d, p, c = coords
        assert out["cp"][0] == [dims.rank_of(d, p, cc) for cc in range(2)]
        assert out["pp"][0] == [dims.rank_of(d, pp, c) for pp in range(2)]
        assert out["dp_cp"][0] == [dims.rank_of(d, p, cc) for cc in range(2)]
        assert out["cp"][1] == sum(out["cp"][0])
        assert out["replica"][0] == [0, 1, 2, 3] and out["replica"][1] == 6.0  # dp=1: the world is one replica
        assert out["lead"] == (rank == 0, 0)
