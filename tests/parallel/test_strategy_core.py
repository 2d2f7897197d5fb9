import pytest
import torch
from torch import nn

from lightning_codraft.parallel.parallel_dims import ParallelDims
from lightning_codraft.parallel.strategy_core import (CoDraftCore, check_codraft_module, is_sharded,
                                                      merge_microbatch_stats, shard_batch, split_microbatches)


def _batch(lengths):
    T = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.arange(T) + 100, "loss_mask": torch.rand(T), "cu_seqlens": cu, "note": "x"}


def test_shard_batch_is_the_zigzag_definition():
    batch = _batch([8, 16])
    cp = 2
    for r in range(cp):
        dims = ParallelDims(cp=cp, world_size=cp, rank=r)
        out = shard_batch(batch, dims)
        want = []
        for start, n in ((0, 8), (8, 16)):
            c = n // (2 * cp)
            for chunk in (r, 2 * cp - 1 - r):
                want.extend(range(start + chunk * c, start + (chunk + 1) * c))
        assert out["input_ids"].tolist() == [100 + i for i in want]
        assert torch.equal(out["loss_mask"], batch["loss_mask"][want])
        assert out["cu_seqlens"] is batch["cu_seqlens"] and out["note"] == "x"
        assert is_sharded(out, dims) and not is_sharded(batch, dims)


def test_shard_batch_errors():
    dims = ParallelDims(cp=2, world_size=2, rank=0)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        shard_batch(_batch([6, 8]), dims)
    bad = _batch([8])
    bad["advantages"] = torch.zeros(5)
    with pytest.raises(ValueError, match="batch\\['advantages'\\] has shape \\(5,\\)"):
        shard_batch(bad, dims)
    with pytest.raises(KeyError, match="cu_seqlens"):
        shard_batch({"input_ids": torch.zeros(4)}, dims)


def test_split_microbatches_deals_whole_documents():
    batch = _batch([4, 8, 4, 12, 4])
    mbs = split_microbatches(batch, 2)
    assert [mb["cu_seqlens"].tolist() for mb in mbs] == [[0, 4, 12, 16], [0, 12, 16]]
    assert torch.equal(torch.cat([mb["input_ids"] for mb in mbs]), batch["input_ids"])
    assert mbs[0]["cu_seqlens"].dtype == torch.int32
    with pytest.raises(ValueError, match="5 documents into num_microbatches=6"):
        split_microbatches(batch, 6)


def test_module_must_hold_policy_and_draft():
    class OnlyPolicy(nn.Module):
        def __init__(self):
            super().__init__()
            self.policy = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="OnlyPolicy lacks draft"):
        check_codraft_module(OnlyPolicy())
    with pytest.raises(TypeError, match="Linear lacks policy and draft"):
        check_codraft_module(nn.Linear(2, 2))


def test_core_validates_sizes():
    with pytest.raises(ValueError, match="world size 3 is not divisible by pp\\*cp = 2\\*1 = 2"):
        CoDraftCore(pp=2).setup_mesh(3, "cpu")
    with pytest.raises(ValueError, match="cp=0 must be a positive integer"):
        CoDraftCore(cp=0)
    with pytest.raises(RuntimeError, match="mesh is not built yet"):
        CoDraftCore().sampler_kwargs()


def test_registered_under_codraft_in_both_front_ends():
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy as FabricStrategy
    from lightning_codraft.pytorch import CoDraftStrategy as TrainerStrategy

    assert isinstance(Fabric(accelerator="cpu", devices=1, strategy="codraft").strategy, FabricStrategy)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="codraft", logger=False)
    assert isinstance(trainer.strategy, TrainerStrategy)


def test_merge_microbatch_stats_means_losses_and_sums_token_counts():
    merged = merge_microbatch_stats([{"pg_loss": 1.0, "num_tokens": 3.0}, {"pg_loss": 4.0, "num_tokens": 5.0}])
    assert merged == {"pg_loss": 2.5, "num_tokens": 8.0}
    assert merge_microbatch_stats([]) == {}
