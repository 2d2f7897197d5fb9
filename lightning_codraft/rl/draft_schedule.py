"""When the co-trained draft trains: every step, every N-th step, or only when an update pays (adaptive).

Co-training is worth its cost only when an update buys more rollout time than it costs (docs/cotraining.md). The
adaptive schedule decides on each RL step, after its rollouts and before its update, from figures the steps measured
anyway:

- **What an update buys**, ``u``: the margin of the current draft over the A/B's frozen reference, ``m = a - r``
  (``a`` the acceptance length the engine measured on the step's rollouts, decoded with the current draft; ``r`` the
  reference's implied acceptance on the same rollouts; without a reference, ``m = a``), moves from one step to the
  next by what the update between them did plus what drift did. Its mean change after steps that trained, less its
  mean change after steps that did not (0 before two such steps), over the last ``window`` of each, is the margin
  one update adds: continued learning as well as recovered drift, measured on the same rollouts for both drafts,
  so the step's prompts cancel. The first ``WARMUP`` + 1 steps train to measure it, and a draft left untrained for
  ``window`` steps trains once to measure it again (a probe).
- **What drift has cost**, ``d``: the smoothed acceptance ``s = 0.5 a + 0.5 s_prev`` below the draft's recent best
  (the highest ``s`` of the last ``window`` steps), less its noise: each step's prompts differ in how predictable
  they are, so ``a`` moves by ``sigma`` (its spread around the previous ``s`` over the window) without any drift;
  ``s`` moves by about ``0.58 sigma`` and the best of a window of them sits above their mean by about as much, so
  ``d = best - s - 2 x 0.58 sigma`` (0 before three steps have measured ``sigma``).
- **What a unit of acceptance is worth**: rollouts take about ``rollout_s / a`` seconds more per step for each unit
  lost (rounds per token are ``1 / a``; ``rollout_s`` the mean of the recent steps'), on the share ``f`` of the
  rounds' capacity the engine actually drafts (``mean_k / K``; the adaptive engine decodes plainly where verifying
  drafts costs more than it saves, e.g. a large batch on a CPU): over the next ``H`` steps (``draft.schedule_horizon``,
  at most the steps left) the update is worth ``gain = (max(u, 0) + d) x rollout_s / a x H x f`` seconds. A step
  whose rollouts drafted nothing (``f = 0``) skips its update whatever else holds: the same economics as the
  engine's, so co-training costs nothing while speculation does not pay, and resumes when it pays again (smaller
  batches, the long tail of a shrinking batch, a drifting policy).
- **What one update costs**: the recent trained steps' training seconds per completion token less the skipped
  steps', times this step's tokens (before both were seen: a third of a trained step, or half a skipped one, the
  prior from docs/benchmarks/codraft_step.md, where co-training made the step 1.4-1.6x as long). How large an
  update is, is ``draft.sample_every`` (docs/benchmarks/cotrain_schedule.md: a quarter of the samples held the
  acceptance of all of them on tiny-drift at a fraction of the cost).

- **What speculation has saved**: the adaptive engine prices every round it drafts at its cost model's plain step
  for the round's batch, so each step reports the decode seconds speculation saved against plain decoding at the
  same batch (``AcceptanceStats.saving_s``). Updates are paid out of that: a step whose credit, the seconds saved so
  far less what the updates before it cost, is below one update's cost skips, whatever else holds. So the draft's
  training never costs more than its speculation saved, and at a batch where speculation buys almost nothing
  (64 rows on a CPU, where verifying K + 1 tokens costs almost K + 1 plain steps) the co-trained step costs what the
  no-draft step costs; at one sequence at a time, where a step saves seconds, the credit never binds. Engines
  without a cost model (fixed K, vLLM) report no saving and this rule is off.

It trains when ``gain >= cost`` and, once training, keeps training while ``gain >= cost / 2`` (hysteresis: one noisy
step neither starts nor stops it). A skipped step runs no draft update (no forward or backward of the trained draft;
it and its optimizer state stay bit-identical; the reference is still scored except on idle steps). Every decision
is logged with its reason and figures, and :func:`replay` recomputes the decisions from those logged figures alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_codraft.rl.reports.stats import paired_difference

SCHEDULES = ("every_step", "every_n", "adaptive")
WARMUP = 3
"""Changes of the margin after trained steps the adaptive schedule measures before it trusts what an update buys."""


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
    tokens: float = math.nan
    """Completion tokens of the step's rollouts (the update's cost scales with them)."""
    smoothed: float = math.nan
    """Smoothed acceptance ``s``."""
    best: float = math.nan
    """The draft's recent best smoothed acceptance."""
    noise: float = math.nan
    """The deficit's allowance for noise (``2 x 0.58 sigma``; inf before three steps measured ``sigma``)."""
    update_gain: float = math.nan
    """What one update adds to the draft's margin over the reference, measured (``u``)."""
    gain_s: float = math.nan
    """Rollout seconds an update is worth over the horizon."""
    cost_s: float = math.nan
    """Estimated seconds of one draft update."""
    train_s: float = math.nan
    """Seconds the step's update took (filled after it)."""
    reference: float = math.nan
    """The reference draft's implied acceptance on the step's rollouts (NaN without one; filled after the step)."""
    ab_gain: float = math.nan
    """The A/B: the current draft's implied acceptance minus the reference's on the step's rollouts (NaN where
    either did not run; filled after the step)."""
    implied_rates: tuple = ()
    """The current draft's implied acceptance rate per position (empty where it did not run; filled after)."""
    speculation: float = 1.0
    """The share of the step's verification rounds' capacity the engine drafted (``mean_k / K``: 1 for a fixed
    engine, 0 where the adaptive engine decoded plainly because speculation did not pay at the step's batch)."""
    saving_s: float = math.nan
    """Decode seconds speculation saved on the step's rollouts against plain decoding at the same batch, by the
    adaptive engine's cost model (NaN for engines without one)."""
    credit_s: float = math.nan
    """Seconds speculation has saved so far, this step included, less what the updates before it cost (NaN
    without a measured saving)."""
    idle: bool = False
    """The draft is off this step, not even scored (no reference either): the engine decoded plainly, or the credit
    does not cover an update. The step then costs what a step without a draft costs."""
    charged_s: float = math.nan
    """What the step's update is charged against that credit (0 for a skipped step; filled after the step)."""


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

    def __init__(
        self,
        schedule: str = "every_step",
        total_steps: int = 1,
        every: int = 1,
        horizon: int = 10,
        window: int = 10,
        trains: bool = True,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"draft schedule {schedule!r} must be one of {SCHEDULES}")
        if every < 1 or horizon < 1 or window < 1:
            raise ValueError(f"every={every}, horizon={horizon} and window={window} must be >= 1")
        self.schedule, self.total_steps, self.every, self.horizon, self.window = (
            schedule,
            total_steps,
            every,
            horizon,
            window,
        )
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

    def decide(
        self,
        step: int,
        acceptance: float,
        rollout_s: float,
        tokens: float = math.nan,
        speculation: float = 1.0,
        saving_s: float = math.nan,
    ) -> Decision:
        """The decision for RL step ``step`` (0-based) from its measured acceptance, rollout seconds, completion
        tokens, the share of its rounds' capacity the engine drafted (:attr:`Decision.speculation`) and the seconds
        speculation saved (:attr:`Decision.saving_s`); call :meth:`record` after the step. Every rank must pass the
        same (global) figures."""
        figures = dict(
            acceptance=float(acceptance),
            rollout_s=float(rollout_s),
            tokens=float(tokens),
            speculation=float(speculation),
            saving_s=float(saving_s),
            credit_s=self._credit(saving_s),
        )
        if not self.trains:
            return Decision(step + 1, False, "the draft is not co-trained (draft.mode)", **figures)
        if self.schedule == "every_step":
            return Decision(step + 1, True, "every step", **figures)
        if self.schedule == "every_n":
            on = step % self.every == 0
            return Decision(step + 1, on, f"every {self.every} steps: {'on' if on else 'off'}", **figures)
        return self._adaptive(step, figures)

    def _credit(self, saving_s: float) -> float:
        """Seconds speculation saved so far (this step's ``saving_s`` included) less the updates' charges; NaN
        while the engine measures no saving."""
        if not math.isfinite(saving_s):
            return math.nan
        saved = sum(d.saving_s for d in self.history if math.isfinite(d.saving_s)) + saving_s
        return saved - sum(d.charged_s for d in self.history if math.isfinite(d.charged_s))

    def _update_gain(self) -> tuple[float, int]:
        """``(u, n)``: what one update adds to the margin over the reference (module docstring), and how many
        changes after trained steps measured it."""
        rows = self.history
        paired = any(math.isfinite(d.reference) for d in rows)  # an idle step scores no reference: its margin is NaN
        margin = [d.acceptance - (d.reference if paired else 0.0) for d in rows]
        after = {True: [], False: []}
        for prev, m0, m1 in zip(rows, margin, margin[1:]):
            if math.isfinite(m1 - m0):
                after[prev.train].append(m1 - m0)
        trained, skipped = after[True][-self.window :], after[False][-self.window :]
        if not trained:
            return math.nan, 0
        base = sum(skipped) / len(skipped) if len(skipped) >= 2 else 0.0
        return sum(trained) / len(trained) - base, len(after[True])

    def _cost(self, tokens: float) -> float:
        """Estimated seconds of one draft update on a step of ``tokens`` completion tokens (module docstring)."""
        scaled = math.isfinite(tokens) and tokens > 0 and all(math.isfinite(d.tokens) for d in self.history)
        per = [
            (d.train, d.train_s / d.tokens if scaled else d.train_s)
            for d in self.history[-20:]
            if math.isfinite(d.train_s)
        ]
        trained = [x for t, x in per if t][-5:]
        skipped = [x for t, x in per if not t][-5:]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        if trained and skipped:
            unit = max(mean(trained) - mean(skipped), 0.0)
        elif trained:
            unit = mean(trained) / 3
        elif skipped:
            unit = 0.5 * mean(skipped)
        else:
            return math.inf
        return unit * (tokens if scaled else 1.0)

    def _adaptive(self, step: int, figures: dict) -> Decision:
        a, rollout_s, tokens, speculation = (figures[k] for k in ("acceptance", "rollout_s", "tokens", "speculation"))
        prev = self.history[-1] if self.history else None
        s = a if prev is None or math.isnan(prev.smoothed) else 0.5 * a + 0.5 * prev.smoothed
        recent = [d for d in self.history[-(self.window - 1) :] if not math.isnan(d.smoothed)]
        best = max([d.smoothed for d in recent] + [s])
        resid = [b.acceptance - a0.smoothed for a0, b in zip(recent, recent[1:])] + (
            [a - recent[-1].smoothed] if recent else []
        )
        sigma = math.sqrt(sum(x * x for x in resid) / len(resid)) if len(resid) >= 3 else math.inf
        noise = 2 * math.sqrt(1 / 3) * sigma
        deficit = max(best - s - noise, 0.0) if math.isfinite(noise) else 0.0
        u, measured = self._update_gain()
        cost = self._cost(tokens)
        H = max(1, min(self.horizon, self.total_steps - step))
        per_unit = (sum(d.rollout_s for d in recent) + rollout_s) / (len(recent) + 1) / max(a, 1.0)
        share = min(max(speculation, 0.0), 1.0) if math.isfinite(speculation) else 1.0
        gain = ((max(u, 0.0) if math.isfinite(u) else 0.0) + deficit) * per_unit * H * share
        training = prev is not None and prev.train
        figures = dict(figures, smoothed=s, best=best, noise=noise, update_gain=u, gain_s=gain, cost_s=cost)
        if share == 0.0:  # the adaptive engine's own economics: speculation does not pay at this batch
            return Decision(
                step + 1,
                False,
                "the engine decoded plainly (speculation does not pay at this batch): "
                "an update buys no rollout time, skip",
                idle=True,
                **figures,
            )
        credit = figures["credit_s"]
        if math.isfinite(credit) and (credit < cost if math.isfinite(cost) else credit <= 0):
            return Decision(
                step + 1,
                False,
                f"credit {credit:.2f} s (the decode time speculation saved so far less "
                f"the updates' cost) is below one update's {cost:.2f} s: skip (updates "
                "are paid only out of time speculation saved)",
                idle=True,
                **figures,
            )
        if measured < WARMUP:
            return Decision(
                step + 1, True, f"measuring what an update buys ({measured} of {WARMUP} measured)", **figures
            )
        if len(self.history) >= self.window and not any(d.train for d in self.history[-self.window :]):
            return Decision(
                step + 1, True, f"no update in {self.window} steps: a probe of what one buys now", **figures
            )
        need = cost / 2 if training else cost
        train = gain >= need and gain > 0
        fig = (
            f"an update adds {u:+.3f} to the margin over the reference, drift cost {deficit:.2f} (acceptance "
            f"{a:.2f}, smoothed {s:.2f}, recent best {best:.2f}, noise {noise:.2f}): worth {gain:.2f} s of "
            f"rollouts over {H} steps"
        )
        verdict = (
            f">= {'half ' if training else ''}one update's {cost:.2f} s: train"
            if train
            else f"< {'half ' if training else ''}one update's {cost:.2f} s: skip"
        )
        return Decision(step + 1, train, f"{fig} {verdict}", **figures)

    def record(
        self,
        decision: Decision,
        train_s: float,
        ab_gain: float = math.nan,
        implied_rates: Sequence[float] = (),
        reference: float = math.nan,
    ) -> None:
        """Append the step's decision with its measured training seconds (the same on every rank) and A/B figures
        (``reference``: the reference draft's implied acceptance)."""
        decision.train_s, decision.ab_gain, decision.reference = float(train_s), float(ab_gain), float(reference)
        decision.implied_rates = tuple(implied_rates)
        self.history.append(decision)
        charge = self._cost(decision.tokens) if decision.train else 0.0
        decision.charged_s = charge if math.isfinite(charge) else float(train_s)

    @property
    def last_rates(self) -> tuple:
        """The current draft's implied per-position rates on the last step it ran (empty if none)."""
        return next((d.implied_rates for d in reversed(self.history) if d.implied_rates), ())

    # ---------------------------------------------------------------- persistence (checkpoint entries, JSON)
    def state_dict(self) -> list[dict[str, Any]]:
        return [asdict(d) for d in self.history]

    def load_state_dict(self, rows: Sequence[dict[str, Any]]) -> None:
        self.history = [
            Decision(**{k: (math.nan if v is None else tuple(v) if isinstance(v, list) else v) for k, v in r.items()})
            for r in rows
        ]


def replay(rows: Sequence[dict[str, Any]], schedule: DraftSchedule) -> list[bool]:
    """The decisions ``schedule`` (fresh) makes from the logged figures ``rows`` (``draft_schedule.jsonl``)."""
    out = []
    for r in rows:
        num = lambda k, r=r: math.nan if r.get(k) is None else float(r[k])
        d = schedule.decide(
            int(r["step"]) - 1,
            num("acceptance"),
            num("rollout_s"),
            num("tokens"),
            1.0 if r.get("speculation") is None else float(r["speculation"]),
            num("saving_s"),
        )
        schedule.record(d, num("train_s"), num("ab_gain"), r.get("implied_rates", ()), num("reference"))
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
