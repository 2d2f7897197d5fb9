"""What both Lightning front ends share: the (dp, pp, cp) mesh, module preparation, gradient reduction and
mesh-aware collectives.

``lightning_codraft.fabric.CoDraftStrategy`` and ``lightning_codraft.pytorch.CoDraftStrategy`` are thin
adapters that forward to one :class:`CoDraftCore`. The core knows the model only through a small duck-typed
protocol, so it stays below ``training/`` in the layer order:

- ``module.configure_parallel(dims)``: the module records the mesh (its ``cp_group``, the groups over which
  losses are token-averaged) and, under PP, splits itself into this rank's pipeline stage.
- ``module.policy`` and ``module.draft``: the two models (checked here so a wrong module fails early).

Gradient semantics: every rank's loss is its share of the global token-mean loss, so the gradient of a
parameter is the SUM over the ``dp_cp`` group (all ranks of one pipeline stage) of the per-rank gradients.
FSDP2 (the default when dp * cp > 1, ``parallel/fsdp.py``) reduce-scatters them as sums; with
``sharding="ddp"`` a DDP wrapper over ``dp_cp`` averages (so the module scales its loss by ``dp*cp``), and under
PP, where the pipeline schedule runs forward and backward itself, :func:`reduce_gradients` sums the gradients
explicitly after the schedule.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from lightning_codraft.parallel.fsdp import SHARDINGS, bf16_resolution_warning, mixed_precision_policy, shard_codraft
from lightning_codraft.parallel.parallel_dims import ParallelDims


def check_codraft_module(module: nn.Module) -> None:
    """Raise ``TypeError`` unless ``module`` holds a policy and a draft and can be parallelised."""
    missing = [name for name in ("policy", "draft") if not isinstance(getattr(module, name, None), nn.Module)]
    if missing:
        raise TypeError(
            f"CoDraftStrategy needs a module holding both a policy and a draft (attributes `policy` and `draft`, "
            f"each an nn.Module, e.g. lightning_codraft.CoDraftModule); {type(module).__name__} lacks "
            f"{' and '.join(missing)}"
        )
    if not callable(getattr(module, "configure_parallel", None)):
        raise TypeError(
            f"{type(module).__name__} has no configure_parallel(dims); subclass lightning_codraft.CoDraftModule"
        )


def reduce_gradients(params: Iterable[nn.Parameter], group: Optional[Any]) -> None:
    """Sum the ``.grad`` of ``params`` over ``group`` (one flattened all-reduce per dtype); no-op for ``None``.

    Parameters without a gradient take part as zeros on ranks where others have one, so every rank issues the
    same collective. Call on every rank of ``group`` with the same parameter list.
    """
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [p for p in params if p.requires_grad]
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for _, ps in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in ps])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        offset = 0
        for p in ps:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n


class CoDraftCore:
    """The strategy logic shared by the Fabric and Trainer adapters.

    Args:
        dp: data-parallel size (``-1``: infer from the world size).
        pp: pipeline stages.
        cp: context-parallel size.
        sharding: ``"fsdp"`` (FSDP2 over each stage's dp x cp ranks) or ``"ddp"`` (replicated weights); None:
            FSDP2 whenever dp * cp > 1.
        ddp_kwargs: extra keyword arguments for ``DistributedDataParallel`` (non-PP meshes, ``sharding="ddp"``).
        checkpoint_io: the adapter's ``checkpoint_io`` plugin; anything but None is refused (the strategy writes
            ``torch.distributed.checkpoint`` directories itself).
    """

    def __init__(
        self,
        dp: int = -1,
        pp: int = 1,
        cp: int = 1,
        sharding: Optional[str] = None,
        ddp_kwargs: Optional[dict] = None,
        checkpoint_io: Any = None,
    ):
        if checkpoint_io is not None:
            raise ValueError(
                f"CoDraftStrategy writes torch.distributed.checkpoint directories itself and cannot use "
                f"checkpoint_io={type(checkpoint_io).__name__}; remove the plugin"
            )
        for name, value in (("pp", pp), ("cp", cp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(dp, int) or (dp < 1 and dp != -1):
            raise ValueError(f"dp={dp!r} must be a positive integer or -1 (infer from the world size)")
        if sharding is not None and sharding not in SHARDINGS:
            raise ValueError(f"sharding={sharding!r} is not one of {SHARDINGS} (or None: FSDP2 when dp*cp > 1)")
        self.dp, self.pp, self.cp = dp, pp, cp
        self.sharding = sharding
        self.ddp_kwargs = dict(ddp_kwargs or {})
        self.dims: Optional[ParallelDims] = None

    # ---------------------------------------------------------------- mesh
    def setup_mesh(self, world_size: int, device_type: str) -> ParallelDims:
        """Validate sizes against ``world_size`` and build the DeviceMesh (process group already initialised)."""
        self.dims = ParallelDims(dp=self.dp, pp=self.pp, cp=self.cp, world_size=world_size)
        self.dims.build_mesh(device_type)
        return self.dims

    def require_dims(self) -> ParallelDims:
        if self.dims is None:
            raise RuntimeError("the CoDraftStrategy mesh is not built yet: call fabric.launch() / Trainer.fit first")
        return self.dims

    def sampler_kwargs(self) -> dict[str, int]:
        """DistributedSampler arguments over the dp dimension only: PP and CP peers read the same samples."""
        dims = self.require_dims()
        return {"num_replicas": dims.dp, "rank": dims.dp_rank}

    # ---------------------------------------------------------------- module
    def resolved_sharding(self) -> str:
        """``"fsdp"`` or ``"ddp"``: the explicit choice, else FSDP2 whenever several ranks hold different tokens."""
        dims = self.require_dims()
        return self.sharding or ("fsdp" if dims.dp_cp > 1 else "ddp")

    def prepare_module(self, module: nn.Module, precision: Optional[str] = None) -> nn.Module:
        """Install the mesh into ``module`` (CP groups, PP stage), then shard or wrap it for data parallelism.

        Args:
            module: a ``CoDraftModule``.
            precision: Lightning's precision string (``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ...).

        Returns:
            ``module`` sharded in place by FSDP2 over each stage's dp x cp ranks (``sharding="fsdp"``); a
            ``DistributedDataParallel`` over the ``dp_cp`` group (``"ddp"`` without PP, several token-holding
            ranks); otherwise ``module`` itself (under PP with DDP the module sums gradients after the schedule).
        """
        check_codraft_module(module)
        dims = self.require_dims()
        sharding = self.resolved_sharding()
        warning = bf16_resolution_warning(
            module.policy.parameters(), float(getattr(getattr(module, "config", None), "policy_lr", 0.0)), precision
        )
        if warning is not None:
            warnings.warn(warning, RuntimeWarning, stacklevel=3)
        ddp = sharding == "ddp" and (not dims.pp_enabled) and dims.dp_cp > 1
        fsdp = sharding == "fsdp" and dims.dp_cp > 1
        compute_dtype = mixed_precision_policy(precision).param_dtype if fsdp else None
        module.configure_parallel(
            dims, grad_average_size=dims.dp_cp if ddp else 1, sharding=sharding, compute_dtype=compute_dtype
        )
        if fsdp:
            return shard_codraft(module, dims.dp_cp_mesh, precision)
        if not ddp:
            return module
        return DistributedDataParallel(module, process_group=dims.dp_cp_group, **self.ddp_kwargs)

    # ---------------------------------------------------------------- collectives
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None, reduce_op: str = "mean") -> Tensor:
        """All-reduce over ``group`` (default: the whole world), ``"mean"`` or ``"sum"``; returns a new tensor.

        Logged scalars in lightning_codraft are already global (token-level over dp x cp) on every rank, so a
        world mean leaves them unchanged; pass ``dims.group("dp")`` to average per-replica values.
        """
        if not dist.is_available() or not dist.is_initialized():
            return tensor
        if isinstance(reduce_op, dist.ReduceOp.RedOpType):  # Lightning passes enums too
            reduce_op = {
                dist.ReduceOp.SUM: "sum",
                dist.ReduceOp.AVG: "mean",
                dist.ReduceOp.MAX: "max",
                dist.ReduceOp.MIN: "min",
            }.get(reduce_op, reduce_op)
        op = str(reduce_op).lower()
        if op not in ("mean", "avg", "sum", "max", "min"):
            raise ValueError(f"reduce_op={reduce_op!r}; expected 'mean', 'sum', 'max' or 'min'")
        out = tensor.clone()
        torch_op = {
            "sum": dist.ReduceOp.SUM,
            "mean": dist.ReduceOp.SUM,
            "avg": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
        }[op]
        dist.all_reduce(out, op=torch_op, group=group)
        if op in ("mean", "avg"):
            out = out / dist.get_world_size(group)
        return out


class CoDraftMeshMixin:
    """What both Lightning adapters do alike with their :class:`CoDraftCore` (``self.core``): build the mesh once
    the process group is up, and show its layout. Put before Lightning's ``DDPStrategy`` in the bases."""

    core: CoDraftCore

    @property
    def parallel_dims(self) -> ParallelDims:
        """The (dp, pp, cp) layout; available once the processes are launched (``fabric.launch()``, or the Trainer
        set them up)."""
        return self.core.require_dims()

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  (Lightning's DDPStrategy: the process group)
        self.core.setup_mesh(self.world_size, self.root_device.type)  # type: ignore[attr-defined]
