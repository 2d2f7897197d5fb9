"""The (dp, pp, cp) process layout: validated sizes, the DeviceMesh, and which group / rank everywhere.

Ranks are laid out row-major over ``("dp", "pp", "cp")``: ``rank = (dp_rank * pp + pp_rank) * cp + cp_rank``.
CP is innermost (the ring is the chattiest group, keep it on one node), DP outermost. Every layer that needs a
process group asks a :class:`ParallelDims` instead of looking one up globally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("dp", "pp", "cp")


@dataclass
class ParallelDims:
    """Sizes of the data-, pipeline- and context-parallel dimensions, and the groups built from them.

    Construct with the sizes, then call :meth:`build_mesh` once on every rank (after
    ``torch.distributed.init_process_group``) to create the process groups. Without a mesh (one process),
    every group is ``None`` and every rank is 0, so single-process code paths need no special casing.
    """

    dp: int = -1
    """Data-parallel replicas; ``-1`` infers ``world_size // (pp * cp)``."""
    pp: int = 1
    """Pipeline stages; the draft lives on the last one."""
    cp: int = 1
    """Context-parallel ranks sharing one packed batch in the zigzag layout."""
    world_size: int = 1
    """Total number of processes; must equal ``dp * pp * cp``."""
    rank: int = 0
    """This process' global rank (set by :meth:`build_mesh` from the initialised process group)."""
    mesh: Any = field(default=None, repr=False)
    """The ``DeviceMesh`` over ``("dp", "pp", "cp")`` once built, else ``None``."""
    _groups: dict = field(default_factory=dict, repr=False)
    _dp_cp_mesh: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("pp", "cp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.world_size % (self.pp * self.cp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by pp*cp = {self.pp}*{self.cp} = {self.pp * self.cp}; "
                f"choose pp and cp whose product divides the number of processes (devices * num_nodes)"
            )
        if self.dp == -1 or self.dp is None:
            self.dp = self.world_size // (self.pp * self.cp)
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp={self.dp!r} must be a positive integer or -1 (infer from the world size)")
        if self.dp * self.pp * self.cp != self.world_size:
            raise ValueError(
                f"dp*pp*cp = {self.dp}*{self.pp}*{self.cp} = {self.dp * self.pp * self.cp} != world size "
                f"{self.world_size}; set dp=-1 to infer it as {self.world_size // (self.pp * self.cp)}"
            )

    # ---------------------------------------------------------------- layout
    @property
    def coordinates(self) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, cp_rank)`` of this process."""
        return self.coordinates_of(self.rank)

    def coordinates_of(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, cp_rank)`` of global ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} processes")
        return rank // (self.pp * self.cp), (rank // self.cp) % self.pp, rank % self.cp

    def rank_of(self, dp_rank: int, pp_rank: int, cp_rank: int) -> int:
        """Global rank at mesh coordinates ``(dp_rank, pp_rank, cp_rank)``."""
        return (dp_rank * self.pp + pp_rank) * self.cp + cp_rank

    @property
    def dp_rank(self) -> int:
        return self.coordinates[0]

    @property
    def pp_rank(self) -> int:
        return self.coordinates[1]

    @property
    def cp_rank(self) -> int:
        return self.coordinates[2]

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def dp_cp(self) -> int:
        """Number of ranks that hold different tokens of the global batch (gradient replicas of one stage)."""
        return self.dp * self.cp

    @property
    def dp_cp_rank(self) -> int:
        """This rank's index inside its ``dp_cp`` group (``dp_rank * cp + cp_rank``)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def replica_size(self) -> int:
        """Ranks of one data-parallel replica (its ``pp x cp`` block), which all train on the same samples."""
        return self.pp * self.cp

    @property
    def is_replica_lead(self) -> bool:
        """True on the lead of this rank's replica: ``(pp_rank 0, cp_rank 0)`` of its ``dp_rank``.

        The lead is the rank that speaks for the replica. It is the replica's lowest global rank, rank 0 of :attr:`replica_group`, and the first pipeline stage, where
        ``CoDraftModule.full_state_dicts`` gathers the whole model.
        """
        return self.pp_rank == 0 and self.cp_rank == 0

    def replica_ranks(self, dp_rank: Optional[int] = None) -> list[int]:
        """Global ranks of data-parallel replica ``dp_rank`` (default: this rank's), ascending: lead first."""
        d = self.dp_rank if dp_rank is None else dp_rank
        if not 0 <= d < self.dp:
            raise ValueError(f"dp_rank {d} is outside the {self.dp} data-parallel replicas")
        return [self.rank_of(d, p, c) for p in range(self.pp) for c in range(self.cp)]

    # ---------------------------------------------------------------- groups
    def build_mesh(self, device_type: str = "cpu") -> Any:
        """Create the ``DeviceMesh``, the flattened ``dp_cp`` and ``replica`` groups; call on every rank, once.

        Args:
            device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL), as for ``init_device_mesh``.

        Returns:
            The DeviceMesh, or ``None`` in a single process without an initialised process group.
        """
        if not dist.is_available() or not dist.is_initialized():
            if self.world_size != 1:
                raise RuntimeError(
                    f"ParallelDims(world_size={self.world_size}) needs torch.distributed initialised before "
                    f"build_mesh(); launch with Fabric / torchrun or use world_size=1"
                )
            return None
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"the process group has {dist.get_world_size()} ranks but ParallelDims.world_size={self.world_size}"
            )
        self.rank = dist.get_rank()
        self.mesh = init_device_mesh(device_type, (self.dp, self.pp, self.cp), mesh_dim_names=MESH_DIM_NAMES)
        for name in MESH_DIM_NAMES:
            self._groups[name] = self.mesh.get_group(name)
        # ranks of one pipeline stage that hold different tokens: all (dp, cp) at a fixed pp index
        dp_cp_ranks = [[self.rank_of(d, p, c) for d in range(self.dp) for c in range(self.cp)] for p in range(self.pp)]
        self._groups["dp_cp"], _ = dist.new_subgroups_by_enumeration(dp_cp_ranks)
        self._dp_cp_mesh = DeviceMesh.from_group(self._groups["dp_cp"], device_type, mesh_dim_names=("dp_cp",))
        # a second group over every pipeline's ranks: the TapChannel's traffic never interleaves the schedule's
        pipelines = [[self.rank_of(d, p, c) for p in range(self.pp)] for d in range(self.dp) for c in range(self.cp)]
        self._groups["pp_tap"], _ = dist.new_subgroups_by_enumeration(pipelines)
        # every replica's pp x cp block, lead (pp_rank 0, cp_rank 0) first: the replica's rollouts are broadcast here
        self._groups["replica"], _ = dist.new_subgroups_by_enumeration([self.replica_ranks(d) for d in range(self.dp)])
        # the same blocks again: an asynchronous producer's thread gathers its rollouts here, beside the trainer's
        self._groups["producer"], _ = dist.new_subgroups_by_enumeration([self.replica_ranks(d) for d in range(self.dp)])
        return self.mesh

    def group(self, name: str) -> Optional[Any]:
        """Process group ``name`` (``dp``, ``pp``, ``cp``, ``dp_cp``, ``pp_tap``, ``replica`` or ``producer``: the
        replica's ranks again, for a thread beside the trainer's) or ``None``.

        ``None`` means "this dimension has a single rank": callers treat it as no communication.
        """
        names = (*MESH_DIM_NAMES, "dp_cp", "pp_tap", "replica", "producer")
        if name not in names:
            raise ValueError(f"unknown mesh dimension {name!r}; expected one of {', '.join(names)}")
        sizes = {"dp_cp": self.dp_cp, "pp_tap": self.pp, "replica": self.replica_size, "producer": self.replica_size}
        size = sizes.get(name) or getattr(self, name)
        if size == 1 or self.mesh is None:
            return None
        return self._groups[name]

    @property
    def dp_group(self) -> Optional[Any]:
        return self.group("dp")

    @property
    def pp_group(self) -> Optional[Any]:
        return self.group("pp")

    @property
    def cp_group(self) -> Optional[Any]:
        return self.group("cp")

    @property
    def dp_cp_group(self) -> Optional[Any]:
        """All ranks of this pipeline stage (dp x cp): gradients and token counts are reduced here."""
        return self.group("dp_cp")

    @property
    def dp_cp_mesh(self) -> Optional[Any]:
        """A 1-D ``DeviceMesh`` over :attr:`dp_cp_group` (FSDP2 shards a stage's parameters over it), or None."""
        return self._dp_cp_mesh if self.dp_cp > 1 and self.mesh is not None else None

    @property
    def tap_group(self) -> Optional[Any]:
        """A group over the same ranks as :attr:`pp_group`, of its own: the TapChannel ships taps on it."""
        return self.group("pp_tap")

    @property
    def replica_group(self) -> Optional[Any]:
        """All ranks of this data-parallel replica (the ``pp x cp`` block sharing this ``dp_rank``), lead first."""
        return self.group("replica")

    def pp_stage_ranks(self) -> list[int]:
        """Global ranks of this rank's pipeline (same dp and cp index), ordered by stage."""
        d, _, c = self.coordinates
        return [self.rank_of(d, p, c) for p in range(self.pp)]
