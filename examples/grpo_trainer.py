"""GRPO with an online co-trained EAGLE-3 draft on GSM8K, inside Lightning's ``Trainer.fit``.

    python examples/grpo_trainer.py                                   # SmolLM2-135M, GSM8K excerpt, 1 process
    python examples/grpo_trainer.py --devices 2 --dp 2 rl.steps=20    # recipe overrides go last

The prompts come through Hugging Face ``datasets`` (``task.source``: a JSONL file, the bundled excerpt, or
``openai/gsm8k`` when online); the reward is math equivalence (math-verify). It is ``codraft fit`` in a second
front end: the same recipe and seeds give the same rewards, losses and weights (tests/rl/test_trainer.py), with
Lightning's loggers, ``ModelCheckpoint`` and ``--resume`` from one of its checkpoints.
"""

import argparse
from pathlib import Path

import lightning.pytorch as pl

from lightning_codraft.config import load_config
from lightning_codraft.pytorch import CoDraftStrategy
from lightning_codraft.rl.run.trainer import GRPOModule, PromptData

REPO = Path(__file__).resolve().parent.parent


def main(argv=None) -> GRPOModule:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO / "recipes" / "smollm2-135m-cpu.yaml"))
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--dp", type=int, default=-1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--resume", default=None, help="a checkpoint directory ModelCheckpoint wrote")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, e.g. rl.steps=20")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, ["task.name=gsm8k", "task.source=excerpt", "task.heldout=16",
                                    "task.rewards=[{fn: math_equivalence, name: correct}]", *args.overrides])
    module = GRPOModule(cfg)
    out = Path(cfg.run.out_dir)
    every = cfg.task.eval_every or cfg.rl.steps
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=CoDraftStrategy(dp=args.dp, pp=args.pp),
        # a logger version per launch: a resumed fit (--resume) writes version_1/ and version_0/ keeps its rows
        # (Lightning's CSVLogger starts its file over when a version is reused); every RL step is logged whatever
        # log_every_n_steps is
        max_steps=cfg.rl.steps, logger=pl.loggers.CSVLogger(out, name="", version=None),
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=1, save_last=True)],
        val_check_interval=every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        limit_val_batches=1 if cfg.task.eval_prompts else 0, enable_model_summary=False)
    trainer.fit(module, datamodule=PromptData.from_module(module), ckpt_path=args.resume)
    return module


if __name__ == "__main__":
    main()
