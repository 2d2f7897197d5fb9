"""GRPO inside Trainer.fit on 2 processes (dp=2 with FSDP2, pp=2) equals `codraft fit` on the same mesh: the same
rewards, losses and whole weights after 3 steps. Both front ends run in the same ranks, one after the other, on the
same process group; they share every object but the front end (rl/run/trainer.py), so the results are equal exactly,
not within round-off."""

import math

import pytest
from distributed import run_distributed
from test_loop import micro_config
from test_trainer import COMPARED

LAYOUTS = {"dp2": ["parallel.devices=2", "parallel.dp=2"], "pp2": ["parallel.devices=2", "parallel.pp=2"]}


def _both(rank, world_size, fabric_cfg, trainer_cfg):
    import lightning.pytorch as pl

    from lightning_codraft.pytorch import CoDraftStrategy
    from lightning_codraft.rl.run.loop import CoDraftRun
    from lightning_codraft.rl.run.trainer import GRPOModule, PromptData

    run = CoDraftRun(fabric_cfg, print_fn=lambda s: None)
    rows_f = [{k: r[k] for k in COMPARED} for r in run.run().rows]
    whole_f = run.module.full_state_dicts()  # a collective: whole on the first stage
    module = GRPOModule(trainer_cfg, print_fn=lambda s: None)
    rows_t = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rows_t.append({k: getattr(pl_module.last_metrics, k) for k in COMPARED})

    p = trainer_cfg.parallel
    trainer = pl.Trainer(accelerator="cpu", devices=world_size, strategy=CoDraftStrategy(dp=p.dp, pp=p.pp, cp=p.cp),
                         max_steps=trainer_cfg.rl.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, callbacks=[Record()])
    trainer.fit(module, datamodule=PromptData.from_module(module))
    whole_t = module.full_state_dicts()
    same = None if whole_f[0] is None else all(
        (a[k] == b[k]).all().item() for a, b in zip(whole_f, whole_t) for k in a)
    run.close()
    return rows_f, rows_t, same


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_trainer_fit_equals_codraft_fit_on_two_processes(tmp_path, layout):
    extra = ["task.eval_prompts=0", "run.plots=false", "draft.adaptive=false", "run.threads=1",
             "task.reward=rewards_for_tests:digit_share_reward", *LAYOUTS[layout]]
    results = run_distributed(_both, world_size=2, timeout=900, args=(
        micro_config(tmp_path / "fabric", *extra), micro_config(tmp_path / "trainer", *extra)))
    assert len(results[0][0]) == 3  # codraft fit's rows are rank 0's (its logger); the Trainer's metrics are global
    for rank, (rows_f, rows_t, same) in enumerate(results):
        assert len(rows_t) == 3 and len(rows_f) in (0, 3), rank
        for a, b in zip(rows_f or rows_t, rows_t):
            for k in COMPARED:
                assert (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k], (rank, k, a[k], b[k])
        assert same in (None, True), f"rank {rank}: the weights differ"
    assert any(same for _, _, same in results)  # the whole weights were compared on some rank
