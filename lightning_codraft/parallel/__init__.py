"""Parallelism: the (dp, pp, cp) mesh, pipeline stages and the TapChannel, the strategy core, checkpoints."""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.parallel.checkpoint import load_checkpoint, read_checkpoint, save_checkpoint
    from lightning_codraft.parallel.parallel_dims import ParallelDims
    from lightning_codraft.parallel.pipeline import PolicyStage, Pruned, StageLayout, prune_unowned
    from lightning_codraft.parallel.pp_runner import PipelineRunner
    from lightning_codraft.parallel.strategy_core import CoDraftCore, reduce_gradients
    from lightning_codraft.parallel.tap_channel import TapChannel

_LAZY = {
    "ParallelDims": "lightning_codraft.parallel.parallel_dims",
    "CoDraftCore": "lightning_codraft.parallel.strategy_core",
    "reduce_gradients": "lightning_codraft.parallel.strategy_core",
    "save_checkpoint": "lightning_codraft.parallel.checkpoint",
    "load_checkpoint": "lightning_codraft.parallel.checkpoint",
    "read_checkpoint": "lightning_codraft.parallel.checkpoint",
    "StageLayout": "lightning_codraft.parallel.pipeline",
    "PolicyStage": "lightning_codraft.parallel.pipeline",
    "Pruned": "lightning_codraft.parallel.pipeline",
    "prune_unowned": "lightning_codraft.parallel.pipeline",
    "TapChannel": "lightning_codraft.parallel.tap_channel",
    "PipelineRunner": "lightning_codraft.parallel.pp_runner",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


__all__ = list(_LAZY)
