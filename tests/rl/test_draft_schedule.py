"""The draft's update schedule (rl/draft_schedule.py): every step, every N, adaptive (trains when the acceptance lost
to drift costs more rollout time than an update, with hysteresis); decisions replay from the logged figures; a run
under the adaptive schedule logs them, tags the engine's draft with its update count and resumes the schedule."""

import json
import math

import pytest
from test_loop import micro_config

from lightning_codraft.rl.draft_schedule import DraftSchedule, ab_difference, replay
from lightning_codraft.rl.loop import fit
from lightning_codraft.rl.logs import read_metrics


def _run(schedule, acceptance, rollout_s=10.0, train_s=(2.0, 3.0)):
    """Feed ``schedule`` a series of measured acceptances; a trained step takes train_s[1] s, a skipped one [0]."""
    out = []
    for step, a in enumerate(acceptance):
        d = schedule.decide(step, a, rollout_s)
        schedule.record(d, train_s[d.train])
        out.append(d.train)
    return out


def test_fixed_schedules_and_a_frozen_draft():
    assert _run(DraftSchedule("every_step", 5), [3.0] * 5) == [True] * 5
    assert _run(DraftSchedule("every_n", 5, every=2), [3.0] * 5) == [True, False, True, False, True]
    assert _run(DraftSchedule("adaptive", 5, trains=False), [3.0, 1.0, 1.0, 1.0, 1.0]) == [False] * 5
    with pytest.raises(ValueError, match="must be one of"):
        DraftSchedule("sometimes")


def test_adaptive_skips_while_acceptance_holds_and_trains_when_drift_costs_more_than_an_update():
    s = DraftSchedule("adaptive", 40, horizon=10)
    # holding at 3.0 (+-0.01 noise): never worth an update
    held = _run(s, [3.0, 3.01, 2.99, 3.0, 3.01, 2.99, 3.0, 3.0])
    assert held == [False] * 8 and s.updates == 0
    # a drop of 0.5: 0.5 x 10 s / 2.5 x 10 steps = 20 s of rollouts >> one update (~1 s): train
    drop = _run(s, [2.5, 2.5])
    assert drop == [True, True]
    d = s.history[-1]
    assert d.gain_s > d.cost_s and "train" in d.reason and "recent best" in d.reason
    # recovered: the deficit is gone, the schedule stops
    assert _run(s, [3.0] * 8)[-1] is False


def test_adaptive_hysteresis_keeps_training_on_a_smaller_deficit_than_starts_it():
    # cost of an update = 1 s (measured: trained 3 s - skipped 2 s); rollout 10 s; horizon 4 steps. After 8 steps at
    # 3.0 a step at 2.6: smoothed 2.8, deficit 0.2 less its noise allowance (0.15) -> 0.05 x 10 / 2.6 x 4 = 0.7 s:
    # enough to go on training (>= half an update), not to start
    s = DraftSchedule("adaptive", 100, horizon=4)
    _run(s, [3.0] * 8)
    s.history[-1].train, s.history[-1].train_s = True, 3.0  # the last step trained: the update's cost is measured
    d = s.decide(8, 2.6, 10.0)
    assert d.train and "half" in d.reason and 0.5 <= d.gain_s < 1.0 and d.noise == pytest.approx(0.154, abs=0.01)
    s.history[-1].train = False
    assert not s.decide(8, 2.6, 10.0).train


def test_adaptive_needs_a_deficit_beyond_the_noise_of_the_measure():
    """Steps whose prompts are just harder (acceptance +-0.2 around 3.0, no drift) never start an update."""
    s = DraftSchedule("adaptive", 40, horizon=10)
    assert not any(_run(s, [3.0, 3.2, 2.8, 3.1, 2.9, 3.2, 2.8, 3.0, 2.85, 3.15, 2.8, 3.0]))
    assert _run(s, [2.4, 2.3])[-1]  # a real drop does


def test_decisions_replay_from_the_logged_figures_and_survive_a_state_round_trip():
    s = DraftSchedule("adaptive", 30, horizon=5)
    series = [3.0, 3.0, 2.9, 2.6, 2.5, 2.8, 3.0, 3.0, 2.4, 2.3, 2.9, 3.0]
    decisions = _run(s, series)
    assert any(decisions) and not all(decisions)
    rows = json.loads(json.dumps(s.state_dict()))  # what draft_schedule.jsonl / the checkpoint hold
    assert replay(rows, DraftSchedule("adaptive", 30, horizon=5)) == decisions
    again = DraftSchedule("adaptive", 30, horizon=5)
    again.load_state_dict(rows)
    assert again.updates == s.updates
    assert again.decide(12, 2.0, 10.0) == s.decide(12, 2.0, 10.0)


def test_ab_difference_running_interval():
    assert all(math.isnan(x) for x in ab_difference([]))
    mean, low, high = ab_difference([0.1, 0.3, math.nan, 0.2])
    assert mean == pytest.approx(0.2) and low < 0.2 < high


def test_an_adaptive_run_logs_every_decision_and_versions_the_draft_by_its_updates(tmp_path):
    cfg = micro_config(tmp_path, "rl.steps=3", "run.plots=false", "task.eval_prompts=0", "draft.schedule=adaptive",
                       "draft.schedule_horizon=1")
    lines = []
    res = fit(cfg, print_fn=lines.append)
    rows = [json.loads(line) for line in (tmp_path / "draft_schedule.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    said = [line for line in lines if "draft update" in line]
    assert len(said) == 3 and all(("taken" in s) == r["train"] for s, r in zip(said, rows))
    assert not rows[0]["train"]  # nothing measured and nothing drifted at the first step
    trained = [float(r["train"]) for r in rows]
    assert [r["draft_trained"] for r in res.rows] == trained
    # the engine decoded step s with the draft after the updates before it
    assert [r["draft_version"] for r in res.rows] == [sum(trained[:i]) for i in range(3)]
    assert replay(rows, DraftSchedule("adaptive", 3, horizon=1)) == [r["train"] for r in rows]
    # a skipped step ran no draft: no implied figure of it; the reference was scored every step
    for r, m in zip(rows, read_metrics(tmp_path / "metrics.csv")):
        assert math.isnan(m["implied_acceptance"]) != r["train"]
        assert math.isfinite(m["reference_acceptance"])
