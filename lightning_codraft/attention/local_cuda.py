"""CUDA kernels for one varlen attention block: PyTorch's own flash attention, and flash-attn when installed.

Both backends run FlashAttention-2's varlen kernels and share one contract, which this module adapts to the
``(out (T, H, D), lse (T, H) fp32, -inf on blind rows)`` contract of :mod:`lightning_codraft.attention.local`:

- fp16 / bf16 inputs only, head dim a multiple of 8 and at most 256. The head dim is zero-padded here (zero
  q/k columns leave ``q . k`` unchanged, zero v columns give output columns that are cut off), always with an
  explicit ``softmax_scale`` so the padded width never enters the default ``1 / sqrt(D)``.
- GQA natively (``H % Hkv == 0``); the kernels sum dK/dV over each group.
- ``causal`` aligned bottom-right (query ``i`` sees key ``j <= i + Lk - Lq``), the convention of local.py.
- lse fp32, packed ``(H, total_q)`` (flash-attn >= 2.6; PyTorch CUDA builds with those kernels), or padded
  ``(num_docs, H, max_seqlen_q)`` (older PyTorch builds, ROCm AOTriton: found by a one-off probe); a row that
  sees no key gets out 0 and lse ``+inf``, and the backward reads the lse it is given (same layout) as
  ``P = exp(S - lse)``, so ``+inf`` gives ``P = 0`` (``-inf`` would give inf/NaN).

Kernels, per backend:

- ``"torch_flash"``: ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward`` with
  ``cum_seq_q`` / ``cum_seq_k`` (the ops ``torch.nn.attention.varlen.varlen_attn`` calls); no extra package.
  The backward op takes ``(out, logsumexp)`` as arguments, so the merged output of a joint softmax can be fed
  to it (docs/design/interfaces.md, attention/).
- ``"flash_attn"``: ``flash_attn.flash_attn_interface._flash_attn_varlen_forward`` / ``_backward``, called
  positionally per release line (never by ``inspect.signature``: from 2.7 on they are ``torch.library``
  custom ops whose Python signature is ``(*args, **kwargs)``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FLASH_DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIM_MAX = 256
FLASH_ATTN_INSTALL = 'pip install "flash-attn>=2.6,<2.9" --no-build-isolation'
FLASH_ATTN_MIN = (2, 6)


class BackendUnavailable(RuntimeError):
    """A forced attention backend cannot run here; the message says why and what to use instead."""


@dataclass(frozen=True)
class TorchFlashOps:
    """PyTorch's varlen flash ops (``torch.ops.aten`` schemas; stand-ins with the same schemas in tests)."""

    forward: Callable[..., Any]
    """``_flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
    return_debug_mask, *, scale) -> (output, softmax_logsumexp (H, total_q), rng_state, unused, debug_mask)``."""
    backward: Callable[..., Any]
    """``_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q,
    max_k, dropout_p, is_causal, rng_state, unused, *, scale) -> (dq, dk, dv)``."""
    packed_lse: bool = True
    """The varlen lse layout of this build: packed ``(H, total_q)`` (CUDA builds with FlashAttention >= 2.6's
    kernels), else padded ``(num_docs, H, max_q)`` (older builds, ROCm AOTriton); the backward takes the same."""


@dataclass(frozen=True)
class FlashAttnOps:
    """flash-attn's varlen functions and the release they come from (which fixes their positional layout)."""

    forward: Callable[..., Any]
    """``flash_attn_interface._flash_attn_varlen_forward``."""
    backward: Callable[..., Any]
    """``flash_attn_interface._flash_attn_varlen_backward``."""
    version: tuple[int, int]
    """``(major, minor)`` of ``flash_attn.__version__``."""


def _need_cuda(backend: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise BackendUnavailable(
            f"attention backend {backend!r} runs on CUDA tensors, got tensors on {device}"
            + ("" if torch.cuda.is_available() else f" (this PyTorch {torch.__version__} has no usable CUDA)")
            + "; use backend='cpu' for CPU tensors, or backend=None to pick by device"
        )


def load_torch_flash(device: torch.device) -> TorchFlashOps:
    """PyTorch's varlen flash ops for ``device``, or :class:`BackendUnavailable` saying why not."""
    _need_cuda("torch_flash", device)
    if not torch.backends.cuda.is_flash_attention_available():
        raise BackendUnavailable(
            f"attention backend 'torch_flash' needs a PyTorch built with flash attention; torch "
            f"{torch.__version__} was built without it. Install a CUDA build of torch, or use "
            f"backend='flash_attn' ({FLASH_ATTN_INSTALL}) or backend='torch' (math path)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise BackendUnavailable(
            f"attention backend 'torch_flash' needs an Ampere or newer GPU (sm80+), {device} is sm{major}{minor}; "
            f"use backend='torch' (math path)"
        )
    return _probe_torch_flash(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _probe_torch_flash(index: int) -> TorchFlashOps:
    fwd, bwd = torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward
    return TorchFlashOps(fwd, bwd, packed_lse=lse_layout_is_packed(fwd, torch.device("cuda", index)))


def lse_layout_is_packed(forward: Callable[..., Any], device: torch.device) -> bool:
    """Run ``forward`` (the aten varlen flash schema) once on two tiny documents: it must launch on ``device``,
    and its lse shape tells the layout (``True``: packed ``(H, total_q)``, ``False``: padded)."""
    x = torch.zeros(3, 1, 8, dtype=torch.float16, device=device)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    try:
        shape = tuple(forward(x, x, x, cu, cu, 2, 2, 0.0, False, False, scale=1.0)[1].shape)
    except RuntimeError as err:
        raise BackendUnavailable(
            f"attention backend 'torch_flash' does not run on {device} with torch "
            f"{torch.__version__} ({err}); use backend='torch' (math path)"
        ) from err
    if shape not in ((1, 3), (2, 1, 2)):
        raise BackendUnavailable(
            f"attention backend 'torch_flash': torch {torch.__version__} returns a varlen lse "
            f"of shape {shape} for 2 documents, 1 head, 3 tokens; expected (1, 3) or (2, 1, 2). "
            f"Use backend='torch' (math path)"
        )
    return shape == (1, 3)


@functools.lru_cache(maxsize=1)
def _import_flash_attn():
    try:
        import flash_attn  # type: ignore[import-not-found]
        from flash_attn import flash_attn_interface  # type: ignore[import-not-found]
    except ImportError as err:
        return None, None, f"{type(err).__name__}: {err}"
    return flash_attn, flash_attn_interface, None


def load_flash_attn(device: torch.device) -> FlashAttnOps:
    """flash-attn's varlen functions for ``device``, or :class:`BackendUnavailable` saying why not."""
    _need_cuda("flash_attn", device)
    package, interface, why = _import_flash_attn()
    if package is None:
        raise BackendUnavailable(
            f"attention backend 'flash_attn' needs the flash-attn package, which does not import here ({why}). "
            f"Install it on the CUDA machine with `{FLASH_ATTN_INSTALL}` (it compiles against the installed "
            f"torch), or use backend='torch_flash' (PyTorch's own flash kernel, no extra package) or "
            f"backend=None to pick automatically"
        )
    found = re.match(r"(\d+)\.(\d+)", getattr(package, "__version__", ""))
    if found is None:
        raise BackendUnavailable(
            f"flash_attn.__version__={getattr(package, '__version__', None)!r} is not a "
            f"version; reinstall with `{FLASH_ATTN_INSTALL}`"
        )
    return FlashAttnOps(
        interface._flash_attn_varlen_forward,
        interface._flash_attn_varlen_backward,
        (int(found.group(1)), int(found.group(2))),
    )


def _loader(backend: str) -> Callable[[torch.device], Any]:
    # looked up at call time so that tests can substitute stand-in kernels for the module-level loaders
    return {"torch_flash": load_torch_flash, "flash_attn": load_flash_attn}[backend]


def _padded_head_dim(d: int) -> int:
    return (d + 7) // 8 * 8


def input_problem(backend: str, q: Tensor, k: Tensor, v: Tensor) -> Optional[str]:
    """Why the flash ``backend`` cannot take these inputs (dtype, head dim), or ``None`` when it can."""
    if q.dtype not in FLASH_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return (
            f"attention backend {backend!r} needs float16 or bfloat16 q, k, v; got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Compute in 16 bits (torch.autocast or a bf16 model) or use backend='torch' (math path)"
        )
    if _padded_head_dim(q.shape[-1]) > HEAD_DIM_MAX:
        return (
            f"attention backend {backend!r} supports head dim <= {HEAD_DIM_MAX}, got {q.shape[-1]}; use "
            f"backend='torch' (math path)"
        )
    return None


def available_cuda_backend(q: Tensor) -> Optional[str]:
    """The flash backend :func:`~lightning_codraft.attention.local.select_backend` picks for ``q``, or ``None``.

    ``"torch_flash"`` when PyTorch's flash kernel runs here, else ``"flash_attn"`` when flash-attn is installed,
    for CUDA fp16/bf16 inputs with head dim <= 256 (``None`` otherwise: the math path then serves).
    """
    if q.device.type != "cuda" or input_problem("torch_flash", q, q, q) is not None:
        return None
    for name in ("torch_flash", "flash_attn"):
        try:
            ops = _loader(name)(q.device)
        except BackendUnavailable:
            continue
        if name == "flash_attn" and ops.version < FLASH_ATTN_MIN:
            continue
        return name
    return None


def _ops(backend: str, q: Tensor, k: Tensor, v: Tensor):
    ops = _loader(backend)(q.device)
    problem = input_problem(backend, q, k, v)
    if problem is not None:
        raise BackendUnavailable(problem)
    if backend == "flash_attn" and ops.version < FLASH_ATTN_MIN:
        raise BackendUnavailable(
            f"flash-attn {ops.version[0]}.{ops.version[1]} is installed; lightning_codraft calls the varlen "
            f"functions of flash-attn >= {FLASH_ATTN_MIN[0]}.{FLASH_ATTN_MIN[1]} (window_size + softcap "
            f"arguments). Upgrade with `{FLASH_ATTN_INSTALL}`, or use backend='torch_flash'"
        )
    return ops


@dataclass(frozen=True)
class _Block:
    """The kernels' view of one block: padded contiguous tensors and the document table."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    head_dim: int
    padded: int
    lens_q: list[int]

    @classmethod
    def build(cls, q: Tensor, cu_q: Tensor, cu_k: Tensor, cq: list[int], ck: list[int]) -> _Block:
        lens_q = [b - a for a, b in zip(cq[:-1], cq[1:])]
        lens_k = [b - a for a, b in zip(ck[:-1], ck[1:])]
        # max_seqlen_q is an upper bound for the kernels' grid; 1 would switch them to their decode layout
        # ("seqlenq_ngroups_swapped"), which assumes every document has exactly one query
        return cls(
            cu_q.to(device=q.device, dtype=torch.int32).contiguous(),
            cu_k.to(device=q.device, dtype=torch.int32).contiguous(),
            max(max(lens_q), 2),
            max(lens_k),
            q.shape[-1],
            _padded_head_dim(q.shape[-1]),
            lens_q,
        )

    def pad(self, x: Tensor) -> Tensor:
        """``(T, h, D)`` -> ``(T, h, padded)`` contiguous, zero columns appended."""
        return F.pad(x, (0, self.padded - self.head_dim)) if self.padded != self.head_dim else x.contiguous()

    def unpad(self, x: Tensor) -> Tensor:
        return x[..., : self.head_dim].contiguous() if self.padded != self.head_dim else x

    def _doc_rows(self, device) -> tuple[Tensor, Tensor]:
        """Per packed query row: its document and its position there, ``(Tq,)`` each."""
        lens = torch.tensor(self.lens_q, device=device)
        doc = torch.repeat_interleave(torch.arange(len(self.lens_q), device=device), lens)
        starts = torch.cumsum(lens, 0) - lens
        return doc, torch.arange(doc.numel(), device=device) - starts[doc]

    def lse_from_kernel(self, lse: Tensor, q: Tensor, backend: str, packed: bool = True) -> Tensor:
        """Kernel lse (``+inf`` on blind rows), packed ``(H, Tq)`` or padded ``(N, H, max_q)``, -> ``(Tq, H)`` fp32
        with ``-inf`` there."""
        want = (q.shape[1], q.shape[0]) if packed else (len(self.lens_q), q.shape[1], self.max_q)
        if tuple(lse.shape) != want:
            raise RuntimeError(
                f"backend {backend!r} returned a softmax_lse of shape {tuple(lse.shape)}; expected the "
                f"{'packed' if packed else 'padded'} varlen layout {want}"
            )
        if packed:
            lse = lse.t()
        else:
            doc, pos = self._doc_rows(lse.device)
            lse = lse[doc, :, pos]
        lse = lse.float().contiguous()
        return lse.masked_fill(~torch.isfinite(lse), float("-inf"))

    def lse_to_kernel(self, lse: Tensor, packed: bool = True) -> Tensor:
        """``(Tq, H)`` lse (``-inf`` on blind rows) -> fp32 with ``+inf`` there, packed ``(H, Tq)`` or padded
        ``(N, H, max_q)`` (rows past a document's end ``+inf``), contiguous."""
        lse = lse.float().masked_fill(torch.isneginf(lse), float("inf"))
        if packed:
            return lse.t().contiguous()
        out = lse.new_full((len(self.lens_q), lse.shape[1], self.max_q), float("inf"))
        doc, pos = self._doc_rows(lse.device)
        out[doc, :, pos] = lse
        return out


def _prepare(backend: str, q, k, v, cu_q, cu_k, cq, ck):
    """The backend's ops (or :class:`BackendUnavailable`) and the kernels' view of the block; the view is
    ``None`` when the block has no query or no key (nothing to launch)."""
    ops = _ops(backend, q, k, v)
    return ops, (_Block.build(q, cu_q, cu_k, cq, ck) if q.shape[0] and k.shape[0] else None)


def _empty_forward(q: Tensor) -> tuple[Tensor, Tensor]:
    return q.new_zeros(q.shape), torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)


def _empty_backward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


# -------------------------------------------------------------------------------------------- torch_flash


def torch_flash_forward(q, k, v, cu_q, cu_k, cq, ck, causal, scale):
    """Block forward with PyTorch's flash kernel: ``out (Tq, H, D)`` and ``lse (Tq, H)`` fp32."""
    ops, blk = _prepare("torch_flash", q, k, v, cu_q, cu_k, cq, ck)
    if blk is None:
        return _empty_forward(q)
    out, lse, *_ = ops.forward(
        blk.pad(q),
        blk.pad(k),
        blk.pad(v),
        blk.cu_q,
        blk.cu_k,
        blk.max_q,
        blk.max_k,
        0.0,
        bool(causal),
        False,
        scale=float(scale),
    )
    return blk.unpad(out), blk.lse_from_kernel(lse, q, "torch_flash", ops.packed_lse)


def torch_flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, cq, ck, causal, scale):
    """Block gradients with PyTorch's flash kernel against the given (joint) ``out`` / ``lse``."""
    ops, blk = _prepare("torch_flash", q, k, v, cu_q, cu_k, cq, ck)
    if blk is None:
        return _empty_backward(q, k, v)
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # read only with dropout, which is 0 here
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = ops.backward(
        blk.pad(dout.to(q.dtype)),
        blk.pad(q),
        blk.pad(k),
        blk.pad(v),
        blk.pad(out.to(q.dtype)),
        blk.lse_to_kernel(lse, ops.packed_lse),
        blk.cu_q,
        blk.cu_k,
        blk.max_q,
        blk.max_k,
        0.0,
        bool(causal),
        rng_state,
        unused,
        scale=float(scale),
    )
    return blk.unpad(dq), blk.unpad(dk), blk.unpad(dv)


# --------------------------------------------------------------------------------------------- flash_attn
# Positional layouts, from flash_attn/flash_attn_interface.py of Dao-AILab/flash-attention:
#   2.6.x  _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
#              dropout_p, softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
#              return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None)
#          -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)
#          _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
#              max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
#              deterministic, rng_state=None) -> (dq, dk, dv, softmax_d), dq/dk/dv written in place
#   >= 2.7 (custom ops "flash_attn::..."; 2.7.4 appended zero_tensors=False to both)
#          _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
#              dropout_p, softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
#              alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None, ...)
#          -> (out, softmax_lse, S_dmask, rng_state)
#          _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
#              max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
#              window_size_right, softcap, alibi_slopes, deterministic, rng_state=None, ...) -> softmax_d,
#              dq/dk/dv mutated


def _fa_window(version: tuple[int, int]) -> tuple:
    """The window-size positional arguments: one ``(left, right)`` tuple before 2.7, two ints from 2.7 on."""
    return ((-1, -1),) if version < (2, 7) else (-1, -1)


def flash_attn_forward(q, k, v, cu_q, cu_k, cq, ck, causal, scale):
    """Block forward with flash-attn's varlen kernel: ``out (Tq, H, D)`` and ``lse (Tq, H)`` fp32."""
    ops, blk = _prepare("flash_attn", q, k, v, cu_q, cu_k, cq, ck)
    if blk is None:
        return _empty_forward(q)
    res = ops.forward(
        blk.pad(q),
        blk.pad(k),
        blk.pad(v),
        blk.cu_q,
        blk.cu_k,
        blk.max_q,
        blk.max_k,
        0.0,
        float(scale),
        bool(causal),
        *_fa_window(ops.version),
        0.0,
        None,
        False,
    )  # softcap, alibi_slopes, return_softmax
    out, lse = (res[0], res[5]) if ops.version < (2, 7) else (res[0], res[1])
    return blk.unpad(out), blk.lse_from_kernel(lse, q, "flash_attn")


def flash_attn_backward(dout, q, k, v, out, lse, cu_q, cu_k, cq, ck, causal, scale):
    """Block gradients with flash-attn's varlen kernel against the given (joint) ``out`` / ``lse``."""
    ops, blk = _prepare("flash_attn", q, k, v, cu_q, cu_k, cq, ck)
    if blk is None:
        return _empty_backward(q, k, v)
    qp, kp, vp = blk.pad(q), blk.pad(k), blk.pad(v)
    dq, dk, dv = torch.empty_like(qp), torch.empty_like(kp), torch.empty_like(vp)
    ops.backward(
        blk.pad(dout.to(q.dtype)),
        qp,
        kp,
        vp,
        blk.pad(out.to(q.dtype)),
        blk.lse_to_kernel(lse),
        dq,
        dk,
        dv,
        blk.cu_q,
        blk.cu_k,
        blk.max_q,
        blk.max_k,
        0.0,
        float(scale),
        bool(causal),
        *_fa_window(ops.version),
        0.0,
        None,
        False,
        None,
    )  # softcap, alibi, deterministic, rng_state
    return blk.unpad(dq), blk.unpad(dk), blk.unpad(dv)
