import math

import numpy as np
import pytest
import torch

from lightning_codraft.rl.tasks.rewards import RewardError, check_failure_budget, resolve_reward, score_completions


def flaky_reward(prompt, completion, answer):
    if "boom" in completion:
        raise KeyError("exploded")
    return float(completion == answer)


def test_resolve_reward_forms():
    assert resolve_reward("lightning_codraft.rl.tasks.arithmetic:arithmetic_reward")("", "#3", "3") == 1.0
    assert resolve_reward("lightning_codraft.rl.tasks.gsm8k.gsm8k_reward")("", "#### 3", "3") == 1.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        resolve_reward("lightning_codraft.rl.tasks.arithmetic:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve_reward("no_such_mod:f")
    with pytest.raises(ValueError, match="not a dotted path"):
        resolve_reward("plainname")


def test_skip_mode_reports_failures_and_never_scores_them():
    r, failures = score_completions(flaky_reward, ["p0", "p1", "p2"], ["a", "boom", "c"], ["a", "b", "x"],
                                    on_error="skip")
    assert r[0] == 1.0 and math.isnan(r[1]) and r[2] == 0.0
    assert [f.index for f in failures] == [1] and "raised KeyError" in str(failures[0])
    assert "test_rewards:flaky_reward failed on sample 1 (prompt 'p1')" in str(failures[0])


def test_failing_reward_stops_by_default():
    with pytest.raises(RewardError, match=r"sample 2 \(prompt 'p2'\)") as e:
        score_completions(flaky_reward, ["p0", "p1", "p2"], ["a", "b", "boom"], ["a", "b", "c"])
    assert e.value.index == 2
    with pytest.raises(ValueError, match="on_error='warn'"):
        score_completions(flaky_reward, ["p"], ["c"], ["a"], on_error="warn")


@pytest.mark.parametrize("value,match", [
    (float("nan"), "non-finite"), (float("inf"), "non-finite"), ([1.0, 0.0], "looks like a batched"),
    ("1.0", "str '1.0', not a number"), (None, "NoneType None, not a number"), (True, "bool True, not a number"),
    (np.array([1.0, 2.0]), "looks like a batched")])
def test_anything_but_one_finite_number_fails(value, match):
    with pytest.raises(RewardError, match=match):
        score_completions(lambda p, c, a: value, ["p"], ["c"], ["a"])


def test_numbers_of_any_kind_are_accepted():
    for value in (1, 0.5, np.float32(0.25), np.int64(2), torch.tensor(0.75), np.array(3.0)):
        r, failures = score_completions(lambda p, c, a: value, ["p"], ["c"], ["a"])
        assert not failures and r == [float(value)]


def test_failure_budget():
    _, failures = score_completions(flaky_reward, ["p0", "p1"], ["boom", "b"], ["a", "b"], on_error="skip")
    check_failure_budget(failures, 1, 20, 0.05)  # 1 of 20 is within 5%
    with pytest.raises(RewardError, match="2 of the step's 20 samples failed, over task.reward_failure_budget"):
        check_failure_budget(failures, 2, 20, 0.05)
    with pytest.raises(RewardError, match="on another data-parallel replica; 1 of the step's 20 samples failed"):
        check_failure_budget([], 1, 20, 0.0)
