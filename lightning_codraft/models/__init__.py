"""Models: the policy (Llama / Qwen2 / Qwen3 family, HF names, taps) and the EAGLE-3 draft."""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.models.config import Eagle3Config, PolicyConfig
    from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder
    from lightning_codraft.models.eagle3 import Eagle3Draft
    from lightning_codraft.models.kv_cache import KVCache
    from lightning_codraft.models.policy import Policy, PolicyOutput
    from lightning_codraft.models.tokenizer import CharTokenizer
    from lightning_codraft.models.vocab import build_vocab_mapping

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
    "CharTokenizer": "lightning_codraft.models.tokenizer",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
