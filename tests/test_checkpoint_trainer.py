"""Trainer checkpoints are DCP directories that load on any mesh: fit 2 steps on (pp=2, cp=2) with FSDP2 over the cp
ranks, resume with ckpt_path on cp=2."""

import pytest
import torch
from codraft_fixtures import full_state, make_batch, make_models
from distributed import run_distributed
from test_fabric import HPARAMS, WEIGHT_ATOL

from lightning_codraft.training.module import CoDraftModule

OVERRIDES = dict(num_microbatches=2)
BATCH_SEED = 42  # one batch per epoch, so every step is a whole epoch and resuming never lands mid-epoch


def _trainer_run(rank, world_size, mesh, path, steps, resume):
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_codraft.pytorch import CoDraftStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=CoDraftStrategy(**mesh), max_steps=steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    module = CoDraftModule(*make_models(seed=1 if resume else 0), **{**HPARAMS, **OVERRIDES})
    losses = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer.callbacks.append(Record())
    trainer.fit(module, DataLoader([make_batch(BATCH_SEED, num_docs=4)], batch_size=None),
                ckpt_path=path if resume else None)
    if not resume:
        trainer.save_checkpoint(path)
    return losses, full_state(module), trainer.global_step


def _reference(steps):
    module = CoDraftModule(*make_models(), **{**HPARAMS, **OVERRIDES})
    optimizer, scheduler = module.build_optimizer()
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        out = module(make_batch(BATCH_SEED, num_docs=4))
        out.loss.backward()
        module.after_backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(out.metrics["loss"]))
    return losses, {k: v.detach().numpy() for k, v in module.state_dict().items()}


@pytest.mark.slow
def test_trainer_checkpoint_pp2_cp2_resumes_on_cp2(tmp_path):
    path = str(tmp_path / "step2.ckpt")
    ref_losses, ref_weights = _reference(3)
    first = run_distributed(_trainer_run, world_size=4, args=(dict(pp=2, cp=2), path, 2, False), timeout=600)
    for losses, _, step in first:
        assert step == 2 and losses == pytest.approx(ref_losses[:2], rel=1e-5)
    second = run_distributed(_trainer_run, world_size=2, args=(dict(cp=2), path, 3, True), timeout=600)
    for rank, (losses, weights, step) in enumerate(second):
        assert step == 3 and losses == pytest.approx(ref_losses[2:], rel=1e-5), f"rank {rank}"
        for name, value in weights.items():
            torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(ref_weights[name]), rtol=1e-5,
                                       atol=WEIGHT_ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
