"""Rollout engines: the engine protocol, the embedded speculative engine, vLLM with EAGLE-3, weight sync.

vLLM tests run from a separate environment (see ``tests/rollout/README.md``)::

    /work/venv-vllm/bin/python -m pytest tests/rollout -m vllm
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.rollout.embedded.adaptive import AdaptiveConfig, SpeculationController
    from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine
    from lightning_codraft.rollout.engine import AcceptanceStats, RolloutEngine, RolloutError, RolloutOutput
    from lightning_codraft.rollout.refit.sync import WeightSync, full_state_dict, module_states
    from lightning_codraft.rollout.sampling.rules import SamplingParams
    from lightning_codraft.rollout.vllm.engine import VLLMEngine

_LAZY = {
    "AcceptanceStats": "lightning_codraft.rollout.engine",
    "AdaptiveConfig": "lightning_codraft.rollout.embedded.adaptive",
    "SpeculationController": "lightning_codraft.rollout.embedded.adaptive",
    "RolloutEngine": "lightning_codraft.rollout.engine",
    "RolloutError": "lightning_codraft.rollout.engine",
    "RolloutOutput": "lightning_codraft.rollout.engine",
    "SamplingParams": "lightning_codraft.rollout.sampling.rules",
    "SpeculativeEngine": "lightning_codraft.rollout.embedded.speculative",
    "VLLMEngine": "lightning_codraft.rollout.vllm.engine",
    "WeightSync": "lightning_codraft.rollout.refit.sync",
    "full_state_dict": "lightning_codraft.rollout.refit.sync",
    "module_states": "lightning_codraft.rollout.refit.sync",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


__all__ = list(_LAZY)
