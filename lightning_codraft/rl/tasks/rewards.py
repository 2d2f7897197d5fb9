"""Reward callables: resolve a user's dotted path, and score a batch so that a failing reward is never silent.

A reward function has the signature ``fn(prompt: str, completion: str, answer: str) -> float``. A user
plugs one in with ``task.reward: "my_pkg.rewards:score"`` (or ``"my_pkg.rewards.score"``). A reward fails when it
raises or returns anything but one finite real number (a list, a string, NaN, inf). By default
(``on_error="raise"``) :func:`score_completions` then stops with a :class:`RewardError` naming the function, the
sample, its prompt and the fix; the loop exits with status 3 and resumes from its last checkpoint. The tolerant mode
(``on_error="skip"``) is opt-in: a failed sample is left out of its group's advantages and of the loss, each one is
reported, and :func:`check_failure_budget` stops the run once a step's failures exceed the budget.

**Weighted reward functions** (``task.rewards``, :class:`RewardSet`): a sample's reward is
``sum_i weight_i * r_i(sample)``. Each term is either *batched* (TRL's signature,
``fn(prompts, completions, **columns) -> list[float]``, rl/tasks/reward_funcs.py) or a per-sample function as above
(``task.reward``, a task's built-in reward). A term that raises, returns the wrong number of values, or returns
anything but a finite number for a sample fails that sample; a batched call that raises fails every sample of its
batch, naming the exception (each sample is then tried alone only to say which ones also fail by themselves). A
batched term may return ``None`` for a sample it does not apply to (TRL's convention): it adds nothing to that
sample's reward and is left out of the term's logged mean; a sample no term applies to fails, and a term that
applies to no sample of a batch is reported (:attr:`RewardScores.not_applied`). A failed sample's reward is NaN and
its :class:`RewardError` goes to the caller, which applies ``task.on_reward_error``. A recipe's reward options
(``kwargs``) are checked against the function's signature before any call (:func:`check_options`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_codraft.rl.tasks.arithmetic import RewardFn, TaskSample
from lightning_codraft.rl.tasks.reward_funcs import BUILTINS
from lightning_codraft.task_config import ANSWER_REWARDS, answer_problem

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
    if isinstance(value, (list, tuple)) or (
        hasattr(value, "__len__") and not isinstance(value, (str, bytes)) and getattr(value, "ndim", 1) != 0
    ):
        raise BadRewardValue(
            f"returned a {type(value).__name__} of {len(value)} values for one sample: this looks "
            f"like a batched (TRL-style) reward; this task calls fn(prompt, completion, answer) -> "
            f"float once per sample, so wrap it: lambda p, c, a: fn([p], [c], answer=[a])[0]"
        )
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


def score_completions(
    fn: RewardFn, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str], on_error: str = "raise"
) -> tuple[list[float], list[RewardError]]:
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
        raise ValueError(
            f"got {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers; they must be equal"
        )
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


def check_failure_budget(
    failures: Sequence[RewardError], num_failed: int, num_samples: int, budget: float, empty_replicas: int = 0
) -> None:
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
    where = (
        f"{num_failed} of the step's {num_samples} samples failed"
        + (
            f" (every sample of {empty_replicas} data-parallel replica(s): nothing to train on)"
            if empty_replicas
            else ""
        )
        + ("" if budget == 0 else f", over task.reward_failure_budget={budget}")
    )
    fix = (
        "; fix the reward function, or set task.on_reward_error=skip to leave failed samples out (a failure budget "
        "per step, task.reward_failure_budget, still stops the run)"
        if budget == 0
        else ""
    )
    if failures:
        first = failures[0]
        raise RewardError(first.index, first.prompt, f"{first.reason}; {where}{fix}", first.function)
    raise RewardError(-1, "", f"on another data-parallel replica; {where}{fix}")


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
    """Each term's own scores, by name (NaN where it failed or did not apply)."""
    failures: list[RewardError] = field(default_factory=list)
    """One per failed sample (its first failing term), in sample order."""
    not_applied: list[str] = field(default_factory=list)
    """Terms that returned ``None`` (does not apply) for every sample of the batch: reported by the caller."""

    @staticmethod
    def concat(batches: Sequence[RewardScores]) -> RewardScores:
        """One batch of ``batches`` in order (failures re-indexed; a term not applied where no batch applied it)."""
        total, parts, failures, offset = [], {}, [], 0
        for b in batches:
            total += b.total
            for k, v in b.parts.items():
                parts.setdefault(k, []).extend(v)
            failures += [RewardError(f.index + offset, f.prompt, f.reason, f.function) for f in b.failures]
            offset += len(b.total)
        none = [k for k in parts if all(k in b.not_applied for b in batches)] if batches else []
        return RewardScores(total, parts, failures, none)


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

    def _batched(
        self, term: RewardTerm, prompts: Sequence, completions: Sequence, columns: Mapping[str, list]
    ) -> tuple[list[float], dict[int, str]]:
        """``(scores, {sample: reason})`` of one batched term; never raises.

        A batched call that raises fails every sample of the batch (the report names the exception): the scores of
        a reward that fails on batches are not taken from another kind of call. Each sample is then tried alone,
        only to say which ones fail by themselves."""
        n = len(prompts)
        try:
            values = term.fn(prompts=list(prompts), completions=list(completions), **columns)
        except Exception as e:  # noqa: BLE001 - a user's reward may raise anything
            raised = f"raised {type(e).__name__}: {e}"
            if n == 1:
                return [math.nan], {0: raised}
            reasons = {}
            for i in range(n):
                _, alone = self._batched(
                    term, prompts[i : i + 1], completions[i : i + 1], {k: v[i : i + 1] for k, v in columns.items()}
                )
                reasons[i] = f"the batched call on {n} samples {raised}; " + (
                    f"alone, this sample also fails ({alone[0]})"
                    if alone
                    else "alone, this sample scores: the function fails only on batches"
                )
            return [math.nan] * n, reasons
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__") or len(values) != n:
            got = f"{len(values)} values" if hasattr(values, "__len__") else type(values).__name__
            return [math.nan] * n, {
                i: f"returned {got} for a batch of {n} samples; return one number per sample" for i in range(n)
            }
        scores, reasons = [], {}
        for i, v in enumerate(values):
            if v is None:  # TRL's "does not apply to this sample": no contribution, not a failure
                scores.append(math.nan)
                continue
            try:
                scores.append(reward_value(v))
            except BadRewardValue as e:
                scores.append(math.nan)
                reasons[i] = str(e)
        return scores, reasons

    def score(self, prompts: Sequence[str], completions: Sequence[str], samples: Sequence[TaskSample]) -> RewardScores:
        """Score ``completions`` (texts) of ``prompts`` (``samples``: each one's task sample, for its answer and
        columns); never raises for a failing reward (see :class:`RewardScores`). Where a prompt is a conversation
        (TRL's conversational form) its completion reaches the rewards as ``[{"role": "assistant", "content":
        text}]``, as TRL passes it."""
        if not len(prompts) == len(completions) == len(samples):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(completions)} completions, {len(samples)} samples; "
                f"they must be equal"
            )
        columns = sample_columns(samples)
        completions = [
            [{"role": "assistant", "content": c}] if isinstance(p, (list, tuple)) else c
            for p, c in zip(prompts, completions)
        ]  # a conversation's completion, as TRL gives it
        first: dict[int, RewardError] = {}
        parts: dict[str, list[float]] = {}
        none: list[str] = []
        for term in self.terms:
            if term.batched:
                scores, reasons = self._batched(term, prompts, completions, columns)
                errors = [
                    RewardError(i, prompts[i], why, _label(term, _name(term.fn))) for i, why in sorted(reasons.items())
                ]
            else:
                scores, errors = score_completions(term.fn, prompts, completions, columns["answer"], on_error="skip")
                errors = [RewardError(e.index, e.prompt, e.reason, _label(term, e.function)) for e in errors]
            for e in errors:
                first.setdefault(e.index, e)
            parts[term.name] = scores
            if scores and not errors and all(math.isnan(v) for v in scores):
                none.append(term.name)
        applied = [[not math.isnan(parts[t.name][i]) for t in self.terms] for i in range(len(prompts))]
        for i, row in enumerate(applied):  # TRL's None: no function applies to this sample, so it has no reward
            if i not in first and not any(row):
                first[i] = RewardError(
                    i,
                    prompts[i],
                    "no reward function applies to it (every one returned None, "
                    "TRL's 'does not apply'); a sample needs at least one reward",
                    " / ".join(self.names),
                )
        total = [
            math.nan if i in first else sum(t.weight * parts[t.name][i] for t, on in zip(self.terms, row) if on)
            for i, row in enumerate(applied)
        ]
        return RewardScores(total=total, parts=parts, failures=[first[i] for i in sorted(first)], not_applied=none)


def as_reward_set(reward) -> RewardSet:
    """``reward`` as a :class:`RewardSet`: a set as it is; a list of :class:`RewardTerm` as a set of them; a
    per-sample function as one term named ``reward``."""
    if isinstance(reward, RewardSet):
        return reward
    if isinstance(reward, (list, tuple)):
        return RewardSet(reward)
    if not callable(reward):
        raise TypeError(
            f"a reward must be a RewardSet or a callable fn(prompt, completion, answer), got {type(reward).__name__}"
        )
    return RewardSet([RewardTerm("reward", reward, 1.0, batched=False)])


RESERVED = ("prompts", "completions", "answer")
"""Arguments every batched reward receives from the run, never from a recipe's ``kwargs``."""


def check_options(fn: Callable, options: Mapping[str, Any], key: str) -> None:
    """Refuse ``options`` (a reward's ``kwargs``) that ``fn`` does not name, before any call.

    An option must be a named keyword parameter of ``fn`` (``def r(prompts, completions, scale=1.0, **columns)``
    takes ``scale``): a function's ``**kwargs`` receive the data set's columns, so a name it does not spell out is
    refused even there, and a misspelt option never runs with the default.

    Raises:
        ValueError: naming ``key`` (e.g. ``task.rewards[0].kwargs``), the unknown option and the ones ``fn`` has.
    """
    params = inspect.signature(fn).parameters
    named = [p for p, v in params.items() if v.kind in (v.POSITIONAL_OR_KEYWORD, v.KEYWORD_ONLY) and p not in RESERVED]
    for option in options:
        if option in RESERVED:
            raise ValueError(f"{key}.{option}: {option!r} is what the run passes every reward; it cannot be an option")
        if option not in named:
            close = difflib.get_close_matches(option, named, n=1)
            raise ValueError(
                f"{key}.{option}: {_name(fn)} has no option {option!r}"
                f"{f' (did you mean {close[0]!r}?)' if close else ''}; its options are {named} (an "
                f"option must be a named parameter of the function)"
            )


def build_reward(cfg, task) -> RewardSet:
    """The rewards of ``cfg`` (a :class:`~lightning_codraft.config.TaskConfig`): ``task.rewards`` (built-ins by
    name, others imported from their dotted path, each with its ``kwargs``, checked by :func:`check_options`), else
    ``task.reward``, else the task's built-in reward (batched where the task has one: ``reward_fn``).

    Raises:
        ValueError: a reward cannot be imported, an option is unknown, or an answer-based built-in reward is asked
            of a data-set task without an answer column (``task.answer_column: null``).
    """
    no_answers = getattr(task, "answer_column", "answer") is None
    if cfg.rewards:
        terms = []
        for i, r in enumerate(cfg.rewards):
            fn = BUILTINS[r.fn] if r.fn in BUILTINS else resolve_reward(r.fn)
            check_options(fn, r.kwargs, f"task.rewards[{i}].kwargs")
            if no_answers and r.fn in ANSWER_REWARDS:
                raise ValueError(answer_problem(f"task.rewards[{i}]", r.fn))
            if r.kwargs:
                fn = functools.partial(fn, **r.kwargs)
            terms.append(RewardTerm(r.label, fn, float(r.weight), batched=True))
        return RewardSet(terms)
    if cfg.reward:
        return RewardSet([RewardTerm("reward", resolve_reward(cfg.reward), 1.0, batched=False)])
    batched = getattr(task, "reward_fn", None)
    if no_answers and getattr(batched, "__name__", None) in ANSWER_REWARDS:
        raise ValueError(answer_problem("the task's built-in reward", batched.__name__))
    return RewardSet([RewardTerm("reward", batched or task.reward, 1.0, batched=batched is not None)])
