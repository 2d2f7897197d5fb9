"""DSpark's two heads on top of a DFlash block (issue 51; docs/design/drafters.md).

- **Markov head** (rank r): a bias on block position k's logits from the token at position k - 1, which makes the
  block semi-autoregressive: ``bias = W2 · e``, ``e = W1[x_{k-1}]`` (``W1``: ``(V, r)`` embedding, ``W2``:
  ``(V, r)``). The ``gated`` kind scales ``e`` by ``sigmoid(G · [h_k; e] + g)`` (``h_k`` the block's hidden state at
  k) first. Trained teacher-forced (``x_{k-1}`` the true previous token); at decode time the drafted tokens are
  drawn one position at a time, each biased by the one drawn before it.
- **Confidence head**: ``sigmoid(w · f_k + b)`` predicts the probability that position k is accepted, from the
  block's hidden state ``f_k = h_k`` (or ``[h_k; e]`` with ``with_markov``).

Parameter names follow DeepSpec's released checkpoints (``markov_w1``, ``markov_w2``, ``gate_proj``; ``proj``), so a
published DSpark drafter's heads load by name.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

MARKOV_KINDS = ("vanilla", "gated")


class MarkovHead(nn.Module):
    """The low-rank bias from the previous token (module docstring).

    Args:
        vocab_size: V.
        rank: r > 0.
        hidden_size: the block's hidden size (the ``gated`` kind's gate reads it).
        kind: ``vanilla`` or ``gated``.
    """

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, kind: str = "vanilla"):
        super().__init__()
        if rank < 1:
            raise ValueError(f"rank={rank} must be >= 1 (a drafter without a Markov head has none)")
        if kind not in MARKOV_KINDS:
            raise ValueError(f"kind={kind!r} must be one of {MARKOV_KINDS}")
        self.kind, self.rank = kind, int(rank)
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if kind == "gated" else None

    def prev_embedding(self, prev_ids: Tensor) -> Tensor:
        """``(...,)`` previous token ids -> ``(..., r)``."""
        return self.markov_w1(prev_ids.long())

    def bias(self, prev_ids: Tensor, hidden: Optional[Tensor] = None) -> Tensor:
        """``(..., V)`` logit bias at positions whose previous tokens are ``prev_ids`` (``(...,)``); ``hidden``
        ``(..., H)`` the block's hidden states there (the gated kind needs them)."""
        e = self.prev_embedding(prev_ids)
        if self.gate_proj is not None:
            if hidden is None:
                raise ValueError("the gated Markov head reads the block's hidden states: pass hidden")
            e = e * torch.sigmoid(self.gate_proj(torch.cat([hidden, e.to(hidden.dtype)], dim=-1))).to(e.dtype)
        return self.markov_w2(e)

    def draw(self, base_logits: Tensor, first_prev: Tensor, pick, hidden: Optional[Tensor] = None) -> tuple:
        """Semi-autoregressive drafting of one block.

        Args:
            base_logits: ``(N, K, V)`` the backbone's logits at the K drafted positions.
            first_prev: ``(N,)`` the token before the first drafted position (the anchor).
            pick: ``fn(logits (N, V), k) -> (N,)`` ids: how a position's token is drawn from its biased logits
                (greedy, or the engine's coupled / rejection sampler).
            hidden: ``(N, K, H)`` the block's hidden states there (the gated kind).

        Returns:
            ``(tokens (N, K), biased logits (N, K, V))``.
        """
        prev, tokens, logits = first_prev.long(), [], []
        for k in range(base_logits.shape[1]):
            step = base_logits[:, k] + self.bias(prev, None if hidden is None else hidden[:, k])
            prev = pick(step, k)
            tokens.append(prev)
            logits.append(step)
        if not tokens:
            return base_logits.new_zeros(base_logits.shape[0], 0, dtype=torch.long), base_logits
        return torch.stack(tokens, 1), torch.stack(logits, 1)


class ConfidenceHead(nn.Module):
    """Predicted acceptance per block position (module docstring): logits, ``(...,)``.

    Args:
        in_features: the block's hidden size, plus the Markov rank with ``with_markov``.
    """

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, features: Tensor) -> Tensor:
        return self.proj(features).squeeze(-1)
