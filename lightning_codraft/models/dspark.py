"""DSpark: the DFlash block drafter (models/dflash.py) plus the Markov and confidence heads (models/dspark_heads.py).

Layout (DeepSpec's "next-token" layout, ``sample_from_anchor``): block row ``j = 0 .. B - 1`` predicts ``x_{a+j+1}``,
so a block of B rows makes B proposals (the anchor's row included; vLLM's ``method: dspark`` verifies
``block_size`` tokens); with ``sample_from_anchor=False`` DFlash's at-position layout (row ``j >= 1`` predicts
``x_{a+j}``, B - 1 proposals). The proposal at row j has the backbone's logits through the policy's head plus the
Markov bias from the token before it (``x_{a+j}``: the anchor's own token for the first; teacher-forced in training,
the token drawn before it at decode time). The confidence
head reads the block's hidden state at k (and the Markov embedding of the previous token with
``confidence_with_markov``) and predicts the probability that position k is accepted. Its loss:
training/dspark_loss.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_codraft.models.dflash import DFlashConfig, DFlashDraft
from lightning_codraft.models.dspark_export import save_dspark
from lightning_codraft.models.dspark_heads import MARKOV_KINDS, ConfidenceHead, MarkovHead


@dataclass
class DSparkConfig(DFlashConfig):
    """A DFlash config plus DSpark's heads."""

    markov_rank: int = 256
    """r of the Markov head (DeepSpec's default 256; 0: no Markov head)."""
    markov_head_type: str = "vanilla"
    """``vanilla`` or ``gated`` (models/dspark_heads.py)."""
    confidence_head: bool = True
    """Whether the drafter predicts its acceptance per position."""
    confidence_with_markov: bool = False
    """The confidence head also reads the Markov embedding of the previous token."""
    sample_from_anchor: bool = True
    """DeepSpec's next-token layout (module docstring): the anchor's row proposes too (B proposals a block)."""

    def check(self) -> None:
        super().check()
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank={self.markov_rank} must be >= 0 (0: no Markov head)")
        if self.markov_head_type not in MARKOV_KINDS:
            raise ValueError(f"markov_head_type={self.markov_head_type!r} must be one of {MARKOV_KINDS}")
        if self.confidence_with_markov and not (self.confidence_head and self.markov_rank):
            raise ValueError("confidence_with_markov needs confidence_head=true and markov_rank > 0")


class DSparkDraft(DFlashDraft):
    """The DSpark drafter (module docstring); the policy's embedding and head are passed in, never owned."""

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        c = config
        self.markov_head: Optional[MarkovHead] = (
            MarkovHead(c.vocab_size, c.markov_rank, c.hidden_size, c.markov_head_type) if c.markov_rank else None
        )
        width = c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0)
        self.confidence_head: Optional[nn.Module] = ConfidenceHead(width) if c.confidence_head else None

    @classmethod
    def from_policy(
        cls,
        policy: nn.Module,
        markov_rank: Optional[int] = None,
        markov_head_type: str = "vanilla",
        confidence_head: bool = True,
        confidence_with_markov: bool = False,
        sample_from_anchor: bool = True,
        **geometry,
    ) -> DSparkDraft:
        """A drafter for ``policy``: ``geometry`` as :meth:`DFlashDraft.from_policy` takes it (``taps``,
        ``num_hidden_layers``, ``block_size``, ``mask_token_id``); ``markov_rank`` defaults to DeepSpec's 256 where
        the hidden size allows, else the hidden size."""
        base = DFlashDraft.from_policy(policy, **geometry).config
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DFlashConfig)}
        rank = min(256, base.hidden_size) if markov_rank is None else markov_rank
        return cls(
            DSparkConfig(
                **fields,
                markov_rank=rank,
                markov_head_type=markov_head_type,
                confidence_head=confidence_head,
                confidence_with_markov=confidence_with_markov,
                sample_from_anchor=sample_from_anchor,
            )
        )

    @property
    def first_slot(self) -> int:
        return 0 if self.config.sample_from_anchor else 1

    def save_pretrained(self, path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the layout vLLM loads with ``method: dspark`` and
        DeepSpec reads (models/dspark_export.py; read back by ``models.dspark_io.load_dspark``)."""
        return save_dspark(self, path)

    def block_logits(self, hidden: Tensor, head_weight: Tensor, prev_ids: Tensor) -> Tensor:
        """``(N, K, V)`` logits of proposal rows with hidden states ``(N, K, H)`` whose previous tokens are
        ``prev_ids`` ``(N, K)`` (teacher-forced): the backbone's through the policy's head, plus the Markov bias."""
        logits = self.logits(hidden, head_weight)
        if self.markov_head is not None:
            logits = logits + self.markov_head.bias(prev_ids, hidden).to(logits.dtype)
        return logits

    def confidence_logits(self, hidden: Tensor, prev_ids: Tensor) -> Optional[Tensor]:
        """``(N, K)`` confidence logits at those positions, or None without a confidence head."""
        if self.confidence_head is None:
            return None
        features = hidden
        if self.config.confidence_with_markov:
            features = torch.cat([hidden, self.markov_head.prev_embedding(prev_ids).to(hidden.dtype)], dim=-1)
        return self.confidence_head(features)
