"""lightning_codraft: online EAGLE-3 draft co-training during RL post-training, on Lightning / Fabric."""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

__version__ = "0.1.0"

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.batch import RLBatch
    from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
    from lightning_codraft.rollout import SpeculativeEngine
    from lightning_codraft.training.config import CoDraftModuleConfig
    from lightning_codraft.training.module import CoDraftModule

_LAZY = {
    "CoDraftModule": "lightning_codraft.training.module",
    "CoDraftModuleConfig": "lightning_codraft.training.config",
    "RLBatch": "lightning_codraft.batch",
    "Policy": "lightning_codraft.models",
    "PolicyConfig": "lightning_codraft.models",
    "Eagle3Draft": "lightning_codraft.models",
    "SpeculativeEngine": "lightning_codraft.rollout",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


__all__ = list(_LAZY)
