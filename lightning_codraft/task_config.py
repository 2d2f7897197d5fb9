"""The ``task`` section of a recipe: where prompts come from and how completions are rewarded.

Part of the run configuration (lightning_codraft/config.py); a module of its own so the configuration of tasks and
rewards reads in one place. :meth:`TaskConfig.check` is the section's check, like every section's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

REWARD_BUILTINS = ("exact_answer", "math_equivalence", "format_match", "length_penalty")
"""Names of the built-in rewards (rl/tasks/reward_funcs.py ``BUILTINS``; this module imports nothing of the library)."""
ANSWER_REWARDS = ("exact_answer", "math_equivalence")
"""The built-ins that score against the reference answer: they need ``task.answer_column``."""
STYLES = ("symbols", "words")
"""How the arithmetic task's worked solutions are written (rl/tasks/arithmetic.py reads them from here)."""
TASKS = ("arithmetic", "gsm8k", "dataset")
"""The task names of ``task.name``."""
RETIRED = {
    ("on_reward_error", "warn"): "'warn' scored a failed reward 0 and trained on it; use 'raise' (the "
    "default) or 'skip' (the sample is left out, within "
    "task.reward_failure_budget)"
}
"""Values that changed meaning: ``(field, old value) -> what to write instead``."""


@dataclass
class RewardTermConfig:
    """One entry of ``task.rewards``."""

    fn: str = "math_equivalence"
    """A built-in reward (``exact_answer``, ``math_equivalence``, ``format_match``, ``length_penalty``) or the
    dotted path ``package.module:function`` of one with TRL's signature ``fn(prompts, completions, **columns)``."""
    weight: float = 1.0
    """Its weight in the sample's reward."""
    name: Optional[str] = None
    """The name its scores are logged under (``reward/<name>``); null: the function's name."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword options passed to the function on every call (e.g. ``{max_chars: 200}`` for ``length_penalty``)."""

    @property
    def label(self) -> str:
        """:attr:`name`, or the function's last dotted component."""
        return self.name or self.fn.replace(":", ".").rsplit(".", 1)[-1]


@dataclass
class TaskConfig:
    name: str = "arithmetic"
    """``arithmetic`` (built-in, generated on the fly), ``gsm8k``, or ``dataset`` (prompts from any data set:
    ``source`` with ``prompt_column`` / ``answer_column`` / ``template``)."""
    source: str = "excerpt"
    """GSM8K: a JSONL path, ``excerpt`` (bundled 200 problems) or a hub name such as ``openai/gsm8k``. ``dataset``:
    a local ``.json`` / ``.jsonl`` / ``.parquet`` / ``.csv`` file, a directory, or a hub name (read with
    Hugging Face ``datasets``)."""
    split: str = "train"
    """``dataset`` / GSM8K from the hub: the split RL draws from."""
    subset: Optional[str] = None
    """``dataset`` from the hub: its configuration (GSM8K: ``main``)."""
    prompt_column: str = "prompt"
    """``dataset``: the column holding the prompt."""
    answer_column: Optional[str] = "answer"
    """``dataset``: the column holding the reference answer (rewards get it as ``answer``; null: none). Every other
    column reaches batched rewards under its own name."""
    template: Optional[str] = None
    """``dataset``: the prompt text as ``str.format`` over the row's columns, e.g. ``"Question: {question}\nAnswer:"``
    (null: the prompt column as it is). The tokenizer's chat template is applied on top, as for every task."""
    solution_column: Optional[str] = None
    """``dataset``: the column holding a worked solution, for the SFT warm-up (null: none; then ``sft.steps`` must
    be 0)."""
    eval_source: Optional[str] = None
    """``dataset``: held-out rows from this file / hub name (same split) instead of the tail of ``source``."""
    limit: Optional[int] = None
    """GSM8K / ``dataset``: use the first ``limit`` problems."""
    heldout: Optional[int] = None
    """GSM8K / ``dataset``: the last ``heldout`` problems are reserved: RL never draws them; the evaluation prompts
    and the final speed-up measurement come from them (null: ``eval_prompts``). A ``draft.warm_start.corpus`` must
    hold out at least as many (its ``heldout_prompts``), so the draft never trains on them either."""
    min_terms: int = 2
    """Arithmetic only: fewest operands per problem."""
    max_terms: int = 3
    """Arithmetic only: most operands per problem."""
    max_operand: int = 9
    """Arithmetic only: operands are drawn from 0..max_operand."""
    styles: list[str] = field(default_factory=lambda: ["symbols"])
    """Arithmetic only: styles of the worked solutions the SFT warm-up teaches, among ``symbols``
    (``3+4=7,7-2=5#5``) and ``words`` (``3 plus 4 is 7, 7 minus 2 is 5#5``)."""
    style_weights: Optional[list[float]] = None
    """Arithmetic only: how often each of ``styles`` is drawn (null: uniform)."""
    required_style: Optional[str] = None
    """Arithmetic only: the built-in reward scores a correct answer only when the whole completion is written in
    this style (null: any). With SFT on mostly one style and RL requiring the other, the policy drifts
    (benchmarks/drift.py)."""
    reward: Optional[str] = None
    """Dotted path ``package.module:function`` of a reward ``fn(prompt, completion, answer) -> float``; null = the
    task's built-in reward. A reward that raises or returns anything but one finite number fails."""
    rewards: Optional[list[RewardTermConfig]] = None
    """Weighted reward functions with TRL's batched signature (``fn(prompts, completions, **columns) -> list``):
    a sample's reward is the weighted sum, each function's mean is logged as ``reward/<name>``. Instead of
    ``reward``; null: ``reward`` or the task's built-in one."""
    on_reward_error: str = "raise"
    """``raise``: stop (exit 3, resumable); ``skip``: leave the sample out of advantages and loss, log it."""
    reward_failure_budget: float = 0.05
    """``skip`` only: the share of a step's samples that may fail before the run stops."""
    eval_prompts: int = 64
    """Held-out prompts scored greedily before and after training (0 = skip)."""
    eval_every: int = 0
    """Every N RL steps also score the same held-out prompts during training: greedy accuracy and the reward of one
    sample per prompt at the rollout temperature (fixed seeds), logged as ``eval_accuracy`` / ``eval_reward`` (NaN
    on other steps). Unlike the step's reward, which is measured on that step's own prompts, these compare steps
    on one fixed set. 0 = only before and after RL."""
    eval_set: str = "heldout"
    """Which fixed set those evaluations score: ``heldout`` (what a run reports) or ``validation`` (another fixed draw
    of the generated task that no step trains on, for choosing settings without looking at the held-out set;
    ``arithmetic`` only: a data set's reserved rows are its held-out set)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range (relative to ``task``) and the fix."""
        for key, choices in (
            ("name", TASKS),
            ("on_reward_error", ("raise", "skip")),
            ("eval_set", ("heldout", "validation")),
        ):
            v = getattr(self, key)
            if (key, v) in RETIRED:
                raise ValueError(f"{key}={v!r} is retired: {RETIRED[key, v]}")
            if v not in choices:
                raise ValueError(f"{key}={v!r} is not one of {choices}")
        if self.name == "arithmetic" and not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(
                f"min_terms={self.min_terms} and max_terms={self.max_terms}: need 2 <= min_terms <= max_terms"
            )
        for style in [*self.styles, self.required_style]:
            if style is not None and style not in STYLES:
                raise ValueError(f"styles / required_style: {style!r} is not one of {STYLES}")
        if not self.styles:
            raise ValueError(f"styles is empty; give at least one of {STYLES}")
        w = self.style_weights
        if w is not None and (len(w) != len(self.styles) or min(w) < 0 or sum(w) <= 0):
            raise ValueError(
                f"style_weights={list(w)} needs one weight >= 0 per entry of styles={list(self.styles)}, not all 0"
            )
        if not 0 <= self.reward_failure_budget < 1:
            raise ValueError(f"reward_failure_budget={self.reward_failure_budget} must be in [0, 1)")
        for key, low in (("eval_every", 0), ("heldout", 0), ("limit", 1)):
            if getattr(self, key) is not None and getattr(self, key) < low:
                raise ValueError(f"{key}={getattr(self, key)} must be >= {low}" + (" (or null)" if low else ""))
        self._check_rewards()
        if self.eval_set == "validation" and self.name != "arithmetic":
            raise ValueError(
                f"eval_set=validation needs a generated task (arithmetic); name={self.name!r} holds out "
                "its reserved rows only: use eval_set=heldout"
            )
        if self.name == "dataset" and self.source == "excerpt":
            raise ValueError(
                "name=dataset needs source: a .json / .jsonl / .parquet / .csv file, a directory or a "
                "hub name ('excerpt' is GSM8K's bundled file)"
            )

    def _check_rewards(self) -> None:
        """``reward`` / ``rewards``: one of them, each entry's function named, answers where a reward needs them."""
        if self.rewards is not None:
            if self.reward is not None:
                raise ValueError("reward and rewards are both set; give the single reward as one entry of rewards")
            if not self.rewards:
                raise ValueError(
                    "rewards is empty; give at least one {fn, weight} entry, or null for the built-in reward"
                )
            labels = [r.label for r in self.rewards]
            for i, r in enumerate(self.rewards):
                if not math.isfinite(r.weight):
                    raise ValueError(f"rewards[{i}].weight={r.weight} must be a finite number")
                if ":" not in r.fn and "." not in r.fn and r.fn not in REWARD_BUILTINS:
                    raise ValueError(
                        f"rewards[{i}].fn={r.fn!r} is neither a built-in reward {REWARD_BUILTINS} nor "
                        f"a dotted path 'package.module:function'"
                    )
                if labels.count(r.label) > 1:
                    raise ValueError(f"rewards[{i}]: the name {r.label!r} repeats; give each entry a distinct `name`")
        if self.name == "dataset" and self.answer_column is None:
            for i, r in enumerate(self.rewards or ()):
                if r.fn in ANSWER_REWARDS:
                    raise ValueError(answer_problem(f"rewards[{i}]", r.fn, key="answer_column"))
            if not self.rewards and self.reward is None:
                raise ValueError(answer_problem("the task's built-in reward", "math_equivalence", key="answer_column"))


def answer_problem(what: str, fn: str, key: str = "task.answer_column") -> str:
    """The message refusing the answer-based reward ``fn`` (``what``: where it is set) on a task without answers
    (``key``: how the message names the answer column)."""
    return (
        f"{what} ({fn}) scores against the reference answer, but {key} is null: name the column holding the "
        f"answers, or use rewards that need none (format_match, length_penalty, your own)"
    )
