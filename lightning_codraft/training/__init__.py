"""Training: the online joint objective — RL and draft losses, their normalisation over the step, draft metrics, the
optimiser recipe and the CoDraftModule. Offline draft distillation (warm starts) is ``lightning_codraft.distill``."""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.training.config import CoDraftModuleConfig
    from lightning_codraft.training.draft_loss import ttt_draft_loss
    from lightning_codraft.training.metrics import DraftAcceptance
    from lightning_codraft.training.module import CoDraftModule
    from lightning_codraft.training.objective import CoDraftStepOutput
    from lightning_codraft.training.rl_loss import policy_gradient_loss
    from lightning_codraft.training.step import optimizer_step

_LAZY = {
    "CoDraftModule": "lightning_codraft.training.module",
    "CoDraftModuleConfig": "lightning_codraft.training.config",
    "CoDraftStepOutput": "lightning_codraft.training.objective",
    "optimizer_step": "lightning_codraft.training.step",
    "ttt_draft_loss": "lightning_codraft.training.draft_loss",
    "DraftAcceptance": "lightning_codraft.training.metrics",
    "policy_gradient_loss": "lightning_codraft.training.rl_loss",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
