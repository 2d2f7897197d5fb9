"""The draft's update schedule (rl/draft_schedule.py): every step, every N, adaptive (trains when what an update
buys, measured as the change of the draft's margin over the reference after trained steps, or the acceptance lost to
drift, is worth more rollout time than an update costs, with hysteresis); decisions replay from the logged figures;
a run under the adaptive schedule logs them, tags the engine's draft with its update count and resumes the
schedule."""

import json
import math

import pytest
from test_loop import micro_config

from lightning_codraft.rl import draft_schedule
from lightning_codraft.rl.draft_schedule import WARMUP, DraftSchedule, ab_difference, replay
from lightning_codraft.rl.run.loop import fit
from lightning_codraft.rl.reports.run_log import read_metrics


def _run(schedule, acceptance, rollout_s=10.0, train_s=(2.0, 3.0)):
    """Feed ``schedule`` a series of measured acceptances (no reference); a trained step takes train_s[1] s, a
    skipped one [0]."""
    out = []
    for a in acceptance:
        d = schedule.decide(len(schedule.history), a, rollout_s)
        schedule.record(d, train_s[d.train])
        out.append(d.train)
    return out


class World:
    """A policy and a draft: the reference's acceptance follows the step's prompts (``base``); each update adds
    ``effect`` to the current draft's margin over it, each skipped step loses ``drift``."""

    def __init__(self, effect: float, drift: float = 0.0, tokens: float = 1000.0):
        self.margin, self.effect, self.drift, self.tokens = 0.3, effect, drift, tokens

    def run(self, schedule, bases, rollout_s=10.0, seconds=(2.0, 3.0), speculation=1.0):
        out = []
        for base in bases:
            d = schedule.decide(len(schedule.history), base + self.margin, rollout_s, self.tokens, speculation)
            scale = self.tokens / 1000.0  # training seconds scale with the step's tokens
            schedule.record(d, seconds[d.train] * scale, reference=base)
            self.margin += self.effect if d.train else -self.drift
            out.append(d.train)
        return out


def test_fixed_schedules_and_a_frozen_draft():
    assert _run(DraftSchedule("every_step", 5), [3.0] * 5) == [True] * 5
    assert _run(DraftSchedule("every_n", 5, every=2), [3.0] * 5) == [True, False, True, False, True]
    assert _run(DraftSchedule("adaptive", 5, trains=False), [3.0, 1.0, 1.0, 1.0, 1.0]) == [False] * 5
    with pytest.raises(ValueError, match="must be one of"):
        DraftSchedule("sometimes")


def test_adaptive_measures_what_an_update_buys_then_trains_only_while_it_pays():
    # rollout 10 s at acceptance ~3.3 over 10 steps: a unit of acceptance is worth ~30 s; an update costs 1 s
    # (a third of a trained 3 s step before a skipped one was seen, then trained 3 s - skipped 2 s)
    s, world = DraftSchedule("adaptive", 100, horizon=10), World(effect=0.05)
    assert world.run(s, [3.0] * 12) == [True] * 12  # +0.05 a step is worth ~1.5 s >= 1 s
    assert [d.reason.startswith("measuring") for d in s.history[:WARMUP + 1]] == [True] * (WARMUP + 1)
    d = s.history[-1]
    assert d.update_gain == pytest.approx(0.05) and d.gain_s >= d.cost_s == pytest.approx(1.0)
    world.effect = 0.005  # the draft has learned what it can: worth ~0.15 s < half an update
    world.run(s, [3.0] * 12)
    assert s.history[-1].train is False and "skip" in s.history[-1].reason


def test_adaptive_probes_after_window_steps_without_an_update_and_trains_again_when_drift_makes_it_pay():
    s, world = DraftSchedule("adaptive", 200, horizon=10, window=6), World(effect=0.0)
    decisions = world.run(s, [3.0] * 30)
    assert decisions[:WARMUP + 1] == [True] * (WARMUP + 1)
    probes = [d.step for d in s.history if d.reason.startswith("no update in 6 steps")]
    assert probes and all(not any(x.train for x in s.history[p - 7:p - 1]) for p in probes)
    assert sum(decisions[WARMUP + 1:]) == len(probes)  # nothing but the probes trains
    # now the policy drifts: a skipped step loses 0.05 of the margin an update restores
    world.drift, world.effect = 0.05, 0.05
    assert all(world.run(s, [3.0] * 20)[-8:])


@pytest.mark.parametrize("effect", [0.0, 0.02])
def test_adaptive_counts_an_update_s_cost_per_token_of_the_step(effect):
    """Training seconds scale with the step's tokens; so does the cost the schedule weighs: a trained step takes 3 s
    and a skipped one 2 s per 1000 tokens, so an update costs 1 s per 1000 tokens, measured (effect 0: the schedule
    skips after the warm-up) or, before a skipped step was seen, a third of a trained step (effect 0.02: it trains)."""
    s, world = DraftSchedule("adaptive", 100, horizon=10), World(effect=effect)
    decisions = world.run(s, [3.0] * 10)
    assert all(decisions) == (effect > 0)
    d = s.decide(len(s.history), 3.3, 10.0, 4000.0)
    assert d.cost_s == pytest.approx(4.0)
    assert s.decide(len(s.history), 3.3, 10.0, 1000.0).cost_s == pytest.approx(1.0)


def test_adaptive_trains_when_drift_costs_acceptance_and_needs_a_deficit_beyond_the_noise():
    s, world = DraftSchedule("adaptive", 40, horizon=10), World(effect=0.0)
    # an update that buys nothing: the warm-up trains, then steps whose prompts are just harder (acceptance +-0.2
    # around 3.3, no drift; the reference sees the same prompts, so the margin does not move) never start an update
    assert world.run(s, [3.0] * (WARMUP + 1)) == [True] * (WARMUP + 1)
    assert not any(world.run(s, [3.0, 3.2, 2.8, 3.1, 2.9, 3.2, 2.8, 3.0, 2.85]))
    # a real drop does: 0.6 x 10 s / 2.7 x 10 steps >> one update (1 s)
    world.margin -= 0.6
    assert world.run(s, [3.0, 3.0])[-1]
    d = s.history[-1]
    assert d.gain_s > d.cost_s and "train" in d.reason and "recent best" in d.reason


def test_without_a_reference_the_margin_is_the_acceptance_itself():
    s = DraftSchedule("adaptive", 40, horizon=10)
    assert _run(s, [3.0, 3.1, 3.2, 3.3, 3.4]) == [True] * 5  # each update +0.1: worth 3 s > 1 s
    assert s.history[-1].update_gain == pytest.approx(0.1) and math.isnan(s.history[-1].reference)


def test_adaptive_hysteresis_keeps_training_on_a_smaller_gain_than_starts_it():
    # an update adds 0.02: worth 0.02 x 10 s / 3.46 x 10 steps = 0.58 s, against an update's 1 s: enough to go on
    # training (>= half an update), not to start
    s, world = DraftSchedule("adaptive", 100, horizon=10), World(effect=0.02)
    assert world.run(s, [3.0] * 8) == [True] * 8
    d = s.decide(8, 3.0 + world.margin, 10.0, world.tokens)
    assert d.train and "half" in d.reason and 0.5 <= d.gain_s < d.cost_s == pytest.approx(1.0)
    s.history[-1].train, s.history[-1].train_s = False, 2.0  # had the last step skipped
    d = s.decide(8, 3.0 + world.margin, 10.0, world.tokens)
    assert not d.train and 0.5 <= d.gain_s < d.cost_s == pytest.approx(1.0)


def test_decisions_replay_from_the_logged_figures_and_survive_a_state_round_trip():
    s, world = DraftSchedule("adaptive", 60, horizon=5), World(effect=0.03, drift=0.02)
    decisions = world.run(s, [3.0, 3.1, 2.9, 2.6, 2.5, 2.8, 3.0, 3.0, 2.4, 2.3, 2.9, 3.0] * 2)
    assert any(decisions) and not all(decisions)
    rows = json.loads(json.dumps(s.state_dict()))  # what draft_schedule.jsonl / the checkpoint hold
    assert replay(rows, DraftSchedule("adaptive", 60, horizon=5)) == decisions
    again = DraftSchedule("adaptive", 60, horizon=5)
    again.load_state_dict(rows)
    assert again.updates == s.updates
    assert again.decide(24, 2.0, 10.0, 1000.0) == s.decide(24, 2.0, 10.0, 1000.0)


def test_ab_difference_running_interval():
    assert all(math.isnan(x) for x in ab_difference([]))
    mean, low, high = ab_difference([0.1, 0.3, math.nan, 0.2])
    assert mean == pytest.approx(0.2) and low < 0.2 < high


def test_an_adaptive_run_logs_every_decision_and_versions_the_draft_by_its_updates(tmp_path, monkeypatch):
    # a warm-up of one measured change, then updates that cost more than anything they could buy: steps 1-2 train
    # (measuring), steps 3-4 skip, whatever the wall times
    monkeypatch.setattr(draft_schedule, "WARMUP", 1)
    monkeypatch.setattr(DraftSchedule, "_cost", lambda self, tokens: math.inf)
    cfg = micro_config(tmp_path, "rl.steps=4", "run.plots=false", "task.eval_prompts=0", "draft.schedule=adaptive",
                       "draft.adaptive=false")  # a fixed K: the engine drafts every round, whatever the wall times
    lines = []
    res = fit(cfg, print_fn=lines.append)
    rows = [json.loads(line) for line in (tmp_path / "draft_schedule.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    said = [line for line in lines if "draft update" in line]
    assert len(said) == 4 and all(("taken" in s) == r["train"] for s, r in zip(said, rows))
    assert [r["train"] for r in rows] == [True, True, False, False]
    assert all(math.isfinite(r["tokens"]) and r["tokens"] > 0 and math.isfinite(r["reference"]) for r in rows)
    trained = [float(r["train"]) for r in rows]
    assert [r["draft_trained"] for r in res.rows] == trained
    # the engine decoded step s with the draft after the updates before it
    assert [r["draft_version"] for r in res.rows] == [sum(trained[:i]) for i in range(4)]
    assert replay(rows, DraftSchedule("adaptive", 4)) == [r["train"] for r in rows]
    # a skipped step ran no draft: no implied figure of it; the reference was scored every step
    for r, m in zip(rows, read_metrics(tmp_path / "metrics.csv")):
        assert math.isnan(m["implied_acceptance"]) != r["train"]
        assert math.isfinite(m["reference_acceptance"])


def test_no_update_while_the_engine_decodes_plainly_and_updates_resume_when_speculation_pays():
    """The adaptive engine's economics: where it drafted nothing (a large batch on a CPU), an update buys no
    rollout time, so the step skips it (even while warming up); where it drafts on part of its rounds, an update
    is worth that share; when speculation pays again, updates resume."""
    s, world = DraftSchedule("adaptive", 100, horizon=10), World(effect=0.05)
    assert world.run(s, [3.0] * 5, speculation=0.0) == [False] * 5
    assert all("decoded plainly" in d.reason and d.gain_s == 0.0 for d in s.history)
    assert world.run(s, [3.0] * 6) == [True] * 6  # speculation pays again: warm-up, then an update pays
    full = s.decide(len(s.history), 3.3, 10.0, 1000.0, 1.0)
    part = s.decide(len(s.history), 3.3, 10.0, 1000.0, 0.25)
    assert part.gain_s == pytest.approx(0.25 * full.gain_s) and part.speculation == 0.25
    # the fixed schedules are literal: they train whatever the engine did
    assert DraftSchedule("every_step", 5).decide(0, 1.0, 10.0, 100.0, 0.0).train
    # and a logged run replays with its speculation figures
    rows = s.state_dict()
    assert replay(rows, DraftSchedule("adaptive", 100, horizon=10)) == [d.train for d in s.history]


def test_updates_are_paid_only_out_of_the_decode_time_speculation_saved():
    """Where the engine measures what speculation saved (a large batch on a CPU: a little a step), the draft trains
    only once the credit (seconds saved so far less the updates' charges) covers one update, so over the run its
    updates cost at most what speculation saved; where a step saves more than an update costs (one sequence at a
    time), the credit never binds; an engine without a cost model (NaN) leaves the rule off."""
    def run(saving, steps=30):
        s, out = DraftSchedule("adaptive", 100, horizon=10), []
        for step in range(steps):
            d = s.decide(step, 3.0 + 0.3, 10.0, 1000.0, 1.0, saving)
            s.record(d, 3.0 if d.train else 2.0, reference=3.0)
            out.append(d)
        return s, out

    s, out = run(0.2)  # an update costs ~1 s (trained 3 s, skipped 2 s); a step saves 0.2 s
    trained = [d for d in out if d.train]
    assert out[0].train and not out[1].train  # the first update measures the cost, then the credit must refill
    assert 0 < len(trained) <= 7
    charged = sum(d.charged_s for d in out)
    assert charged <= sum(d.saving_s for d in out) + out[0].charged_s  # spent only what was saved (+ the first)
    assert all(d.credit_s >= d.cost_s for d in trained[1:])
    assert any("paid only out of time speculation saved" in d.reason for d in out)
    assert all(math.isfinite(d.credit_s) for d in out) and all(d.charged_s == 0.0 for d in out if not d.train)
    # the logged figures replay to the same decisions
    assert replay(s.state_dict(), DraftSchedule("adaptive", 100, horizon=10)) == [d.train for d in out]

    _, rich = run(5.0)  # a step saves 5 s: the credit never binds
    assert not any("speculation saved" in d.reason for d in rich)
    assert [d.train for d in rich][:4] == [True] * 4

    _, nothing = run(-0.1)  # speculation lost time: nothing is ever paid
    assert not any(d.train for d in nothing)

    _, unmeasured = run(math.nan)  # no cost model: the rule is off
    assert not any("speculation saved" in d.reason for d in unmeasured) and unmeasured[0].train
    assert all(math.isnan(d.credit_s) for d in unmeasured)
