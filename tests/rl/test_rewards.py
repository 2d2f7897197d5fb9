import pytest

from lightning_codraft.rl.rewards import RewardError, resolve_reward, score_completions


def flaky_reward(prompt, completion, answer):
    if "boom" in completion:
        raise KeyError("exploded")
    return float(completion == answer)


def test_resolve_reward_forms():
    assert resolve_reward("lightning_codraft.rl.tasks:arithmetic_reward")("", "#3", "3") == 1.0
    assert resolve_reward("lightning_codraft.rl.gsm8k.gsm8k_reward")("", "#### 3", "3") == 1.0
    with pytest.raises(ValueError, match="no callable 'nope'"):
        resolve_reward("lightning_codraft.rl.tasks:nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        resolve_reward("no_such_mod:f")
    with pytest.raises(ValueError, match="not a dotted path"):
        resolve_reward("plainname")


def test_failing_reward_warns_and_scores_zero():
    with pytest.warns(RuntimeWarning, match=r"sample 1 \(prompt 'p1'\).*KeyError"):
        r, failed = score_completions(flaky_reward, ["p0", "p1", "p2"], ["a", "boom", "c"], ["a", "b", "x"])
    assert r == [1.0, 0.0, 0.0] and failed == [1]


def test_failing_reward_stops_cleanly_when_asked():
    with pytest.raises(RewardError, match=r"sample 2 \(prompt 'p2'\)") as e:
        score_completions(flaky_reward, ["p0", "p1", "p2"], ["a", "b", "boom"], ["a", "b", "c"], on_error="raise")
    assert e.value.index == 2
    with pytest.raises(RewardError, match="non-finite"):
        score_completions(lambda p, c, a: float("nan"), ["p"], ["c"], ["a"], on_error="raise")
    with pytest.raises(ValueError, match="on_error='ignore'"):
        score_completions(flaky_reward, ["p"], ["c"], ["a"], on_error="ignore")
