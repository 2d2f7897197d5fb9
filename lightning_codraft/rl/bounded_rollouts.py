"""Asynchronous RL with bounded staleness (``rl.max_staleness: eta``): a free-running producer of prompt groups.

The prompts form one stream: group ``i`` is prompt ``i % P`` of step ``i // P`` (``P = rl.prompts_per_step``; the
prompts and seeds the synchronous loop would use). :class:`BoundedRollouts` runs a producer thread that takes the next
groups of the stream, refits the engine's copies to the newest weights the trainer has published, generates them and
queues them in stream order. The trainer's step t takes the first P groups of the queue that it keeps (rewards are
computed on the trainer's thread: a reward function may need the main thread, e.g. for a signal-based timeout).

**Capacity.** The producer may admit group ``i`` only while ``admitted < (min(t + eta + 1, steps)) * P + dropped``,
t the trainer's version: at most ``eta + 1`` steps of work ahead of it, plus one group per group it dropped. A
group admitted at trainer version v has stream index ``i < (v + eta + 1) P + D_v`` (``D_v``: drops known by then,
all earlier in the stream than i), and the step that keeps it, t, has ``t P <= i - D_i`` kept groups before it
(``D_i >= D_v``), so ``t - v <= eta``: no group the trainer keeps is staler than eta, by construction. A slow producer
makes the trainer wait; a slow trainer makes the producer wait. A dropped group (``rl.drop_uniform_groups``: rewards
all equal, DAPO's dynamic sampling; or staler than eta, which only a resume with a smaller eta can produce) returns
its capacity, so the producer generates the group that replaces it; without that the trainer would wait forever
(the state is detected and raised: the producer at capacity, nothing queued, nothing in flight).

**Weights.** At each ``take(t)`` the trainer publishes a snapshot of version t (``RolloutWorker.snapshot``: the
producer never reads weights the optimizer is changing); the producer refits from the newest snapshot before each
batch of groups. Every rollout records the policy and drafter versions that generated it. With in-flight updates
(``rl.inflight_updates``) the engine also takes a newer snapshot between decoding rounds: the tokens after it carry
the new version (``RolloutOutput.token_versions``); a group's version, for the bound, is its first token's.

**Nothing lost.** :meth:`BoundedRollouts.state_dict` (no waiting) holds the queued, finished groups, the cursor (the
first group not finished: the batch in flight is generated again on resume, first), the dropped count and the
ledger of every group kept or dropped by a step. Runs do not repeat exactly (which version generates a group depends
on timing); a killed and resumed run consumes every group of the stream exactly once, as an uninterrupted run does.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_codraft.rl.step import Generation, Produced, step_prompts, weight_versions
from lightning_codraft.rl.step_metrics import idle_share
from lightning_codraft.rl.tasks.rewards import RewardScores
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput


@dataclass
class Group:
    """One prompt's rollouts, as the producer queues them."""

    index: int
    """Its place in the prompt stream (step ``index // P``, prompt ``index % P``)."""
    requests: list[list[int]]
    """The prompt's ids, once per sample."""
    outs: list[RolloutOutput]
    """The engine's outputs (each with the policy and draft versions that generated it)."""
    seconds: float
    """Its share of its batch's generation seconds."""
    refit_s: float
    """Its share of its batch's refit seconds."""


class BoundedRollouts:
    """The bounded-staleness producer of an :class:`~lightning_codraft.rl.step.RLStep` (module docstring).

    Args:
        rl_step: the step whose rollouts this produces (its worker decodes copies of the training modules).
        max_staleness: eta >= 0.
        num_steps: the run's RL steps (no group past what they need, plus replacements, is produced).
        drop_uniform: drop groups whose rewards are all equal (``rl.drop_uniform_groups``).
        inflight: the engine takes newly published weights between decoding rounds (``rl.inflight_updates``).
    """

    def __init__(self, rl_step, max_staleness: int, num_steps: int, drop_uniform: bool = False, inflight: bool = False):
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0")
        self.rl_step, self.eta, self.num_steps = rl_step, int(max_staleness), num_steps
        self.drop_uniform, self.inflight = drop_uniform, inflight
        self.P = rl_step.cfg.rl.prompts_per_step
        self.ledger: list[dict[str, Any]] = []
        """Per consumed step: the stream indices it kept and dropped (a checkpoint entry)."""
        self.admissions: list[tuple[int, int, int, int]] = []
        """``(first group, groups, trainer version, dropped so far)`` of every batch the producer admitted."""
        self._cond = threading.Condition()
        self._ready: collections.deque[Group] = collections.deque()
        self._admitted = self._dropped = 0
        self._version = -1  # the trainer's version (published weights); -1 before the first take
        self._published: Optional[tuple[dict[str, int], dict]] = None
        self._in_flight: Optional[range] = None
        self._paused = self._stop = False
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._busy_s, self._last_take = 0.0, None
        self._prompts: dict[int, list] = {}

    # ------------------------------------------------------------------ the trainer's side
    def take(self, step: int, samples=None) -> Produced:
        """Publish the weights of version ``step``, then return the step's ``P`` kept groups (waiting for them)."""
        if samples is not None:
            raise ValueError("an asynchronous run draws every step's prompts itself (rl.async_level > 0)")
        t0 = time.perf_counter()
        self._publish(step)
        kept, scored, dropped = [], [], []
        while len(kept) < self.P:
            with self._cond:
                group = self._next_ready()
            why, scores = self._drop_reason(group, step)  # scored here, on the trainer's thread, where it filters
            if why is None:
                kept.append(group)
                scored.append(scores)
                continue
            dropped.append(group.index)
            with self._cond:
                self._dropped += 1  # its capacity returns: the producer may admit one more group
                self._cond.notify_all()
        with self._cond:
            now = time.perf_counter()
            idle = idle_share(self._busy_s, self._last_take, now)
            self._busy_s, self._last_take = 0.0, now
        scores = RewardScores.concat(scored) if self.drop_uniform else None
        self.ledger.append({"step": step, "kept": [g.index for g in kept], "dropped": dropped})
        return self._produced(step, kept, scores, len(dropped), now - t0, idle)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A context in which the producer is idle (the batch in flight finished): the engine is the caller's."""
        with self._cond:
            self._paused = True
            while self._in_flight is not None:
                self._cond.wait()
        self._raise_error()
        self._own_engine(False)
        try:
            yield
        finally:
            self._own_engine(self._thread is not None)
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def close(self) -> None:
        """Stop the producer (the batch in flight is finished and queued) and join its thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._own_engine(False)
        self._raise_error()

    def _own_engine(self, on: bool) -> None:
        """Point the engine's in-flight weight source at this producer (``on``), or leave the engine to the caller."""
        if self.inflight:
            self.rl_step.worker.engine.weight_source = self._offer if on else None

    # ------------------------------------------------------------------ the producer's side
    def _capacity(self) -> int:
        """Groups the producer may still admit (caller holds the lock)."""
        ahead = min(self._version + self.eta + 1, self.num_steps)
        return ahead * self.P + self._dropped - self._admitted

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._stop and (self._paused or self._capacity() <= 0):
                        self._cond.wait()
                    if self._stop:
                        return
                    first, n = self._admitted, min(self.P, self._capacity())
                    self._admitted += n
                    self._in_flight = range(first, first + n)
                    self.admissions.append((first, n, self._version, self._dropped))
                    versions, state = self._published
                t0 = time.perf_counter()
                groups = self._generate(first, n, versions, state)
                with self._cond:
                    self._busy_s += time.perf_counter() - t0
                    self._ready.extend(groups)
                    self._in_flight = None
                    self._cond.notify_all()
        except BaseException as e:  # raised on the trainer's side at its next take
            with self._cond:
                self._error, self._in_flight = e, None
                self._cond.notify_all()

    def _generate(self, first: int, n: int, versions: dict[str, int], state: dict) -> list[Group]:
        """Refit from ``state`` (version ``versions``) and generate groups ``first .. first + n - 1`` (rewards are
        the trainer thread's: a reward function may need the main thread, e.g. for signal-based timeouts)."""
        rl, G = self.rl_step, self.rl_step.cfg.rl.group_size
        places = [divmod(i, self.P) for i in range(first, first + n)]
        samples = [self._prompt(s, j) for s, j in places]
        refit_s = rl.worker.prepare(versions, state=state)
        gen = rl.generate_prepared(places[0][0], samples, versions, refit_s, places=places)
        return [
            Group(
                first + g,
                gen.requests[g * G : (g + 1) * G],
                gen.outs[g * G : (g + 1) * G],
                gen.rollout_s / n,
                refit_s / n,
            )
            for g in range(n)
        ]

    def _prompt(self, step: int, j: int):
        """Prompt ``j`` of ``step`` (either thread: a step's prompts are a pure function of it; a few are kept)."""
        prompts = self._prompts.get(step)
        if prompts is None:
            prompts = step_prompts(self.rl_step.task, self.rl_step.cfg, step)
            self._prompts = {**{s: p for s, p in self._prompts.items() if s > step - 4}, step: prompts}
        return prompts[j]

    # ------------------------------------------------------------------ helpers
    def _publish(self, step: int) -> None:
        rl = self.rl_step
        if step <= self._version:
            return
        published = (weight_versions(rl.cfg, step, rl.schedule.updates), rl.worker.snapshot())
        with self._cond:
            self._version, self._published = step, published
            self._cond.notify_all()
        if self._thread is None:
            self._own_engine(True)
            self._thread = threading.Thread(target=self._run, name="codraft-bounded-producer", daemon=True)
            self._thread.start()

    def _offer(self, current: dict[str, int]):
        """The engine's weight source (in-flight updates): the newest published weights when newer than ``current``."""
        with self._cond:
            versions, state = self._published
        if versions["policy"] <= current["policy"]:
            return None
        parts = {p: {k[len(p) :]: v for k, v in state.items() if k.startswith(p)} for p in ("policy.", "draft.")}
        return dict(versions), parts["policy."], parts["draft."] or None

    def _next_ready(self) -> Group:
        """The first queued group, waiting for it (caller holds the lock)."""
        while not self._ready:
            self._raise_error()
            if self._in_flight is None and self._capacity() <= 0 and not self._paused:
                raise RuntimeError(
                    f"the bounded-staleness producer is at capacity ({self._admitted} groups admitted, "
                    f"{self._dropped} dropped, trainer version {self._version}) with nothing queued or in flight: "
                    f"a dropped group did not return its capacity"
                )
            self._cond.wait(timeout=1.0)
        return self._ready.popleft()

    def _drop_reason(self, group: Group, step: int) -> tuple[Optional[str], Optional[RewardScores]]:
        """Why ``group`` is dropped at trainer version ``step`` (None: kept), and its rewards where the uniform
        filter computed them."""
        if step - min(o.policy_version for o in group.outs) > self.eta:
            return "stale", None
        if not self.drop_uniform:
            return None, None
        rl, G = self.rl_step, self.rl_step.cfg.rl.group_size
        sample = self._prompt(*divmod(group.index, self.P))
        texts = [rl.tokenizer.decode(o.token_ids) for o in group.outs]
        scores = rl.rewards.score([sample.prompt] * G, texts, [sample] * G)
        return ("uniform" if all(v == scores.total[0] for v in scores.total) else None), scores

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the bounded-staleness producer failed") from self._error

    def _produced(self, step, kept: list[Group], scores, dropped: int, wait_s: float, idle: float) -> Produced:
        outs = [o for g in kept for o in g.outs]
        versions = {"policy": min(o.policy_version for o in outs), "draft": min(o.draft_version for o in outs)}
        gen = Generation(
            [r for g in kept for r in g.requests],
            outs,
            AcceptanceStats.total(o.stats for o in outs),
            sum(g.seconds for g in kept),
            sum(g.refit_s for g in kept),
            versions,
        )
        prompts = [self._prompt(*divmod(g.index, self.P)) for g in kept]
        return Produced(step, prompts, gen, wait_s=wait_s, producer_idle=idle, scores=scores, dropped=dropped)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The queued finished groups, the cursor (the first group not finished), the dropped count and the
        ledger: plain values, taken under the lock without waiting for the batch in flight."""
        with self._cond:
            cursor = self._in_flight.start if self._in_flight is not None else self._admitted
            return {
                "groups": [_group_state(g) for g in self._ready],
                "cursor": cursor,
                "dropped": self._dropped,
                "ledger": [dict(r) for r in self.ledger],
            }

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore a checkpoint's producer state (before the first take): its queued groups are consumed first,
        then the stream goes on from its cursor (a batch that was in flight is generated again)."""
        if not state:
            return
        if not isinstance(state, dict):
            raise ValueError(
                "this checkpoint's rollouts were produced by the deterministic k-step-off producer; resume it "
                "without rl.max_staleness"
            )
        self._ready = collections.deque(_group_from(r) for r in state["groups"])
        self._admitted, self._dropped = int(state["cursor"]), int(state["dropped"])
        self.ledger = [dict(r) for r in state["ledger"]]


def _group_state(g: Group) -> dict[str, Any]:
    return {
        "index": g.index,
        "requests": [list(r) for r in g.requests],
        "outs": [asdict(o) for o in g.outs],
        "seconds": g.seconds,
        "refit_s": g.refit_s,
    }


def _group_from(row: dict[str, Any]) -> Group:
    outs = [RolloutOutput.from_dict(o) for o in row["outs"]]
    return Group(int(row["index"]), row["requests"], outs, row["seconds"], row["refit_s"])
