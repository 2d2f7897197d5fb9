"""The mesh side of :class:`~lightning_codraft.training.module.CoDraftModule`: binding the module to its (dp, pp, cp)
layout (the pipeline stage it keeps, its runners, how its gradients are reduced) and gathering whole state dicts
back from stages and shards (for the rollout engines and exports).

A mixin of the module (it sets and reads ``parallel_dims``, ``pipeline``, ``ref_pipeline``, ``sharding``,
``grad_average_size`` and ``released_bytes``); the strategies call :meth:`configure_parallel` once per process.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_codraft.parallel.fsdp import full_row
from lightning_codraft.parallel.parallel_dims import ParallelDims
from lightning_codraft.parallel.pipeline import gather_stage_states, prune_unowned
from lightning_codraft.parallel.pp_runner import PipelineRunner


class ParallelHooks:
    """Bind the module to its mesh; gather its whole state back."""

    def configure_parallel(
        self,
        dims: ParallelDims,
        grad_average_size: int = 1,
        sharding: str = "ddp",
        compute_dtype: Optional[torch.dtype] = None,
    ) -> None:
        """Called by the strategy with the mesh, before it wraps or shards the module and before optimizers exist.

        Args:
            dims: the (dp, pp, cp) layout with its groups.
            grad_average_size: ranks over which the strategy's wrapper AVERAGES gradients (the loss is scaled).
            sharding: ``"fsdp"`` (FSDP2 sums the gradients of every rank's loss share) or ``"ddp"``.
            compute_dtype: the dtype activations flow in between pipeline stages (FSDP2's mixed-precision
                compute dtype), when it differs from the parameters'.

        Under PP this rank keeps only its pipeline stage (the embeddings on the first stage, its decoder layers,
        the final norm, ``lm_head`` and the draft on the last; with tied embeddings the first and the last stage
        both hold the shared weight); every other submodule is replaced by a parameter-less placeholder
        (``parallel.pipeline.prune_unowned``), so optimizers and checkpoints hold this stage's slice only. The
        module is then bound to this stage: configuring it for another stage or mesh raises.
        """
        binding = (dims.pp, dims.pp_rank, self.config.layers_per_stage) if dims.pp_enabled else None
        if self._stage_binding is not None and binding != self._stage_binding:
            pp, stage, sizes = self._stage_binding
            raise ValueError(
                f"this CoDraftModule holds only pipeline stage {stage} of pp={pp} (layers_per_stage="
                f"{sizes}; the other stages were pruned), so it cannot be configured for pp={dims.pp} "
                f"stage {dims.pp_rank}; build a fresh module for the new mesh and load a checkpoint"
            )
        self.parallel_dims = dims
        self.grad_average_size = int(grad_average_size)
        self.sharding = sharding
        if not dims.pp_enabled or self._stage_binding is not None:
            return
        c = self.config
        stage = dict(
            stage=dims.pp_rank,
            num_stages=dims.pp,
            pp_group=dims.pp_group,
            tap_group=dims.tap_group,
            cp_group=dims.cp_group,
            layers_per_stage=c.layers_per_stage,
        )
        self.pipeline = PipelineRunner(self.policy, tap_ids=self._tap_ids() or (), schedule=c.pp_schedule, **stage)
        self.pipeline.activation_dtype = compute_dtype
        keep = self.pipeline.stage_module.owned_modules() + ([self.draft] if dims.is_last_stage else [])
        if self.reference is not None:
            self.ref_pipeline = PipelineRunner(self.reference, schedule="gpipe", **stage)
            self.ref_pipeline.activation_dtype = compute_dtype
            keep += self.ref_pipeline.stage_module.owned_modules()
        self.released_bytes += prune_unowned(self, keep)
        self._stage_binding = binding

    def share_mask_embedding(self) -> None:
        """Under PP: the first stage sends the policy's embedding of the drafter's mask token to the last stage,
        which keeps it as ``stage_mask_embedding`` for this step's blocks (one row over the TapChannel's group;
        every stage calls it). The embedding is read detached, as every policy input of the draft."""
        dims = self.parallel_dims
        like = next(p for p in self.pipeline.stage_module.parameters())
        row = torch.zeros(self.policy.config.hidden_size, dtype=like.dtype, device=like.device)
        if dims.is_first_stage:
            weight = self.policy.model.embed_tokens.weight
            row = full_row(weight.detach(), self.draft_term.mask_token_id).to(like.dtype)
        dist.broadcast(row, group_src=0, group=dims.tap_group)
        self.stage_mask_embedding = row

    def full_state_dicts(self) -> tuple[Optional[dict[str, Tensor]], Optional[dict[str, Tensor]]]:
        """Full HF-named ``(policy_state, draft_state)`` for a rollout engine; a collective under PP.

        Without PP every rank gets both dicts. FSDP2 shards are gathered (a collective over the stage's dp x cp
        ranks); under PP the stages' states are gathered onto the first stage (``pp_rank == 0``), which gets the
        full dicts, the other stages get ``(None, None)``. Call on every rank.
        """
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in self.state_dict().items()}
        whole = gather_stage_states(state, self.parallel_dims.pp_group if self.pipeline else None)
        if whole is None:
            return None, None
        policy = {k[len("policy.") :]: v.detach() for k, v in whole.items() if k.startswith("policy.")}
        draft = {k[len("draft.") :]: v.detach() for k, v in whole.items() if k.startswith("draft.")}
        return policy, draft
