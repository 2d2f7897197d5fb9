"""GRPO inside Trainer.fit (rl/run/trainer.py) is `codraft fit` in a second front end: on the same recipe and seeds the
same rewards, losses and weights; resuming from a ModelCheckpoint after a kill repeats the uninterrupted run."""

import math

import pytest
import torch
from test_loop import micro_config

FAST = ["task.eval_prompts=0", "run.plots=false", "draft.adaptive=false"]
COMPARED = ("reward", "reward_std", "accuracy", "completion_tokens", "acceptance_length", "draft_loss", "draft_acc0",
            "policy_loss", "clip_frac", "kl", "greedy_agreement", "policy_version", "draft_version")


def _fabric(cfg):
    from lightning_codraft.rl.run.loop import CoDraftRun

    run = CoDraftRun(cfg, print_fn=lambda s: None)
    try:
        res = run.run()
        return [{k: r[k] for k in COMPARED} for r in res.rows], _weights(run.module)
    finally:
        run.close()


def _weights(module):
    return {f"{k}.{n}": v.detach().clone() for k in ("policy", "draft")
            for n, v in getattr(module, k).state_dict().items()}


def _trainer(cfg, steps=None, ckpt_dir=None, ckpt_path=None):
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy
    from lightning_codraft.rl.run.trainer import GRPOModule, PromptData

    module = GRPOModule(cfg, print_fn=lambda s: None)
    rows = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rows.append({k: getattr(pl_module.last_metrics, k) for k in COMPARED})

    callbacks = [Record()]
    if ckpt_dir is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=steps or cfg.rl.steps,
                         logger=False, enable_checkpointing=ckpt_dir is not None, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks)
    trainer.fit(module, datamodule=PromptData.from_module(module), ckpt_path=ckpt_path)
    return rows, _weights(module)


def _same(a, b):
    return all((math.isnan(x[k]) and math.isnan(y[k])) or x[k] == y[k] for x, y in zip(a, b) for k in COMPARED) \
        and len(a) == len(b)


def test_trainer_fit_equals_codraft_fit_on_one_process(tmp_path):
    rows_f, w_f = _fabric(micro_config(tmp_path / "fabric", *FAST))
    rows_t, w_t = _trainer(micro_config(tmp_path / "trainer", *FAST))
    assert len(rows_f) == 3 and _same(rows_f, rows_t), (rows_f, rows_t)
    assert w_f.keys() == w_t.keys() and all(torch.equal(w_f[k], w_t[k]) for k in w_f)


def test_resume_from_a_model_checkpoint_repeats_the_uninterrupted_run(tmp_path):
    cfg = micro_config(tmp_path / "run", *FAST)
    full, w_full = _trainer(cfg)
    first, _ = _trainer(cfg, steps=2, ckpt_dir=tmp_path / "ckpt")  # killed after step 2
    ckpt = sorted((tmp_path / "ckpt").iterdir())[-1]
    rest, w_rest = _trainer(cfg, ckpt_path=str(ckpt))
    assert _same(first + rest, full), (first + rest, full)
    assert all(torch.equal(w_full[k], w_rest[k]) for k in w_full)


def test_a_trainer_longer_than_the_run_is_refused(tmp_path):
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy
    from lightning_codraft.rl.run.trainer import GRPOModule, PromptData

    cfg = micro_config(tmp_path / "run", *FAST, "sft.steps=0", "draft.warm_start.steps=0")
    module = GRPOModule(cfg, print_fn=lambda s: None)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="pass max_steps=3"):
        trainer.fit(module, datamodule=PromptData.from_module(module))


def test_every_rl_step_reaches_the_logger_whatever_log_every_n_steps(tmp_path):
    """The README's Trainer leaves Lightning's default log_every_n_steps=50; a 3-step run still logs 3 rows."""
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy
    from lightning_codraft.rl.reports.run_log import read_metrics
    from lightning_codraft.rl.run.trainer import GRPOModule, PromptData

    cfg = micro_config(tmp_path / "run", *FAST)
    module = GRPOModule(cfg, print_fn=lambda s: None)
    logger = pl.loggers.CSVLogger(tmp_path / "logs", name="", version="")
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), max_steps=cfg.rl.steps,
                         logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    assert trainer.log_every_n_steps == 50
    trainer.fit(module, datamodule=PromptData.from_module(module))
    rows = read_metrics(tmp_path / "logs" / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(0.0 <= r["reward"] <= 1.0 and math.isfinite(r["policy_loss"]) for r in rows)


def test_s1_a_batched_reward_that_raises_stops_trainer_fit_naming_the_exception(tmp_path):
    from lightning_codraft.rl.tasks.rewards import RewardError

    cfg = micro_config(tmp_path / "run", *FAST, "task.rewards=[{fn: 'rewards_for_tests:batch_only_reward'}]",
                       "sft.steps=0", "draft.warm_start.steps=0")
    with pytest.raises(RewardError, match=r"batch_only_reward.*the batched call on 4 samples raised RuntimeError: "
                                          r"rate limit: 4 requests in one call"):
        _trainer(cfg)


def test_a_resumed_trainer_fit_skips_the_warm_ups(tmp_path, monkeypatch):
    import lightning_codraft.rl.run.warm_start as warm_start_module

    cfg = micro_config(tmp_path / "run", *FAST)
    _trainer(cfg, steps=1, ckpt_dir=tmp_path / "ckpt")
    ckpt = sorted((tmp_path / "ckpt").iterdir())[-1]
    calls = []  # the warm-ups themselves (SFT, the draft's warm start): none on a resume
    monkeypatch.setattr(warm_start_module, "run_warm_starts", lambda *a, **k: calls.append(1) or {})
    rows, _ = _trainer(cfg, ckpt_path=str(ckpt))
    assert len(rows) == 2 and calls == []


def test_grpo_module_takes_a_datasets_dataset(tmp_path):
    import datasets

    from lightning_codraft.rl.run.trainer import GRPOModule

    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    cfg = micro_config(tmp_path / "run", *FAST, "task.name=dataset", "task.source=given", "task.prompt_column=question",
                       "task.heldout=5", "sft.steps=0", "task.rewards=[{fn: exact_answer}]")
    module = GRPOModule(cfg, task=datasets.Dataset.from_list(rows), print_fn=lambda s: None)
    assert module.task.num_train == 20 and module.task.samples[3].prompt == "0+3=" and \
        module.task.samples[3].answer == "3"
    assert module.task.heldout_samples(5)[0].prompt == "4+0="
