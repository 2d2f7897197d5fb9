"""``compiled_draft``: a draft's per-row blocks under ``torch.compile`` for the length of a fit.

On a CPU the draft fit is bound by memory-bound elementwise work (RMSNorm, RoPE, SiLU-gating, casts) between its
matmuls; compiling the draft layer's ``qkv`` and ``finish`` blocks and the final norm fuses it (measured in
docs/benchmarks/draft_warmstart.md). The attention (custom autograd functions) and the loss stay eager.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def compiled_draft(draft, enabled: bool = True):
    """While open, ``draft.midlayer.qkv`` / ``finish`` and ``draft.norm.forward`` run ``torch.compile``d (dynamic
    shapes), as instance attributes that shadow the methods and are removed on exit; parameters are untouched.

    Args:
        draft: an :class:`~lightning_codraft.models.Eagle3Draft`.
        enabled: False opens a context that changes nothing.
    """
    parts = [(draft.midlayer, "qkv"), (draft.midlayer, "finish"), (draft.norm, "forward")] if enabled else []
    parts = [(obj, name) for obj, name in parts if name not in vars(obj)]  # someone else's override stays theirs
    for obj, name in parts:
        setattr(obj, name, torch.compile(getattr(obj, name), dynamic=True))
    try:
        yield
    finally:
        for obj, name in parts:
            delattr(obj, name)
