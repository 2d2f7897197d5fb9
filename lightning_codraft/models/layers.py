"""Building blocks shared by the policy and the EAGLE-3 draft, Hugging Face parameter names.

Public classes (import them from here):

- :class:`RMSNorm` ``(hidden_size, eps)``: parameter ``weight``; ``norm(x (..., H)) -> (..., H)``, computed in
  fp32 and cast back, then scaled (HF ``LlamaRMSNorm`` numerics).
- :class:`GatedMLP` ``(hidden_size, intermediate_size, bias=False)``: parameters ``gate_proj``, ``up_proj``,
  ``down_proj``; ``mlp(x (..., H)) -> (..., H) = down(silu(gate(x)) * up(x))``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias).

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """x: ``(..., hidden_size)`` -> same shape and dtype."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedMLP(nn.Module):
    """SwiGLU feed-forward block of the Llama family.

    Args:
        hidden_size: model width H.
        intermediate_size: inner width I.
        bias: whether the three projections carry biases (Llama ``mlp_bias``).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """x: ``(..., H)`` -> ``(..., H)``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
