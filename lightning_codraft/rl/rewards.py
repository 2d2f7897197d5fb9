"""Reward callables: resolve a user's dotted path, and score a batch while surviving a failing reward.

A reward function has the signature ``fn(prompt: str, completion: str, answer: str) -> float``. A user
plugs one in with ``task.reward: "my_pkg.rewards:score"`` (or ``"my_pkg.rewards.score"``). When it raises,
:func:`score_completions` either stops with a :class:`RewardError` naming the sample and its prompt, or
(``on_error="warn"``) warns with the same information and scores that sample 0.
"""

from __future__ import annotations

import importlib
import math
import warnings
from typing import Sequence

from lightning_codraft.rl.tasks import RewardFn

ON_ERROR = ("warn", "raise")


class RewardError(RuntimeError):
    """A reward function raised (or returned a non-finite value) on one sample."""

    def __init__(self, index: int, prompt: str, message: str):
        self.index = index
        self.prompt = prompt
        super().__init__(f"reward function failed on sample {index} (prompt {prompt!r}): {message}")


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
                      answers: Sequence[str], on_error: str = "warn") -> tuple[list[float], list[int]]:
    """Apply ``fn`` to every (prompt, completion, answer).

    Args:
        fn: the reward callable.
        prompts, completions, answers: equal-length sequences, one entry per sample.
        on_error: ``"warn"`` (failed sample scores 0 and a ``RuntimeWarning`` names it) or ``"raise"``.

    Returns:
        ``(rewards, failed)``: a float per sample, and the indices of samples whose reward failed.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error={on_error!r}; use one of {ON_ERROR}")
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers; "
                         f"they must be equal")
    rewards, failed = [], []
    for i, (p, c, a) in enumerate(zip(prompts, completions, answers)):
        try:
            r = float(fn(p, c, a))
            if not math.isfinite(r):
                raise ValueError(f"returned a non-finite reward {r}")
        except Exception as e:  # noqa: BLE001 - a user's reward may raise anything
            err = RewardError(i, p, f"{type(e).__name__}: {e}")
            if on_error == "raise":
                raise err from e
            warnings.warn(f"{err}; scoring it 0 (set task.on_reward_error=raise to stop instead)",
                          RuntimeWarning, stacklevel=2)
            r = 0.0
            failed.append(i)
        rewards.append(r)
    return rewards, failed
