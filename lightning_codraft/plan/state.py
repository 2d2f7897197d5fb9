"""What a rank holds between steps: parameters, gradients, AdamW state and buffers, from models built on the META
device (no memory, no weights) and split exactly as the training code splits them.

Which modules a rank holds: without PP, the whole policy, the draft and the optional reference policy. Under PP
the stage's :class:`~lightning_codraft.parallel.pipeline.PolicyStage` ``owned_modules()`` (the embeddings on the
first stage, its layers of ``StageLayout.split``, the final norm and ``lm_head`` on the last; with tied embeddings
the first and the last stage each hold the one shared weight), the draft on the last stage, the reference's owned
modules likewise (``CoDraftModule.configure_parallel`` prunes everything else). A tensor shared inside a rank
(tied embeddings) counts once.

Bytes per parameter tensor of shape ``(d0, *rest)`` (``n = prod(rest)``, ``N = dp * cp`` shard ranks, ``r`` this
rank's index among them, ``c = ceil(d0 / N)``; ``p``, ``g``, ``o`` the precision's parameter, gradient and
optimizer-state bytes, ``plan/spec.py``):

- FSDP2 (``fully_shard`` pads every parameter along dim 0 to a multiple of ``N`` and keeps the padded shard):
  parameter ``c * n * p`` on every rank; gradient ``c * n * g`` (the reduce-scatter output, padded, one buffer
  per FSDP unit); AdamW ``2 * rows_r * n * o`` with ``rows_r = clamp(d0 - r * c, 0, c)`` (``exp_avg`` and
  ``exp_avg_sq`` are ``zeros_like`` the unpadded local shard). Rank 0 holds the most.
- replicated (DDP, or one rank per stage): parameter ``d0 * n * p``, gradient ``d0 * n * g``, AdamW
  ``2 * d0 * n * o``.

Gradients and AdamW state exist only for trained tensors (the policy; the draft with ``draft.mode=cotrain``); the
reference policy is frozen. AdamW's ``step`` counters are host scalars (not ``capturable``) and count nothing.

FSDP2 units (what is all-gathered at once, in the compute dtype): every decoder layer, the draft, and the root
(the module's, or under PP the stage's, remaining parameters: embeddings, final norm, ``lm_head``). A unit's
unsharded size is ``N * sum(c * n) * compute bytes`` (the all-gather output, padding included).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import nn

from lightning_codraft.models.eagle3 import Eagle3Draft
from lightning_codraft.models.policy import Policy
from lightning_codraft.parallel.pipeline import PolicyStage, StageLayout
from lightning_codraft.plan.spec import PlanSpec


@dataclass
class MetaModels:
    """The run's models on the meta device (shapes only) and the pipeline split."""

    policy: Policy
    """The policy."""
    draft: Eagle3Draft
    """The EAGLE-3 draft, as ``rl.run.build.build_draft`` shapes it for the policy."""
    reference: Optional[Policy]
    """The frozen reference policy, or None."""
    layout: StageLayout
    """Layers of every pipeline stage."""

    @classmethod
    def build(cls, spec: PlanSpec) -> MetaModels:
        """Build policy, draft (and reference) on the meta device; raise ``ValueError`` on an impossible split."""
        layout = StageLayout.split(spec.policy.num_hidden_layers, spec.pp, spec.layers_per_stage)
        with torch.device("meta"):
            policy = Policy(spec.policy)
            draft = Eagle3Draft.from_policy(policy)  # taps and shapes as build_draft derives them
            V = spec.policy.vocab_size
            vd = V if spec.draft_vocab_size is None else spec.draft_vocab_size
            if not 1 <= vd <= V:
                raise ValueError(f"draft.draft_vocab_size={vd} must be in [1, vocab_size={V}]")
            if vd != V:
                draft = Eagle3Draft(replace(draft.config, draft_vocab_size=vd))
            reference = copy.deepcopy(policy) if spec.with_reference else None
        return cls(policy=policy, draft=draft, reference=reference, layout=layout)


@dataclass
class Unit:
    """One FSDP2 unit (or, unsharded, one group) of parameters a rank holds."""

    name: str
    """e.g. ``policy.layers.3``, ``policy.root``, ``draft``."""
    params: list[nn.Parameter] = field(default_factory=list)
    """Its parameters (meta tensors)."""
    trained: bool = True
    """Whether it has gradients and AdamW state."""
    layer: bool = False
    """A decoder layer (policy or reference) or the draft: resharded after use."""


def _units_of(model: nn.Module, owned: Iterable[nn.Module], prefix: str, trained: bool) -> list[Unit]:
    owned = list(owned)
    layers = [m for m in owned if m in list(model.model.layers)]
    index = {id(m): i for i, m in enumerate(model.model.layers)}
    units = [Unit(f"{prefix}.layers.{index[id(m)]}", list(m.parameters()), trained, True) for m in layers]
    root = [p for m in owned if m not in layers for p in m.parameters()]
    if root:
        units.append(Unit(f"{prefix}.root", root, trained, False))
    return units


def rank_units(models: MetaModels, spec: PlanSpec, stage: int) -> list[Unit]:
    """The parameter units pipeline stage ``stage`` holds, each shared tensor in one unit only."""

    def owned(model: Policy) -> list[nn.Module]:
        if spec.pp == 1:
            m = model.model
            return [m.embed_tokens, *m.layers, m.norm, model.lm_head]
        return PolicyStage(model, models.layout, stage).owned_modules()

    units = _units_of(models.policy, owned(models.policy), "policy", True)
    if stage == spec.pp - 1:
        units.append(Unit("draft", list(models.draft.parameters()), spec.trains_draft, True))
    if models.reference is not None:
        units += _units_of(models.reference, owned(models.reference), "reference", False)
    seen: set[int] = set()
    for u in units:  # tied embeddings: embed_tokens and lm_head are one tensor
        u.params = [p for p in u.params if not (id(p) in seen or seen.add(id(p)))]
    return [u for u in units if u.params]


def rank_buffers(models: MetaModels, spec: PlanSpec, stage: int) -> int:
    """Bytes of buffers: RoPE tables on every rank (pruning keeps parameter-less modules), the draft's ``d2t`` /
    ``t2d`` and RoPE on the last stage; floating buffers follow the parameters under ``bf16-true``."""
    mods: list[nn.Module] = [models.policy.model.rotary_emb]
    if models.reference is not None:
        mods.append(models.reference.model.rotary_emb)
    if stage == spec.pp - 1:
        mods.append(models.draft)
    total = 0
    for m in mods:
        for b in m.buffers():
            size = spec.bytes[0] if b.is_floating_point() else b.element_size()
            total += b.numel() * size
    return total


def shard_rows(rows: int, shards: int, rank: int) -> tuple[int, int]:
    """``(padded, local)`` rows of dim 0 that shard rank ``rank`` of ``shards`` holds (``torch.chunk`` semantics)."""
    chunk = -(-rows // shards)
    return chunk, max(0, min(chunk, rows - rank * chunk))


@dataclass
class StateBytes:
    """Bytes one rank holds between steps (see the module docstring for the formulas)."""

    parameters: int = 0
    """Trained and frozen parameters of the policy and the draft (the reference is counted apart)."""
    gradients: int = 0
    """Gradients of the trained parameters."""
    optimizer: int = 0
    """AdamW ``exp_avg`` + ``exp_avg_sq``."""
    reference: int = 0
    """The frozen reference policy's parameters."""
    buffers: int = 0
    """RoPE tables, the draft's vocabulary maps."""
    root_unsharded: int = 0
    """FSDP2: the policy root unit all-gathered (held from the forward to the end of the backward)."""
    reference_root_unsharded: int = 0
    """FSDP2 under PP: the reference stage root stays all-gathered after its forward (``reshard_after_forward=False``
    and no backward ever reshards it)."""
    largest_unit_unsharded: int = 0
    """FSDP2: the largest resharded unit all-gathered (a decoder layer or the draft), compute dtype."""
    largest_trained_unit: int = 0
    """Elements (padded, unsharded) of the largest trained unit: what one reduce-scatter handles."""
    trained_elements: int = 0
    """Elements of this rank's trained parameters (local shards): the size of AdamW's foreach temporaries."""
    trained_whole_elements: int = 0
    """Elements of the trained parameters as whole tensors: what autocast caches as bf16 copies (no FSDP2)."""


def state_bytes(models: MetaModels, spec: PlanSpec, stage: int, shard_rank: int = 0) -> StateBytes:
    """Parameters, gradients, AdamW state, reference and buffers of one rank, and its FSDP2 unit sizes.

    Args:
        models: :meth:`MetaModels.build` of ``spec``.
        spec: the run.
        stage: pipeline stage of the rank.
        shard_rank: its index among the stage's dp * cp ranks (``dp_rank * cp + cp_rank``); 0 holds the most.
    """
    p_b, g_b, o_b, c_b, _ = spec.bytes
    n_shards = spec.shards
    out = StateBytes(buffers=rank_buffers(models, spec, stage))
    for unit in rank_units(models, spec, stage):
        padded_elems = 0
        for p in unit.params:
            rows = p.shape[0]
            rest = p.numel() // rows
            padded, local = shard_rows(rows, n_shards, shard_rank if spec.fsdp else 0)
            padded_elems += padded * rest
            if unit.name.startswith("reference"):
                out.reference += padded * rest * p_b
                continue
            out.parameters += padded * rest * p_b
            if unit.trained:
                out.gradients += padded * rest * g_b
                out.optimizer += 2 * local * rest * o_b
                out.trained_elements += local * rest
                out.trained_whole_elements += p.numel()
        if not spec.fsdp:
            continue
        unsharded = n_shards * padded_elems * c_b
        if unit.name == "policy.root":
            out.root_unsharded = unsharded
        elif unit.name == "reference.root":
            out.reference_root_unsharded = unsharded if spec.pp > 1 else 0
        else:
            out.largest_unit_unsharded = max(out.largest_unit_unsharded, unsharded)
        if unit.trained:
            out.largest_trained_unit = max(out.largest_trained_unit, n_shards * padded_elems)
    return out
