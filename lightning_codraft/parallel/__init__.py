"""Parallelism: the (dp, pp, cp) mesh, pipeline stages and the TapChannel, the strategy core, checkpoints."""

import importlib

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


def __getattr__(name):  # lazy: `import lightning_codraft.parallel.parallel_dims` stays light
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_codraft.parallel' has no attribute {name!r}")


__all__ = list(_LAZY)
