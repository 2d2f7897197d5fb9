"""Lightning conventions that just work: Trainer.fit with the library's module, a plain DataLoader and a
ModelCheckpoint prints no warning the library causes, and shows the loss and the draft's acceptance on the
progress bar."""

import re
import warnings

import pytest
from codraft_fixtures import make_models, step_batches
from torch.utils.data import DataLoader

from lightning_codraft.training.module import CoDraftModule


def test_trainer_fit_warns_about_nothing_the_library_causes_and_fills_the_progress_bar(tmp_path):
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy

    policy, draft = make_models()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=2, logger=False,
                         default_root_dir=tmp_path, enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1)])
    with warnings.catch_warnings(record=True) as caught:  # the filters in place: what a user sees
        trainer.fit(CoDraftModule(policy, draft), DataLoader([b for per in step_batches(2, 1) for b in per],
                                                           batch_size=None))
    ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
            if "lightning_codraft" in w.filename or any(s in str(w.message) for s in (
                "logger=True", "manual optimization", "overwrit", "CoDraft"))]
    assert not ours, ours
    assert {"loss", "draft/top1_acceptance"} <= set(trainer.progress_bar_metrics)


@pytest.mark.parametrize("flag, says", [(dict(gradient_clip_val=1.0), "CoDraftModule(grad_clip=1.0)"),
                                        (dict(accumulate_grad_batches=4), "CoDraftModule(num_microbatches=4)")])
def test_trainer_flags_the_module_cannot_honour_name_its_own_setting(tmp_path, flag, says):
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy

    policy, draft = make_models()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, default_root_dir=tmp_path, **flag)
    with pytest.raises(ValueError, match=re.escape(says)):
        trainer.fit(CoDraftModule(policy, draft), DataLoader(step_batches(1, 1)[0], batch_size=None))


def test_a_dataloader_of_rl_batches_collates_with_its_default_batch_size(tmp_path):
    """DataLoader(batches) with batch_size=1 (the default) trains like batch_size=None; batch_size=2 packs two."""
    import lightning.pytorch as pl
    import torch

    from lightning_codraft.batch import RLBatch
    from lightning_codraft.pytorch import CoDraftStrategy

    batches = [b for per in step_batches(2, 1) for b in per]
    weights = []
    for loader in (DataLoader(batches, batch_size=None), DataLoader(batches)):
        policy, draft = make_models()
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=2, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
        trainer.fit(CoDraftModule(policy, draft), loader)
        weights.append({k: v.clone() for k, v in policy.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    packed = next(iter(DataLoader(batches, batch_size=2)))
    assert isinstance(packed, RLBatch) and packed.num_docs == batches[0].num_docs + batches[1].num_docs
    assert torch.equal(packed.input_ids, torch.cat([batches[0].input_ids, batches[1].input_ids]))


def test_a_callback_monitoring_a_renamed_metric_is_refused_naming_the_new_name(tmp_path):
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy

    policy, draft = make_models()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=1, logger=False,
                         default_root_dir=tmp_path, enable_model_summary=False,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="draft/acceptance_length",
                                                                 mode="max")])
    with pytest.raises(KeyError, match="renamed 'draft/top1_acceptance'"):
        trainer.fit(CoDraftModule(policy, draft), DataLoader(step_batches(1, 1)[0], batch_size=None))
