"""Attention kernels: local varlen attention with LSE, branch attention, LSE merge, zigzag CP ring."""

from lightning_codraft.attention.packing import (
    PackedBatch,
    document_ids_from_cu_seqlens,
    pack_documents,
    position_ids_from_cu_seqlens,
    shift_left_local,
    validate_cu_seqlens,
)

__all__ = [
    "PackedBatch",
    "document_ids_from_cu_seqlens",
    "pack_documents",
    "position_ids_from_cu_seqlens",
    "shift_left_local",
    "validate_cu_seqlens",
]
