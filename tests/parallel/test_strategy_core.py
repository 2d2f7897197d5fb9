import pytest
from torch import nn

from lightning_codraft.parallel.strategy_core import CoDraftCore, check_codraft_module


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
