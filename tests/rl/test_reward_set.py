"""Rewards as functions (task.rewards): TRL's batched signature, weights, per-function scores, the built-ins (math
equivalence through math-verify), and failures localised to the sample that caused them."""

import math

import pytest

from lightning_codraft.rl.tasks.reward_funcs import exact_answer, format_match, length_penalty, math_equivalence
from lightning_codraft.rl.tasks.rewards import RewardSet, RewardTerm, as_reward_set
from lightning_codraft.rl.tasks.arithmetic import TaskSample

EQUIVALENT = [("0.5", "1/2"), ("1/2", "\\frac{1}{2}"), ("The answer is \\boxed{\\frac{1}{2}}.", "0.5"),
              ("so she has 1,200 dollars", "1200"), ("#### 72", "72"), ("x = 2", "2"), ("50%", "0.5"),
              ("It costs $18.00.", "18"), ("-3", "-3"), ("3 eggs, then 7 more: 10", "10")]
DIFFERENT = [("-3", "3"), ("0.5", "1/3"), ("#### 71", "72"), ("\\frac{2}{3}", "0.66"), ("no number", "4"),
             ("1200", "12")]


@pytest.mark.parametrize("completion, answer", EQUIVALENT)
def test_math_equivalence_accepts_equal_answers_in_any_notation(completion, answer):
    assert math_equivalence(["p"], [completion], answer=[answer]) == [1.0]


@pytest.mark.parametrize("completion, answer", DIFFERENT)
def test_math_equivalence_rejects_different_answers(completion, answer):
    assert math_equivalence(["p"], [completion], answer=[answer]) == [0.0]


def test_the_other_builtins():
    assert exact_answer(["p"] * 3, ["1+1=2#2", "so \\boxed{7}", "x\n  42 "], answer=["2", "7", "42"]) == [1, 1, 1]
    assert exact_answer(["p"], ["#2.0"], answer=["2"]) == [0.0]  # exact: no equivalence
    assert format_match(["p"] * 2, ["3+4=7#7", "seven"]) == [1.0, 0.0]
    assert format_match(["p"], ["<think>a</think> 3"], pattern="<think>.*</think>.*") == [1.0]
    assert length_penalty(["p"] * 3, ["a" * 10, "a" * 15, "a" * 40], max_chars=10) == [0.0, -0.5, -1.0]


def _samples(n, **columns):
    return [TaskSample(prompt=f"q{i}", answer=str(i), solution="", columns={k: v[i] for k, v in columns.items()})
            for i in range(n)]


def test_weighted_sum_per_function_scores_and_the_datasets_columns_reach_the_rewards():
    seen = {}

    def level_bonus(prompts, completions, answer, level, **_):
        seen["level"], seen["answer"] = list(level), list(answer)
        return [0.5 if lv == "hard" else 0.0 for lv in level]

    rs = RewardSet([RewardTerm("math", math_equivalence, 1.0), RewardTerm("bonus", level_bonus, 2.0)])
    out = rs.score(["q0", "q1", "q2"], ["0", "7", "2"], _samples(3, level=["easy", "hard", "hard"]))
    assert out.parts == {"math": [1.0, 0.0, 1.0], "bonus": [0.0, 0.5, 0.5]}
    assert out.total == [1.0, 1.0, 2.0] and out.failures == []
    assert seen == {"level": ["easy", "hard", "hard"], "answer": ["0", "1", "2"]}


def test_a_failing_reward_is_localised_to_its_sample_and_prompt():
    def fragile(prompts, completions, **_):
        if any("boom" in c for c in completions):
            raise RuntimeError("cannot parse")
        return [1.0] * len(completions)

    rs = RewardSet([RewardTerm("fragile", fragile, 1.0)])
    out = rs.score(["q0", "q1", "q2"], ["ok", "boom", "ok"], _samples(3))
    assert all(math.isnan(t) for t in out.total)  # the batched call failed: no score comes from another call
    assert [e.index for e in out.failures] == [0, 1, 2]
    assert all("the batched call on 3 samples raised RuntimeError: cannot parse" in str(e) for e in out.failures)
    err = out.failures[1]
    assert err.prompt == "q1" and "fragile" in str(err) and "alone, this sample also fails" in str(err)
    assert "alone, this sample scores" in str(out.failures[0])


def test_s1_a_reward_that_fails_only_on_batches_is_reported_never_rerun_silently():
    """S1: TRL calls a reward on the whole batch; one that raises there (API limits, batch normalisation, a shape
    bug) fails every sample, naming the exception, though each sample alone would score."""
    def batch_limited(prompts, completions, **_):
        if len(completions) > 1:
            raise RuntimeError("rate limit: batches over 1")
        return [1.0]

    out = RewardSet([RewardTerm("api", batch_limited, 1.0)]).score(["a", "b"], ["x", "y"], _samples(2))
    assert len(out.failures) == 2 and all(math.isnan(t) for t in out.total)
    assert all("RuntimeError: rate limit: batches over 1" in str(e) and "fails only on batches" in str(e)
               for e in out.failures)


def test_s6_a_sample_no_reward_applies_to_fails_and_a_reward_that_never_applies_is_reported():
    def never(prompts, completions, **_):
        return [None] * len(completions)

    alone = RewardSet([RewardTerm("never", never, 1.0)]).score(["a", "b"], ["0", "1"], _samples(2))
    assert [e.index for e in alone.failures] == [0, 1] and "no reward function applies" in str(alone.failures[0])
    assert all(math.isnan(t) for t in alone.total) and alone.not_applied == ["never"]
    beside = RewardSet([RewardTerm("never", never, 1.0), RewardTerm("math", math_equivalence, 1.0)]).score(
        ["a", "b"], ["0", "1"], _samples(2))
    assert beside.failures == [] and beside.total == [1.0, 1.0] and beside.not_applied == ["never"]


def test_an_empty_final_answer_never_matches_and_an_empty_reference_is_an_error():
    assert exact_answer(["p"] * 2, ["", "#"], answer=["3", "3"]) == [0.0, 0.0]
    assert math_equivalence(["p"], [""], answer=["3"]) == [0.0]
    for fn in (exact_answer, math_equivalence):
        with pytest.raises(ValueError, match="reference answer '' is empty"):
            fn(["p"], ["#"], answer=[""])


@pytest.mark.parametrize("bad, reason", [(lambda prompts, completions, **_: [1.0],
                                          "returned 1 values for a batch of 2"),
                                         (lambda prompts, completions, **_: [1.0, float("nan")], "non-finite"),
                                         (lambda prompts, completions, **_: [1.0, "x"], "not a number")])
def test_wrong_length_nan_or_non_numbers_fail_loudly(bad, reason):
    out = RewardSet([RewardTerm("bad", bad, 1.0)]).score(["a", "b"], ["x", "y"], _samples(2))
    assert out.failures and reason in str(out.failures[-1]) and math.isnan(out.total[-1])


def test_a_per_sample_reward_and_set_validation():
    rs = as_reward_set(lambda p, c, a: float(c == a))
    assert rs.score(["p", "p"], ["1", "2"], _samples(2)).total == [0.0, 0.0]
    assert rs.score(["p", "p"], ["0", "1"], _samples(2)).total == [1.0, 1.0]
    with pytest.raises(ValueError, match="unique"):
        RewardSet([RewardTerm("a", exact_answer), RewardTerm("a", math_equivalence)])
    with pytest.raises(ValueError, match="at least one"):
        RewardSet([])


def test_none_means_the_reward_does_not_apply_as_in_trl():
    def only_even(prompts, completions, **_):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    rs = RewardSet([RewardTerm("even", only_even, 2.0), RewardTerm("math", math_equivalence, 1.0)])
    out = rs.score(["a", "b"], ["0", "1"], _samples(2))
    assert out.total == [3.0, 1.0] and out.failures == [] and math.isnan(out.parts["even"][1])


def test_the_config_layer_names_exactly_the_built_in_rewards():
    """task_config.REWARD_BUILTINS (the config imports nothing of the library) mirrors reward_funcs.BUILTINS."""
    from lightning_codraft.rl.tasks.reward_funcs import BUILTINS
    from lightning_codraft.task_config import REWARD_BUILTINS

    assert set(REWARD_BUILTINS) == set(BUILTINS)


def _task_cfg(**kw):
    from lightning_codraft.task_config import RewardTermConfig, TaskConfig

    rewards = kw.pop("rewards", None)
    return TaskConfig(rewards=None if rewards is None else [RewardTermConfig(**r) for r in rewards], **kw)


def test_s4_reward_options_are_checked_against_the_signature_before_any_call():
    from lightning_codraft.rl.tasks.rewards import build_reward

    with pytest.raises(ValueError, match=r"task.rewards\[0\].kwargs.max_charz: .*length_penalty has no option "
                                         r"'max_charz' \(did you mean 'max_chars'\?\)"):
        build_reward(_task_cfg(rewards=[{"fn": "length_penalty", "kwargs": {"max_charz": 1}}]), None)
    with pytest.raises(ValueError, match="'answer' is what the run passes every reward"):
        build_reward(_task_cfg(rewards=[{"fn": "format_match", "kwargs": {"answer": "x"}}]), None)
    rs = build_reward(_task_cfg(rewards=[{"fn": "length_penalty", "kwargs": {"max_chars": 1}}]), None)
    assert rs.score(["p"], ["abc"], _samples(1)).total == [-1.0]  # the option is used
    # a user's function: named parameters, or anything through **kwargs
    with pytest.raises(ValueError, match=r"rewards_for_tests:scaled_length has no option 'scal'"):
        build_reward(_task_cfg(rewards=[{"fn": "rewards_for_tests:scaled_length", "kwargs": {"scal": 2}}]), None)
    build_reward(_task_cfg(rewards=[{"fn": "rewards_for_tests:scaled_length", "kwargs": {"scale": 2}}]), None)


def test_s5_answer_rewards_need_an_answer_column():
    from lightning_codraft.config import ConfigError, load_config
    from lightning_codraft.rl.tasks.rewards import build_reward

    for rewards in (None, [{"fn": "exact_answer"}], [{"fn": "format_match"}, {"fn": "math_equivalence"}]):
        with pytest.raises(ValueError, match=r"(rewards\[\d\]|built-in reward) .*answer_column is null"):
            _task_cfg(name="dataset", source="x.jsonl", answer_column=None, rewards=rewards)
    _task_cfg(name="dataset", source="x.jsonl", answer_column=None, rewards=[{"fn": "format_match"}])
    with pytest.raises(ConfigError, match=r"^task.rewards\[0\] \(exact_answer\) .*but answer_column is null"):
        load_config(None, ["task.name=dataset", "task.source=x.jsonl", "task.answer_column=null", "sft.steps=0",
                           "task.rewards=[{fn: exact_answer}]"])

    class NoAnswers:  # a DatasetTask built in Python without an answer column
        answer_column, reward_fn = None, math_equivalence

    with pytest.raises(ValueError, match="task.answer_column is null"):
        build_reward(_task_cfg(), NoAnswers())
