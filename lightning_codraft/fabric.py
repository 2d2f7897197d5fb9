"""``CoDraftStrategy`` for ``lightning.fabric``: a DDPStrategy that lays processes on a (dp, pp, cp) mesh.

Example::

    from lightning.fabric import Fabric
    from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step

    fabric = Fabric(accelerator="cpu", devices=4, strategy=CoDraftStrategy(dp=2, cp=2))
    fabric.launch()
    model = fabric.setup_module(CoDraftModule(policy, draft))
    optimizer, scheduler = model.build_optimizer()          # only this rank's parameters
    optimizer = fabric.setup_optimizers(optimizer)
    loader = fabric.setup_dataloaders(DataLoader(batches, batch_size=None))   # sampler over dp only
    for batch in loader:
        metrics = fabric_training_step(fabric, model, batch, optimizer, scheduler)

``Fabric(strategy="codraft")`` selects it too (dp inferred, pp = cp = 1) once this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import STRATEGY_REGISTRY, DDPStrategy
from torch import Tensor, nn

from lightning_codraft.batch import RLBatch
from lightning_codraft.parallel import checkpoint as ckpt
from lightning_codraft.parallel.strategy_core import CoDraftCore, CoDraftMeshMixin
from lightning_codraft.rollout.engine import RolloutEngine
from lightning_codraft.rollout.refit.sync import WeightSync, full_state_dict
from lightning_codraft.training.step import optimizer_step


class CoDraftStrategy(CoDraftMeshMixin, DDPStrategy):
    """Fabric strategy for online draft co-training on a (dp, pp, cp) mesh over gloo or NCCL.

    Args:
        dp, pp, cp, sharding: the mesh and how each stage's parameters are held, as
            :class:`~lightning_codraft.parallel.strategy_core.CoDraftCore` takes them (``dp=-1``: the world size's
            rest; ``sharding=None``: FSDP2 whenever dp * cp > 1).
        process_group_backend: ``"gloo"`` / ``"nccl"``; default from the device.
        timeout: collective timeout.
        start_method: how Fabric starts local processes (``"popen"`` re-runs the script, as torchrun).
        **kwargs: Fabric strategy plugins (accelerator, parallel_devices, cluster_environment, checkpoint_io,
            precision) and ``DistributedDataParallel`` options.
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
        precision=None,
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
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        self.core = CoDraftCore(
            dp=dp, pp=pp, cp=cp, sharding=sharding, ddp_kwargs=ddp_kwargs, checkpoint_io=checkpoint_io
        )

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Install the mesh into the module (CP groups, PP stage) and wrap it with DDP over dp x cp."""
        return self.core.prepare_module(module, precision=getattr(self.precision, "precision", None))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samplers shard over the dp dimension only: PP and CP peers read the same samples."""
        return self.core.sampler_kwargs()

    def all_reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[str, Any]] = "mean"
    ) -> Tensor:
        if not isinstance(tensor, Tensor):
            return tensor
        return self.core.all_reduce(tensor, group=group, reduce_op=reduce_op or "mean")

    def save_checkpoint(
        self,
        path,
        state: dict[str, Any],
        storage_options: Optional[Any] = None,
        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None,
    ) -> None:
        """Write a DCP checkpoint directory that loads on any mesh (``lightning_codraft.parallel.checkpoint``)."""
        if storage_options is not None or filter is not None:
            raise TypeError(
                "CoDraftStrategy.save_checkpoint supports neither storage_options nor filter; pass only the state dict"
            )
        ckpt.save_checkpoint(path, state, self.core.dims)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        """Restore modules, optimizers, schedulers and plain entries from a checkpoint of any mesh."""
        if not state:
            return ckpt.read_checkpoint(path)
        if isinstance(state, (nn.Module, torch.optim.Optimizer)):
            state = {"model" if isinstance(state, nn.Module) else "optimizer": state}
        return ckpt.load_checkpoint(path, state, self.core.dims, strict=strict)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "codraft" not in strategy_registry:
            strategy_registry.register("codraft", cls, description="online draft co-training on a (dp, pp, cp) mesh")


CoDraftStrategy.register_strategies(STRATEGY_REGISTRY)


def fabric_training_step(fabric, model, batch: RLBatch, optimizer, scheduler=None) -> dict[str, float]:
    """One optimizer step of the joint RL + draft objective under Fabric (``training.step.optimizer_step``).

    Args:
        fabric: the launched ``Fabric``.
        model: the ``CoDraftModule`` returned by ``fabric.setup_module`` / ``fabric.setup``.
        batch: this dp replica's whole RL batch (an ``RLBatch``; sharded over CP inside).
        optimizer: the Fabric-wrapped optimizer of ``CoDraftModule.build_optimizer``.
        scheduler: its LR scheduler (stepped once), or None.

    Returns:
        Global scalar metrics (loss terms, draft accuracy / acceptance length, grad norms) as floats.
    """
    metrics = optimizer_step(model, ckpt.unwrap_module(model), batch, optimizer, scheduler, fabric.backward)
    return {k: float(v) for k, v in metrics.items()}


def fabric_sync_weights(
    fabric,
    engine: RolloutEngine,
    policy: nn.Module,
    draft: Optional[nn.Module] = None,
    *,
    step: int,
    every_n_steps: int = 1,
    policy_state_fn: Optional[Callable] = None,
    draft_state_fn: Optional[Callable] = None,
    push_on_rank: Optional[Callable[[int], bool]] = None,
    log_name: str = "weight_sync/seconds",
    force: bool = False,
) -> Optional[float]:
    """Fabric helper of the one weight-sync path (``rollout.refit.sync.WeightSync``): call after
    ``optimizer.step()`` with the optimizer-step count ``step`` (>= 1), and with ``force=True`` once training is set
    up and after every ``fabric.load`` (so the engine decodes with the restored weights, not its own).

    Pushes when ``step % every_n_steps == 0`` (or ``force``) and logs the seconds with ``fabric.log``; returns them
    (None when not due). The state functions default to ``full_state_dict`` of ``policy`` / ``draft``; they run on
    every rank, the push where ``push_on_rank(fabric.global_rank)`` (default: every rank).
    """

    def states():
        return (
            (policy_state_fn or (lambda: full_state_dict(policy)))(),
            (draft_state_fn or (lambda: full_state_dict(draft)))(),
        )

    push = push_on_rank is None or push_on_rank(fabric.global_rank)
    seconds = WeightSync(engine, states, every_n_steps)(step, push=push, force=force)
    if seconds is not None:
        fabric.log(log_name, seconds, step=step)
    return seconds
