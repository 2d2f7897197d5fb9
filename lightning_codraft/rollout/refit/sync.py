"""The one weight-sync path: push policy + draft weights into a rollout engine every N optimizer steps.

:class:`WeightSync` is what the RL loop, the Fabric helper (``lightning_codraft.fabric.fabric_sync_weights``) and
the Trainer callback (``lightning_codraft.pytorch.WeightSyncCallback``) all call. It knows no Lightning and no
mesh: a *state function* returns the full, HF-named ``(policy_state, draft_state)`` (gathering shards is the
training side's job and may be a collective: it runs on every rank); the push runs where the caller says
(``push=True`` on the ranks that hold an engine). :func:`module_states` is the default state function of a module
holding ``policy`` and ``draft``: ``module.full_state_dicts()`` when it has it (a ``CoDraftModule``, also under
pipeline parallelism), else :func:`full_state_dict` of each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Optional, Union

import torch

from lightning_codraft.rollout.engine import RolloutEngine
from lightning_codraft.rollout.refit.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketPool,
    WeightBucket,
    pack_buckets,
    prefetched,
)

State = Optional[Mapping[str, torch.Tensor]]
StatesFn = Callable[[], tuple]
_WRAPPER_PREFIXES = ("_forward_module.", "module.", "_orig_mod.")


def full_state_dict(module: Optional[torch.nn.Module]) -> Optional[dict[str, torch.Tensor]]:
    """Detached full state dict of ``module`` with wrapper prefixes removed (None for None).

    Wrappers (DDP, Fabric, ``torch.compile``: ``module.``, ``_forward_module.``, ``_orig_mod.``) are stripped from
    the names; DTensor entries (FSDP2) are materialised with ``full_tensor()``, a collective: every rank must call.
    """
    if module is None:
        return None
    pruned = [n for n, m in module.named_modules() if hasattr(m, "pruned_name")]
    if pruned:
        raise RuntimeError(
            f"{type(module).__name__} holds only its pipeline stage ({pruned[0]} and "
            f"{len(pruned) - 1} more live on other stages); build the whole state with "
            f"CoDraftModule.full_state_dicts() (a collective over the pipeline group)"
        )
    out = {}
    for name, value in module.state_dict().items():
        if value.device.type == "meta":
            raise RuntimeError(
                f"{name} is not materialised on this rank (device 'meta'); build the state where the "
                f"whole module lives, e.g. with CoDraftModule.full_state_dicts()"
            )
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if hasattr(value, "full_tensor"):  # DTensor (FSDP2 / TP): gather the shards
            value = value.full_tensor()
        out[name] = value.detach()
    return out


def release_parameters(module: torch.nn.Module) -> None:
    """Free the storage of every parameter of ``module`` between rollout phases; :func:`refill_parameters` gives it
    back (empty, to be filled by a weight stream). The shapes are kept on the parameters."""
    for p in module.parameters():
        p._codraft_shape = tuple(p.shape)  # noqa: SLF001 - a plain attribute on the engine's own copy
        p.data = p.data.new_empty(0)


def refill_parameters(module: torch.nn.Module) -> None:
    """Storage of the released shapes for every parameter of ``module`` (values to be loaded by the next sync)."""
    for p in module.parameters():
        shape = getattr(p, "_codraft_shape", None)
        if shape is not None and tuple(p.shape) != shape:
            p.data = p.data.new_empty(shape)


def module_states(module: torch.nn.Module) -> tuple[State, State]:
    """``(policy_state, draft_state)`` of a module holding ``policy`` and ``draft`` (call on every rank).

    A ``CoDraftModule`` answers with ``full_state_dicts()`` (under PP the stages are gathered onto the first stage;
    the others get ``(None, None)``); any other module with :func:`full_state_dict` of its two attributes.
    """
    gather = getattr(module, "full_state_dicts", None)
    if callable(gather):
        return gather()
    return full_state_dict(module.policy), full_state_dict(getattr(module, "draft", None))


def engine_drafts(engine: RolloutEngine) -> bool:
    """Whether ``engine`` proposes draft tokens, so a draft state is worth pushing (unknown engines: yes)."""
    return int(getattr(engine, "num_speculative_tokens", 1)) > 0


Items = Optional[Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]]


def _pairs(items: Items) -> Iterable[tuple[str, torch.Tensor]]:
    return items.items() if isinstance(items, Mapping) else items


def refit_buckets(
    policy: Items,
    draft: Items,
    versions: Mapping[str, int],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Optional[torch.dtype] = None,
    shared: bool = False,
    pool: Optional[BucketPool] = None,
) -> Iterator[WeightBucket]:
    """The buckets of one refit: the policy's (if given), then the draft's, each tagged with its version."""
    pool = pool if pool is not None else BucketPool(shared)
    for kind, items in (("policy", policy), ("draft", draft)):
        if items is not None:
            yield from pack_buckets(_pairs(items), kind, int(versions[kind]), bucket_bytes, dtype=dtype, pool=pool)


class WeightSync:
    """Push the states of ``states()`` into ``engine`` after every ``every_n_steps``-th optimizer step, in buckets.

    Args:
        engine: any :class:`~lightning_codraft.rollout.engine.RolloutEngine`; None on ranks that only take part in
            the state function's collectives.
        states: ``states() -> (policy, draft)``, each a state dict or a ``(name, tensor)`` stream (possibly a
            collective: every rank consumes it) or None (that model is left unchanged).
        every_n_steps: push after every N-th optimizer step, N >= 1.
        bucket_bytes: bytes per bucket (the refit's peak extra memory is two buckets; rollout/refit/buckets.py).
        verify: ``"buckets"`` (every bucket's checksum recomputed where it lands) or ``"off"``.

    Attributes:
        last_synced_step: the optimizer step of the last push (-1 before any).
        sync_seconds: seconds of every sync (state function + push).
    """

    def __init__(
        self,
        engine: Optional[RolloutEngine],
        states: StatesFn,
        every_n_steps: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        verify: str = "buckets",
    ):
        if int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be >= 1")
        self.engine = engine
        self.states = states
        self.every_n_steps = int(every_n_steps)
        self.bucket_bytes, self.verify = int(bucket_bytes), verify
        self.pool: Optional[BucketPool] = None
        """The refit's two buffers, kept between refits until :meth:`release_buffers`."""
        self.last_synced_step = -1
        self.sync_seconds: list[float] = []

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (>= 1 once an optimizer step ran) needs a push."""
        return step >= 1 and step != self.last_synced_step and step % self.every_n_steps == 0

    def __call__(
        self, step: int, push: bool = True, force: bool = False, versions: Optional[Mapping[str, int]] = None
    ) -> Optional[float]:
        """Sync after optimizer step ``step`` if due (or ``force``); returns the seconds taken, or None when not due.

        The state function runs on every rank that calls (it may be a collective: its streams are consumed here
        whether or not this rank pushes); the engine is updated only where ``push`` is True, an engine is set and
        a state came back (the draft's only if the engine drafts). ``force``: push whatever the step, e.g. when
        training starts or resumes, so the engine never decodes with weights other than the ones being trained.
        ``versions``: ``{"policy": v, "draft": v}`` the pushed weights carry (default: ``step`` for both).
        """
        if not (force or self.due(step)):
            return None
        start = time.perf_counter()
        policy, draft = self.states()
        if self.engine is not None and not engine_drafts(self.engine):
            draft = _drain(draft)
        if push and self.engine is not None and (policy is not None or draft is not None):
            versions = dict(versions or {"policy": step, "draft": step})
            load = getattr(self.engine, "load_buckets", None)
            if load is None:  # an engine of the earlier protocol: whole state dicts
                self.engine.update_weights(
                    None if policy is None else dict(_pairs(policy)), None if draft is None else dict(_pairs(draft))
                )
            else:
                if self.pool is None:
                    self.pool = BucketPool(shared=bool(getattr(self.engine, "keeps_own_weights", False)))
                buckets = refit_buckets(policy, draft, versions, self.bucket_bytes, pool=self.pool)
                load(prefetched(buckets), verify=self.verify)  # bucket i + 1 packed while bucket i loads
        else:
            _drain(policy), _drain(draft)
        seconds = time.perf_counter() - start
        self.last_synced_step = step
        self.sync_seconds.append(seconds)
        return seconds

    def release_buffers(self) -> None:
        """Free the refit's buffers (e.g. while training runs); the next refit allocates them again."""
        if self.pool is not None:
            self.pool.release()


def _drain(items: Items) -> None:
    """Consume a stream this rank does not push (its collectives must still run); None."""
    if items is not None and not isinstance(items, Mapping):
        for _ in items:
            pass
    return None
