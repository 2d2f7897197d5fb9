"""Training: RL and draft losses, draft metrics, and the CoDraftModule."""

from lightning_codraft._lazy import lazy_getattr

_LAZY = {
    "CoDraftModule": "lightning_codraft.training.module",
    "ttt_draft_loss": "lightning_codraft.training.draft_loss",
    "DraftAcceptance": "lightning_codraft.training.metrics",
    "policy_gradient_loss": "lightning_codraft.training.rl_loss",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = list(_LAZY)
