"""Rewards as functions (task.rewards): TRL's batched signature, weights, per-function scores, the built-ins (math
equivalence through math-verify), and failures localised to the sample that caused them."""

import math

import pytest

from lightning_codraft.rl.reward_funcs import exact_answer, format_match, length_penalty, math_equivalence
from lightning_codraft.rl.rewards import RewardSet, RewardTerm, as_reward_set
from lightning_codraft.rl.tasks import TaskSample

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
    assert out.total[0] == 1.0 and math.isnan(out.total[1]) and out.total[2] == 1.0
    (err,) = out.failures
    assert err.index == 1 and err.prompt == "q1" and "fragile" in str(err) and "RuntimeError: cannot parse" in str(err)


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
    from lightning_codraft.rl.reward_funcs import BUILTINS
    from lightning_codraft.task_config import REWARD_BUILTINS

    assert set(REWARD_BUILTINS) == set(BUILTINS)
