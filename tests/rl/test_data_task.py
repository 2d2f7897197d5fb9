"""Prompts from a data set (task.name=dataset): local JSONL / parquet / CSV through `datasets`, a column mapping, a
template, held-out rows; clear errors naming the missing file or column; a custom task with two weighted rewards
runs from a recipe and from Python, each reward's mean in its own metrics column."""

import json

import pytest

from lightning_codraft.config import ConfigError
from lightning_codraft.rl.tasks.dataset import DatasetTask
from lightning_codraft.rl.reports.run_log import read_metrics
from lightning_codraft.rl.run.loop import fit
from test_loop import micro_config

ROWS = [{"question": f"what is {a} plus {b}", "answer": str(a + b), "level": "hard" if a > 4 else "easy"}
        for a in range(8) for b in range(3)]


def _write(path, rows=ROWS):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pandas as pd

        frame = pd.DataFrame(rows)
        frame.to_parquet(path) if path.suffix == ".parquet" else frame.to_csv(path, index=False)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".csv"])
def test_rows_columns_template_and_heldout_from_any_local_format(tmp_path, suffix):
    task = DatasetTask(str(_write(tmp_path / f"q{suffix}")), prompt_column="question", template="Q: {question}?",
                       heldout=4)
    assert len(task.samples) == len(ROWS) and task.num_train == len(ROWS) - 4
    s = task.samples[7]
    assert (s.prompt, s.answer, s.columns["level"]) == ("Q: what is 2 plus 1?", "3", "easy")
    assert task.heldout_samples(4) == task.samples[-4:]
    drawn = {x.prompt for seed in range(5) for x in task.sample(30, seed)}
    assert drawn == {x.prompt for x in task.samples[:-4]}  # never a held-out row
    assert task.sample(6, seed=3) == task.sample(6, seed=3)


def test_clear_errors_for_a_missing_file_column_or_template_field(tmp_path):
    path = _write(tmp_path / "q.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        DatasetTask(str(tmp_path / "nope.jsonl"))
    with pytest.raises(ValueError, match="row 0 has no column 'prompt'.*'answer', 'level', 'question'"):
        DatasetTask(str(path))
    with pytest.raises(ValueError, match="task.template .* names the column 'problem'"):
        DatasetTask(str(path), prompt_column="question", template="{problem}")
    with pytest.raises(ValueError, match="at least one to train on"):
        DatasetTask(str(path), prompt_column="question", heldout=len(ROWS))


def test_an_eval_source_holds_out_another_file(tmp_path):
    train, held = _write(tmp_path / "a.jsonl", ROWS[:10]), _write(tmp_path / "b.jsonl", ROWS[10:13])
    task = DatasetTask(str(train), prompt_column="question", eval_source=str(held), heldout=3)
    assert task.num_train == 10 and [s.answer for s in task.heldout_samples(3)] == [r["answer"] for r in ROWS[10:13]]


def level_bonus(prompts, completions, answer, level, **_):
    """A batched (TRL-style) reward that reads a data-set column."""
    return [0.5 if lv == "hard" else 0.0 for lv in level]


REWARDS = ("task.rewards=[{fn: math_equivalence, weight: 1.0, name: correct}, "
           "{fn: 'test_data_task:level_bonus', weight: 0.5}, {fn: length_penalty, weight: 0.1, "
           "kwargs: {max_chars: 6}}]")


def test_a_custom_jsonl_task_with_weighted_rewards_runs_from_a_recipe(tmp_path):
    path = _write(tmp_path / "q.jsonl")
    cfg = micro_config(tmp_path / "run", "task.name=dataset", f"task.source={path}", "task.prompt_column=question",
                       "task.template='{question}='", "sft.steps=0", "task.heldout=2", REWARDS)
    res = fit(cfg, print_fn=lambda s: None)
    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    assert [r["step"] for r in rows] == [1.0, 2.0, 3.0]
    for r in rows:  # each reward's own mean, and the weighted total
        assert 0 <= r["reward/correct"] <= 1 and 0 <= r["reward/level_bonus"] <= 0.5
        assert -1 <= r["reward/length_penalty"] <= 0
        total = r["reward/correct"] + 0.5 * r["reward/level_bonus"] + 0.1 * r["reward/length_penalty"]
        assert r["reward"] == pytest.approx(total, abs=1e-9)
    assert res.completed


def test_sft_needs_worked_solutions_from_a_dataset():
    with pytest.raises(ConfigError, match="task.solution_column"):
        micro_config("/tmp/unused", "task.name=dataset", "task.source=q.jsonl", "sft.steps=3")


def test_the_same_task_and_rewards_built_in_python(tmp_path):
    """A user's task object and reward terms passed to fit() directly: the same metrics as the recipe's."""
    from lightning_codraft.rl.tasks.reward_funcs import length_penalty, math_equivalence
    from lightning_codraft.rl.tasks.rewards import RewardTerm

    path = _write(tmp_path / "q.jsonl")
    common = ["sft.steps=0", "rl.steps=2", "run.plots=false"]
    recipe = micro_config(tmp_path / "a", "task.name=dataset", f"task.source={path}", "task.prompt_column=question",
                          "task.template='{question}='", "task.heldout=2", *common,
                          "task.rewards=[{fn: math_equivalence, name: correct}, {fn: length_penalty, weight: 0.1, "
                          "kwargs: {max_chars: 6}}]")
    fit(recipe, print_fn=lambda s: None)
    task = DatasetTask(str(path), prompt_column="question", template="{question}=", heldout=2)
    rewards = [RewardTerm("correct", math_equivalence),
               RewardTerm("length_penalty", lambda prompts, completions, **kw: length_penalty(
                   prompts, completions, max_chars=6), 0.1)]
    fit(micro_config(tmp_path / "b", *common), print_fn=lambda s: None, task=task, rewards=rewards)
    a, b = read_metrics(tmp_path / "a" / "metrics.csv"), read_metrics(tmp_path / "b" / "metrics.csv")
    keys = ["reward", "reward/correct", "reward/length_penalty", "policy_loss", "draft_loss"]
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


def test_the_loop_logs_to_any_lightning_logger_from_the_recipe(tmp_path):
    import importlib.util

    from lightning_codraft.rl.run.preflight import preflight

    extra = tmp_path / "extra"
    cfg = micro_config(tmp_path / "run", "rl.steps=2", "sft.steps=0", "task.eval_prompts=0", "run.plots=false",
                       f"run.loggers=[{{class_path: lightning.fabric.loggers.CSVLogger, init_args: "
                       f"{{root_dir: '{extra}', name: rl}}}}]")
    assert preflight(cfg) == []
    fit(cfg, print_fn=lambda s: None)
    rows = read_metrics(next(extra.rglob("metrics.csv")))
    assert [r["step"] for r in rows] == [1.0, 2.0] and all(0 <= r["reward"] <= 1 for r in rows)
    if importlib.util.find_spec("wandb") is None:  # a logger whose package is missing is found before launch
        problems = preflight(micro_config(tmp_path / "w", "run.loggers=[wandb]"))
        assert problems == ["run.loggers[0]='wandb' needs the 'wandb' package: pip install wandb"]
    bad = preflight(micro_config(tmp_path / "b", "run.loggers=[tensorbored]"))
    assert bad and "run.loggers[0]='tensorbored' is not one of" in bad[0]
