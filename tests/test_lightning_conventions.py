"""Lightning conventions that just work: Trainer.fit with the library's module, a plain DataLoader and a
ModelCheckpoint prints no warning the library causes, and shows the loss and the draft's acceptance on the
progress bar."""

import warnings

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
    assert {"loss", "draft/acceptance_length"} <= set(trainer.progress_bar_metrics)
