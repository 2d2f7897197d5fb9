"""``PackedLinear``: ``x @ W^T + b`` with the weight packed once for the CPU's oneDNN matmul (the decode path).

``F.linear`` on CPU re-lays the weight out for its kernel on every call; at decode sizes (a few to a hundred rows) that
costs as much as the product. Packing the weight once (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's CPU
freezing does) and calling ``torch.ops.mkldnn._linear_pointwise`` makes a decode-sized projection faster
(docs/design/decoding.md §3), and in bf16 bitwise equal to ``F.linear`` up to :data:`ROW_BLOCK` rows. The packed call
has no autograd, so a call that needs a gradient, an input of another dtype, a non-CPU weight, a torch build without
oneDNN or a CPU without oneDNN's kernel for the dtype (bf16 on an AVX2-only CPU) takes ``F.linear`` on the plain
weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PACKED_DTYPES = (torch.bfloat16, torch.float32)
"""Weight dtypes packed by default. In bf16 the packed kernel equals ``F.linear`` bit for bit; in fp32 ``F.linear``
runs MKL and the two round differently (~1e-7 relative), but the packed kernel's result for a row does not depend
on how many rows the call holds (MKL's does), which a speculative verify of 1 + k rows against a one-row step
needs to stay token-exact."""

ROW_BLOCK = 32
"""The most rows one bf16 oneDNN call gets. On a CPU with AMX (Intel Sapphire Rapids and later) oneDNN runs a bf16
product of more than 32 rows on AMX tiles and one of at most 32 rows on AVX-512; the two round some outputs
differently, so a 40-row verify would not equal the 8-row plain step holding the same rows. Larger bf16 calls run in
blocks of 32 rows (slower above 32 rows on AMX: docs/design/decoding.md §3)."""


def packing_available() -> bool:
    """Whether this torch build has the oneDNN packed linear ops."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _reorder(weight: Tensor) -> Tensor | None:
    """``weight`` packed for oneDNN, or None where this CPU has no oneDNN kernel for its dtype (bf16 needs AVX-512
    BW/VL/DQ or AVX-NE-CONVERT: an AVX2-only CPU then runs ``F.linear``, slower, never wrong)."""
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    except RuntimeError as e:
        if "cpu support" not in str(e):
            raise
        return None


class PackedLinear:
    """A decode-time linear layer.

    Args:
        weight: ``(out, in)``.
        bias: ``(out,)`` or None.
        pack: pack the weight (default: a CPU weight of a dtype in :data:`PACKED_DTYPES`, when
            :func:`packing_available`).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None, pack: bool | None = None):
        self.weight, self.bias = weight, bias
        if pack is None:
            pack = weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and packing_available()
        self.packed = _reorder(weight.detach()) if pack else None

    def __call__(self, x: Tensor) -> Tensor:
        """``(..., in) -> (..., out)``; a one-row input runs as two copies of the row (a bf16 one-row product over
        1536 inputs rounds ~1 output in 5000 differently from the same row among others: a one-row decode step
        must equal that row of a verify), a bf16 input of more than :data:`ROW_BLOCK` rows in blocks of that many."""
        if (
            self.packed is None
            or x.dtype != self.weight.dtype
            or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))
        ):
            return F.linear(x, self.weight, self.bias)
        if x.numel() == x.shape[-1]:  # one row: oneDNN's one-row kernel rounds differently; two rows take the
            two = x.reshape(1, -1).expand(2, -1).contiguous()  # kernel every other row count takes
            y = self._call(two)
            return y[:1].view(*x.shape[:-1], y.shape[-1])
        rows = x.reshape(-1, x.shape[-1])
        if x.dtype == torch.bfloat16 and rows.shape[0] > ROW_BLOCK:
            y = torch.cat([self(block) for block in rows.split(ROW_BLOCK)])  # a last block of one row: as above
            return y.view(*x.shape[:-1], y.shape[-1])
        return self._call(x.contiguous())

    def _call(self, x: Tensor) -> Tensor:
        """One oneDNN call on ``(..., in)``."""
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
