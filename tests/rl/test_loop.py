import dataclasses
import json
import math
import shutil

import pytest

from lightning_codraft.config import ConfigError, load_config
from lightning_codraft.rl.reports.run_log import read_metrics
from lightning_codraft.rl.run.loop import fit
from lightning_codraft.rl.step_metrics import COLUMNS, SCHEDULE_COLUMNS, TIME_COLUMNS
from lightning_codraft.rl.tasks.rewards import RewardError

MICRO = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
         "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
         "sft.steps=3", "sft.batch_size=4", "draft.warm_start.steps=2", "draft.warm_start.batch_size=4",
         "rl.steps=3", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=12",
         "task.eval_prompts=2", "run.checkpoint_every=1", "run.progress=false",
         "draft.schedule=every_step"]  # the adaptive schedule follows measured times; runs that tests compare pin it


def micro_config(tmp, *extra):
    from conftest import REPO

    return load_config(REPO / "recipes" / "tiny-cpu.yaml", MICRO + [f"run.out_dir={tmp}", *extra])


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro")
    # prompts starting with 7 make the reward raise: in the opt-in tolerant mode the run skips and reports them
    cfg = micro_config(out, "task.reward=rewards_for_tests:flaky_reward", "rl.prompts_per_step=4",
                       "task.eval_every=2", "task.on_reward_error=skip", "task.reward_failure_budget=0.9")
    lines = []
    res = fit(cfg, print_fn=lines.append)
    res.log_lines = lines
    return cfg, res


def _comparable(rows):
    """What a resumed run must reproduce: everything but wall times and the adaptive schedule (the rollouts are the
    same tokens; which k each round chose follows measured times)."""
    return [{k: "nan" if v != v else v for k, v in r.items() if k not in TIME_COLUMNS + SCHEDULE_COLUMNS}
            for r in rows]


def test_fit_writes_metrics_plots_and_checkpoints(micro_run):
    cfg, res = micro_run
    out = res.out_dir
    assert res.completed and len(res.rows) == 3
    rows = read_metrics(out / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    assert set(rows[0]) == set(COLUMNS)
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0
        assert 1.0 <= r["acceptance_length"] <= cfg.draft.num_speculative_tokens + 1
        assert r["completion_tokens"] > 0 and math.isfinite(r["draft_loss"]) and math.isfinite(r["policy_loss"])
    assert sum(r["reward_failures"] for r in rows) > 0  # the flaky reward raised and the run went on
    skipped = [line for line in res.log_lines if "skipped sample" in line]
    assert len(skipped) == sum(r["reward_failures"] for r in rows)  # every skipped sample is reported
    assert "rewards_for_tests:flaky_reward raised ZeroDivisionError" in skipped[0] and "prompt '7" in skipped[0]
    # drift from the start policy (rl.track_drift, the default): none before the first update
    assert rows[0]["kl"] == 0.0 and rows[0]["greedy_agreement"] == 1.0
    # task.eval_every=2: the fixed held-out set is scored on steps 2 (and not 1, 3)
    assert math.isnan(rows[0]["eval_accuracy"]) and math.isnan(rows[2]["eval_reward"])
    assert 0.0 <= rows[1]["eval_accuracy"] <= 1.0 and 0.0 <= rows[1]["eval_reward"] <= 1.0
    assert (out / "curves.png").stat().st_size > 1000
    assert list((out / "tb").glob("events.*"))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{i:06d}" for i in range(4)]
    assert (out / "warm" / "weights.pt").is_file()
    assert res.speedup is not None and res.speedup.speedup > 0
    assert "acceptance length" in (out / "summary.txt").read_text()
    # the live A/B: the reference draft (the warm start) equals the live draft before its first update, then both
    # are scored every step, plotted and summarised with the gain's interval
    assert rows[0]["implied_acceptance"] == rows[0]["reference_acceptance"] and rows[0]["ab_gain"] == 0.0
    assert all(1.0 <= r["reference_acceptance"] <= cfg.draft.num_speculative_tokens + 1 for r in rows)
    assert math.isfinite(rows[2]["ab_gain_low"]) and rows[2]["ab_gain_low"] <= rows[2]["ab_gain_high"]
    assert (out / "ab.png").stat().st_size > 1000 and "live A/B" in (out / "summary.txt").read_text()


def test_resume_after_kill_reproduces_the_metrics(micro_run, tmp_path):
    cfg, res = micro_run
    # what a run killed during step 3 leaves: checkpoints up to step 2, CSV rows up to step 3 (not saved)
    killed = tmp_path / "killed"
    shutil.copytree(res.out_dir, killed)
    shutil.rmtree(killed / "checkpoints" / "step-000003")
    shutil.rmtree(killed / "checkpoints" / "step-000002")
    cfg2 = micro_config(killed, "task.reward=rewards_for_tests:flaky_reward", "rl.prompts_per_step=4",
                        "task.eval_every=2", "run.plots=false")
    # kill again after one resumed step (no checkpoint written for it), then resume to the end
    lines = []
    part = fit(cfg2, stop_after=1, print_fn=lines.append)
    assert not part.completed and [r["step"] for r in part.rows] == [1.0, 2.0]
    said = next(line for line in lines if line.startswith("resuming"))  # a resume says which settings changed
    assert "run.plots: True -> False" in said and "task.on_reward_error: 'skip' -> 'raise'" in said
    again = fit(cfg2, print_fn=lambda s: None)
    assert again.completed
    assert _comparable(read_metrics(killed / "metrics.csv")) == _comparable(res.rows)
    # what the policy wrote: 4 completions per step, the same ones after the kills and resumes
    logged = [json.loads(line) for line in (res.out_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1] * 4 + [2] * 4 + [3] * 4
    assert all(isinstance(r["prompt"], str) and isinstance(r["completion"], str) for r in logged)
    assert (killed / "completions.jsonl").read_text() == (res.out_dir / "completions.jsonl").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # and in TensorBoard's text

    events = EventAccumulator(str(res.out_dir / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [1, 2, 3]
    assert b"| prompt | completion | reward |" in texts[0].tensor_proto.string_val[0]


def test_failing_reward_can_stop_the_run(tmp_path):
    cfg = micro_config(tmp_path, "task.reward=rewards_for_tests:flaky_reward", "task.on_reward_error=raise",
                       "rl.prompts_per_step=8", "sft.steps=0", "draft.warm_start.steps=0", "task.eval_prompts=0")
    with pytest.raises(RewardError, match=r"prompt '7"):
        fit(cfg, print_fn=lambda s: None)


@pytest.mark.parametrize("fn,match", [("batched_reward", "looks like a batched"), ("nan_reward", "non-finite")])
def test_a_reward_failing_on_one_sample_is_refused_before_launch_with_exit_2(tmp_path, capsys, fn, match):
    from conftest import REPO

    from lightning_codraft.cli import main

    code = main(["fit", "--config", str(REPO / "recipes" / "tiny-cpu.yaml"), *MICRO, f"run.out_dir={tmp_path}",
                 f"task.reward=rewards_for_tests:{fn}", "sft.steps=0", "draft.warm_start.steps=0", "task.eval_prompts=0"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "checked before launch" in err and f"task.reward (rewards_for_tests:{fn}): a one-sample call failed" in err
    assert match in err and not (tmp_path / "checkpoints").exists()  # nothing ran


def test_a_reward_failing_during_the_run_stops_it_with_exit_3(tmp_path, capsys):
    from conftest import REPO

    from lightning_codraft.cli import main

    code = main(["fit", "--config", str(REPO / "recipes" / "tiny-cpu.yaml"), *MICRO, f"run.out_dir={tmp_path}",
                 "task.reward=rewards_for_tests:flaky_reward", "rl.prompts_per_step=8", "sft.steps=0",
                 "draft.warm_start.steps=0", "task.eval_prompts=0"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "reward function rewards_for_tests:flaky_reward failed on sample" in err and "prompt '7" in err
    assert "task.on_reward_error=skip" in err and "resumes the run" in err


def test_skip_mode_stops_past_its_budget(tmp_path):
    cfg = micro_config(tmp_path, "task.reward=rewards_for_tests:nan_reward", "task.on_reward_error=skip",
                       "task.reward_failure_budget=0.5", "sft.steps=0", "draft.warm_start.steps=0", "task.eval_prompts=0")
    lines = []
    with pytest.raises(RewardError, match="4 of the step's 4 samples failed.*over task.reward_failure_budget=0.5"):
        fit(cfg, print_fn=lines.append)
    assert sum("skipped sample" in line for line in lines) == 4


def test_retired_warn_mode_is_refused():
    with pytest.raises(ConfigError, match="'warn' scored a failed reward 0"):
        load_config(None, ["task.on_reward_error=warn"])


def test_prompt_longer_than_the_context_is_rejected(tmp_path):
    cfg = micro_config(tmp_path, "model.max_position_embeddings=16", "rl.max_new_tokens=12", "sft.steps=0",
                       "draft.warm_start.steps=0", "task.eval_prompts=0", "task.max_terms=4", "task.min_terms=4")
    with pytest.raises(ValueError, match=r"prompt \d+ has \d+ tokens but the context 16 minus "
                                         r"rl.max_new_tokens=12 leaves 4"):
        fit(cfg, print_fn=lambda s: None)


def test_grpo_climbs_a_dense_reward(tmp_path):
    """The loop optimises what it is given: with the share of digits in a completion as the reward (dense, easy
    to learn), 12 GRPO steps take an almost untrained micro policy from ~0.1 to most of the way to 1. A flipped
    advantage sign, a misaligned rollout/advantage packing or a detached loss leaves it near its start."""
    cfg = micro_config(tmp_path, "task.reward=rewards_for_tests:digit_share_reward", "rl.steps=12", "rl.lr=3e-2",
                       "draft.mode=none", "rl.prompts_per_step=4", "rl.group_size=4", "task.eval_prompts=0",
                       "run.checkpoint_every=0", "run.plots=false", "run.tensorboard=false")
    rows = fit(cfg, print_fn=lambda s: None).rows
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert first < 0.3 and last > 0.6, rewards
    # the drift metrics (rl.track_drift, on by default) follow: the KL from the start policy rises from exactly 0,
    # greedy continuations stop agreeing with the start policy's
    kl = [r["kl"] for r in rows]
    assert kl[0] == 0.0 and rows[0]["greedy_agreement"] == 1.0
    assert sum(kl[-3:]) / 3 > 10 * max(sum(kl[1:4]) / 3, 1e-6) and rows[-1]["greedy_agreement"] < 0.9, kl


def test_kl_to_the_reference_policy_is_scored_by_the_module(tmp_path):
    """rl.kl_coef > 0: the module holds the frozen reference (sharded like the policy on a mesh) and scores the KL;
    it is 0 while the policy equals its start and positive once it moved."""
    cfg = micro_config(tmp_path, "rl.kl_coef=0.1", "rl.lr=1e-2", "task.eval_prompts=0", "run.plots=false",
                       "run.checkpoint_every=0", "task.reward=rewards_for_tests:digit_share_reward")
    rows = fit(cfg, print_fn=lambda s: None).rows
    assert abs(rows[0]["kl"]) < 1e-6 and rows[-1]["kl"] > 1e-6, [r["kl"] for r in rows]


def test_per_prompt_scores_and_a_validation_set_apart_from_every_held_out_set(micro_run, tmp_path, monkeypatch):
    """The run keeps each held-out prompt's greedy reward before and after RL (to pair them per prompt), and
    ``task.eval_set=validation`` scores a fixed set that is neither this seed's held-out set nor another seed's."""
    cfg, res = micro_run
    assert len(res.eval_before_scores) == len(res.eval_after_scores) == cfg.task.eval_prompts
    assert res.eval_before == pytest.approx(sum(res.eval_before_scores) / len(res.eval_before_scores))
    assert res.eval_after == pytest.approx(sum(res.eval_after_scores) / len(res.eval_after_scores))
    from lightning_codraft.rl.run.build import build_task
    from lightning_codraft.rl.run.evaluate import VALIDATION_OFFSET, heldout_samples

    task = build_task(cfg.task)
    prompts = lambda seed, offset=0: [s.prompt for s in heldout_samples(task, seed, 64, offset)]  # noqa: E731
    validation = prompts(0, VALIDATION_OFFSET)
    assert validation != prompts(0) and all(validation != prompts(seed) for seed in range(1, 50))
    from lightning_codraft.rl.run import evaluate

    offsets, draw = [], evaluate.heldout_samples
    monkeypatch.setattr(evaluate, "heldout_samples", lambda *a: offsets.append(a[3]) or draw(*a))
    val = fit(micro_config(tmp_path, "rl.steps=1", "task.eval_set=validation", "run.plots=false"),
              print_fn=lambda s: None)
    assert len(val.eval_before_scores) == cfg.task.eval_prompts and set(offsets) == {VALIDATION_OFFSET}
    with pytest.raises(ConfigError, match="task.eval_set=validation needs a generated task"):
        load_config(None, ["task.name=gsm8k", "task.eval_set=validation"])


def test_a_frozen_draft_is_warm_started_too(tmp_path):
    """draft.mode=frozen: the draft is fixed during RL but warm-started offline before it (its parameters do not
    require gradients, which the warm-up must not mistake for "nothing to train")."""
    # a fixed K (not adaptive, whose choice of k follows measured costs on a loaded machine) so that the acceptance
    # reflects the warm-started draft alone
    cfg = micro_config(tmp_path, "draft.mode=frozen", "rl.steps=1", "task.eval_prompts=0", "run.plots=false",
                       "draft.adaptive=false")
    res = fit(cfg, print_fn=lambda s: None)
    assert res.completed and res.rows[0]["acceptance_length"] > 1.5
    # a frozen draft runs no forward in the training step unless asked to be scored (draft.score_frozen)
    assert math.isnan(res.rows[0]["implied_acceptance"]) and math.isnan(res.rows[0]["draft_loss"])
    scored = fit(dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, score_frozen=True),
                                     run=dataclasses.replace(cfg.run, out_dir=str(tmp_path / "scored"))),
                 print_fn=lambda s: None)
    assert scored.rows[0]["implied_acceptance"] > 1.5 and math.isfinite(scored.rows[0]["draft_loss"])


def test_recipe_warm_start_self_distills_caches_and_reuses_the_draft(tmp_path):
    """draft.warm_start.corpus: the draft is fitted on the policy's own responses (not the small pool), cached
    under draft.warm_start.cache_dir, and a second run of the same recipe loads it instead of fitting again."""
    ws = ("draft.warm_start.corpus={num_prompts: 8, max_new_tokens: 8, generation_batch: 8, "
          "fit: {epochs: 1, batch_tokens: 64, val_docs: 2, ttt_steps: 2}}")
    cfg = micro_config(tmp_path / "a", ws, f"draft.warm_start.cache_dir={tmp_path / 'cache'}", "rl.steps=1",
                       "task.eval_prompts=0", "run.plots=false", "draft.warm_start.steps=0",
                       "draft.adaptive=false")  # acceptance then depends on the draft alone, not on measured times
    lines = []
    first = fit(cfg, print_fn=lines.append)
    assert first.completed and any("saved" in l and "draft-" in l for l in lines)
    assert len(list((tmp_path / "cache").glob("draft-*/COMPLETE"))) == 1
    lines.clear()
    again = fit(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(tmp_path / "b"))),
                print_fn=lines.append)
    assert any("cache hit" in l for l in lines) and not any("warm start: generated" in l for l in lines)
    assert again.rows[0]["acceptance_length"] == first.rows[0]["acceptance_length"]


def test_recipe_warm_start_rejects_unknown_keys(tmp_path):
    with pytest.raises(ConfigError, match="'draft.warm_start.corpus.prompts'; valid keys under "
                                          "'draft.warm_start.corpus': .*num_prompts"):
        micro_config(tmp_path, "draft.warm_start.corpus={prompts: 8}", "rl.steps=1")
    with pytest.raises(ConfigError, match=r"draft.warm_start.corpus.fit.ttt_steps=0 must be > 0"):
        micro_config(tmp_path, "draft.warm_start.corpus={fit: {ttt_steps: 0}}")


def test_recipe_warm_start_must_hold_out_the_tasks_heldout_problems(tmp_path):
    """A warm start whose held-out tail is shorter than the task's would train the draft on the very problems the
    evaluation and the final speed-up are measured on: a config error before anything runs."""
    cfg = load_config(None, ["task.name=gsm8k", "task.heldout=40", "draft.warm_start.corpus={heldout_prompts: 8}",
                             f"run.out_dir={tmp_path}", "run.progress=false"])
    with pytest.raises(ConfigError, match="heldout_prompts=8 is below task.heldout=40"):
        fit(cfg, print_fn=lambda s: None)


def test_the_final_evaluation_and_speedup_refill_the_engine_once(tmp_path, monkeypatch):
    """finish(): greedy evaluation and the speed-up measurement decode with the same weights, so the engine's copies
    (on a multi-process or vLLM run, a collective over every stage) are refilled once, not once each."""
    from lightning_codraft.rl.rollout_worker import RolloutWorker
    from lightning_codraft.rl.run.loop import CoDraftRun

    calls, inside = [], {"on": False}
    prepare, finish = RolloutWorker.prepare, CoDraftRun.finish
    monkeypatch.setattr(RolloutWorker, "prepare",
                        lambda self, *a, **k: (calls.append(inside["on"]), prepare(self, *a, **k))[1])

    def counted_finish(self, completed=True):
        inside["on"] = True
        return finish(self, completed)

    monkeypatch.setattr(CoDraftRun, "finish", counted_finish)
    res = fit(micro_config(tmp_path, "rl.steps=1", "run.plots=false", "run.checkpoint_every=0"),
              print_fn=lambda s: None)
    assert res.completed and res.speedup is not None and calls.count(True) == 1


def test_engine_dtype_reaches_the_rollout_and_speedup_engines(tmp_path, monkeypatch):
    """parallel.engine_dtype=bfloat16: the step's rollouts and both arms of the final speed-up decode in bf16 (the
    summary says so); the training weights stay fp32."""
    import torch

    from lightning_codraft.rollout import SpeculativeEngine

    made, init = [], SpeculativeEngine.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self.dtype, self.draft is not None))

    monkeypatch.setattr(SpeculativeEngine, "__init__", recording_init)
    res = fit(micro_config(tmp_path, "rl.steps=1", "run.plots=false", "run.checkpoint_every=0",
                           "parallel.engine_dtype=bfloat16"), print_fn=lambda s: None)
    assert res.completed and res.speedup is not None
    with_draft = [d for d, has_draft in made if has_draft]
    assert len(with_draft) >= 2 and set(with_draft) == {torch.bfloat16}   # the worker's engine, the speed-up's
    assert made.count((torch.bfloat16, False)) >= 1                         # the speed-up's plain arm
    assert "K=4, adaptive, bfloat16)" in (res.out_dir / "summary.txt").read_text()


def test_rollouts_carry_versions_and_an_engine_left_one_version_behind_fails(tmp_path, monkeypatch):
    """Every rollout carries the policy and draft versions it was generated with; metrics.csv logs them and the
    refit's time and share; an engine that misses one refit (here: the second step's) stops the run, named."""
    import csv

    from lightning_codraft.rl.rollout_worker import RolloutWorker
    from lightning_codraft.rl.step import weight_versions
    from lightning_codraft.rollout import RolloutError

    cfg = micro_config(tmp_path, "rl.steps=2", "run.plots=false", "task.eval_prompts=0", "draft.train_every=2",
                       "draft.schedule=every_n")
    assert [weight_versions(cfg, s) for s in range(4)] == [{"policy": s, "draft": (s + 1) // 2} for s in range(4)]
    res = fit(cfg, print_fn=lambda s: None)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [(float(r["policy_version"]), float(r["draft_version"])) for r in rows] == [(0.0, 0.0), (1.0, 1.0)]
    assert all(0.0 <= float(r["refit_share"]) <= 1.0 for r in rows) and res.completed

    prepare = RolloutWorker.prepare

    def misses_the_second_refit(self, versions=None, full_verify=False):
        return 0.0 if versions is not None and versions["policy"] == 1 else prepare(self, versions, full_verify)

    monkeypatch.setattr(RolloutWorker, "prepare", misses_the_second_refit)
    with pytest.raises(RolloutError, match="generated with policy version 0 .* the training state is policy 1"):
        fit(micro_config(tmp_path / "stale", "rl.steps=2", "run.plots=false", "task.eval_prompts=0"),
            print_fn=lambda s: None)


def test_s2_a_resume_with_changed_rewards_keeps_every_earlier_row_and_each_segments_settings(micro_run, tmp_path):
    """S2: the rewards change on resume: the rows up to the checkpoint stay as they were (their reward column
    too), the new reward continues under its own column, config.yaml says where its segment began and the first
    segment's settings stay in config.step-000000.yaml; nothing is deleted first."""
    cfg, res = micro_run
    run = tmp_path / "run"
    shutil.copytree(res.out_dir, run)
    shutil.rmtree(run / "checkpoints" / "step-000003")  # resume from step 2
    before = read_metrics(run / "metrics.csv")
    cfg2 = micro_config(run, "task.rewards=[{fn: 'rewards_for_tests:digit_share_batched', name: digits}]",
                        "rl.prompts_per_step=4", "task.eval_every=2", "run.plots=false", "run.keep_checkpoints=2")
    again = fit(cfg2, print_fn=lambda s: None)
    assert again.completed
    rows = read_metrics(run / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    for old, kept in zip(before[:2], rows[:2]):  # every earlier row, every value (NaN in the new column)
        assert {k: v for k, v in kept.items() if k in old} == pytest.approx(old, nan_ok=True)
        assert math.isnan(kept["reward/digits"])
    assert 0.0 <= rows[2]["reward/digits"] <= 1.0 and rows[2]["reward_failures"] == 0
    text = (run / "config.yaml").read_text()
    assert text.startswith("# segment began at step 2, resumed with") and "task.rewards" in text
    assert "config.step-000000.yaml" in text
    first = load_config(run / "config.step-000000.yaml")
    assert first.task.reward == "rewards_for_tests:flaky_reward" and first.task.rewards is None
    assert load_config(run / "config.yaml").task.rewards[0].name == "digits"  # still a recipe
    # run.keep_checkpoints=2: the newest two complete checkpoints are kept
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000003"]


def test_an_unreadable_checkpoint_is_named_with_the_fix(micro_run, tmp_path, capsys):
    from conftest import REPO

    from lightning_codraft.cli import main

    cfg, res = micro_run
    run = tmp_path / "run"
    shutil.copytree(res.out_dir, run)
    for f in (run / "checkpoints" / "step-000003").iterdir():
        if f.name != "COMPLETE":
            f.write_bytes(b"\0" * 16)  # a damaged disk or a copy cut short
    config_before = (run / "config.yaml").read_text()
    code = main(["fit", "--config", str(REPO / "recipes" / "tiny-cpu.yaml"), *MICRO, f"run.out_dir={run}",
                 "task.reward=rewards_for_tests:flaky_reward", "rl.prompts_per_step=4", "task.eval_every=2",
                 "task.on_reward_error=skip", "task.reward_failure_budget=0.9", "rl.steps=4"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"checkpoint {run / 'checkpoints' / 'step-000003'} cannot be read" in err and "Traceback" not in err
    assert f"mv {run / 'checkpoints' / 'step-000003'}" in err and "resumes from" in err and "step-000002" in err
    assert (run / "config.yaml").read_text() == config_before  # nothing was touched


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_s1_a_batched_reward_that_raises_stops_the_run_naming_the_exception(tmp_path, capsys, mode):
    """S1 from the command line: the reward fails only on batches (each sample alone scores, so the check before
    launch passes); the run never falls back to per-sample calls: it stops with exit 3 naming the function and the
    exception, and in skip mode every sample is first counted and reported as skipped."""
    from conftest import REPO

    from lightning_codraft.cli import main

    code = main(["fit", "--config", str(REPO / "recipes" / "tiny-cpu.yaml"), *MICRO, f"run.out_dir={tmp_path}",
                 "task.rewards=[{fn: 'rewards_for_tests:batch_only_reward'}]", f"task.on_reward_error={mode}",
                 "sft.steps=0", "draft.warm_start.steps=0", "task.eval_prompts=0"])
    captured = capsys.readouterr()
    assert code == 3, captured.err
    assert "rewards_for_tests:batch_only_reward" in captured.err
    assert "the batched call on 4 samples raised RuntimeError: rate limit: 4 requests in one call" in captured.err
    assert "fails only on batches" in captured.err
    if mode == "skip":
        assert captured.out.count("skipped sample") == 4 and "4 of the step's 4 samples failed" in captured.err
    assert not (tmp_path / "checkpoints" / "step-000001").exists()


def test_s6_none_for_a_whole_step_is_reported(tmp_path):
    """S6: a reward that applies to no sample beside one that does: each step says so; alone, it stops the run."""
    lines = []
    cfg = micro_config(tmp_path / "beside", "task.rewards=[{fn: 'rewards_for_tests:never_applies', name: never}, "
                                            "{fn: 'rewards_for_tests:digit_share_batched', name: digits}]",
                       "sft.steps=0", "draft.warm_start.steps=0", "task.eval_prompts=0", "rl.steps=2")
    res = fit(cfg, print_fn=lines.append)
    said = [line for line in lines if "returned None" in line]
    assert said == [f"step {i}: reward 'never' returned None (does not apply) for every sample of the step"
                    for i in (1, 2)]
    assert all(math.isnan(r["reward/never"]) and r["reward_failures"] == 0 for r in res.rows)
    cfg = micro_config(tmp_path / "alone", "task.rewards=[{fn: 'rewards_for_tests:never_applies', name: never}]",
                       "sft.steps=0", "draft.warm_start.steps=0", "task.eval_prompts=0")
    with pytest.raises(RewardError, match="no reward function applies to it"):
        fit(cfg, print_fn=lambda s: None)
