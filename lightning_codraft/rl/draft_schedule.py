"""When the co-trained draft trains: every step, every N-th step, or only when drift costs acceptance (adaptive).

Co-training is worth its cost only when the policy drifts away from the draft (docs/cotraining.md). The adaptive
schedule decides on each RL step, after its rollouts and before its update, from figures the step measured anyway:

- ``a``: the acceptance length the engine measured on this step's rollouts (decoded with the current draft);
- its smoothed value ``s = 0.5 a + 0.5 s_prev`` and the draft's recent best ``best`` (the highest ``s`` of the last
  ``window`` steps): the deficit ``best - s`` is what drift has cost since the draft was last in shape, less its
  noise: each step's prompts differ in how predictable they are, so ``a`` moves by ``sigma`` (the spread of ``a``
  around the previous ``s`` over the window) without any drift; ``s`` moves by about ``0.58 sigma`` and the best of
  a window of them sits above their mean by about as much, so the deficit counted is ``d = best - s - 2 x 0.58
  sigma`` (and nothing before three steps have measured ``sigma``);
- what a unit of acceptance is worth: rollouts take about ``rollout_s / a`` seconds more per step for each unit of
  acceptance lost (rounds per token are ``1 / a``); over the next ``H`` steps (``draft.schedule_horizon``, at most
  the steps left) the deficit costs ``gain = d * rollout_s / a * H`` seconds;
- what one draft update costs: the mean training seconds of the recent steps that trained the draft minus those of
  the steps that did not (before both were seen: half a skipped step's training time, the prior from
  docs/benchmarks/codraft_step.md, where co-training made the step 1.4-1.6x as long).

It trains when ``gain >= cost`` and, once training, keeps training while ``gain >= cost / 2`` (hysteresis: one noisy
step neither starts nor stops it). A skipped step runs no draft at all (no forward, no backward; the draft and its
optimizer state stay bit-identical). Every decision is logged with its reason and figures, and :func:`replay`
recomputes the decisions from those logged figures alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from lightning_codraft.rl.stats import paired_difference

SCHEDULES = ("every_step", "every_n", "adaptive")


@dataclass
class Decision:
    """One step's decision and the figures it used (a row of ``draft_schedule.jsonl``)."""

    step: int
    """1-based RL step."""
    train: bool
    """Whether the draft trains on this step."""
    reason: str
    """Why, in words."""
    acceptance: float = math.nan
    """The engine's acceptance length on the step's rollouts (the current draft)."""
    rollout_s: float = math.nan
    """Seconds the step's rollouts took."""
    smoothed: float = math.nan
    """Smoothed acceptance ``s``."""
    best: float = math.nan
    """The draft's recent best smoothed acceptance."""
    noise: float = math.nan
    """The deficit's allowance for noise (``2 x 0.58 sigma``; inf before three steps measured ``sigma``)."""
    gain_s: float = math.nan
    """Rollout seconds the deficit costs over the horizon."""
    cost_s: float = math.nan
    """Estimated seconds of one draft update."""
    train_s: float = math.nan
    """Seconds the step's update took (filled after it)."""
    ab_gain: float = math.nan
    """The A/B: the current draft's implied acceptance minus the reference's on the step's rollouts (NaN where
    either did not run; filled after the step)."""
    implied_rates: tuple = ()
    """The current draft's implied acceptance rate per position (empty where it did not run; filled after)."""


class DraftSchedule:
    """The co-trained draft's update schedule (module docstring).

    Args:
        schedule: ``every_step``, ``every_n`` or ``adaptive``.
        total_steps: RL steps of the run (the horizon never passes its end).
        every: N of ``every_n``.
        horizon: H of ``adaptive``.
        window: steps over which the recent best is taken.
        trains: False for a frozen or absent draft (then nothing trains, every schedule alike).
    """

    def __init__(self, schedule: str = "every_step", total_steps: int = 1, every: int = 1, horizon: int = 10,
                 window: int = 10, trains: bool = True):
        if schedule not in SCHEDULES:
            raise ValueError(f"draft schedule {schedule!r} must be one of {SCHEDULES}")
        if every < 1 or horizon < 1 or window < 1:
            raise ValueError(f"every={every}, horizon={horizon} and window={window} must be >= 1")
        self.schedule, self.total_steps, self.every, self.horizon, self.window = (schedule, total_steps, every,
                                                                                  horizon, window)
        self.trains = trains
        self.history: list[Decision] = []

    @property
    def skips_draft(self) -> bool:
        """Whether a step this schedule does not train runs no draft at all (the adaptive schedule's off steps)."""
        return self.trains and self.schedule == "adaptive"

    @property
    def updates(self) -> int:
        """Steps that trained the draft so far (its version)."""
        return sum(d.train for d in self.history)

    def decide(self, step: int, acceptance: float, rollout_s: float) -> Decision:
        """The decision for RL step ``step`` (0-based) from its measured acceptance and rollout seconds; call
        :meth:`record` after the step. Every rank must pass the same (global) figures."""
        figures = dict(acceptance=float(acceptance), rollout_s=float(rollout_s))
        if not self.trains:
            return Decision(step + 1, False, "the draft is not co-trained (draft.mode)", **figures)
        if self.schedule == "every_step":
            return Decision(step + 1, True, "every step", **figures)
        if self.schedule == "every_n":
            on = step % self.every == 0
            return Decision(step + 1, on, f"every {self.every} steps: {'on' if on else 'off'}", **figures)
        return self._adaptive(step, float(acceptance), float(rollout_s))

    def _adaptive(self, step: int, a: float, rollout_s: float) -> Decision:
        prev = self.history[-1] if self.history else None
        s = a if prev is None or math.isnan(prev.smoothed) else 0.5 * a + 0.5 * prev.smoothed
        recent = [d for d in self.history[-(self.window - 1):] if not math.isnan(d.smoothed)]
        best = max([d.smoothed for d in recent] + [s])
        resid = [b.acceptance - a0.smoothed for a0, b in zip(recent, recent[1:])] + (
            [a - recent[-1].smoothed] if recent else [])
        sigma = math.sqrt(sum(x * x for x in resid) / len(resid)) if len(resid) >= 3 else math.inf
        noise = 2 * math.sqrt(1 / 3) * sigma
        trained = [d.train_s for d in self.history[-20:] if d.train and not math.isnan(d.train_s)][-5:]
        skipped = [d.train_s for d in self.history[-20:] if not d.train and not math.isnan(d.train_s)][-5:]
        if trained and skipped:
            cost = max(sum(trained) / len(trained) - sum(skipped) / len(skipped), 0.0)
        elif skipped:
            cost = 0.5 * sum(skipped) / len(skipped)
        else:
            cost = math.inf  # the first step: nothing measured, and nothing has drifted yet
        H = max(1, min(self.horizon, self.total_steps - step))
        gain = max(best - s - noise, 0.0) * rollout_s / max(a, 1.0) * H if math.isfinite(noise) else 0.0
        training = prev is not None and prev.train
        need = cost / 2 if training else cost
        train = gain >= need and gain > 0
        fig = (f"acceptance {a:.2f} (smoothed {s:.2f}, recent best {best:.2f}, noise {noise:.2f}): the deficit "
               f"costs {gain:.2f} s of rollouts over {H} steps")
        verdict = (f">= {'half ' if training else ''}one update's {cost:.2f} s: train" if train else
                   f"< {'half ' if training else ''}one update's {cost:.2f} s: skip")
        return Decision(step + 1, train, f"{fig} {verdict}", acceptance=a, rollout_s=rollout_s, smoothed=s,
                        best=best, noise=noise, gain_s=gain, cost_s=cost)

    def record(self, decision: Decision, train_s: float, ab_gain: float = math.nan,
               implied_rates: Sequence[float] = ()) -> None:
        """Append the step's decision with its measured training seconds and A/B figures."""
        decision.train_s, decision.ab_gain = float(train_s), float(ab_gain)
        decision.implied_rates = tuple(implied_rates)
        self.history.append(decision)

    @property
    def last_rates(self) -> tuple:
        """The current draft's implied per-position rates on the last step it ran (empty if none)."""
        return next((d.implied_rates for d in reversed(self.history) if d.implied_rates), ())

    # ---------------------------------------------------------------- persistence (checkpoint entries, JSON)
    def state_dict(self) -> list[dict[str, Any]]:
        return [asdict(d) for d in self.history]

    def load_state_dict(self, rows: Sequence[dict[str, Any]]) -> None:
        self.history = [Decision(**{k: (math.nan if v is None else tuple(v) if isinstance(v, list) else v)
                                    for k, v in r.items()}) for r in rows]


def replay(rows: Sequence[dict[str, Any]], schedule: DraftSchedule) -> list[bool]:
    """The decisions ``schedule`` (fresh) makes from the logged figures ``rows`` (``draft_schedule.jsonl``)."""
    out = []
    for r in rows:
        d = schedule.decide(int(r["step"]) - 1, float(r["acceptance"]), float(r["rollout_s"]))
        schedule.record(d, float(r["train_s"]), float(r.get("ab_gain", math.nan)), r.get("implied_rates", ()))
        out.append(d.train)
    return out


def ab_difference(gains: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the running mean of the per-step A/B differences (current - reference implied
    acceptance) and its 95% confidence interval (NaN bounds with fewer than 2 steps)."""
    xs = [g for g in gains if not math.isnan(g)]
    if not xs:
        return math.nan, math.nan, math.nan
    if len(xs) < 2:
        return xs[0], math.nan, math.nan
    d = paired_difference(xs, [0.0] * len(xs))
    return d.mean, d.low, d.high
