"""CPU stand-ins for the CUDA flash kernels, with their exact call signatures and return layouts.

They let the CPU suite run the real backend code of ``lightning_codraft.attention.local_cuda`` (argument
mapping, head-dim padding, lse layout and its +inf convention) against kernels that check what the real ones
check and compute with the package's CPU path in fp32:

- ``torch.ops.codraft_test.flash_attention_forward`` / ``flash_attention_backward``: the schemas of
  ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` of the installed torch (copied
  from them at import), varlen layout: lse ``(H, total_q)`` fp32; the ``..._padded`` pair returns / takes the
  padded ``(num_docs, H, max_seqlen_q)`` lse of older PyTorch builds and ROCm AOTriton.
- flash-attn 2.6.3 (``flash_attn/flash_attn_interface.py`` at tag v2.6.3): plain functions,
  ``window_size=(left, right)``, forward returning ``(out, q, k, v, out_padded, softmax_lse, S_dmask,
  rng_state)``, backward writing dq/dk/dv and returning ``(dq, dk, dv, softmax_d)``.
- flash-attn 2.8.3 (same file at tag v2.8.3): ``torch.library.custom_op`` objects ``codraft_test::_flash_attn_
  varlen_forward`` / ``_backward`` (Python signature ``(*args, **kwargs)``, as flash-attn >= 2.7 ships them),
  ``window_size_left`` / ``window_size_right``, forward returning ``(out, softmax_lse, S_dmask, rng_state)``,
  backward mutating dq/dk/dv and returning ``softmax_d``.

Kernel behaviour mimicked: fp16/bf16 only, head dim a multiple of 8 and <= 256, int32 cu_seqlens,
``max_seqlen`` an upper bound, GQA, bottom-right causal, blind rows give out 0 and lse ``+inf``, the backward
computes ``P = exp(S - lse)`` from the lse it is given (a ``-inf`` there would be inf/NaN in the real kernel:
the stand-in raises instead), and a ``None`` scale means ``1 / sqrt(padded head dim)``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Tuple

import torch
from torch import Tensor

from lightning_codraft.attention import local_cuda
from lightning_codraft.attention.local import varlen_attention_backward, varlen_attention_forward

KERNELS = ("torch_flash", "torch_flash-padded", "flash_attn-2.6", "flash_attn-2.8")


class KernelCheckError(RuntimeError):
    """What the real kernel's TORCH_CHECK (or its garbage output) would have reported."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise KernelCheckError(msg)


def _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k):
    _check(q.dtype in (torch.float16, torch.bfloat16), f"FlashAttention only supports fp16 and bf16, got {q.dtype}")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query, key and value must have the same dtype")
    _check(q.dim() == 3 and k.dim() == 3 and k.shape == v.shape, "varlen q, k, v must be (total, heads, head_dim)")
    d = q.shape[-1]
    _check(d % 8 == 0, f"head_size must be a multiple of 8, got {d}")
    _check(d <= 256, f"FlashAttention supports head dimension at most 256, got {d}")
    _check(k.shape[-1] == d, "q and k must have the same head dim")
    _check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    for cu, total, mx in ((cu_q, q.shape[0], max_q), (cu_k, k.shape[0], max_k)):
        _check(cu.dtype == torch.int32 and cu.is_contiguous(), "cu_seqlens must be contiguous int32")
        _check(cu.device == q.device, "cu_seqlens must be on q's device")
        _check(int(cu[-1]) == total, f"cu_seqlens[-1]={int(cu[-1])} != total {total}")
        _check(isinstance(mx, int), f"max_seqlen must be an int, got {type(mx)}")
        _check(int((cu[1:] - cu[:-1]).max()) <= mx, f"max_seqlen={mx} below the longest document")
    _check(cu_q.numel() == cu_k.numel(), "cu_seqlens_q and cu_seqlens_k must have batch_size + 1 entries")
    # max_seqlen_q == 1 with GQA switches the kernel to its decode layout, a reshape of q to (batch, ...)
    _check(max_q != 1 or q.shape[1] == k.shape[1] or q.shape[0] == cu_q.numel() - 1,
           f"shape '[{cu_q.numel() - 1}, {k.shape[1]}, {q.shape[1] // k.shape[1]}, {d}]' is invalid for input "
           f"of size {q.numel()}")


def _check_features(dropout_p, causal, left, right, softcap=0.0, alibi_slopes=None, return_softmax=False):
    right = 0 if causal else right
    _check(dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not return_softmax,
           "stand-in implements no dropout, softcap, alibi or returned softmax")
    _check(left in (-1, None) and right in ((0,) if causal else (-1, None)), "stand-in implements no sliding window")


def _forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> tuple[Tensor, Tensor]:
    """Kernel semantics: ``out`` in q's dtype, lse ``(H, total_q)`` fp32 with ``+inf`` on blind rows."""
    _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = varlen_attention_forward(q.float(), k.float(), v.float(), cu_q, cu_k, causal=causal,
                                        softmax_scale=scale, backend="cpu")
    return out.to(q.dtype), lse.masked_fill(torch.isneginf(lse), float("inf")).t().contiguous()


def _backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> tuple[Tensor, Tensor, Tensor]:
    _check_inputs(q, k, v, cu_q, cu_k, max_q, max_k)
    _check(dout.shape == q.shape and out.shape == q.shape, "dout and out must have q's (padded) shape")
    _check(dout.dtype == q.dtype and out.dtype == q.dtype, "dout and out must have q's dtype")
    _check(lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0]) and lse.is_contiguous(),
           f"softmax_lse must be contiguous fp32 (num_heads, total_q), got {tuple(lse.shape)} {lse.dtype}")
    _check(not bool((torch.isneginf(lse) | torch.isnan(lse)).any()),
           "softmax_lse holds -inf/NaN: P = exp(S - lse) would be inf/NaN in the kernel")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lse_th = lse.t().masked_fill(torch.isposinf(lse.t()), float("-inf"))
    return varlen_attention_backward(dout.float(), q.float(), k.float(), v.float(), out.float(), lse_th, cu_q,
                                     cu_k, causal=causal, softmax_scale=scale, backend="cpu")


# ------------------------------------------------------------------------ torch's aten varlen flash ops

_LIB = torch.library.Library("codraft_test", "FRAGMENT")


def _define_like(aten_op, name: str) -> None:
    schema = str(aten_op.default._schema)
    _LIB.define(name + schema[schema.index("("):])


def _padded(lse: Tensor, cu: Tensor, max_q: int) -> Tensor:
    """Packed ``(H, T)`` -> padded ``(N, H, max_q)``, rows past a document's end ``+inf``."""
    out = torch.full((cu.numel() - 1, lse.shape[0], max_q), float("inf"))
    for i in range(cu.numel() - 1):
        a, b = int(cu[i]), int(cu[i + 1])
        out[i, :, :b - a] = lse[:, a:b]
    return out


def _packed(lse: Tensor, cu: Tensor, max_q: int) -> Tensor:
    _check(lse.shape == (cu.numel() - 1, lse.shape[1], max_q), f"padded softmax_lse must be (num_docs, H, "
                                                                f"max_seqlen_q={max_q}), got {tuple(lse.shape)}")
    return torch.cat([lse[i, :, :int(cu[i + 1] - cu[i])] for i in range(cu.numel() - 1)], 1).contiguous()


def _aten_pair(padded: bool):
    def forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
                *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None, alibi_slopes=None,
                block_table=None, num_splits=None):
        _check_features(dropout_p, is_causal, window_size_left, window_size_right, alibi_slopes=alibi_slopes,
                        return_softmax=return_debug_mask)
        _check(cum_seq_q is not None and cum_seq_k is not None and seqused_k is None and block_table is None,
               "stand-in implements the varlen path only")
        out, lse = _forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale, is_causal)
        lse = _padded(lse, cum_seq_q, max_q) if padded else lse
        rng = torch.zeros(2, dtype=torch.uint64)
        return out, lse, rng, torch.empty((), dtype=torch.uint64), torch.empty(0, dtype=query.dtype)

    def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                 is_causal, rng_state, unused, *, scale=None, window_size_left=None, window_size_right=None):
        _check_features(dropout_p, is_causal, window_size_left, window_size_right)
        lse = _packed(logsumexp, cum_seq_q, max_q) if padded else logsumexp
        dq, dk, dv = _backward(grad_out, query, key, value, out, lse, cum_seq_q, cum_seq_k, max_q, max_k, scale,
                               is_causal)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype)

    return forward, backward


for _suffix, _is_padded in (("", False), ("_padded", True)):
    _define_like(torch.ops.aten._flash_attention_forward, "flash_attention_forward" + _suffix)
    _define_like(torch.ops.aten._flash_attention_backward, "flash_attention_backward" + _suffix)
    _fwd, _bwd = _aten_pair(_is_padded)
    _LIB.impl("flash_attention_forward" + _suffix, _fwd, "CPU")
    _LIB.impl("flash_attention_backward" + _suffix, _bwd, "CPU")


# ------------------------------------------------------------------------------- flash-attn 2.6.3 (plain)


def _fa26_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                         softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                         return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
    _check_features(dropout_p, causal, window_size[0], window_size[1], softcap, alibi_slopes, return_softmax)
    out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, q, k, v, out, lse, None, torch.zeros(2, dtype=torch.int64)


def _fa26_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          deterministic, rng_state=None):
    _check_features(dropout_p, causal, window_size[0], window_size[1], softcap, alibi_slopes)
    _check(isinstance(deterministic, bool), f"deterministic must be a bool, got {deterministic!r}")
    for name, g, x in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check(g.shape == x.shape and g.dtype == x.dtype, f"{name} must match its input's shape and dtype")
    for g, r in zip((dq, dk, dv), _backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, softmax_scale, causal)):
        g.copy_(r)
    batch = cu_seqlens_q.numel() - 1
    return dq, dk, dv, torch.zeros(q.shape[1], q.shape[0] + 128 * batch)


# -------------------------------------------------------------------------- flash-attn 2.8.3 (custom ops)


@torch.library.custom_op("codraft_test::_flash_attn_varlen_forward", mutates_args=())
def _fa28_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    return_softmax: bool = False,
    block_table: Optional[torch.Tensor] = None,
    leftpad_k: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_features(dropout_p, causal, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax)
    out, lse = _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return out, lse, torch.empty((0,), dtype=q.dtype), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op("codraft_test::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"))
def _fa28_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],
    dk: Optional[torch.Tensor],
    dv: Optional[torch.Tensor],
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _check_features(dropout_p, causal, window_size_left, window_size_right, softcap, alibi_slopes)
    _check(dq is not None and dk is not None and dv is not None, "stand-in needs preallocated dq, dk, dv")
    for g, r in zip((dq, dk, dv), _backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, softmax_scale, causal)):
        g.copy_(r)
    batch = cu_seqlens_q.numel() - 1
    return torch.zeros(q.shape[1], q.shape[0] + 128 * batch)


# ------------------------------------------------------------------------------------------- installing


def ops_for(kernel: str):
    """The loader result the backend code receives for ``kernel`` (one of :data:`KERNELS`)."""
    if kernel in ("torch_flash", "torch_flash-padded"):
        suffix = "_padded" if kernel.endswith("padded") else ""
        return local_cuda.TorchFlashOps(getattr(torch.ops.codraft_test, "flash_attention_forward" + suffix),
                                        getattr(torch.ops.codraft_test, "flash_attention_backward" + suffix),
                                        packed_lse=not suffix)
    if kernel == "flash_attn-2.6":
        return local_cuda.FlashAttnOps(_fa26_varlen_forward, _fa26_varlen_backward, (2, 6))
    if kernel == "flash_attn-2.8":
        return local_cuda.FlashAttnOps(_fa28_varlen_forward, _fa28_varlen_backward, (2, 8))
    raise ValueError(f"unknown stand-in kernel {kernel!r}; expected one of {KERNELS}")


def install(monkeypatch, kernel: str) -> str:
    """Make the backend named by ``kernel`` load the stand-ins (any device); returns the backend name."""
    backend = kernel.split("-")[0]
    ops = ops_for(kernel)
    monkeypatch.setattr(local_cuda, "load_" + backend, lambda device: ops)
    return backend


FLASH_ATTN_26 = SimpleNamespace(_flash_attn_varlen_forward=_fa26_varlen_forward,
                                _flash_attn_varlen_backward=_fa26_varlen_backward, __version__="2.6.3")
FLASH_ATTN_28 = SimpleNamespace(_flash_attn_varlen_forward=_fa28_varlen_forward,
                                _flash_attn_varlen_backward=_fa28_varlen_backward, __version__="2.8.3")
