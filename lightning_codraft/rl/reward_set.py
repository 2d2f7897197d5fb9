"""A weighted list of reward functions (``task.rewards``), scored per batch, each function's scores kept apart.

A sample's reward is ``sum_i weight_i * r_i(sample)``. Each term is either *batched* (TRL's signature,
``fn(prompts, completions, **columns) -> list[float]``, rl/reward_funcs.py) or a per-sample function
``fn(prompt, completion, answer) -> float`` (``task.reward``, a task's built-in reward). A term that raises, returns
the wrong number of values, or returns anything but a finite number for a sample fails that sample: a batched
call that raises is repeated one sample at a time so the failure names its sample and prompt. A failed sample's
reward is NaN and the :class:`~lightning_codraft.rl.rewards.RewardError` goes to the caller, which applies
``task.on_reward_error`` (rl/rewards.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from lightning_codraft.rl.rewards import BadRewardValue, RewardError, reward_value, score_completions
from lightning_codraft.rl.tasks import TaskSample


@dataclass
class RewardTerm:
    """One reward function of a :class:`RewardSet`."""

    name: str
    """The name its scores are logged under (``reward/<name>``)."""
    fn: Callable
    """The function (see ``batched``)."""
    weight: float = 1.0
    """Its weight in the sample's reward."""
    batched: bool = True
    """TRL's batched signature; False: ``fn(prompt, completion, answer) -> float`` per sample."""


@dataclass
class RewardScores:
    """The scores of one batch."""

    total: list[float]
    """Each sample's weighted reward (NaN where a term failed on it)."""
    parts: dict[str, list[float]] = field(default_factory=dict)
    """Each term's own scores, by name (NaN where it failed)."""
    failures: list[RewardError] = field(default_factory=list)
    """One per failed sample (its first failing term), in sample order."""


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def _label(term: RewardTerm, function: str) -> str:
    """How a failure names its function: the term's name too where the set has several."""
    return function if term.name == "reward" else f"{term.name} ({function})"


def sample_columns(samples: Sequence[TaskSample]) -> dict[str, list]:
    """The keyword columns a batched reward receives: ``answer`` and every data-set column of the samples."""
    cols: dict[str, list] = {"answer": [s.answer for s in samples]}
    for key in samples[0].columns if samples else ():
        cols.setdefault(key, [s.columns.get(key) for s in samples])
    return cols


class RewardSet:
    """Score completions with weighted reward terms.

    Args:
        terms: the terms; names must be unique and weights finite.
    """

    def __init__(self, terms: Sequence[RewardTerm]):
        if not terms:
            raise ValueError("a RewardSet needs at least one reward term")
        names = [t.name for t in terms]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward names must be unique, {dup} repeats; give each a distinct `name`")
        bad = [t.name for t in terms if not math.isfinite(float(t.weight))]
        if bad:
            raise ValueError(f"reward {bad[0]!r} has a non-finite weight")
        self.terms = list(terms)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.terms]

    @property
    def logged_parts(self) -> list[str]:
        """The terms whose scores are logged apart (``reward/<name>``): all, unless the set is one term named
        ``reward`` (``task.reward`` or a task's built-in reward: its scores are the reward itself)."""
        return [] if self.names == ["reward"] else self.names

    def _batched(self, term: RewardTerm, prompts: Sequence[str], completions: Sequence[str],
                 columns: Mapping[str, list]) -> tuple[list[float], dict[int, str]]:
        """``(scores, {sample: reason})`` of one batched term."""
        n = len(prompts)
        try:
            values = term.fn(prompts=list(prompts), completions=list(completions), **columns)
        except Exception:  # noqa: BLE001 - localise: one sample at a time
            if n == 1:
                raise
            scores, reasons = [math.nan] * n, {}
            for i in range(n):
                try:
                    s, r = self._batched(term, prompts[i:i + 1], completions[i:i + 1],
                                         {k: v[i:i + 1] for k, v in columns.items()})
                    scores[i] = s[0]
                    if r:
                        reasons[i] = r[0]
                except Exception as e:  # noqa: BLE001 - a user's reward may raise anything
                    reasons[i] = f"raised {type(e).__name__}: {e}"
            return scores, reasons
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != n:
            got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
            return [math.nan] * n, {i: f"returned {got} for a batch of {n} samples; return one number per sample"
                                    for i in range(n)}
        scores, reasons = [], {}
        for i, v in enumerate(values):
            try:
                scores.append(reward_value(v))
            except BadRewardValue as e:
                scores.append(math.nan)
                reasons[i] = str(e)
        return scores, reasons

    def score(self, prompts: Sequence[str], completions: Sequence[str], samples: Sequence[TaskSample]
              ) -> RewardScores:
        """Score ``completions`` of ``prompts`` (``samples``: each one's task sample, for its answer and columns);
        never raises for a failing reward (see :class:`RewardScores`)."""
        if not len(prompts) == len(completions) == len(samples):
            raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions, {len(samples)} samples; "
                             f"they must be equal")
        columns = sample_columns(samples)
        first: dict[int, RewardError] = {}
        parts: dict[str, list[float]] = {}
        for term in self.terms:
            if term.batched:
                try:
                    scores, reasons = self._batched(term, prompts, completions, columns)
                except Exception as e:  # noqa: BLE001 - a batch of one that raised
                    scores, reasons = [math.nan], {0: f"raised {type(e).__name__}: {e}"}
                errors = [RewardError(i, prompts[i], why, _label(term, _name(term.fn)))
                          for i, why in sorted(reasons.items())]
            else:
                scores, errors = score_completions(term.fn, prompts, completions, columns["answer"], on_error="skip")
                errors = [RewardError(e.index, e.prompt, e.reason, _label(term, e.function)) for e in errors]
            for e in errors:
                first.setdefault(e.index, e)
            parts[term.name] = scores
        total = [sum(t.weight * parts[t.name][i] for t in self.terms) for i in range(len(prompts))]
        return RewardScores(total=total, parts=parts, failures=[first[i] for i in sorted(first)])


def as_reward_set(reward) -> RewardSet:
    """``reward`` as a :class:`RewardSet`: a set as it is; a per-sample function as one term named ``reward``."""
    if isinstance(reward, RewardSet):
        return reward
    if not callable(reward):
        raise TypeError(f"a reward must be a RewardSet or a callable fn(prompt, completion, answer), got "
                        f"{type(reward).__name__}")
    return RewardSet([RewardTerm("reward", reward, 1.0, batched=False)])
