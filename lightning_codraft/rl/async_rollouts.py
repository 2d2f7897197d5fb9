"""Asynchronous RL, deterministic k-step-off: the rollouts of step t are generated while the trainer trains step t - 1,
by the policy (and drafter) of version ``max(0, t - k)``.

:class:`AsyncRollouts` is the producer of :class:`~lightning_codraft.rl.step.RLStep` when ``rl.async_level = k > 0``.
At the start of trainer step t (its weights: version t), :meth:`AsyncRollouts.take`:

1. waits for the rollouts of step t (produced earlier; at a run's start, steps ``0 .. k - 1`` are produced at once
   with version 0) and for the producer to be idle;
2. refits the engine's own copies with version t (``RolloutWorker.prepare``: the producer decodes copies, never the
   weights being trained) and hands step ``t + k``'s generation to the producer thread;
3. returns step t's rollouts: the trainer trains on them while the producer generates.

Every rollout of step s is therefore a function of step s's prompts and seeds and the weights of version
``max(0, s - k)``: a run repeats exactly, and its staleness (trainer version minus behaviour version) is k once
``t >= k``. The decoupled objective (training/off_policy.py) corrects for it. The producer is one thread of this
process: torch releases the GIL in its kernels, so with ``run.threads = 1`` generation and training each keep one core
busy. With one engine copy the producer works on one step at a time, so k > 1 adds staleness, not overlap.

On a mesh every rank runs a producer thread; each replica's ranks decode their shares of its requests and gather the
outputs on a process group of their own (``ParallelDims`` ``producer``), so the producer's collectives never
interleave with the trainer's; the refit (collectives over the training mesh) runs on the trainer's thread in
:meth:`AsyncRollouts.take`, while the producer is idle.

Nothing is lost: :meth:`AsyncRollouts.state_dict` waits for the step in flight and returns every finished step's
rollouts (a checkpoint entry); a resumed run takes them instead of producing them again, so it consumes the same
prompts with the same rollouts as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any, Optional

import torch.distributed as dist

from lightning_codraft.rl.bounded_rollouts import BoundedRollouts
from lightning_codraft.rl.step import Generation, Produced, weight_versions
from lightning_codraft.rl.step_metrics import idle_share
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput


def producer(rl_step, state=None):
    """The asynchronous producer of ``rl_step``'s run (its config's ``rl.async_level`` / ``rl.max_staleness``)
    restored from a checkpoint's ``state``; None for a synchronous run."""
    r = rl_step.cfg.rl
    if not r.async_level:
        return None
    if isinstance(state, dict) and "replicas" in state:  # a mesh's entry: this replica's
        state = state["replicas"][rl_step.dims.dp_rank]
    if r.max_staleness is None:
        made = AsyncRollouts(rl_step, r.async_level, r.steps)
        made.load_state_dict(state or [])
    else:
        made = BoundedRollouts(
            rl_step, r.max_staleness, r.steps, drop_uniform=r.drop_uniform_groups, inflight=r.inflight_updates
        )
        made.load_state_dict(state)
    return made


def checkpoint_entry(made, dims) -> Any:
    """The producer's checkpoint entry: its state in one process; on a mesh every replica's, from its lead (one
    all-gather over the world on the trainer's thread: call on every rank)."""
    state = made.state_dict()
    if dims.world_size == 1:
        return state
    gathered = [None] * dims.world_size
    dist.all_gather_object(gathered, state)
    return {"replicas": [gathered[dims.replica_ranks(d)[0]] for d in range(dims.dp)]}


class AsyncRollouts:
    """The k-step-off producer of an :class:`~lightning_codraft.rl.step.RLStep`.

    Args:
        rl_step: the step whose rollouts this produces (its worker decodes copies of the training modules: a
            ``RolloutWorker`` of a config with ``rl.async_level > 0``).
        async_level: k >= 1.
        num_steps: the run's RL steps (no step past the last is produced).
    """

    def __init__(self, rl_step, async_level: int, num_steps: int):
        if async_level < 1:
            raise ValueError(f"async_level={async_level} must be >= 1 (0 is the synchronous step)")
        self.rl_step, self.k, self.num_steps = rl_step, int(async_level), int(num_steps)
        self.done: dict[int, Produced] = {}  # finished steps not yet consumed
        self._future: Optional[Future] = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="codraft-producer")
        self._busy_s = 0.0  # producer seconds since the last take (written by the producer, read after _drain)
        self._last_take: Optional[float] = None

    # ------------------------------------------------------------------ the trainer's side
    def take(self, step: int, samples=None) -> Produced:
        """Step ``step``'s rollouts, and step ``step + k``'s generation started (module docstring)."""
        if samples is not None:
            raise ValueError("an asynchronous run draws every step's prompts itself (rl.async_level > 0)")
        t0 = time.perf_counter()
        self._drain()
        for s in range(step, min(step + self.k, self.num_steps)):  # a run's first steps (or a resume's missing):
            if s not in self.done:  # by the weights the trainer holds now, tagged as such, waited for
                self._start(s, version=step)
                self._drain()
        produced = self.done.pop(step)
        now = time.perf_counter()
        wait = now - t0
        idle = idle_share(self._busy_s, self._last_take, now)
        self._busy_s, self._last_take = 0.0, now
        nxt = step + self.k
        if nxt < self.num_steps and nxt not in self.done:
            self._start(nxt, version=step)
        produced.wait_s, produced.producer_idle = wait, idle
        return produced

    def paused(self) -> contextlib.AbstractContextManager:
        """A context in which the producer is idle (the step in flight finished): the engine is the caller's (a
        held-out evaluation between steps); the next :meth:`take` refits it again."""
        self._drain()
        return contextlib.nullcontext()

    def close(self) -> None:
        """Finish the step in flight (its rollouts kept) and stop the producer thread."""
        self._drain()
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ the producer's side
    def _start(self, step: int, version: int) -> None:
        """Refit the engine's copies to the training state now (version ``version``: before the trainer changes it),
        then generate step ``step``'s rollouts on the producer thread."""
        rl = self.rl_step
        versions = weight_versions(rl.cfg, version, rl.schedule.updates)
        mine = rl._replica_prompts(step, None)
        refit_s = rl.worker.prepare(versions)
        self._future = self._pool.submit(self._generate, step, mine, versions, refit_s)

    def _generate(self, step: int, mine: list, versions: dict[str, int], refit_s: float) -> Produced:
        t0 = time.perf_counter()
        gen = self.rl_step.generate_prepared(step, mine, versions, refit_s, group=self.rl_step.dims.group("producer"))
        self._busy_s += time.perf_counter() - t0
        return Produced(step, mine, gen)

    def _drain(self) -> None:
        """Wait for the step in flight and keep its rollouts (a failure in the producer is raised here)."""
        if self._future is not None:
            produced = self._future.result()
            self._future = None
            self.done[produced.step] = produced

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> list[dict[str, Any]]:
        """Every finished, unconsumed step's rollouts (the step in flight is finished first): a checkpoint entry of
        plain values."""
        self._drain()
        return [_produced_state(p) for _, p in sorted(self.done.items())]

    def load_state_dict(self, rows: list[dict[str, Any]]) -> None:
        """Restore the finished steps of a checkpoint (they are consumed before anything is produced again; their
        prompts are drawn again: a pure function of the run's seed and the step)."""
        if not isinstance(rows, list):
            raise ValueError(
                "this checkpoint's rollouts were produced under rl.max_staleness (bounded staleness); resume it with "
                "the same rl.max_staleness"
            )
        self.done = {
            int(r["step"]): _produced_from(r, self.rl_step._replica_prompts(int(r["step"]), None)) for r in rows
        }


def _produced_state(p: Produced) -> dict[str, Any]:
    g = p.gen
    return {
        "step": p.step,
        "requests": [list(r) for r in g.requests],
        "outs": [asdict(o) for o in g.outs],
        "acc": asdict(g.acc),
        "rollout_s": g.rollout_s,
        "refit_s": g.refit_s,
        "versions": dict(g.versions),
    }


def _produced_from(row: dict[str, Any], prompts: list) -> Produced:
    outs = [RolloutOutput.from_dict(o) for o in row["outs"]]
    gen = Generation(
        row["requests"], outs, AcceptanceStats(**row["acc"]), row["rollout_s"], row["refit_s"], row["versions"]
    )
    return Produced(int(row["step"]), prompts, gen)
