"""lightning_codraft: online EAGLE-3 draft co-training during RL post-training, on Lightning / Fabric."""

__version__ = "0.1.0"

_LAZY = {
    "CoDraftModule": "lightning_codraft.training.module",
    "Policy": "lightning_codraft.models",
    "PolicyConfig": "lightning_codraft.models",
    "Eagle3Draft": "lightning_codraft.models",
    "SpeculativeEngine": "lightning_codraft.rollout",
}


def __getattr__(name):  # lazy so `import lightning_codraft.attention` does not import Lightning
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_codraft' has no attribute {name!r}")


__all__ = list(_LAZY)
