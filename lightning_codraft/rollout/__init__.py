"""Rollout engines: the engine protocol, the embedded speculative engine, vLLM with EAGLE-3, weight sync.

vLLM tests run from a separate environment (see ``tests/rollout/README.md``)::

    /work/venv-vllm/bin/python -m pytest tests/rollout -m vllm
"""

from lightning_codraft._lazy import lazy_getattr

_LAZY = {
    "AcceptanceStats": "lightning_codraft.rollout.engine",
    "AdaptiveConfig": "lightning_codraft.rollout.adaptive",
    "SpeculationController": "lightning_codraft.rollout.adaptive",
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

__getattr__ = lazy_getattr(__name__, _LAZY)  # lazy: importing the package pulls in neither Lightning nor vLLM


__all__ = list(_LAZY)
