"""Export a trained (sharded, pipelined) ``CoDraftModule``: the policy as a Hugging Face checkpoint, the draft as the
vLLM EAGLE-3 checkpoint, gathered one tensor at a time.

Every rank calls :func:`export_pretrained`. Each pipeline stage has one writer (its dp x cp rank 0); an FSDP2 shard
is gathered into a whole tensor (``full_tensor()``, a collective over the stage's dp x cp ranks) right before it is
written and dropped right after, and a writer holds at most one safetensors file of ``max_shard_bytes`` in memory,
so no rank ever holds a whole copy of the model. The writers' files are named by stage; global rank 0 writes
``config.json`` and the index that maps every tensor to its file. With tied embeddings the first stage's
``embed_tokens`` is written and the last stage's ``lm_head`` (the same weight) is not, as Hugging Face does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_codraft.models.eagle3_io import save_draft_state
from lightning_codraft.models.hf_io import ShardWriter, clear_weights, write_config, write_index
from lightning_codraft.parallel.collectives import is_distributed
from lightning_codraft.parallel.parallel_dims import ParallelDims


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def export_pretrained(
    module: nn.Module,
    out_dir: str | Path,
    dims: Optional[ParallelDims] = None,
    max_shard_bytes: int = 5 * 2**30,
    dtype: Optional[torch.dtype] = None,
) -> tuple[Path, Path]:
    """Write ``out_dir/policy`` (HF: config.json + safetensors + index) and ``out_dir/draft`` (vLLM EAGLE-3).

    Args:
        module: a ``CoDraftModule`` (set up by the strategy, or not); call on every rank.
        out_dir: where the two directories go.
        dims: the mesh (``module.parallel_dims`` by default).
        max_shard_bytes: the largest safetensors file a writer builds (and holds) at once.
        dtype: cast the tensors to this dtype (e.g. ``torch.bfloat16`` for serving); None keeps theirs.

    Returns:
        ``(policy_dir, draft_dir)``.
    """
    dims = dims or getattr(module, "parallel_dims", None) or ParallelDims()
    out = Path(out_dir)
    policy_dir, draft_dir = out / "policy", out / "draft"
    writer_rank = dims.dp_cp_rank == 0
    policy = module.policy
    tied = bool(getattr(policy.config, "tie_word_embeddings", False))
    if dims.rank == 0:
        policy_dir.mkdir(parents=True, exist_ok=True)
        clear_weights(policy_dir)
    _barrier()
    writer = (
        ShardWriter(policy_dir, prefix=f"model-pp{dims.pp_rank:02d}", max_shard_bytes=max_shard_bytes)
        if writer_rank
        else None
    )
    out_dtype = None
    for name, value in policy.state_dict().items():
        if tied and name == "lm_head.weight":
            continue  # the tied weight is written once, as model.embed_tokens.weight (by the first stage)
        full = _full(value)  # every rank of the stage joins the gather
        if writer is not None:
            full = full if dtype is None else full.to(dtype)
            out_dtype = out_dtype or full.dtype
            writer.add(name, full)
        del full
    parts = (writer.close(), writer.total_size, out_dtype) if writer is not None else ({}, 0, None)
    gathered = _gather(parts)
    if dims.rank == 0:
        weight_map = {k: v for m, _, _ in gathered for k, v in m.items()}
        write_index(policy_dir, weight_map, sum(size for _, size, _ in gathered))
        write_config(policy_dir, policy.config, next(d for _, _, d in gathered if d is not None))
    if dims.is_last_stage:
        draft_state = {k: _full(v) for k, v in module.draft.state_dict().items()}
        if writer_rank:
            if dtype is not None:
                draft_state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in draft_state.items()}
            save_draft_state(draft_state, module.draft.config, draft_dir)
    _barrier()
    return policy_dir, draft_dir


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def _gather(obj):
    if not is_distributed():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
