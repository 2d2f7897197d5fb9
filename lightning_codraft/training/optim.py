"""The optimiser recipe every trainer here uses: one AdamW builder and one cosine schedule.

The RL step (:meth:`~lightning_codraft.training.module.CoDraftModule.build_optimizer`), the offline draft fit
(``distill.fit``) and the SFT / draft warm-ups (``rl.run.sft``, ``distill.pool``) build their optimisers and learning-rate
multipliers here, each with its own betas and warm-up form (kept as they were measured), so a change of the recipe is
made in one place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch


def cosine_decay(progress: float, min_ratio: float = 0.0) -> float:
    """Learning-rate multiplier of a cosine decay from 1 at ``progress = 0`` to ``min_ratio`` at ``progress = 1``.

    Args:
        progress: position in the decay, clamped to [0, 1].
        min_ratio: the final multiplier (e.g. 0.1: decay to 10% of the peak).
    """
    p = min(max(float(progress), 0.0), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p))


def adamw(
    params: Iterable[torch.nn.Parameter] | Sequence[dict],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params`` (tensors or parameter groups); every optimiser of the library is built
    here. Betas are the caller's: (0.9, 0.999) for RL (``CoDraftModuleConfig.betas``), (0.9, 0.95) for the offline
    draft fit, (0.9, 0.98) for the short warm-ups."""
    return torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps)
