"""Attention kernels: local varlen attention with LSE, branch attention, LSE merge, zigzag CP ring."""

from lightning_codraft.attention.branch import branch_attention_backward, branch_attention_forward
from lightning_codraft.attention.cached import cached_attention
from lightning_codraft.attention.codraft import codraft_attention
from lightning_codraft.attention.local import (
    BACKENDS,
    select_backend,
    varlen_attention,
    varlen_attention_backward,
    varlen_attention_forward,
)
from lightning_codraft.attention.local_cuda import BackendUnavailable
from lightning_codraft.attention.merge import merge_attention
from lightning_codraft.attention.packing import (
    PackedDocuments,
    document_ids_from_cu_seqlens,
    pack_documents,
    position_ids_from_cu_seqlens,
    shift_left_local,
    validate_cu_seqlens,
)
from lightning_codraft.attention.zigzag import ZigzagLayout, shift_left, zigzag_shard, zigzag_unshard

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "PackedDocuments",
    "ZigzagLayout",
    "branch_attention_backward",
    "branch_attention_forward",
    "cached_attention",
    "codraft_attention",
    "document_ids_from_cu_seqlens",
    "merge_attention",
    "pack_documents",
    "position_ids_from_cu_seqlens",
    "select_backend",
    "shift_left",
    "shift_left_local",
    "validate_cu_seqlens",
    "varlen_attention",
    "varlen_attention_backward",
    "varlen_attention_forward",
    "zigzag_shard",
    "zigzag_unshard",
]
