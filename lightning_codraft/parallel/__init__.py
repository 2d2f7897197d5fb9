"""Parallelism: the (dp, pp, cp) mesh, pipeline stages and the TapChannel, the strategy core, checkpoints."""

from lightning_codraft._lazy import lazy_getattr

_LAZY = {
    "ParallelDims": "lightning_codraft.parallel.parallel_dims",
    "CoDraftCore": "lightning_codraft.parallel.strategy_core",
    "shard_batch": "lightning_codraft.parallel.strategy_core",
    "split_microbatches": "lightning_codraft.parallel.strategy_core",
    "reduce_gradients": "lightning_codraft.parallel.strategy_core",
    "save_checkpoint": "lightning_codraft.parallel.checkpoint",
    "load_checkpoint": "lightning_codraft.parallel.checkpoint",
    "read_checkpoint": "lightning_codraft.parallel.checkpoint",
    "StageLayout": "lightning_codraft.parallel.pipeline",
    "PolicyStage": "lightning_codraft.parallel.pipeline",
    "TapChannel": "lightning_codraft.parallel.tap_channel",
    "PipelineCoDraft": "lightning_codraft.parallel.pp_step",
}

__getattr__ = lazy_getattr(__name__, _LAZY)  # lazy: `import lightning_codraft.parallel.parallel_dims` stays light


__all__ = list(_LAZY)
