"""FSDP2 over the dp x cp ranks of each pipeline stage (torchtitan's layout), and Lightning's precision strings.

Every rank of one pipeline stage holds ``1 / (dp * cp)`` of that stage's parameters, gradients and optimizer state:
``fully_shard`` on every decoder layer this rank holds (policy, reference policy, the draft's layer), then on the
roots that hold the rest (embeddings, final norms, heads). The draft (one decoder layer) is one unit whose
``ttt_forward`` gathers it. Without PP the root is the whole module; under PP the policy's (and the reference's)
root is this rank's ``PolicyStage`` (what the pipeline schedule runs) and the draft a root of its own (it runs in
the loss function on the last stage).

Gradients are SUMMED over the shard group (``set_gradient_divide_factor(1)`` with sum-only collectives): every
rank's loss is its share of the global token-mean loss, so the gradient is the sum of the shares, as with the
explicit reduction under PP and DDP's average times the loss scale.

Precision (Lightning's argument, ``Fabric(precision=...)`` / ``Trainer(precision=...)``):

- ``"32-true"``: everything fp32 (the exact tests).
- ``"bf16-mixed"``: fp32 master weights and optimizer state, bf16 compute, fp32 gradient reduction (FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; without FSDP, Lightning's autocast).
- ``"bf16-true"``: parameters, gradients and optimizer state in bf16 (Lightning converts the module); updates below
  bf16's resolution round away, which :func:`bf16_resolution_warning` says.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

SHARDINGS = ("fsdp", "ddp")
_MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def mixed_precision_policy(precision: Optional[str]) -> MixedPrecisionPolicy:
    """FSDP2's policy for Lightning's ``precision`` string (fp32 reduction whenever compute is 16-bit)."""
    dtype = _MIXED.get(str(precision))
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def _shard(module: nn.Module, mesh, mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool = True) -> None:
    fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum: reduce with a plain SUM


def _is_pruned(module: Optional[nn.Module]) -> bool:
    return module is None or hasattr(module, "pruned_name")


def shard_decoder_layers(models: Iterable[Optional[nn.Module]], mesh, mp_policy: MixedPrecisionPolicy) -> None:
    """``fully_shard`` every decoder layer this rank holds of the given policies (pruned layers are skipped)."""
    for policy in models:
        if _is_pruned(policy):
            continue
        for layer in policy.model.layers:
            if not _is_pruned(layer):
                _shard(layer, mesh, mp_policy)


def shard_codraft(module: nn.Module, mesh, precision: Optional[str] = None) -> nn.Module:
    """Apply FSDP2 to a ``CoDraftModule`` (already configured for its mesh, pruned to its stage under PP).

    Args:
        module: the module; its ``policy``, ``draft``, optional ``reference`` and, under PP, ``pipeline`` /
            ``ref_pipeline`` runners are sharded as the module docstring says.
        mesh: the 1-D DeviceMesh over the stage's dp x cp ranks (``ParallelDims.dp_cp_mesh``).
        precision: Lightning's precision string.

    Returns:
        ``module`` itself (FSDP2 changes it in place).
    """
    mp_policy = mixed_precision_policy(precision)
    reference = getattr(module, "reference", None)
    shard_decoder_layers((module.policy, reference), mesh, mp_policy)
    draft = module.draft
    if not _is_pruned(draft):  # one unit; training runs it through forward and the methods its term names
        _shard(draft, mesh, mp_policy)
        for method in module.draft_term.fsdp_methods:
            register_fsdp_forward_method(draft, method)
    pipeline = getattr(module, "pipeline", None)
    if pipeline is None:
        if not _is_pruned(reference):
            _shard(reference, mesh, mp_policy)
        _shard(module, mesh, mp_policy, reshard_after_forward=False)  # the root: embeddings, norms, heads
        return module
    _shard(pipeline.stage_module, mesh, mp_policy, reshard_after_forward=False)
    ref_pipeline = getattr(module, "ref_pipeline", None)
    if ref_pipeline is not None:
        _shard(ref_pipeline.stage_module, mesh, mp_policy, reshard_after_forward=False)
    return module


def full_row(weight: torch.Tensor, index: int) -> torch.Tensor:
    """Row ``index`` of a 2-D parameter, whole: of an FSDP2-sharded one (a DTensor sharded on dim 0), from the rank
    holding it by one all-reduce of one row over the shard group (a collective: call on every rank of it)."""
    if not isinstance(weight, DTensor):
        return weight[index]
    local, group = weight.to_local(), weight.device_mesh.get_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunk = -(-weight.shape[0] // size)
    row = torch.zeros(weight.shape[1], dtype=local.dtype, device=local.device)
    if index // chunk == rank:
        row.copy_(local[index - rank * chunk])
    dist.all_reduce(row, group=group)
    return row


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 manages ``module`` or any of its submodules."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def bf16_resolution_warning(params: Iterable[torch.Tensor], lr: float, precision: Optional[str]) -> Optional[str]:
    """A warning text when ``precision="bf16-true"`` would round most updates of size ``lr`` away, else None.

    bf16 keeps 8 significant bits: a weight ``w`` moves only by steps of about ``|w| * 2^-7``, so an Adam update of
    about ``lr`` that is below half that spacing rounds to zero. The typical weight is the median of the
    parameters' root-mean-square values.
    """
    if str(precision) != "bf16-true" or lr <= 0:
        return None
    rms = sorted(float(p.detach().float().pow(2).mean().sqrt()) for p in params if p.numel() > 1)
    if not rms:
        return None
    typical = rms[len(rms) // 2]
    half_spacing = typical * 2.0**-8
    if lr >= half_spacing:
        return None
    return (
        f"precision='bf16-true' with learning rate {lr:g}: bf16 weights of typical size {typical:.3g} move in "
        f"steps of {2 * half_spacing:.2g}, so updates of ~{lr:g} round away and the model barely trains; use "
        f"precision='bf16-mixed' (fp32 master weights, bf16 compute) or a learning rate >= "
        f"{half_spacing:.2g} ({math.log2(half_spacing / lr):.1f} binary orders more)"
    )
