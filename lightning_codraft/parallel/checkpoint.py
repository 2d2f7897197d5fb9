"""Mesh-independent checkpoints: written on one (dp, pp, cp) mesh, loadable on any other.

A checkpoint is a directory::

    meta.pt          rank 0: plain entries (step counters, loop state, scheduler states), the writer's mesh
                     and every rank's RNG state
    stage{p}.pt      the first rank of pipeline stage p (dp = cp = 0): its modules' state dicts and its
                     optimizers' states, everything keyed by PARAMETER NAME, never by position

Because dp and cp ranks hold replicas, one copy per stage is the whole model; because optimizer states are keyed
by name, a loader on any mesh picks the entries for the parameters it holds (pp = 2 -> pp = 1 merges both
stage files, cp = 2 -> cp = 1 reads the same files). RNG states are restored per rank when the world size
matches, else every rank takes rank 0's.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any, Optional

import numpy
import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_codraft.parallel.parallel_dims import ParallelDims

FORMAT = "lightning_codraft.checkpoint/1"


def unwrap_module(module: nn.Module) -> nn.Module:
    """Strip DistributedDataParallel / Fabric wrappers."""
    while hasattr(module, "module") and isinstance(getattr(module, "module"), nn.Module) and module is not getattr(
            module, "module"):
        module = module.module
    return module


def owned_state_dict(module: nn.Module) -> dict[str, Any]:
    """The entries this rank writes: its module's state (under PP a pruned module holds only its stage)."""
    return unwrap_module(module).state_dict()


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict") and hasattr(obj, "optimizer") and not \
        isinstance(obj, Optimizer)


def capture_rng() -> dict[str, Any]:
    """This process' RNG states: torch CPU (+ CUDA), Python ``random`` and (if installed) numpy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    state["numpy"] = numpy.random.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        numpy.random.set_state(state["numpy"])


def optimizer_state_by_name(optimizer: Optimizer, names: dict[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with parameters identified by name instead of position.

    Args:
        optimizer: the optimizer.
        names: ``id(parameter) -> name`` for every parameter it holds.
    """
    sd = optimizer.state_dict()
    index_to_name = {}
    i = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise KeyError(f"optimizer parameter of shape {tuple(p.shape)} belongs to no module in the "
                               f"checkpoint state; save the module that owns it in the same checkpoint")
            index_to_name[i] = names[id(p)]
            i += 1
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = [index_to_name[j] for j in g["params"]]
        groups.append(g)
    return {"state": {index_to_name[j]: v for j, v in sd["state"].items()}, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: Optimizer, by_name: dict[str, Any], names: dict[int, str]) -> None:
    """Load a name-keyed optimizer state (possibly merged from several stages) into ``optimizer``."""
    saved_groups = by_name["param_groups"]
    state, groups, i = {}, [], 0
    for gi, group in enumerate(optimizer.param_groups):
        match = [g for g in saved_groups if "name" in group and g.get("name") == group["name"]]
        saved = match[0] if match else (saved_groups[gi] if gi < len(saved_groups) else None)
        if saved is None:
            raise KeyError(f"the checkpoint has {len(saved_groups)} optimizer parameter groups; this optimizer's "
                           f"group {gi} ({group.get('name', 'unnamed')}) has no counterpart")
        indices = []
        for p in group["params"]:
            name = names[id(p)]
            if name in by_name["state"]:
                state[i] = by_name["state"][name]
            indices.append(i)
            i += 1
        g = {k: v for k, v in saved.items() if k != "params"}
        g["params"] = indices
        groups.append(g)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _merge_optimizer_states(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged_state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        merged_state.update(part["state"])
        for gi, g in enumerate(part["param_groups"]):
            match = [h for h in groups if "name" in g and h.get("name") == g.get("name")]
            if not match and "name" not in g and gi < len(groups):
                match = [groups[gi]]
            if match:
                match[0]["params"] = list(match[0]["params"]) + [n for n in g["params"]
                                                                 if n not in match[0]["params"]]
            else:
                groups.append(dict(g))
    return {"state": merged_state, "param_groups": groups}


def _param_names(state: dict[str, Any]) -> dict[int, str]:
    names = {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            for n, p in unwrap_module(obj).named_parameters(remove_duplicate=False):
                names.setdefault(id(p), f"{key}/{n}")
    return names


def _dims(dims: Optional[ParallelDims]) -> ParallelDims:
    return dims if dims is not None else ParallelDims()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _gather_rngs(dims: ParallelDims) -> list[dict[str, Any]]:
    """Every rank's RNG state, indexed by global rank (a collective: call on every rank)."""
    if _distributed() and dist.get_world_size() > 1:
        rngs: list[Any] = [None] * dims.world_size
        dist.all_gather_object(rngs, capture_rng())
        return rngs
    return [capture_rng()]


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any], dims: Optional[ParallelDims] = None) -> None:
    """Write ``state`` (modules, optimizers, schedulers, plain values) to directory ``path``; call on every rank.

    Args:
        path: checkpoint directory (created).
        state: ``{"model": module, "optimizer": opt, "scheduler": sched, "step": 7, ...}``.
        dims: the mesh (None: one process).
    """
    dims = _dims(dims)
    path = Path(path)
    names = _param_names(state)
    rngs = _gather_rngs(dims)
    if dims.dp_rank == 0 and dims.cp_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        stage: dict[str, Any] = {"modules": {}, "optimizers": {}}
        for key, obj in state.items():
            if isinstance(obj, nn.Module):
                stage["modules"][key] = owned_state_dict(obj)
            elif isinstance(obj, Optimizer):
                stage["optimizers"][key] = optimizer_state_by_name(obj, names)
        torch.save(stage, path / f"stage{dims.pp_rank}.pt")
    if dims.rank == 0:
        meta: dict[str, Any] = {"format": FORMAT, "mesh": {"dp": dims.dp, "pp": dims.pp, "cp": dims.cp},
                                "rng": rngs, "entries": {}}
        for key, obj in state.items():
            if isinstance(obj, (nn.Module, Optimizer)):
                continue
            meta["entries"][key] = obj.state_dict() if hasattr(obj, "state_dict") else obj
        path.mkdir(parents=True, exist_ok=True)
        torch.save(meta, path / "meta.pt")
    if _distributed():
        dist.barrier()


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint directory into one merged dict (any mesh): ``{"modules", "optimizers", "meta"}``."""
    path = Path(path)
    if not (path / "meta.pt").exists():
        raise FileNotFoundError(f"{path} is not a lightning_codraft checkpoint directory (no meta.pt)")
    meta = torch.load(path / "meta.pt", weights_only=False)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}/meta.pt has format {meta.get('format')!r}, expected {FORMAT!r}")
    modules: dict[str, dict] = {}
    optimizers: dict[str, list] = {}
    for p in range(meta["mesh"]["pp"]):
        stage = torch.load(path / f"stage{p}.pt", weights_only=False)
        for key, sd in stage["modules"].items():
            modules.setdefault(key, {}).update(sd)
        for key, sd in stage["optimizers"].items():
            optimizers.setdefault(key, []).append(sd)
    return {"modules": modules, "optimizers": {k: _merge_optimizer_states(v) for k, v in optimizers.items()},
            "meta": meta}


def load_module_subset(module: nn.Module, full: dict[str, Any], strict: bool = True) -> None:
    """Load the entries of ``full`` that ``module`` holds (a pipeline stage holds a subset of the names)."""
    own = owned_state_dict(module)
    module = unwrap_module(module)
    missing = [k for k in own if k not in full]
    if strict and missing:
        raise KeyError(f"checkpoint lacks {len(missing)} entries of {type(module).__name__}, e.g. {missing[:3]}")
    module.load_state_dict({k: full[k] for k in own if k in full}, strict=False)


def load_checkpoint(path: str | os.PathLike, state: dict[str, Any], dims: Optional[ParallelDims] = None,
                    strict: bool = True) -> dict[str, Any]:
    """Restore ``state``'s objects in place from ``path`` (written on any mesh); plain entries are replaced.

    Returns:
        The checkpoint's plain entries that ``state`` did not ask for.
    """
    dims = _dims(dims)
    ckpt = read_checkpoint(path)
    names = _param_names(state)
    entries = dict(ckpt["meta"]["entries"])
    if strict:
        unknown = [k for k in state if k not in entries and k not in ckpt["modules"] and k not in ckpt["optimizers"]]
        if unknown:
            raise KeyError(f"checkpoint {path} has no entries {unknown}; it holds "
                           f"{sorted([*entries, *ckpt['modules'], *ckpt['optimizers']])}")
    for key, obj in list(state.items()):
        if isinstance(obj, nn.Module):
            if key in ckpt["modules"]:
                load_module_subset(obj, ckpt["modules"][key], strict=strict)
        elif isinstance(obj, Optimizer):
            if key in ckpt["optimizers"]:
                load_optimizer_state_by_name(obj, ckpt["optimizers"][key], names)
        elif key in entries:
            value = entries.pop(key)
            if _is_scheduler(obj) or (hasattr(obj, "load_state_dict") and isinstance(value, dict)):
                obj.load_state_dict(value)
            else:
                state[key] = value
    rngs = ckpt["meta"]["rng"]
    restore_rng(rngs[dims.rank] if len(rngs) == dims.world_size else rngs[0])
    return entries


# ---------------------------------------------------------------------------------------- Trainer checkpoints
def module_param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` in ``module`` (the keys of name-keyed optimizer states of the Trainer path)."""
    return {id(p): n for n, p in unwrap_module(module).named_parameters(remove_duplicate=False)}


def save_trainer_checkpoint(path: str | os.PathLike, checkpoint: dict[str, Any],
                            dims: Optional[ParallelDims] = None) -> None:
    """Write a Trainer checkpoint dict as a mesh-independent directory; call on every rank.

    ``checkpoint["state_dict"]`` and ``checkpoint["optimizer_states"]`` must be this rank's slices (owned
    state, name-keyed optimizer states); the first rank of every pipeline stage writes them to ``stage{p}.pt``
    and rank 0 writes every other entry (loops, schedulers, callbacks, hyper-parameters) to ``meta.pt``.
    """
    dims = _dims(dims)
    path = Path(path)
    rngs = _gather_rngs(dims)
    if dims.dp_rank == 0 and dims.cp_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"modules": {"state_dict": checkpoint["state_dict"]},
                    "optimizers": dict(enumerate(checkpoint.get("optimizer_states", [])))},
                   path / f"stage{dims.pp_rank}.pt")
    if dims.rank == 0:
        entries = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        meta = {"format": FORMAT, "mesh": {"dp": dims.dp, "pp": dims.pp, "cp": dims.cp}, "rng": rngs,
                "entries": entries}
        path.mkdir(parents=True, exist_ok=True)
        torch.save(meta, path / "meta.pt")
    if _distributed():
        dist.barrier()


def read_trainer_checkpoint(path: str | os.PathLike, dims: Optional[ParallelDims] = None) -> dict[str, Any]:
    """The Trainer checkpoint dict of a directory written on any mesh (state and optimizer states merged)."""
    dims = _dims(dims)
    ckpt = read_checkpoint(path)
    out = dict(ckpt["meta"]["entries"])
    out["state_dict"] = ckpt["modules"].get("state_dict", {})
    out["optimizer_states"] = [ckpt["optimizers"][i] for i in sorted(ckpt["optimizers"])]
    rngs = ckpt["meta"]["rng"]
    restore_rng(rngs[dims.rank] if len(rngs) == dims.world_size else rngs[0])
    return out
