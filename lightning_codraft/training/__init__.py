"""Training: RL and draft losses, draft metrics, and the CoDraftModule."""

import importlib

_LAZY = {
    "CoDraftModule": "lightning_codraft.training.module",
    "ttt_draft_loss": "lightning_codraft.training.draft_loss",
    "DraftAcceptance": "lightning_codraft.training.metrics",
    "policy_gradient_loss": "lightning_codraft.training.rl_loss",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_codraft.training' has no attribute {name!r}")


__all__ = list(_LAZY)
