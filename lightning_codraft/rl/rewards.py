"""Reward callables: resolve a user's dotted path, and score a batch so that a failing reward is never silent.

A reward function has the signature ``fn(prompt: str, completion: str, answer: str) -> float``. A user
plugs one in with ``task.reward: "my_pkg.rewards:score"`` (or ``"my_pkg.rewards.score"``). A reward fails when it
raises or returns anything but one finite real number (a list, a string, NaN, inf). By default
(``on_error="raise"``) :func:`score_completions` then stops with a :class:`RewardError` naming the function, the
sample, its prompt and the fix; the loop exits with status 3 and resumes from its last checkpoint. The tolerant mode
(``on_error="skip"``) is opt-in: a failed sample is left out of its group's advantages and of the loss, each one is
reported, and :func:`check_failure_budget` stops the run once a step's failures exceed the budget.
"""

from __future__ import annotations

import importlib
import math
import numbers
from typing import Sequence

from lightning_codraft.rl.tasks import RewardFn

ON_ERROR = ("raise", "skip")


class RewardError(RuntimeError):
    """A reward function failed on one sample (raised, or returned something other than one finite number)."""

    def __init__(self, index: int, prompt: str, message: str, function: str = "reward"):
        self.index = index
        self.prompt = prompt
        self.function = function
        self.reason = message
        super().__init__(f"reward function {function} failed on sample {index} (prompt {prompt!r}): {message}")


class BadRewardValue(ValueError):
    """What :func:`reward_value` raises: the reward returned something other than one finite number."""


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def reward_value(value) -> float:
    """``value`` as a float when it is one finite real number; else :class:`BadRewardValue` saying what it is and
    the fix."""
    if isinstance(value, (list, tuple)) or (hasattr(value, "__len__") and not isinstance(value, (str, bytes))
                                            and getattr(value, "ndim", 1) != 0):
        raise BadRewardValue(f"returned a {type(value).__name__} of {len(value)} values for one sample: this looks "
                             f"like a batched (TRL-style) reward; this task calls fn(prompt, completion, answer) -> "
                             f"float once per sample, so wrap it: lambda p, c, a: fn([p], [c], answer=[a])[0]")
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0 and not isinstance(value, numbers.Real):
        value = value.item()  # a 0-dim tensor / array
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadRewardValue(f"returned {type(value).__name__} {value!r}, not a number; return a float")
    r = float(value)
    if not math.isfinite(r):
        raise BadRewardValue(f"returned the non-finite reward {r}; return a finite float (e.g. 0.0 for a failure)")
    return r


def resolve_reward(path: str) -> RewardFn:
    """Import ``"package.module:function"`` or ``"package.module.function"`` and return the callable."""
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"reward {path!r} is not a dotted path; write 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"reward {path!r}: cannot import module {mod_name!r} ({e})") from e
    fn = getattr(mod, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward {path!r}: module {mod_name!r} has no callable {attr!r}")
    return fn


def score_completions(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str],
                      answers: Sequence[str], on_error: str = "raise") -> tuple[list[float], list[RewardError]]:
    """Apply ``fn`` to every (prompt, completion, answer).

    Args:
        fn: the reward callable.
        prompts, completions, answers: equal-length sequences, one entry per sample.
        on_error: ``"raise"`` (stop at the first failure) or ``"skip"`` (report it; the sample's reward is NaN).

    Returns:
        ``(rewards, failures)``: a float per sample (NaN where it failed) and one :class:`RewardError` per failed
        sample (``.index`` is the sample).

    Raises:
        RewardError: a sample's reward failed and ``on_error="raise"``.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}; use one of {ON_ERROR}")
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers; "
                         f"they must be equal")
    rewards, failures = [], []
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
        try:
            r = reward_value(fn(p, c, a))
        except Exception as e:  # noqa: BLE001 - a user's reward may raise anything
            reason = str(e) if isinstance(e, BadRewardValue) else f"raised {type(e).__name__}: {e}"
            err = RewardError(i, p, reason, _name(fn))
            if on_error == "raise":
                raise err from e
            failures.append(err)
            r = math.nan
        rewards.append(r)
    return rewards, failures


def check_failure_budget(failures: Sequence[RewardError], num_failed: int, num_samples: int, budget: float,
                         empty_replicas: int = 0) -> None:
    """Stop every rank alike when a step's reward failures exceed the budget.

    Args:
        failures: this rank's failures (the message names the first; a rank without one says where they were).
        num_failed: failed samples of the whole step (summed over ranks: the same on every rank).
        num_samples: samples of the whole step.
        budget: the share of the step's samples that may fail (0: none, ``on_error="raise"``).
        empty_replicas: replicas all of whose samples failed (nothing to train on).

    Raises:
        RewardError: more than ``budget * num_samples`` samples failed, or a replica has no sample left.
    """
    if num_failed <= budget * num_samples and not empty_replicas:
        return
    where = (f"{num_failed} of the step's {num_samples} samples failed"
             + (f" (every sample of {empty_replicas} data-parallel replica(s): nothing to train on)"
                if empty_replicas else "")
             + ("" if budget == 0 else f", over task.reward_failure_budget={budget}"))
    fix = ("; fix the reward function, or set task.on_reward_error=skip to leave failed samples out (a failure budget "
           "per step, task.reward_failure_budget, still stops the run)" if budget == 0 else "")
    if failures:
        first = failures[0]
        raise RewardError(first.index, first.prompt, f"{first.reason}; {where}{fix}", first.function)
    raise RewardError(-1, "", f"on another data-parallel replica; {where}{fix}")
