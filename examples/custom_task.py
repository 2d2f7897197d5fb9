"""Your own prompts and rewards: a JSONL task with two weighted reward functions, trained with Trainer.fit.

    python examples/custom_task.py problems.jsonl      # rows like {"question": "what is 2 plus 3", "answer": "5"}
"""

import sys
from pathlib import Path

import lightning.pytorch as pl

from lightning_codraft.config import load_config
from lightning_codraft.pytorch import CoDraftStrategy
from lightning_codraft.rl.tasks.dataset import DatasetTask
from lightning_codraft.rl.tasks.reward_funcs import math_equivalence
from lightning_codraft.rl.tasks.rewards import RewardTerm
from lightning_codraft.rl.run.trainer import GRPOModule, PromptData


def brevity(prompts, completions, **columns):  # TRL's signature: batched, the data set's columns as keywords
    return [1.0 if len(c) <= 12 else 0.0 for c in completions]


def main(path: str, *overrides: str) -> pl.Trainer:
    recipe = Path(__file__).resolve().parent.parent / "recipes" / "tiny-cpu.yaml"  # the tiny model
    cfg = load_config(recipe, ["sft.steps=0", *overrides])  # sft.steps=0: these rows have no worked solutions
    task = DatasetTask(path, prompt_column="question", template="{question}=", heldout=4)
    rewards = [RewardTerm("correct", math_equivalence, 1.0), RewardTerm("brevity", brevity, 0.2)]
    module = GRPOModule(cfg, task=task, rewards=rewards)
    trainer = pl.Trainer(accelerator="cpu", strategy=CoDraftStrategy(), max_steps=cfg.rl.steps,
                         logger=pl.loggers.CSVLogger(cfg.run.out_dir), limit_val_batches=0, log_every_n_steps=1)
    trainer.fit(module, datamodule=PromptData.from_module(module))  # metrics: reward/correct, reward/brevity, ...
    return trainer


if __name__ == "__main__":
    main(*sys.argv[1:])
