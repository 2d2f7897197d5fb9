"""CoDraftStrategy under Trainer.fit: 2 and 4 devices train exactly like one process."""

import pytest
import torch
from codraft_fixtures import make_models, step_batches
from distributed import run_distributed
from test_fabric import HPARAMS, STEPS, WEIGHT_ATOL, reference_run

from lightning_codraft.training.module import CoDraftModule


def _trainer_worker(rank, world_size, layout):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_codraft.pytorch import CoDraftStrategy

    strategy = CoDraftStrategy(**layout)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    policy, draft = make_models()
    module = CoDraftModule(policy, draft, **HPARAMS)
    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    dp = world_size // (layout.get("cp", 1) * layout.get("pp", 1))
    flat = [b for per_rank in step_batches(STEPS, dp) for b in per_rank]
    trainer.fit(module, DataLoader(flat, batch_size=None, shuffle=False))
    return losses, {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("world_size, layout", [(2, dict(cp=2)),
                                                pytest.param(4, dict(dp=2, cp=2), marks=pytest.mark.slow)])
def test_trainer_fit_equals_single_process(world_size, layout):
    results = run_distributed(_trainer_worker, world_size=world_size, args=(layout,), timeout=600)
    dp = world_size // layout.get("cp", 1)
    # the Trainer always shuffles training data: DistributedSampler(shuffle=True, seed=0) over dp replicas
    order = torch.randperm(STEPS * dp, generator=torch.Generator().manual_seed(0)).tolist()
    ref_losses, ref_weights = reference_run(dp, order=order)
    for rank, (losses, weights) in enumerate(results):
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        for name, ref in ref_weights.items():
            torch.testing.assert_close(torch.from_numpy(weights[name]), torch.from_numpy(ref), rtol=1e-5,
                                       atol=WEIGHT_ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
