"""Push policy + draft weights into a rollout engine every N optimizer steps (Lightning callback + Fabric helper).

Gathering PP / CP / FSDP shards into full tensors is the strategy's job; here a *state function* returns a full,
HF-named state dict (``None`` to skip that model). The default, :func:`full_state_dict`, handles an unwrapped
module or one wrapped by DDP / Fabric / ``torch.compile`` (prefixes ``module.``, ``_forward_module.``,
``_orig_mod.`` stripped) and materialises DTensor parameters with ``full_tensor()`` (a collective: every rank
must call it). The state function runs on every rank; the push runs where ``push_on_rank(rank)`` is true
(default: every rank, one embedded engine per rank; pass ``lambda r: r == 0`` for one shared vLLM server).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping

import torch
from lightning.pytorch.callbacks import Callback

from lightning_codraft.rollout.engine import RolloutEngine

StateFn = Callable[[], "Mapping[str, torch.Tensor] | None"]
_WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.")


def full_state_dict(module: torch.nn.Module | None) -> dict[str, torch.Tensor] | None:
    """Detached full state dict of ``module`` with wrapper prefixes removed (None for None)."""
    if module is None:
        return None
    out = {}
    for name, value in module.state_dict().items():
        if value.device.type == "meta":
            raise RuntimeError(f"{name} is not materialised on this rank (device 'meta'): under pipeline "
                               "parallelism each rank holds only its stage; build the full state with "
                               "CoDraftModule.full_state_dicts() (a collective over the pipeline group)")
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if hasattr(value, "full_tensor"):  # DTensor (FSDP2 / TP): gather the shards
            value = value.full_tensor()
        out[name] = value.detach()
    return out


def engine_drafts(engine: RolloutEngine) -> bool:
    """Whether ``engine`` proposes draft tokens, so a draft state is worth pushing (unknown engines: yes)."""
    return int(getattr(engine, "num_speculative_tokens", 1)) > 0


def push_weights(engine: RolloutEngine, policy_state_fn: StateFn, draft_state_fn: StateFn | None = None,
                 push: bool = True) -> float:
    """Build the state dicts (on every rank) and, if ``push``, load them into ``engine``; returns seconds taken."""
    start = time.perf_counter()
    policy_state = policy_state_fn()
    draft_state = draft_state_fn() if draft_state_fn is not None else None
    if push:
        engine.update_weights(policy_state, draft_state)
    return time.perf_counter() - start


class WeightSyncCallback(Callback):
    """Push ``pl_module.policy`` / ``pl_module.draft`` (or custom state functions) to ``engine`` every N steps.

    Args:
        engine: any :class:`~lightning_codraft.rollout.engine.RolloutEngine`.
        every_n_steps: push after every N-th optimizer step (``trainer.global_step``), N >= 1.
        policy_state_fn: ``fn(pl_module) -> state dict``; default: ``pl_module.full_state_dicts()`` when the
            module has it (a :class:`~lightning_codraft.CoDraftModule`: gathers pipeline stages onto the first
            stage, whose ranks push), else ``full_state_dict(pl_module.policy)``.
        draft_state_fn: ``fn(pl_module) -> state dict | None``; default ``full_state_dict(pl_module.draft)``
            when the module has a draft and the engine drafts, else None.
        push_on_rank: ``fn(global_rank) -> bool``; default every rank.
        log_name: metric logged with the seconds a push took.
    """

    def __init__(self, engine: RolloutEngine, every_n_steps: int = 1,
                 policy_state_fn: Callable | None = None, draft_state_fn: Callable | None = None,
                 push_on_rank: Callable[[int], bool] | None = None, log_name: str = "weight_sync/seconds"):
        if int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
        self.engine = engine
        self.every_n_steps = int(every_n_steps)
        self._gather = policy_state_fn is None and draft_state_fn is None
        self.policy_state_fn = policy_state_fn or (lambda m: full_state_dict(m.policy))
        self.draft_state_fn = draft_state_fn or _default_draft_state(engine)
        self.push_on_rank = push_on_rank or (lambda rank: True)
        self.log_name = log_name
        self.last_synced_step = -1
        self.sync_seconds: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = int(trainer.global_step)
        if step == 0 or step == self.last_synced_step or step % self.every_n_steps:
            return  # no optimizer step yet, or already pushed after this one (gradient accumulation)
        push = self.push_on_rank(trainer.global_rank)
        if self._gather and hasattr(pl_module, "full_state_dicts"):  # PP-aware: gathered on the first stage
            start = time.perf_counter()
            policy_state, draft_state = pl_module.full_state_dicts()
            if push and policy_state is not None:
                self.engine.update_weights(policy_state, draft_state if engine_drafts(self.engine) else None)
            seconds = time.perf_counter() - start
        else:
            seconds = push_weights(self.engine, lambda: self.policy_state_fn(pl_module),
                                   lambda: self.draft_state_fn(pl_module), push=push)
        self.last_synced_step = step
        self.sync_seconds.append(seconds)
        pl_module.log(self.log_name, seconds, on_step=True, on_epoch=False, prog_bar=False, batch_size=1)


def _default_draft_state(engine) -> Callable:
    drafts = engine_drafts(engine)

    def fn(module):
        draft = getattr(module, "draft", None)
        return full_state_dict(draft) if (draft is not None and drafts) else None

    return fn


def fabric_sync_weights(fabric, engine: RolloutEngine, policy: torch.nn.Module, draft: torch.nn.Module | None = None,
                        *, step: int, every_n_steps: int = 1, policy_state_fn: StateFn | None = None,
                        draft_state_fn: StateFn | None = None, push_on_rank: Callable[[int], bool] | None = None,
                        log_name: str = "weight_sync/seconds") -> float | None:
    """Fabric helper: call after ``optimizer.step()`` with the optimizer-step count ``step`` (>= 1).

    Pushes when ``step % every_n_steps == 0`` and logs the seconds with ``fabric.log``; returns them (None when
    not due). The state functions default to :func:`full_state_dict` of ``policy`` / ``draft``.
    """
    if int(every_n_steps) < 1:
        raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
    if step < 1 or step % every_n_steps:
        return None
    drafts = draft is not None and engine_drafts(engine)
    seconds = push_weights(engine, policy_state_fn or (lambda: full_state_dict(policy)),
                           draft_state_fn or (lambda: full_state_dict(draft) if drafts else None),
                           push=(push_on_rank or (lambda r: True))(fabric.global_rank))
    fabric.log(log_name, seconds, step=step)
    return seconds
