"""CoDraftStrategy under Trainer.fit: 2 and 4 devices train exactly like one process."""

import pytest
import torch
from codraft_fixtures import full_state, make_models, step_batches
from distributed import run_distributed
from test_fabric import GRAD_RTOL, HPARAMS, LATER_GRAD_RTOL, STEPS, WEIGHT_ATOL, _grads, reference_run

from lightning_codraft.training.module import CoDraftModule


def _trainer_worker(rank, world_size, layout, overrides):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_codraft.pytorch import CoDraftStrategy

    strategy = CoDraftStrategy(**layout)
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    policy, draft = make_models()
    module = CoDraftModule(policy, draft, **{**HPARAMS, **overrides})
    losses, grads = [], []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(_grads(pl_module))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    dp = world_size // (layout.get("cp", 1) * layout.get("pp", 1))
    flat = [b for per_rank in step_batches(STEPS, dp) for b in per_rank]
    trainer.fit(module, DataLoader(flat, batch_size=None, shuffle=False))
    sharded = sum(hasattr(p, "full_tensor") for p in module.parameters())
    return losses, full_state(module), grads, sharded


@pytest.mark.parametrize("world_size, layout", [(2, dict(cp=2)), (4, dict(dp=2, pp=2)),
                                                pytest.param(2, dict(cp=2, sharding="ddp"), marks=pytest.mark.slow),
                                                pytest.param(4, dict(dp=2, cp=2), marks=pytest.mark.slow)])
def test_trainer_fit_equals_single_process(world_size, layout):
    """FSDP2 (the default) and DDP under Trainer.fit: losses, gradients (directly, every step) and weights."""
    overrides = dict(pp_schedule="gpipe") if layout.get("pp", 1) > 1 else {}
    results = run_distributed(_trainer_worker, world_size=world_size, args=(layout, overrides), timeout=600)
    dp = world_size // (layout.get("cp", 1) * layout.get("pp", 1))
    # the Trainer always shuffles training data: DistributedSampler(shuffle=True, seed=0) over dp replicas
    order = torch.randperm(STEPS * dp, generator=torch.Generator().manual_seed(0)).tolist()
    ref_losses, ref_weights, ref_grads = reference_run(dp, order=order, with_grads=True, **overrides)
    for rank, (losses, weights, grads, sharded) in enumerate(results):
        assert (sharded > 0) == (layout.get("sharding", "fsdp") == "fsdp"), rank
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        assert len(grads) == STEPS
        for step, (got, want) in enumerate(zip(grads, ref_grads)):
            for name, g in got.items():
                err = float(abs(g - want[name]).max() / max(abs(want[name]).max(), 1e-12))
                tol = GRAD_RTOL if step == 0 else LATER_GRAD_RTOL
                assert err <= tol, f"rank {rank} step {step} grad {name}: relative error {err:.2e}"
        for name, value in weights.items():  # under PP: this rank's stage
            torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(ref_weights[name]), rtol=1e-5,
                                       atol=WEIGHT_ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
        if layout.get("pp", 1) == 1:
            assert set(weights) == set(ref_weights)
