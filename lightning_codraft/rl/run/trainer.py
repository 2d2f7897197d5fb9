"""GRPO with the co-trained draft inside ``lightning.pytorch.Trainer.fit``: ``codraft fit``'s objects in a second
front end.

:class:`GRPOModule` is a :class:`~lightning_codraft.training.module.CoDraftModule` built from a recipe exactly as
``codraft fit`` builds its module (``rl.run.build.build_parts``); its ``training_step`` is the Fabric loop's step
(:class:`~lightning_codraft.rl.step.RLStep`: refit, rollouts, rewards, group advantages, the joint update), fed by
:class:`PromptData`, a ``LightningDataModule`` whose every item is one step's prompts. Under
:class:`~lightning_codraft.pytorch.CoDraftStrategy` it runs on any (dp, pp, cp) mesh; the warm-ups (SFT, the
draft's warm start) run in :meth:`GRPOModule.setup`, on the whole modules, before the strategy prunes or shards
them; checkpoints are the strategy's (``ModelCheckpoint``, ``Trainer.fit(ckpt_path=...)``: a resumed run repeats
the uninterrupted one, every step's prompts and samples being functions of the seed and the step); the step's
metrics go to Lightning's loggers and its progress bar; the validation loop is the held-out evaluation. On the
same recipe and seeds the two front ends give the same rewards, losses and weights (tests/rl/test_trainer.py)::

    module = GRPOModule(load_config("recipes/tiny-cpu.yaml"))
    trainer = pl.Trainer(strategy=CoDraftStrategy(), max_steps=module.cfg.rl.steps, accelerator="cpu")
    trainer.fit(module, datamodule=PromptData.from_module(module))
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Callable
from typing import Optional

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, IterableDataset

from lightning_codraft.config import CoDraftConfig, ConfigError
from lightning_codraft.rl.rollout_worker import RolloutWorker
from lightning_codraft.rl.run.build import build_parts, module_arguments
from lightning_codraft.rl.run.evaluate import heldout_rewards, mean_of
from lightning_codraft.rl.run.run_dir import RunCheckpoints, reference_draft, warm_key, warm_state, write_warm
from lightning_codraft.rl.run.warm_start import warm_start
from lightning_codraft.rl.step import RLStep, draft_schedule, step_prompts
from lightning_codraft.rl.step_metrics import StepMetrics
from lightning_codraft.training.module import CoDraftModule

PROGRESS_BAR = ("reward", "acceptance_length", "draft_loss")
"""The step metrics shown in Lightning's progress bar."""


class StepBatch:
    """One RL step's prompts (a plain object: Lightning moves no text to a device and leaves it as it is)."""

    def __init__(self, step: int, samples: list):
        self.step, self.samples = int(step), list(samples)
        """``step``: the 0-based RL step; ``samples``: its ``rl.prompts_per_step`` task samples."""

    def __repr__(self) -> str:
        return f"StepBatch(step={self.step}, {len(self.samples)} prompts)"


class PromptSteps(IterableDataset):
    """The RL steps ``start .. steps - 1`` as :class:`StepBatch` items, every rank the same ones (the step itself
    gives each data-parallel replica its share), each step's prompts a function of the seed and the step."""

    def __init__(self, task, cfg: CoDraftConfig, start: int = 0):
        self.task, self.cfg, self.start = task, cfg, int(start)

    def __iter__(self):
        for step in range(self.start, self.cfg.rl.steps):
            yield StepBatch(step, step_prompts(self.task, self.cfg, step))


def _as_is(item):
    return item


class PromptData(LightningDataModule):
    """The RL prompts as a ``LightningDataModule``: one item per step (:class:`PromptSteps`), resumed at the
    Trainer's ``global_step`` (the optimizer steps taken, restored from a checkpoint), and the held-out prompts the
    validation loop evaluates.

    Args:
        task: the task (``sample(n, seed)``; held-out rows where it has them).
        cfg: the run's config (``rl.steps``, ``rl.prompts_per_step``, ``run.seed``, ``task.eval_prompts``).
    """

    def __init__(self, task, cfg: CoDraftConfig):
        super().__init__()
        self.task, self.cfg = task, cfg

    @classmethod
    def from_module(cls, module: GRPOModule) -> PromptData:
        """The prompts of ``module``'s task and config."""
        return cls(module.task, module.cfg)

    def train_dataloader(self) -> DataLoader:
        start = int(self.trainer.global_step) if self.trainer is not None else 0
        return DataLoader(PromptSteps(self.task, self.cfg, start), batch_size=None, collate_fn=_as_is)

    def val_dataloader(self) -> DataLoader:
        """One item: the held-out evaluation (``task.eval_prompts`` prompts, greedy)."""
        return DataLoader([self.cfg.task.eval_prompts], batch_size=None, collate_fn=_as_is)


class _StrategyCollectives:
    """What an :class:`RLStep` asks of its front end (``all_reduce``, ``backward``), from the Trainer's strategy."""

    def __init__(self, module: GRPOModule):
        self.module = module

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str = "mean") -> torch.Tensor:
        return self.module.trainer.strategy.reduce(tensor, reduce_op=reduce_op)

    def backward(self, loss: torch.Tensor) -> None:
        self.module.manual_backward(loss)


class GRPOModule(CoDraftModule):
    """GRPO + the co-trained draft as a LightningModule (see the module docstring).

    Args:
        cfg: the validated run config (``lightning_codraft.config.load_config``); ``parallel``'s mesh is the
            strategy's business here (``CoDraftStrategy(dp=..., pp=..., cp=...)``).
        task, rewards: Python objects instead of the recipe's ``task`` section (as ``rl.run.loop.fit``).
        print_fn: where status lines go (rank 0).
    """

    def __init__(self, cfg: CoDraftConfig, task=None, rewards=None, print_fn: Callable[[str], None] = print):
        if cfg.rl.async_level:
            raise ConfigError(
                f"rl.async_level={cfg.rl.async_level}: asynchronous RL runs in `codraft fit` (rl/run/loop.py). The "
                f"Trainer front end runs synchronous steps: its producer would have to refit after Lightning's "
                f"optimizer step of step t - 1 and before that of step t, and its in-flight rollouts go into "
                f"Lightning's checkpoint hooks; neither is wired yet (docs/multinode.md, Asynchronous RL)"
            )
        parts = build_parts(cfg, task, rewards)
        super().__init__(parts.policy, parts.draft, **module_arguments(cfg, parts))
        self.cfg, self.tokenizer, self.context = cfg, parts.tokenizer, parts.context
        self.task, self.rewards = parts.task, parts.rewards
        self._print = print_fn
        self.worker: Optional[RolloutWorker] = None
        self.extra: dict = {}
        self.last_metrics: Optional[StepMetrics] = None
        self.draft_schedule = draft_schedule(cfg)
        """The draft's update schedule across steps (saved in and restored from Lightning's checkpoints)."""

    def log_line(self, msg: str) -> None:
        if self._trainer is None or self.trainer.is_global_zero:
            self._print(msg)

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, stage: str) -> None:
        """Before the strategy prunes / shards the module: the warm-ups (not when resuming from a checkpoint: the
        checkpoint holds the trained weights) and this rank's rollout engine over the whole modules."""
        if stage != "fit" or self.worker is not None:
            return
        self.extra = self.warm_up()
        # the A/B's reference draft: the warm start (a resume restores it from the checkpoint, below) or a user's
        self.set_reference_draft(reference_draft(self.cfg, self.draft))
        strategy = self.trainer.strategy
        dims = strategy.parallel_dims
        self.worker = RolloutWorker(self.cfg, dims, strategy.root_device, eos_token_id=self.tokenizer.eos_token_id)
        self.worker.start(self)

    def warm_up(self) -> dict:
        """The warm-ups (SFT, the draft's warm start), or their result kept in ``run.out_dir/warm/weights.pt`` by an
        earlier fit of this run with the same warm-up settings (:func:`~lightning_codraft.rl.run.run_dir.warm_key`;
        ``run.resume``): Lightning restores a checkpoint only after the strategy has set the module up, so a
        resumed ``Trainer.fit`` is told apart from a new one here by that file, and never repeats the warm-ups."""
        cfg = self.cfg
        key, warm = warm_key(cfg), RunCheckpoints(cfg.run.out_dir, fabric=None).warm_file
        ours = cfg.run.resume and not cfg.run.init_from and warm.is_file() and warm_state(warm).get("key") == key
        extra = warm_start(
            cfg, self, self.tokenizer, self.task, self.context, log=self.log_line, cached=warm if ours else None
        )
        if not ours and self.trainer.is_global_zero:
            write_warm(warm, self.policy, self.draft, extra, key=key)
        return extra

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["draft_schedule"] = self.draft_schedule.state_dict()
        if self.reference_draft is not None:  # the checkpoint's non-tensor part is JSON: the tensors as bytes
            buf = io.BytesIO()
            torch.save(self.reference_draft.module.state_dict(), buf)
            checkpoint["reference_draft"] = base64.b64encode(buf.getvalue()).decode("ascii")

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.draft_schedule.load_state_dict(checkpoint.get("draft_schedule", []))
        self.set_live_position_rates(self.draft_schedule.last_rates)
        if self.reference_draft is not None and "reference_draft" in checkpoint:
            raw = io.BytesIO(base64.b64decode(checkpoint["reference_draft"]))
            self.reference_draft.module.load_state_dict(torch.load(raw, map_location="cpu", weights_only=True))

    def on_fit_start(self) -> None:
        """Refuse a Trainer whose length is not the run's: one RL step per optimizer step, ``rl.steps`` of them."""
        t, steps = self.trainer, self.cfg.rl.steps
        if t.max_steps > steps or (t.max_steps == -1 and t.max_epochs != 1):
            raise ValueError(
                f"Trainer(max_steps={t.max_steps}, max_epochs={t.max_epochs}) for a run of rl.steps="
                f"{steps}: one training step is one RL step; pass max_steps={steps} (or fewer, to stop "
                f"early and resume later)"
            )

    def training_step(self, batch: StepBatch, batch_idx: int = 0) -> torch.Tensor:
        """One RL step: ``batch`` is a :class:`StepBatch` of :class:`PromptData`."""
        step, samples = batch.step, batch.samples
        if step != self.trainer.global_step:
            raise RuntimeError(
                f"the data gave RL step {step + 1} but the Trainer has taken {self.trainer.global_step} "
                f"optimizer steps; feed GRPOModule with PromptData (it resumes at global_step)"
            )
        rl_step = RLStep(
            self.cfg,
            _StrategyCollectives(self),
            self.worker.dims,
            self.task,
            self.rewards,
            self.tokenizer,
            self.context,
            self.worker,
            self,
            self.optimizers(),
            self.lr_schedulers(),
            log=self.log_line,
            schedule=self.draft_schedule,
        )
        metrics = rl_step(step, samples)
        self.last_metrics = metrics
        row = {k: float(v) for k, v in metrics.as_dict().items() if k != "step" and not math.isnan(float(v))}
        for name, value in row.items():  # the progress bar and callbacks (e.g. ModelCheckpoint(monitor=...))
            self.log(
                name, value, on_step=True, on_epoch=False, prog_bar=name in PROGRESS_BAR, batch_size=1, logger=False
            )
        if self.trainer.is_global_zero:  # every RL step reaches the loggers, whatever Trainer(log_every_n_steps=)
            for logger in self.loggers:
                logger.log_metrics(row, step=metrics.step)
        return torch.tensor(metrics.policy_loss)

    def validation_step(self, n: int, batch_idx: int = 0) -> None:
        """The held-out evaluation: greedy mean reward on ``task.eval_prompts`` fixed prompts (logged as
        ``eval_accuracy``)."""
        if not n or self.worker is None:
            return
        value = mean_of(
            heldout_rewards(
                self.cfg,
                self.worker,
                self.tokenizer,
                self.task,
                self.rewards,
                int(self.trainer.global_step),
                int(n),
                draft_updates=self.draft_schedule.updates,
            )
        )
        self.log("eval_accuracy", value, on_step=False, on_epoch=True, prog_bar=True, batch_size=1)

    def teardown(self, stage: str) -> None:
        if self.worker is not None:
            self.worker.close()
