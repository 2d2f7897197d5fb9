"""Rollout engines: the engine protocol, the embedded speculative engine, vLLM with EAGLE-3, weight sync.

vLLM tests run from a separate environment (see ``tests/rollout/README.md``)::

    /work/venv-vllm/bin/python -m pytest tests/rollout -m vllm
"""

import importlib

_LAZY = {
    "AcceptanceStats": "lightning_codraft.rollout.engine",
    "RolloutEngine": "lightning_codraft.rollout.engine",
    "RolloutError": "lightning_codraft.rollout.engine",
    "RolloutOutput": "lightning_codraft.rollout.engine",
    "SamplingParams": "lightning_codraft.rollout.sampling",
    "SpeculativeEngine": "lightning_codraft.rollout.speculative",
    "VLLMEngine": "lightning_codraft.rollout.vllm_engine",
    "WeightSyncCallback": "lightning_codraft.rollout.weight_sync",
    "fabric_sync_weights": "lightning_codraft.rollout.weight_sync",
    "full_state_dict": "lightning_codraft.rollout.weight_sync",
    "push_weights": "lightning_codraft.rollout.weight_sync",
}


def __getattr__(name):  # lazy: importing the package pulls in neither Lightning nor vLLM
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_codraft.rollout' has no attribute {name!r}")


__all__ = list(_LAZY)
