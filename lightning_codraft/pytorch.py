"""``CoDraftStrategy`` for ``lightning.pytorch.Trainer``: a DDPStrategy that lays processes on a (dp, pp, cp) mesh.

Example::

    import lightning.pytorch as pl
    from lightning_codraft import CoDraftModule
    from lightning_codraft.pytorch import CoDraftStrategy

    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=CoDraftStrategy(dp=2, cp=2), max_steps=100)
    trainer.fit(CoDraftModule(policy, draft), DataLoader(rl_batches, batch_size=None))

``Trainer(strategy="codraft")`` selects it too (dp inferred, pp = cp = 1) once this module is imported. The
Trainer's distributed sampler shards over the dp dimension only; CP peers read the same batch and the module
zigzag-shards it.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.ddp import DDPStrategy
from torch import Tensor
from torch.utils.data._utils.collate import default_collate_fn_map

from lightning_codraft.batch import RLBatch
from lightning_codraft.parallel import checkpoint as ckpt
from lightning_codraft.parallel.strategy_core import CoDraftCore, CoDraftMeshMixin
from lightning_codraft.rollout.engine import RolloutEngine
from lightning_codraft.rollout.refit.sync import WeightSync, full_state_dict, module_states


class CoDraftStrategy(CoDraftMeshMixin, DDPStrategy):
    """Trainer strategy for online draft co-training on a (dp, pp, cp) mesh over gloo or NCCL.

    Takes the arguments of the Fabric adapter, :class:`lightning_codraft.fabric.CoDraftStrategy` (documented
    there), with the Trainer's ``precision_plugin`` in place of Fabric's ``precision``.
    """

    strategy_name = "codraft"

    def __init__(
        self,
        dp: int = -1,
        pp: int = 1,
        cp: int = 1,
        *,
        sharding: Optional[str] = None,
        accelerator=None,
        parallel_devices=None,
        cluster_environment=None,
        checkpoint_io=None,
        precision_plugin=None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ):
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.core = CoDraftCore(
            dp=dp, pp=pp, cp=cp, sharding=sharding, ddp_kwargs=ddp_kwargs, checkpoint_io=checkpoint_io
        )
        # CoDraftModule optimises manually and a step's checkpoint is meant to hold the weights AFTER that step's
        # update (what a resume continues from); ModelCheckpoint warns about exactly that on every save.
        warnings.filterwarnings(
            "ignore", message="Using ModelCheckpoint with manual optimization and every_n_train_steps"
        )
        self._checkpoint_path: Optional[Path] = None
        self._optimizers_loaded = False

    def connect(self, model) -> None:
        """Refuse the Trainer flags a manually optimising ``CoDraftModule`` cannot honour, naming its own setting."""
        trainer = getattr(model, "_trainer", None)
        if trainer is not None:
            if trainer.gradient_clip_val:
                raise ValueError(
                    f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): the module clips inside its "
                    f"own step; pass CoDraftModule(grad_clip={trainer.gradient_clip_val}) (recipes: "
                    f"rl.grad_clip) and leave gradient_clip_val unset"
                )
            if trainer.accumulate_grad_batches != 1:
                raise ValueError(
                    f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}): the module "
                    f"splits each batch into microbatches itself; pass CoDraftModule(num_microbatches="
                    f"{trainer.accumulate_grad_batches}) (recipes: parallel.num_microbatches) and leave "
                    f"accumulate_grad_batches at 1"
                )
        super().connect(model)

    def configure_ddp(self) -> None:
        """Install the mesh into the CoDraftModule (CP groups, PP stage), then DDP over dp x cp."""
        precision = getattr(self.precision_plugin, "precision", None)
        self.model = self.core.prepare_module(self.model, precision=precision)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samplers shard over the dp dimension only: PP and CP peers read the same samples."""
        return self.core.sampler_kwargs()

    # ----- distributed checkpoints (torch.distributed.checkpoint): loaded after setup, into shards / stages
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load checkpoints into the set-up module (pruned to its stage, FSDP-sharded), as sharded strategies do."""
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: :meth:`save_checkpoint` writes the live module through DCP (each rank its shards)."""
        return {}

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        """Nothing: :meth:`save_checkpoint` writes the live optimizers through DCP, keyed by parameter name."""
        return {}

    def _dcp_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"state_dict": self.lightning_module}
        for i, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = getattr(optimizer, "_optimizer", optimizer)
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        """Write ``filepath`` as a DCP checkpoint directory: the module and optimizers through DCP, Lightning's
        other entries (loops, schedulers, callbacks) as JSON; call on every rank."""
        if storage_options is not None:
            raise TypeError(f"CoDraftStrategy.save_checkpoint does not support storage_options={storage_options!r}")
        plain = {k: _plain(v) for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        ckpt.save_checkpoint(filepath, {**self._dcp_state(), **plain}, self.core.dims)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Lightning's checkpoint dict of the plain entries; the tensors load in :meth:`load_model_state_dict`."""
        self._checkpoint_path = Path(checkpoint_path)
        self._optimizers_loaded = False
        return {**ckpt.read_checkpoint(checkpoint_path), "state_dict": {}, "optimizer_states": []}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the module (and, once set up, the optimizers) from the checkpoint directory, resharded."""
        state = self._dcp_state()
        plain = {k: v for k, v in state.items() if k == "state_dict"} if not self.optimizers else state
        ckpt.load_checkpoint(self._checkpoint_path, plain, self.core.dims, strict=strict)
        self._optimizers_loaded = bool(self.optimizers)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if not self._optimizers_loaded:
            ckpt.load_checkpoint(self._checkpoint_path, self._dcp_state(), self.core.dims)
            self._optimizers_loaded = True

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero and Path(filepath).is_dir():
            shutil.rmtree(filepath)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "codraft" not in strategy_registry:
            strategy_registry.register("codraft", cls, description="online draft co-training on a (dp, pp, cp) mesh")


CoDraftStrategy.register_strategies(StrategyRegistry)


def _collate_rl_batches(batch, *, collate_fn_map=None) -> RLBatch:
    return RLBatch.concat(batch)


default_collate_fn_map.setdefault(RLBatch, _collate_rl_batches)
"""A ``DataLoader`` of ``RLBatch`` items works with its default ``batch_size=1`` (one batch per step) and with a
larger one (the items packed into one batch: ``RLBatch.concat``), not only with ``batch_size=None``."""


def _plain(value: Any) -> Any:
    """Lightning's checkpoint entries as JSON data: tensors (e.g. a callback's best score) become numbers."""
    if isinstance(value, Tensor):
        return value.detach().cpu().tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class WeightSyncCallback(Callback):
    """Push ``pl_module.policy`` / ``pl_module.draft`` to ``engine`` when training starts (also after a resume from
    a checkpoint) and every N optimizer steps (the Trainer side of the one weight-sync path,
    ``rollout.refit.sync.WeightSync``).

    Args:
        engine: any :class:`~lightning_codraft.rollout.engine.RolloutEngine`.
        every_n_steps: push after every N-th optimizer step (``trainer.global_step``), N >= 1.
        policy_state_fn: ``fn(pl_module) -> state dict``; default: ``rollout.refit.sync.module_states`` (a
            ``CoDraftModule``'s ``full_state_dicts()``, which gathers pipeline stages onto the first stage).
        draft_state_fn: ``fn(pl_module) -> state dict | None``; default with ``policy_state_fn``:
            ``full_state_dict(pl_module.draft)``.
        push_on_rank: ``fn(global_rank) -> bool``; default every rank (one embedded engine per rank).
        log_name: metric logged with the seconds a sync took.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        every_n_steps: int = 1,
        policy_state_fn: Optional[Callable] = None,
        draft_state_fn: Optional[Callable] = None,
        push_on_rank: Optional[Callable[[int], bool]] = None,
        log_name: str = "weight_sync/seconds",
    ):
        self._policy_state_fn, self._draft_state_fn = policy_state_fn, draft_state_fn
        self._module = None
        self.sync = WeightSync(engine, self._states, every_n_steps)
        self.push_on_rank = push_on_rank or (lambda rank: True)
        self.log_name = log_name

    @property
    def sync_seconds(self) -> list[float]:
        return self.sync.sync_seconds

    def _states(self):
        module = self._module
        if self._policy_state_fn is None and self._draft_state_fn is None:
            return module_states(module)
        policy = (self._policy_state_fn or (lambda m: full_state_dict(m.policy)))(module)
        draft = (self._draft_state_fn or (lambda m: full_state_dict(getattr(m, "draft", None))))(module)
        return policy, draft

    def on_train_start(self, trainer, pl_module) -> None:
        """Push when training starts, after ``Trainer.fit(ckpt_path=...)`` restored the weights: the engine then
        holds the trained (restored) weights before the first rollout, not the ones it was built with."""
        self._module = pl_module
        self.sync(int(trainer.global_step), push=self.push_on_rank(trainer.global_rank), force=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._module = pl_module
        seconds = self.sync(int(trainer.global_step), push=self.push_on_rank(trainer.global_rank))
        if seconds is not None:  # due: an optimizer step happened (not only a gradient-accumulation micro step)
            pl_module.log(self.log_name, seconds, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)
