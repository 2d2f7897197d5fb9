"""Models: the policy (Llama / Qwen2 / Qwen3 family, HF names, taps) and the EAGLE-3 draft."""

import importlib

_LAZY = {
    "PolicyConfig": "lightning_codraft.models.config",
    "Policy": "lightning_codraft.models.policy",
    "PolicyOutput": "lightning_codraft.models.policy",
    "KVCache": "lightning_codraft.models.kv_cache",
    "DraftConfig": "lightning_codraft.models.eagle3",
    "Eagle3Draft": "lightning_codraft.models.eagle3",
    "build_vocab_mapping": "lightning_codraft.models.vocab",
}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_codraft.models' has no attribute {name!r}")


__all__ = list(_LAZY)
