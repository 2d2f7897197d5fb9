"""Models: the policy (Llama / Qwen2 / Qwen3 family, HF names, taps) and the EAGLE-3 draft."""

from lightning_codraft._lazy import lazy_getattr

_LAZY = {
    "PolicyConfig": "lightning_codraft.models.config",
    "Policy": "lightning_codraft.models.policy",
    "PolicyOutput": "lightning_codraft.models.policy",
    "KVCache": "lightning_codraft.models.kv_cache",
    "Eagle3Config": "lightning_codraft.models.config",
    "Eagle3Draft": "lightning_codraft.models.eagle3",
    "build_vocab_mapping": "lightning_codraft.models.vocab",
    "PolicyDecoder": "lightning_codraft.models.decode",
    "DraftDecoder": "lightning_codraft.models.decode",
}

__getattr__ = lazy_getattr(__name__, _LAZY)

__all__ = list(_LAZY)
