"""Pipeline stages of a :class:`~lightning_codraft.models.Policy` on ``torch.distributed.pipelining``.

A policy of ``L`` decoder layers is cut into ``pp`` stages of consecutive layers (balanced by default,
explicit sizes on request). The first stage also owns the token embedding, the last the final norm and the
``lm_head`` (and, in the co-training step, the draft). Every stage runs the packed THD path
``policy.model.layers[i](x (T, H), cos, sin, cu_seqlens, cp_group)``.

Microbatches are packed batches of their own (own ``cu_seqlens`` and position ids), all padded to one token
count ``T`` so the schedule's static send/receive buffers fit every microbatch. A stage learns which
microbatch it is running from the ``mb`` keyword the schedule hands every stage (``mb=arange(M)`` chunked
into ``tensor([m])``), and looks up that microbatch's metadata with :meth:`PolicyStage.set_microbatches`.

Public API::

    layout = StageLayout.split(num_layers, pp, layers_per_stage=None)
    layout.layer_range(stage) -> (start, stop) ; layout.tap_owner(tap) -> stage ; layout.tap_owners(taps)
    stage_mod = PolicyStage(policy, layout, stage, cp_group=None, tap_sink=None, tap_ids=())
    schedule = build_schedule(stage_mod, pp_group, num_microbatches, tokens, schedule="1f1b", loss_fn=None)
    freed = prune_unowned(module, keep=stage_mod.owned_modules())   # other stages' modules -> Pruned placeholders

A rank that runs only its stage frees the rest of the policy with :func:`prune_unowned` (modules outside the
stage are replaced by parameter-less :class:`Pruned` placeholders, names of the kept ones unchanged); the stage
never calls them.

``tap_sink(microbatch, tap, hidden)`` is called with the hidden state ENTERING layer ``tap`` for every
``tap`` in ``tap_ids`` that this stage owns (tap ``L`` = the output of the last layer, before the final
norm, owned by the last stage); a :class:`~lightning_codraft.parallel.tap_channel.TapChannel` ``send`` fits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class StageLayout:
    """Which consecutive decoder layers every pipeline stage holds."""

    num_layers: int
    """Decoder layers ``L`` of the policy."""
    layer_ranges: tuple[tuple[int, int], ...]
    """``(start, stop)`` half-open layer range of every stage, in stage order, covering ``[0, L)``."""

    @property
    def num_stages(self) -> int:
        return len(self.layer_ranges)

    @classmethod
    def split(cls, num_layers: int, num_stages: int, layers_per_stage: Optional[Sequence[int]] = None) -> StageLayout:
        """Cut ``num_layers`` layers into ``num_stages`` stages.

        Args:
            num_layers: decoder layers of the policy.
            num_stages: pipeline stages (``pp``).
            layers_per_stage: explicit layer count of every stage (each >= 1, summing to ``num_layers``);
                ``None`` balances: every stage gets ``L // pp`` layers and the first ``L % pp`` stages one
                more (the last stage also carries the head, the losses and the draft).
        """
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages} must be >= 1")
        if num_stages > num_layers:
            raise ValueError(
                f"{num_stages} pipeline stages for a policy of {num_layers} layers: every stage needs "
                f"at least one layer; use pp <= {num_layers}"
            )
        if layers_per_stage is None:
            base, extra = divmod(num_layers, num_stages)
            sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        else:
            sizes = [int(n) for n in layers_per_stage]
            if len(sizes) != num_stages:
                raise ValueError(
                    f"layers_per_stage={list(layers_per_stage)} has {len(sizes)} entries for "
                    f"{num_stages} stages; give one layer count per stage"
                )
            if min(sizes) < 1 or sum(sizes) != num_layers:
                raise ValueError(
                    f"layers_per_stage={sizes} must be >= 1 each and sum to the {num_layers} layers "
                    f"of the policy (sums to {sum(sizes)})"
                )
        ranges, start = [], 0
        for n in sizes:
            ranges.append((start, start + n))
            start += n
        return cls(num_layers=num_layers, layer_ranges=tuple(ranges))

    def layer_range(self, stage: int) -> tuple[int, int]:
        """``(start, stop)`` layers of ``stage``."""
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage={stage} is outside [0, {self.num_stages})")
        return self.layer_ranges[stage]

    def tap_owner(self, tap: int) -> int:
        """Stage computing tap ``tap`` (the hidden state entering layer ``tap``; tap ``L`` is the last output)."""
        if not 0 <= tap <= self.num_layers:
            raise ValueError(
                f"tap layer {tap} is outside the model: tap ids are 0..{self.num_layers} for a "
                f"policy of {self.num_layers} layers (tap l = hidden state entering layer l)"
            )
        if tap == self.num_layers:
            return self.num_stages - 1
        for s, (start, stop) in enumerate(self.layer_ranges):
            if start <= tap < stop:
                return s
        raise AssertionError(f"layer ranges {self.layer_ranges} do not cover tap {tap}")

    def tap_owners(self, taps: Sequence[int]) -> dict[int, int]:
        """tap id -> owning stage, for every distinct tap in ``taps``."""
        return {t: self.tap_owner(int(t)) for t in sorted(set(int(t) for t in taps))}


@dataclass
class MicrobatchMeta:
    """What a stage needs to know about one packed microbatch besides the activations it receives."""

    cu_seqlens: Tensor
    """``(N + 1,)`` int32 GLOBAL prefix sum of document lengths (never sharded)."""
    position_ids: Tensor
    """``(T,)`` int64 position of each of this rank's tokens in its document (zigzag shard under CP)."""


class PolicyStage(nn.Module):
    """One pipeline stage of a policy: (embedding) -> layers ``[start, stop)`` -> (final norm + lm_head).

    The stage shares the policy's modules (its parameters ARE the policy's), and registers only the ones it
    owns, so ``stage.parameters()`` is this stage's slice of the policy.

    Args:
        policy: the full :class:`~lightning_codraft.models.Policy` (modules outside the stage stay unused).
        layout: the stage split.
        stage: this stage's index.
        cp_group: context-parallel group of this rank (ring attention), or ``None``.
        tap_sink: ``tap_sink(microbatch, tap, hidden (T, H))`` receives every tap in ``tap_ids`` this stage owns.
        tap_ids: taps to hand to ``tap_sink``.
    """

    def __init__(
        self,
        policy: nn.Module,
        layout: StageLayout,
        stage: int,
        cp_group: Optional[Any] = None,
        tap_sink: Optional[Callable[[int, int, Tensor], None]] = None,
        tap_ids: Sequence[int] = (),
    ):
        super().__init__()
        if layout.num_layers != policy.num_layers:
            raise ValueError(f"the layout splits {layout.num_layers} layers but the policy has {policy.num_layers}")
        self.stage = stage
        self.num_stages = layout.num_stages
        self.start, self.stop = layout.layer_range(stage)
        self.is_first = stage == 0
        self.is_last = stage == layout.num_stages - 1
        object.__setattr__(self, "_policy", policy)  # not registered: only the owned modules are
        if self.is_first:
            self.embed_tokens = policy.model.embed_tokens
        self.layers = nn.ModuleList(policy.model.layers[i] for i in range(self.start, self.stop))
        if self.is_last:
            self.norm = policy.model.norm
            self.lm_head = policy.lm_head
        owners = layout.tap_owners(tap_ids)
        if tap_ids and tap_sink is None:
            raise ValueError(f"tap_ids={tuple(tap_ids)} given without a tap_sink to hand them to")
        self.own_taps = frozenset(t for t, s in owners.items() if s == stage)
        self.tap_sink = tap_sink
        self.cp_group = cp_group
        self.head_fn: Optional[Callable[[Tensor, int], Tensor]] = None
        """Last stage: ``head_fn(logits (T, V), m) -> (T, W)`` replaces the logits of microbatch ``m`` as the stage's
        output (a forward-only pass reduces them per row, so the schedule does not keep M vocabulary-wide outputs);
        None returns the logits."""
        self._microbatches: list[MicrobatchMeta] = []

    def owned_modules(self) -> list[nn.Module]:
        """The policy's submodules this stage holds: embeddings (first), its layers, norm and ``lm_head`` (last)."""
        head = [self.norm, self.lm_head] if self.is_last else []
        return ([self.embed_tokens] if self.is_first else []) + list(self.layers) + head

    def set_microbatches(self, microbatches: Sequence[MicrobatchMeta]) -> None:
        """Metadata of the microbatches of the coming step, indexed like the schedule's microbatches."""
        self._microbatches = list(microbatches)

    def forward(self, x: Tensor, mb: Tensor) -> Tensor:
        """Run this stage on one microbatch.

        Args:
            x: first stage: ``(1, T)`` int64 token ids; later stages: ``(T, H)`` hidden state from the
                previous stage (``T`` tokens of this rank, its zigzag shard under CP).
            mb: ``(1,)`` int64 index of the microbatch (chunk of ``arange(M)``).

        Returns:
            ``(T, H)`` hidden state for the next stage, or ``(T, V)`` logits on the last stage.
        """
        m = int(mb.reshape(-1)[0])
        if not 0 <= m < len(self._microbatches):
            raise RuntimeError(
                f"stage {self.stage} got microbatch {m} but set_microbatches() registered {len(self._microbatches)}"
            )
        meta = self._microbatches[m]
        policy = self._policy
        h = policy.embed(x.reshape(-1)) if self.is_first else x
        cos, sin = policy.rotary(meta.position_ids, h.dtype)  # h: this stage's dtype (others may be meta)
        for i, layer in zip(range(self.start, self.stop), self.layers):
            if i in self.own_taps:
                self.tap_sink(m, i, h)
            h = layer(h, cos, sin, meta.cu_seqlens, cp_group=self.cp_group)
        if not self.is_last:
            return h
        if self.stop in self.own_taps:  # tap L: the last layer's output, before the final norm
            self.tap_sink(m, self.stop, h)
        logits = policy.head(h)
        return logits if self.head_fn is None else self.head_fn(logits, m)


class Pruned(nn.Module):
    """Stands in for a submodule whose parameters live on another pipeline stage: no parameters, no state.

    Calling it raises, naming what it replaced, so a forward that strays off this rank's stage fails loudly.
    """

    def __init__(self, name: str):
        super().__init__()
        self.pruned_name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self.pruned_name} lives on another pipeline stage; this rank holds only its own stage "
            f"(run it through the pipeline, or build a whole model for it)"
        )

    def extra_repr(self) -> str:
        return f"{self.pruned_name} (on another pipeline stage)"


def prune_unowned(module: nn.Module, keep: Iterable[nn.Module]) -> int:
    """Replace every submodule of ``module`` outside the ``keep`` modules by a :class:`Pruned` placeholder.

    The rank then holds only the memory of ``keep`` (e.g. ``PolicyStage.owned_modules()`` plus the draft on the last
    stage), and its ``state_dict`` / ``named_parameters`` list exactly what it owns, under their full names
    (``policy.model.layers.5...``: indices never shift), so checkpoints keyed by name load on any mesh. Ancestors
    of kept modules are recursed into; modules without parameters (RoPE tables) stay everywhere. With tied
    embeddings the first stage keeps ``embed_tokens`` and the last ``lm_head``: one module each, the same weight.

    Args:
        module: the module to prune in place (e.g. a ``CoDraftModule`` holding the policy and the draft).
        keep: the modules this rank owns.

    Returns:
        Bytes of the parameters no kept module holds any more (freed once nothing else references them).
    """
    kept = {id(m) for m in keep}
    kept_params = {id(p) for m in keep for p in m.parameters()}
    ancestors = set()
    for name, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in kept:
            parts = name.split(".") if name else []
            node = module
            ancestors.add(id(node))
            for part in parts[:-1]:
                node = node._modules[part]
                ancestors.add(id(node))
    dropped: dict[int, int] = {}

    def visit(parent: nn.Module, prefix: str) -> None:
        for n, p in parent.named_parameters(recurse=False):
            if id(p) not in kept_params:
                raise ValueError(
                    f"cannot prune {prefix or type(parent).__name__}: it holds parameter {n!r} "
                    f"directly next to modules of this stage; give it a submodule of its own"
                )
        for name, child in list(parent._modules.items()):
            if child is None or id(child) in kept:
                continue
            if id(child) in ancestors:
                visit(child, f"{prefix}{name}.")
                continue
            params = list(child.parameters())
            if not params:
                continue
            for p in params:
                if id(p) not in kept_params:
                    dropped[id(p)] = p.numel() * p.element_size()
            parent._modules[name] = Pruned(f"{prefix}{name}")

    visit(module, "")
    return sum(dropped.values())


def check_num_microbatches(schedule: str, num_microbatches: int, num_stages: int) -> None:
    """Raise ``ValueError`` unless ``schedule`` can run ``num_microbatches`` over ``num_stages`` stages."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {SCHEDULES}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
    if schedule == "1f1b" and num_microbatches < num_stages:
        raise ValueError(
            f"the 1F1B schedule needs at least as many microbatches as stages: got "
            f"{num_microbatches} microbatches for {num_stages} stages; use >= {num_stages} "
            f"microbatches or schedule='gpipe'"
        )


def build_schedule(
    stage_module: PolicyStage,
    pp_group: Optional[Any],
    num_microbatches: int,
    tokens: int,
    schedule: str = "1f1b",
    loss_fn: Optional[Callable[[Tensor, Tensor], Tensor]] = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    out_width: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """Wrap ``stage_module`` in a ``PipelineStage`` with static shapes and a GPipe / 1F1B schedule.

    Args:
        stage_module: this rank's :class:`PolicyStage`.
        pp_group: pipeline group of this (dp, cp) coordinate, group rank == stage index.
        num_microbatches: microbatches per step ``M``.
        tokens: tokens ``T`` of every microbatch on this rank (padded length, zigzag shard under CP).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        loss_fn: ``loss_fn(logits (T, V), mb (1,) int64) -> scalar``, called on the last stage; the value it
            returns is back-propagated as is (``scale_grads=False``: divide by ``M`` yourself for a microbatch
            mean). ``None`` builds a forward-only schedule. Pass the same on every stage.
        dtype: activation dtype.
        device: device of the stage.
        out_width, out_dtype: the last stage's output width and dtype (default: vocabulary, ``dtype``), e.g. for a
            :attr:`PolicyStage.head_fn` that reduces the logits.

    Returns:
        The schedule; call ``schedule.step(ids (M, T), mb=arange(M))`` on the first stage,
        ``schedule.step(mb=arange(M), target=arange(M), losses=[])`` on the last, ``schedule.step(mb=...)``
        elsewhere.
    """
    check_num_microbatches(schedule, num_microbatches, stage_module.num_stages)
    policy = stage_module._policy
    hidden = policy.config.hidden_size
    device = torch.device(device)
    if stage_module.is_first:
        example_in = torch.zeros(1, tokens, dtype=torch.int64, device="meta")
    else:
        example_in = torch.empty(tokens, hidden, dtype=dtype, device="meta", requires_grad=True)
    width = (out_width or policy.config.vocab_size) if stage_module.is_last else hidden
    o_dtype = (out_dtype or dtype) if stage_module.is_last else dtype
    example_out = torch.empty(tokens, width, dtype=o_dtype, device="meta", requires_grad=True)
    pipe_stage = PipelineStage(
        stage_module,
        stage_module.stage,
        stage_module.num_stages,
        device,
        input_args=(example_in,),
        output_args=(example_out,),
        group=pp_group,
    )
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    # every stage gets the loss_fn: the schedule runs backward only when one is set (it is called on the last)
    return cls(pipe_stage, num_microbatches, loss_fn=loss_fn, scale_grads=False)


def gather_stage_states(state: dict[str, Tensor], pp_group: Optional[Any]) -> Optional[dict[str, Tensor]]:
    """The whole model's state, gathered from every pipeline stage's own ``state`` onto stage 0 (a collective).

    Args:
        state: this stage's state dict (its own parameters and buffers, full names).
        pp_group: the pipeline group of this rank (group rank == stage), or None (one stage: ``state`` itself).

    Returns:
        On stage 0 the union of every stage's entries; None on the other stages.
    """
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return dict(state)
    stage = dist.get_rank(pp_group)
    parts: Optional[list] = [None] * dist.get_world_size(pp_group) if stage == 0 else None
    dist.gather_object({k: v.detach() for k, v in state.items()}, parts, group=pp_group, group_dst=0)
    if stage != 0:
        return None
    return {k: v for part in parts for k, v in part.items()}
