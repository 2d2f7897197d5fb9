"""Distributed checkpoints that load on any mesh: ``torch.distributed.checkpoint`` for tensors, JSON for the rest.

A checkpoint is a directory::

    .metadata, __<rank>_<n>.distcp   DCP: every module's and optimizer's tensors, keyed by parameter NAME (FQN);
                                     each rank writes only its shards (FSDP2) or its stage (PP); replicas once
    codraft.json                     rank 0: the format, the writer's mesh, plain entries (step counters, loop
                                     state), scheduler states, optimizers' param groups, every rank's RNG states

Because tensors are keyed by name and DCP reshards on read, a loader on any (dp, pp, cp, sharding) asks for the
entries it holds in the layout it holds them: pp = 2 -> pp = 1 reads both stages' keys, FSDP2 over 4 ranks ->
one process reads whole tensors, a DDP checkpoint -> FSDP2 shards. RNG states are restored per rank when the world
size matches, else every rank takes rank 0's.

Nothing is unpickled from a checkpoint: ``codraft.json`` is JSON, tensors are read with ``weights_only=True``, and
DCP's ``.metadata`` (a pickle) is read with an unpickler that admits only DCP's own metadata classes, so a crafted
file raises ``CheckpointError`` instead of running code.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Optional

import numpy
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_codraft.parallel.collectives import is_distributed, reduced
from lightning_codraft.parallel.parallel_dims import ParallelDims
from lightning_codraft.parallel.safe_read import CheckpointError, SafeFileSystemReader, SafeLoadPlanner

FORMAT = "lightning_codraft.checkpoint/2"
META_FILE = "codraft.json"


def unwrap_module(module: nn.Module) -> nn.Module:
    """Strip DistributedDataParallel / Fabric wrappers."""
    while isinstance(getattr(module, "module", None), nn.Module) and module is not module.module:
        module = module.module
    return module


# ------------------------------------------------------------------------------------------------ rng and json
def capture_rng() -> dict[str, Any]:
    """This process' RNG states as JSON-able data: torch CPU (+ CUDA), Python ``random`` and numpy."""
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(numpy.random.get_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    def tensor(b64: str) -> Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8).clone()

    torch.set_rng_state(tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    numpy.random.set_state((kind, numpy.asarray(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


def _jsonable(obj: Any, where: str = "state") -> Any:
    """``obj`` as JSON data (tuples -> lists, numpy -> lists / numbers); raises naming ``where`` if impossible."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x, f"{where}[{i}]") for i, x in enumerate(obj)]
    if isinstance(obj, dict):
        return {str(k): _jsonable(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, numpy.ndarray):
        return obj.tolist()
    if isinstance(obj, numpy.generic):
        return obj.item()
    raise CheckpointError(
        f"cannot store {where} of type {type(obj).__name__} in a checkpoint: plain entries must be "
        f"numbers, strings, lists or dicts (tensors are stored through DCP)"
    )


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _gather_rngs(dims: ParallelDims) -> list[dict[str, Any]]:
    if is_distributed():
        rngs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(rngs, capture_rng())
        return rngs
    return [capture_rng()]


def _fresh(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` has taken no step yet (no state). DCP's ``get_optimizer_state_dict`` would initialise
    such an optimizer by stepping it once with zero gradients and learning rate 0, which leaves AdamW's step count at
    1: the first real step would then use the bias correction of step 2 and update by ~0.74x. A fresh optimizer is
    therefore saved as its hyper-parameters only, and restored fresh."""
    return not any(optimizer.state.values())


def _owner(optimizer: Optimizer, modules: dict[str, nn.Module]) -> nn.Module:
    """The module of ``modules`` that holds the optimizer's parameters (the names its state is keyed by)."""
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for module in modules.values():
        held = {id(p) for p in module.parameters()}
        if params <= held:
            return module
    raise CheckpointError(
        "the optimizer's parameters belong to no module of the checkpoint state; save the module "
        "that owns them in the same checkpoint"
    )


# ------------------------------------------------------------------------------------------------ save / load
def _check_finite(tensors: dict[str, Any], dims: ParallelDims) -> None:
    """Refuse to write a checkpoint from a non-finite state (checked on every rank's shards, agreed globally)."""
    bad: list[str] = []

    def visit(node: Any, name: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                visit(v, f"{name}.{k}" if name else str(k))
        elif isinstance(node, Tensor) and node.is_floating_point():
            local = node.to_local() if hasattr(node, "to_local") else node
            if not bool(torch.isfinite(local).all()):
                bad.append(name)

    visit(tensors, "")
    flag = reduced(torch.tensor([float(len(bad))]), dist.group.WORLD, op="max")  # WORLD is None before init
    if float(flag) > 0:
        where = f"e.g. {bad[:3]}" if bad else "on another rank"
        raise CheckpointError(
            f"refusing to write a checkpoint from a non-finite state: non-finite values in {where}; "
            f"the last checkpoint written is the last finite state"
        )


@contextlib.contextmanager
def _deliberate_dcp_use():
    """Silence DCP's warnings about what this module does on purpose: saving over a step's directory, and saving or
    loading in one process without a process group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


@contextlib.contextmanager
def _interrupt_after():
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block is done, then raise it: a checkpoint
    is written whole or not started, never cut in the middle (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any], dims: Optional[ParallelDims] = None) -> None:
    """Write ``state`` (modules, optimizers, schedulers, plain entries) to directory ``path``; call on every rank. A
    Ctrl-C during the write takes effect once the checkpoint is whole.

    Args:
        path: checkpoint directory (created).
        state: ``{"model": module, "optimizer": opt, "scheduler": sched, "step": 7, ...}``; tensors among the plain
            entries go through DCP, everything else must be JSON data.
        dims: the mesh (None: one process).
    """
    with _interrupt_after():
        _save(Path(path), state, dims or ParallelDims())


def _save(path: Path, state: dict[str, Any], dims: ParallelDims) -> None:
    modules = {k: unwrap_module(v) for k, v in state.items() if isinstance(v, nn.Module)}
    tensors: dict[str, Any] = {}
    meta: dict[str, Any] = {
        "format": FORMAT,
        "mesh": {"dp": dims.dp, "pp": dims.pp, "cp": dims.cp},
        "modules": sorted(modules),
        "optimizers": {},
        "stateful": {},
        "entries": {},
        "tensor_entries": [],
    }
    for key, obj in state.items():
        if key in modules:
            tensors[key] = get_model_state_dict(modules[key])
        elif isinstance(obj, Optimizer):
            groups = [{k: v for k, v in g.items() if k != "params"} for g in obj.param_groups]
            meta["optimizers"][key] = _jsonable(groups, f"{key}.param_groups")
            if _fresh(obj):  # no step taken yet: nothing to save (see _fresh)
                meta.setdefault("fresh_optimizers", []).append(key)
                continue
            osd = get_optimizer_state_dict(_owner(obj, modules), obj)
            tensors[key] = osd["state"]  # tensors only; the hyper-parameters go to JSON (the same on every stage)
        elif _is_stateful(obj):
            meta["stateful"][key] = _jsonable(obj.state_dict(), key)
        elif isinstance(obj, Tensor):
            tensors[f"entry.{key}"] = obj
            meta["tensor_entries"].append(key)
        else:
            meta["entries"][key] = _jsonable(obj, key)
    _check_finite(tensors, dims)
    meta["rng"] = _gather_rngs(dims)
    with _deliberate_dcp_use():
        dcp.save(tensors, storage_writer=FileSystemWriter(path, overwrite=True))
    if dims.rank == 0:
        tmp = path / f".{META_FILE}.tmp"
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(path / META_FILE)
    if is_distributed():
        dist.barrier()


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``codraft.json`` of a checkpoint directory (its plain parts), validated."""
    path = Path(path)
    f = path / META_FILE
    if not f.is_file():
        raise CheckpointError(
            f"{path} is not a lightning_codraft checkpoint directory (no {META_FILE}; checkpoints "
            f"of the older pickled format must be re-created)"
        )
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _keys(reader: SafeFileSystemReader) -> set[str]:
    return set(reader.read_metadata().state_dict_metadata)


def _tied_alias(fqn: str, available: set[str], prefix: str) -> Optional[str]:
    """With tied embeddings the optimizer state is keyed by the first name of the shared weight: ``lm_head.weight``
    on a last pipeline stage, ``model.embed_tokens.weight`` elsewhere; map one onto the other."""
    for a, b in (("lm_head.weight", "model.embed_tokens.weight"), ("model.embed_tokens.weight", "lm_head.weight")):
        if fqn.endswith(a) and f"{prefix}{fqn[: -len(a)] + b}" in available:
            return fqn[: -len(a)] + b
    return None


def _param_groups(current: list[dict], saved: list[dict], path: Path) -> list[dict]:
    """The saved hyper-parameters of every group (matched by ``name``, else by position) with this rank's params."""
    out = []
    for i, group in enumerate(current):
        match = [g for g in saved if "name" in group and g.get("name") == group["name"]]
        if not match and i < len(saved) and "name" not in group:
            match = [saved[i]]
        if not match:
            raise CheckpointError(
                f"checkpoint {path} has no optimizer parameter group {group.get('name', i)!r}; it "
                f"holds {[g.get('name', j) for j, g in enumerate(saved)]}"
            )
        out.append({**match[0], "params": group["params"]})
    return out


def load_checkpoint(
    path: str | os.PathLike, state: dict[str, Any], dims: Optional[ParallelDims] = None, strict: bool = True
) -> dict[str, Any]:
    """Restore ``state``'s objects in place from ``path`` (written on any mesh); plain entries are replaced.

    Args:
        path: a checkpoint directory of :func:`save_checkpoint`.
        state: the objects to restore, keyed as when saved; modules and optimizers are restored in place (in their
            current layout: shards, stage), schedulers through ``load_state_dict``, plain entries replaced.
        dims: the mesh (None: one process).
        strict: every key of ``state`` and every tensor of its modules must be in the checkpoint.

    Returns:
        The checkpoint's plain entries that ``state`` did not ask for.
    """
    dims = dims or ParallelDims()
    path = Path(path)
    meta = read_meta(path)
    reader = SafeFileSystemReader(path)
    available = _keys(reader)
    known = (
        set(meta["modules"])
        | set(meta["optimizers"])
        | set(meta["stateful"])
        | set(meta["entries"])
        | set(meta["tensor_entries"])
    )
    if strict:
        unknown = [k for k in state if k not in known]
        if unknown:
            raise CheckpointError(f"checkpoint {path} has no entries {unknown}; it holds {sorted(known)}")
    modules = {k: unwrap_module(v) for k, v in state.items() if isinstance(v, nn.Module)}
    to_load: dict[str, Any] = {}
    renames: dict[str, dict[str, str]] = {}
    for key, module in modules.items():
        if key not in meta["modules"]:
            continue
        sd = get_model_state_dict(module)
        missing = [k for k in sd if f"{key}.{k}" not in available]
        if missing and strict:
            raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensors of {key!r}, e.g. {missing[:3]}")
        to_load[key] = {k: v for k, v in sd.items() if k not in missing}
    optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer) and k in meta["optimizers"]}
    _restore_fresh_optimizers(optimizers, meta, path)
    for key, opt in optimizers.items():
        to_load[key], renames[key] = _optimizer_targets(key, opt, modules, available, path)
    for key in meta["tensor_entries"]:
        if key in state and isinstance(state[key], Tensor):
            to_load[f"entry.{key}"] = state[key]
    with _deliberate_dcp_use():
        dcp.load(to_load, storage_reader=reader, planner=SafeLoadPlanner())
    for key, module in modules.items():
        if key in to_load:
            set_model_state_dict(module, to_load[key], options=StateDictOptions(strict=False))
    for key, opt in optimizers.items():
        owner = _owner(opt, modules)
        groups = _param_groups(get_optimizer_state_dict(owner, opt)["param_groups"], meta["optimizers"][key], path)
        state_dict = {"state": {renames[key][src]: v for src, v in to_load[key].items()}, "param_groups": groups}
        set_optimizer_state_dict(owner, opt, state_dict)
    rest = dict(meta["entries"])
    for key, obj in list(state.items()):
        if key in meta["stateful"] and _is_stateful(obj) and not isinstance(obj, (nn.Module, Optimizer)):
            obj.load_state_dict(meta["stateful"][key])
        elif key in rest:
            state[key] = rest.pop(key)
        elif f"entry.{key}" in to_load:
            state[key] = to_load[f"entry.{key}"]
    rngs = meta["rng"]
    restore_rng(rngs[dims.rank] if len(rngs) == dims.world_size else rngs[0])
    return rest


def _restore_fresh_optimizers(optimizers: dict[str, Optimizer], meta: dict[str, Any], path: Path) -> None:
    """Optimizers saved before their first step: restored fresh (their param groups only) and taken out of
    ``optimizers`` (DCP has no state tensors of theirs)."""
    for key in meta.get("fresh_optimizers", []):
        if key in optimizers:
            opt = optimizers.pop(key)
            opt.state.clear()
            groups = _param_groups(opt.param_groups, meta["optimizers"][key], path)
            for group, saved in zip(opt.param_groups, groups):
                group.update(saved)


def _optimizer_targets(
    key: str, opt: Optimizer, modules: dict[str, nn.Module], available: set[str], path: Path
) -> tuple[dict[str, Any], dict[str, str]]:
    """The state tensors DCP loads optimizer ``key`` into, by the checkpoint's names, and those names' map back to
    the optimizer's (a tied weight saved under its other name)."""
    osd = _initialised_state_dict(_owner(opt, modules), opt)
    loaded, renames = {}, {}
    for fqn, value in osd["state"].items():
        src = (
            fqn
            if any(k.startswith(f"{key}.{fqn}.") for k in available)
            else _tied_alias(fqn, {k.rsplit(".", 1)[0] for k in available}, f"{key}.")
        )
        if src is None:
            raise CheckpointError(f"checkpoint {path} has no optimizer state for {fqn!r} in {key!r}")
        loaded[src] = value
        renames[src] = fqn
    return loaded, renames


def _initialised_state_dict(owner: nn.Module, opt: Optimizer) -> dict[str, Any]:
    """``get_optimizer_state_dict`` with the optimizer's state tensors created. Torch creates them (a step at lr 0
    on zero gradients) only when no parameter holds a gradient: a gradient left from before the load (e.g. a
    Trainer's setup) would make it skip that, and the load would silently restore nothing. Gradients are set aside
    for the call and put back."""
    if opt.state:
        return get_optimizer_state_dict(owner, opt)
    params = [p for group in opt.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        return get_optimizer_state_dict(owner, opt)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The plain parts of a checkpoint (entries, scheduler states, the writer's mesh), without loading tensors."""
    meta = read_meta(path)
    return {**meta["entries"], **meta["stateful"], "mesh": meta["mesh"]}
