"""Local (single-block) variable-length attention returning the log-sum-exp.

One packed block of queries against one packed block of keys, documents paired by ``cu_seqlens_q`` /
``cu_seqlens_k`` (document ``i`` of the queries sees only document ``i`` of the keys). This is the kernel
every other attention in the package is built from: the ring feeds it K/V blocks of other ranks and merges
the partial results with :func:`~lightning_codraft.attention.merge.merge_attention` using the returned
``lse``. The backward takes the ``(out, lse)`` to differentiate against as arguments, so a caller can pass the
*merged* output of a joint softmax (the flash-attention identity ``dS = P * (dP - rowsum(dO * O))`` holds
for each block of keys with ``P = exp(S - lse_joint)``).

Backends (``backend=None`` picks the first that fits, see :func:`select_backend`):

- ``"cpu"``: CPU tensors, any float dtype. ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  backward, one call per document, computed in fp32 for bf16 / fp16 inputs (results in the inputs' dtype): on a
  Zen 4 EPYC the fp32 kernels ran a bf16-mixed draft fit 2-19% faster than the bf16 ones (mean +13% over four
  side-by-side pairs on SmolLM2 features).
- ``"torch_flash"``: CUDA fp16/bf16, head dim <= 256, sm80+. PyTorch's own FlashAttention-2 varlen ops
  ``aten._flash_attention_forward`` / ``_flash_attention_backward``; no extra package.
- ``"flash_attn"``: CUDA fp16/bf16, head dim <= 256, flash-attn >= 2.6 installed. Its
  ``_flash_attn_varlen_forward`` / ``_backward``; picked by default only where ``"torch_flash"`` cannot run.
- ``"torch"``: everything else (CUDA fp32, other devices). Pure-PyTorch math, one document at a time, fp32
  softmax.

The CUDA backends live in :mod:`lightning_codraft.attention.local_cuda`. A forced backend that cannot run
raises :class:`~lightning_codraft.attention.local_cuda.BackendUnavailable` saying why and what to use instead.

``causal=True`` aligns the causal mask to the bottom-right corner of each document's block (as
flash-attention >= 2.1 does): query ``i`` of a document with ``Lq`` queries and ``Lk`` keys sees keys
``j <= i + Lk - Lq``. Rows that see no key get ``out = 0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from lightning_codraft.attention import local_cuda
from lightning_codraft.attention.local_cuda import BackendUnavailable

_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
BACKENDS = ("cpu", "torch_flash", "flash_attn", "torch")


def select_backend(q: Tensor) -> str:
    """Name of the kernel :func:`varlen_attention` uses for ``q`` by default (one of :data:`BACKENDS`)."""
    if q.device.type == "cpu":
        return "cpu"
    return local_cuda.available_cuda_backend(q) or "torch"


def _resolve(backend: Optional[str], q: Tensor) -> str:
    if backend is None:
        return select_backend(q)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS} or None")
    if backend == "cpu" and q.device.type != "cpu":
        raise BackendUnavailable(
            f"attention backend 'cpu' runs on CPU tensors, got tensors on {q.device}; use "
            f"backend=None to pick by device"
        )
    return backend


def _check(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> tuple[list[int], list[int]]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be (T, H, D) packed tensors, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} != k head dim {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} must be a multiple of key/value heads {k.shape[1]} (GQA)")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} documents but cu_seqlens_k has {len(ck) - 1}")
    if cq[0] != 0 or ck[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens_q[0]={cq[0]}, cu_seqlens_k[0]={ck[0]}")
    if cq[-1] != q.shape[0] or ck[-1] != k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q[-1]={cq[-1]} / cu_seqlens_k[-1]={ck[-1]} must equal the token counts "
            f"{q.shape[0]} / {k.shape[0]} of q / k"
        )
    return cq, ck


def _causal_mask(lq: int, lk: int, device) -> Tensor:
    """``(lq, lk)`` float mask, 0 where visible, -inf elsewhere (bottom-right aligned)."""
    i = torch.arange(lq, device=device).unsqueeze(1)
    j = torch.arange(lk, device=device).unsqueeze(0)
    zero = torch.zeros((), device=device)
    return torch.where(j <= i + (lk - lq), zero, torch.full((), float("-inf"), device=device))


def _fold_heads(g: Tensor, groups: int) -> Tensor:
    """``(1, H, L, D)`` gradient -> ``(L, H // groups, D)`` summed over each GQA group."""
    g = g[0].transpose(0, 1)
    if groups > 1:
        g = g.unflatten(1, (-1, groups)).sum(2)
    return g


def _doc_blocks(cq, ck):
    """Per document: ``(a, b, c, d)`` = query rows ``[a, b)`` and key rows ``[c, d)``, empty blocks skipped."""
    for i in range(len(cq) - 1):
        a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
        if a != b and c != d:
            yield a, b, c, d


# ---------------------------------------------------------------------------------------------- forward


def _cpu_work(*ts: Tensor) -> tuple[Tensor, ...]:
    """The tensors the CPU kernels compute in: fp32 copies of bf16 / fp16 ones (see the module docstring)."""
    return tuple(t.float() if t.dtype in (torch.bfloat16, torch.float16) else t for t in ts)


def _same_shape_docs(cq, ck, device):
    """The documents grouped by shape: ``{(lq, lk): (query row index, key row index)}``, each index ``(n * l,)``
    int64 listing the groups' ``n`` documents' rows in order (one kernel call per shape, not per document)."""
    groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for a, b, c, d in _doc_blocks(cq, ck):
        starts = groups.setdefault((b - a, d - c), ([], []))
        starts[0].append(a)
        starts[1].append(c)
    return {(lq, lk): (_rows(qs, lq, device), _rows(ks, lk, device)) for (lq, lk), (qs, ks) in groups.items()}


def _rows(starts: list[int], length: int, device) -> Tensor:
    return (torch.tensor(starts, device=device).unsqueeze(1) + torch.arange(length, device=device)).reshape(-1)


def _stack_heads(x: Tensor, rows: Tensor, length: int, groups: int) -> Tensor:
    """Rows ``rows`` of ``(T, Hx, D)`` as ``(n, Hx * groups, length, D)``: one batch entry per document."""
    x = x.index_select(0, rows).unflatten(0, (-1, length))
    if groups > 1:
        x = x.repeat_interleave(groups, dim=2)
    return x.transpose(1, 2)


def _fwd_cpu(q, k, v, cq, ck, causal, scale):
    T, H, D = q.shape
    groups = H // k.shape[1]
    out = q.new_zeros(T, H, D)
    q, k, v = _cpu_work(q, k, v)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for (lq, lk), (qi, ki) in _same_shape_docs(cq, ck, q.device).items():
        mask = None
        square = causal and lq == lk
        if causal and not square:
            mask = _causal_mask(lq, lk, q.device).to(q.dtype)
        o, l = _CPU_FWD(
            _stack_heads(q, qi, lq, 1),
            _stack_heads(k, ki, lk, groups),
            _stack_heads(v, ki, lk, groups),
            0.0,
            square,
            attn_mask=mask,
            scale=scale,
        )
        l = l.transpose(1, 2)  # (n, lq, H)
        if mask is not None:  # rows with no visible key report lse = 0; make them -inf
            blind = torch.arange(lq, device=q.device) + (lk - lq) < 0
            l = l.masked_fill(blind.view(1, -1, 1), float("-inf"))
        out.index_copy_(0, qi, o.transpose(1, 2).reshape(-1, H, D).to(out.dtype))
        lse.index_copy_(0, qi, l.reshape(-1, H))
    return out, lse


def _fwd_torch(q, k, v, cq, ck, causal, scale):
    T, H, D = q.shape
    groups = H // k.shape[1]
    out = q.new_zeros(T, H, D)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for a, b, c, d in _doc_blocks(cq, ck):
        qs = q[a:b].float().transpose(0, 1)  # (H, lq, D)
        ks = k[c:d].float().repeat_interleave(groups, 1).transpose(0, 1)  # (H, lk, D)
        vs = v[c:d].float().repeat_interleave(groups, 1).transpose(0, 1)
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if causal:
            s = s + _causal_mask(b - a, d - c, q.device)
        l = torch.logsumexp(s, dim=-1)  # (H, lq)
        p = torch.exp(s - l.masked_fill(torch.isinf(l), 0.0).unsqueeze(-1))
        out[a:b] = torch.matmul(p, vs).transpose(0, 1).to(q.dtype)
        lse[a:b] = l.transpose(0, 1)
    return out, lse


# --------------------------------------------------------------------------------------------- backward


def _bwd_cpu(dout, q, k, v, out, lse, cq, ck, causal, scale):
    T, H, D = q.shape
    groups = H // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dout, q, k, v, out = _cpu_work(dout, q, k, v, out)
    lse_safe = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that see nothing: P = exp(-inf - 0) = 0
    for (lq, lk), (qi, ki) in _same_shape_docs(cq, ck, q.device).items():
        square = causal and lq == lk
        mask = _causal_mask(lq, lk, q.device).to(q.dtype) if causal and not square else None
        lse_g = lse_safe.index_select(0, qi).unflatten(0, (-1, lq)).transpose(1, 2).contiguous()
        g_q, g_k, g_v = _CPU_BWD(
            _stack_heads(dout, qi, lq, 1),
            _stack_heads(q, qi, lq, 1),
            _stack_heads(k, ki, lk, groups),
            _stack_heads(v, ki, lk, groups),
            _stack_heads(out, qi, lq, 1),
            lse_g,
            0.0,
            square,
            attn_mask=mask,
            scale=scale,
        )
        dq.index_copy_(0, qi, g_q.transpose(1, 2).reshape(-1, H, D).to(dq.dtype))
        dk.index_copy_(0, ki, _fold_batched(g_k, groups).to(dk.dtype))
        dv.index_copy_(0, ki, _fold_batched(g_v, groups).to(dv.dtype))
    return dq, dk, dv


def _fold_batched(g: Tensor, groups: int) -> Tensor:
    """``(n, H, L, D)`` gradient -> ``(n * L, H // groups, D)`` summed over each GQA group."""
    g = g.transpose(1, 2)
    if groups > 1:
        g = g.unflatten(2, (-1, groups)).sum(3)
    return g.reshape(-1, *g.shape[2:])


def _bwd_torch(dout, q, k, v, out, lse, cq, ck, causal, scale):
    T, H, D = q.shape
    groups = H // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for a, b, c, d in _doc_blocks(cq, ck):
        qs = q[a:b].float().transpose(0, 1)
        ks = k[c:d].float().repeat_interleave(groups, 1).transpose(0, 1)
        vs = v[c:d].float().repeat_interleave(groups, 1).transpose(0, 1)
        do = dout[a:b].float().transpose(0, 1)  # (H, lq, D)
        o = out[a:b].float().transpose(0, 1)
        l = lse[a:b].t().masked_fill(torch.isinf(lse[a:b].t()), 0.0)  # (H, lq)
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        if causal:
            s = s + _causal_mask(b - a, d - c, q.device)
        p = torch.exp(s - l.unsqueeze(-1))
        delta = (do * o).sum(-1, keepdim=True)
        ds = p * (torch.matmul(do, vs.transpose(1, 2)) - delta)
        dq[a:b] = (torch.matmul(ds, ks) * scale).transpose(0, 1).to(q.dtype)
        dk[c:d] = _fold_heads((torch.matmul(ds.transpose(1, 2), qs) * scale).unsqueeze(0), groups).to(k.dtype)
        dv[c:d] = _fold_heads(torch.matmul(p.transpose(1, 2), do).unsqueeze(0), groups).to(v.dtype)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------- public


def varlen_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """Non-differentiable forward of :func:`varlen_attention` (for callers that write their own backward).

    Args:
        q: ``(Tq, H, D)`` packed queries.
        k, v: ``(Tk, Hkv, D)`` packed keys / values, ``H % Hkv == 0``.
        cu_seqlens_q, cu_seqlens_k: ``(N + 1,)`` prefix sums pairing query document ``i`` with key document ``i``.
        causal: bottom-right-aligned causal mask inside each document.
        softmax_scale: multiplier of ``q @ k``.
        backend: one of :data:`BACKENDS`; default :func:`select_backend`.

    Returns:
        ``out (Tq, H, D)`` in q's dtype and ``lse (Tq, H)`` fp32 (``-inf`` on rows that see no key).
    """
    cq, ck = _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    backend = _resolve(backend, q)
    with torch.no_grad():
        if backend == "cpu":
            return _fwd_cpu(q, k, v, cq, ck, causal, softmax_scale)
        if backend == "torch":
            return _fwd_torch(q, k, v, cq, ck, causal, softmax_scale)
        fwd = local_cuda.torch_flash_forward if backend == "torch_flash" else local_cuda.flash_attn_forward
        return fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, cq, ck, causal, softmax_scale)


def varlen_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: float,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one attention block given the ``(out, lse)`` of the softmax it is part of.

    Args:
        dout: ``(Tq, H, D)`` gradient of the (joint) attention output.
        q, k, v: the block's inputs, as in :func:`varlen_attention_forward`.
        out: ``(Tq, H, D)`` output of the joint softmax this block's keys belong to (the merged output).
        lse: ``(Tq, H)`` fp32 log-sum-exp of that joint softmax (``-inf`` on rows that see no key).
        backend: one of :data:`BACKENDS`; default :func:`select_backend`.

    Returns:
        ``dq (Tq, H, D)``, ``dk (Tk, Hkv, D)``, ``dv (Tk, Hkv, D)``: this block's contribution.
    """
    cq, ck = _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    backend = _resolve(backend, q)
    with torch.no_grad():
        if backend == "cpu":
            return _bwd_cpu(dout, q, k, v, out, lse, cq, ck, causal, softmax_scale)
        if backend == "torch":
            return _bwd_torch(dout, q, k, v, out, lse, cq, ck, causal, softmax_scale)
        bwd = local_cuda.torch_flash_backward if backend == "torch_flash" else local_cuda.flash_attn_backward
        return bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, cq, ck, causal, softmax_scale)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, causal, scale, backend):
        backend = _resolve(backend, q)
        out, lse = varlen_attention_forward(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale, backend=backend)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        if dlse is not None and bool((dlse != 0).any()):
            # d lse_i / d s_ij = P_ij, so dS = P * (dO.v_j - rowsum(dO*O) + dlse_i). Append a head-dim column:
            # v' = [v, 1], dO' = [dO, dlse], and hand the kernel out' = [O, 0] so its rowsum stays dO.O;
            # then dO'.v'_j = dO.v_j + dlse_i, exactly the term needed. q and k get a zero column.
            pad = lambda x, val: torch.cat([x, x.new_full((*x.shape[:-1], 1), val)], -1)  # noqa: E731
            qp, kp, vp = pad(q, 0.0), pad(k, 0.0), pad(v, 1.0)
            backend = ctx.backend
            if backend in ("torch_flash", "flash_attn") and local_cuda.input_problem(backend, qp, kp, vp):
                backend = "torch"  # head dim D + 1 past the flash kernels' limit
            dq, dk, dv = varlen_attention_backward(
                torch.cat([dout, dlse.to(dout.dtype).unsqueeze(-1)], -1),
                qp,
                kp,
                vp,
                pad(out, 0.0),
                lse,
                cu_q,
                cu_k,
                causal=ctx.causal,
                softmax_scale=ctx.scale,
                backend=backend,
            )
            dq, dk, dv = dq[..., :-1], dk[..., :-1], dv[..., :-1]
        else:
            dq, dk, dv = varlen_attention_backward(
                dout, q, k, v, out, lse, cu_q, cu_k, causal=ctx.causal, softmax_scale=ctx.scale, backend=ctx.backend
            )
        return dq, dk, dv, None, None, None, None, None


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    *,
    causal: bool,
    softmax_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> tuple[Tensor, Tensor]:
    """Packed variable-length attention returning ``(out, lse)``; differentiable in q, k, v via both outputs.

    Args:
        q: ``(Tq, H, D)`` packed queries, documents delimited by ``cu_seqlens_q``.
        k, v: ``(Tk, Hkv, D)`` packed keys / values (GQA when ``Hkv < H``), delimited by ``cu_seqlens_k``.
        cu_seqlens_q, cu_seqlens_k: ``(N + 1,)`` int32 prefix sums; query document ``i`` sees key document ``i``.
        causal: causal mask inside each document, aligned bottom-right (query ``i`` sees key
            ``j <= i + Lk - Lq``).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        backend: force ``"cpu"``, ``"torch_flash"``, ``"flash_attn"`` or ``"torch"`` (the module docstring's
            table); default picks by device and dtype (:func:`select_backend`). A forced backend that cannot run
            here raises :class:`~lightning_codraft.attention.local_cuda.BackendUnavailable`.

    Returns:
        ``out (Tq, H, D)`` (q's dtype) and ``lse (Tq, H)`` fp32; rows with no visible key give 0 and ``-inf``.
    """
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _VarlenAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, bool(causal), scale, backend)
