"""lightning_codraft: online EAGLE-3 draft co-training during RL post-training, on Lightning / Fabric."""

from lightning_codraft._lazy import lazy_getattr

__version__ = "0.1.0"

_LAZY = {
    "CoDraftModule": "lightning_codraft.training.module",
    "Policy": "lightning_codraft.models",
    "PolicyConfig": "lightning_codraft.models",
    "Eagle3Draft": "lightning_codraft.models",
    "SpeculativeEngine": "lightning_codraft.rollout",
}

__getattr__ = lazy_getattr(__name__, _LAZY)  # lazy so `import lightning_codraft.attention` does not import Lightning


__all__ = list(_LAZY)
