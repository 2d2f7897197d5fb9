"""Packing variable-length documents into one THD token stream with ``cu_seqlens``.

The packed layout is the one every layer of lightning_codraft speaks: tokens of all documents
concatenated along dim 0, ``cu_seqlens`` the int32 prefix sum of document lengths (``cu_seqlens[0] == 0``,
``cu_seqlens[-1] == T``), position ids restarting at 0 in each document. Under context parallelism every
document length is a multiple of ``2 * cp`` (:func:`pack_documents` pads to ``multiple_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PackedDocuments:
    """A packed batch of documents.

    Attributes:
        input_ids: ``(T,)`` int64 token ids, documents concatenated, each padded to ``multiple_of``.
        cu_seqlens: ``(N + 1,)`` int32 prefix sum of padded document lengths.
        position_ids: ``(T,)`` int64 position of each token inside its document.
        valid: ``(T,)`` bool, False on padding tokens.
        lengths: ``(N,)`` int64 unpadded document lengths.
    """

    input_ids: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    valid: Tensor
    lengths: Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.lengths.shape[0])


def validate_cu_seqlens(cu_seqlens: Tensor, total_tokens: int | None = None, multiple_of: int = 1) -> None:
    """Raise ``ValueError`` unless ``cu_seqlens`` is a valid prefix sum (optionally of multiples)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 (or int64), got {cu_seqlens.dtype}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens[0]={cu[0]} must be 0")
    for i in range(1, len(cu)):
        if cu[i] <= cu[i - 1]:
            raise ValueError(
                f"cu_seqlens must be strictly increasing: cu_seqlens[{i}]={cu[i]} <= "
                f"cu_seqlens[{i - 1}]={cu[i - 1]} (empty documents are not allowed)"
            )
        if multiple_of > 1 and cu[i] % multiple_of:
            raise ValueError(
                f"cu_seqlens[{i}]={cu[i]} is not a multiple of {multiple_of}; pad documents with "
                f"pack_documents(..., multiple_of={multiple_of})"
            )
    if total_tokens is not None and cu[-1] != total_tokens:
        raise ValueError(f"cu_seqlens[-1]={cu[-1]} does not cover the batch of {total_tokens} tokens")


def position_ids_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """``(T,)`` int64 positions restarting at 0 at every document start."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths)
    return torch.arange(int(cu[-1]), device=cu.device) - starts


def document_ids_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """``(T,)`` int64 index of the document each token belongs to."""
    cu = cu_seqlens.to(torch.int64)
    return torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), cu[1:] - cu[:-1])


def pack_documents(docs: Sequence[Sequence[int] | Tensor], multiple_of: int = 1, pad_id: int = 0) -> PackedDocuments:
    """Concatenate documents into one packed batch, padding each to a multiple of ``multiple_of``.

    Args:
        docs: token id sequences (lists or 1-D tensors), each non-empty.
        multiple_of: every padded document length is a multiple of this (use ``2 * cp`` under CP).
        pad_id: token id used for padding (padding is masked out by ``valid``).

    Returns:
        A :class:`PackedDocuments`.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    if len(docs) == 0:
        raise ValueError("pack_documents needs at least one document")
    ids, valid, lengths, padded = [], [], [], []
    for i, d in enumerate(docs):
        t = torch.as_tensor(d, dtype=torch.int64).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"document {i} is empty")
        n = t.numel()
        m = -(-n // multiple_of) * multiple_of
        ids.append(torch.cat([t, t.new_full((m - n,), pad_id)]))
        valid.append(torch.arange(m) < n)
        lengths.append(n)
        padded.append(m)
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(padded), 0)
    return PackedDocuments(
        input_ids=torch.cat(ids),
        cu_seqlens=cu,
        position_ids=position_ids_from_cu_seqlens(cu),
        valid=torch.cat(valid),
        lengths=torch.tensor(lengths, dtype=torch.int64),
    )


def shift_left_local(x: Tensor, cu_seqlens: Tensor, shift: int, fill: float | int = 0) -> Tensor:
    """``y[i] = x[i + shift]`` when token ``i + shift`` is in the same document as ``i``, else ``fill``.

    Args:
        x: ``(T, ...)`` packed tensor of the whole batch.
        cu_seqlens: ``(N + 1,)`` prefix sum of document lengths.
        shift: non-negative offset.
        fill: value for rows whose shifted source lies past their document's end.
    """
    if shift < 0:
        raise ValueError(f"shift must be >= 0, got {shift}")
    if shift == 0:
        return x
    T = x.shape[0]
    pos = position_ids_from_cu_seqlens(cu_seqlens).to(x.device)
    cu = cu_seqlens.to(torch.int64).to(x.device)
    doc_len = torch.repeat_interleave(cu[1:] - cu[:-1], cu[1:] - cu[:-1])
    ok = pos + shift < doc_len
    src = torch.clamp(torch.arange(T, device=x.device) + shift, max=T - 1)
    y = x[src]
    mask = ok.view(-1, *([1] * (x.dim() - 1)))
    return torch.where(mask, y, torch.as_tensor(fill, dtype=x.dtype, device=x.device))


def masked_suffix(cu_seqlens: Tensor, mask: Tensor, reach: int) -> Tensor:
    """Per document, the rows from ``reach`` rows before its first ``mask`` row to its end, as a prefix sum.

    A causal model whose row ``i`` feeds outputs at rows ``i + 1 .. i + reach`` (a TTT unroll of ``reach`` steps)
    needs no row that ends more than ``reach`` rows before the first row that counts: only those rows' keys.

    Args:
        cu_seqlens: ``(N + 1,)`` prefix sum of document lengths.
        mask: ``(T,)`` bool / float, the rows that count.
        reach: how many rows past itself a row's output reaches (>= 0).

    Returns:
        ``(N + 1,)`` int32 prefix sum of the suffix lengths (0 for a document without a ``mask`` row): the
        ``cu_seqlens_q`` of :func:`~lightning_codraft.attention.codraft.codraft_attention`.
    """
    if reach < 0:
        raise ValueError(f"reach must be >= 0, got {reach}")
    cu = cu_seqlens.to(torch.int64).cpu()
    T = int(cu[-1])
    if tuple(mask.shape) != (T,):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected ({T},) = cu_seqlens[-1] rows")
    hit = mask.detach().cpu() != 0
    # first masked row of each document (its end when none): the minimum of masked row ids per document
    rows = torch.where(hit, torch.arange(T), T)
    doc = document_ids_from_cu_seqlens(cu).cpu().long()
    first = torch.full((len(cu) - 1,), T, dtype=torch.int64).scatter_reduce(0, doc, rows, "amin")
    start = torch.clamp(first - reach, min=cu[:-1])
    lengths = torch.where(first < cu[1:], cu[1:] - start, 0)
    out = torch.zeros(len(cu), dtype=torch.int32)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def suffix_rows(cu_seqlens: Tensor, cu_seqlens_q: Tensor, total_tokens: int | None = None) -> Tensor:
    """``(Tq,)`` int64 packed row ids of the last ``cu_seqlens_q[d + 1] - cu_seqlens_q[d]`` rows of each document
    ``d`` of ``cu_seqlens`` (:func:`masked_suffix`), in order; raises ``ValueError`` unless ``cu_seqlens_q`` starts
    at 0, ends at ``total_tokens`` (when given) and gives each document a suffix length in [0, its length]."""
    cu, cq = cu_seqlens.to(torch.int64), cu_seqlens_q.to(torch.int64).to(cu_seqlens.device)
    lq = cq[1:] - cq[:-1]
    if (
        cu.shape != cq.shape
        or int(cq[0]) != 0
        or bool((lq < 0).any())
        or bool((lq > cu[1:] - cu[:-1]).any())
        or (total_tokens is not None and int(cq[-1]) != total_tokens)
    ):
        rows = "" if total_tokens is None else f", end at the {total_tokens} query rows"
        raise ValueError(
            f"cu_seqlens_q {cq.tolist()} must start at 0{rows} and give each document of cu_seqlens "
            f"{cu.tolist()} a suffix length in [0, its length]"
        )
    # row r of document d's suffix -> end_d - lq_d + (r - cq[d])
    offset = torch.repeat_interleave(cu[1:] - lq - cq[:-1], lq)
    return torch.arange(int(cq[-1]), device=cu.device) + offset
