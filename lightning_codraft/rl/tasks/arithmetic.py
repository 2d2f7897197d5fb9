"""Built-in verifiable tasks: multi-step arithmetic generated on the fly, and a character tokenizer.

A task yields :class:`TaskSample` items (prompt text, reference answer, worked solution) and scores a
completion with an exact-answer reward. The arithmetic task is learnable by a tiny policy trained from
scratch: the worked solution spells each partial sum (``"3+4-2="`` -> ``"3+4=7,7-2=5#5"``), so most
completion tokens are copies a draft predicts well, and the final answer after ``#`` is checked exactly.

**Solution styles** make a policy that drifts, as RL post-training reshapes a model's style: the SFT solutions
mix ``symbols`` (``3+4=7,7-2=5#5``) and ``words`` (``3 plus 4 is 7, 7 minus 2 is 5#5``) with ``style_weights``,
and ``required_style`` makes the reward count only completions written in that style. A policy fine-tuned on
mostly-symbols solutions and then rewarded for words moves its whole output distribution to the style it rarely
used: the drift benchmark (benchmarks/drift.py) measures what that does to a frozen vs a co-trained draft.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_codraft.task_config import STYLES

#: A reward function: ``(prompt, completion, reference_answer) -> float``.
RewardFn = Callable[[str, str, str], float]


@dataclass(frozen=True)
class TaskSample:
    """One prompt of a verifiable task.

    Attributes:
        prompt: the text given to the policy, or a conversation in TRL's form (a list of ``{"role", "content"}``
            messages, rendered by the tokenizer's chat template).
        answer: the reference final answer the reward checks against (e.g. ``"5"``).
        solution: a correct completion (worked steps + answer) used by the SFT warm-up (may be empty for a data set
            without one).
        columns: the sample's other data-set columns, passed to batched rewards by name (rl/tasks/rewards.py).
    """

    prompt: Any
    answer: str
    solution: str
    columns: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)


_ANSWER_RE = re.compile(r"#\s*(-?\d+)")
_STEP = {"symbols": r"-?\d+[+-]\d+=-?\d+", "words": r"-?\d+ (?:plus|minus) \d+ is -?\d+"}
_STYLE_RE = {k: re.compile(f"{v}(?:{',' if k == 'symbols' else ', '}{v})*#-?\\d+") for k, v in _STEP.items()}


def solution_style(completion: str) -> str | None:
    """The style a completion is written in (``symbols`` / ``words``), or None when it follows neither."""
    text = completion.strip()
    for style, pattern in _STYLE_RE.items():
        if pattern.fullmatch(text):
            return style
    return None


def arithmetic_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the first integer after ``#`` in ``completion`` equals ``answer`` exactly, else 0.0."""
    m = _ANSWER_RE.search(completion)
    return 1.0 if m is not None and m.group(1) == answer.strip() else 0.0


@dataclass
class ArithmeticTask:
    """Multi-step integer addition / subtraction, e.g. prompt ``"7+5-3="``, solution ``"7+5=12,12-3=9#9"``.

    Attributes:
        min_terms: fewest operands in a problem (>= 2).
        max_terms: most operands in a problem.
        max_operand: operands are drawn uniformly from ``0..max_operand``.
        styles: the styles the worked solutions are written in (:data:`STYLES`).
        style_weights: how often each of ``styles`` is drawn for a solution (None: uniform).
        required_style: the reward counts a correct answer only in this style (None: any text with ``#answer``).
    """

    min_terms: int = 2
    max_terms: int = 3
    max_operand: int = 9
    styles: tuple[str, ...] = ("symbols",)
    style_weights: tuple[float, ...] | None = None
    required_style: str | None = None

    def __post_init__(self):
        if not 2 <= self.min_terms <= self.max_terms:
            raise ValueError(
                f"need 2 <= min_terms <= max_terms, got min_terms={self.min_terms}, max_terms={self.max_terms}"
            )
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        self.styles = tuple(self.styles)
        bad = [x for x in (*self.styles, self.required_style) if x is not None and x not in STYLES]
        if bad or not self.styles:
            raise ValueError(
                f"styles={list(self.styles)} / required_style={self.required_style!r}: every style must "
                f"be one of {STYLES} and styles non-empty"
            )
        if self.style_weights is not None:
            self.style_weights = tuple(float(w) for w in self.style_weights)
            if (
                len(self.style_weights) != len(self.styles)
                or min(self.style_weights) < 0
                or sum(self.style_weights) <= 0
            ):
                raise ValueError(
                    f"style_weights={list(self.style_weights)} needs one weight >= 0 per style "
                    f"{list(self.styles)}, not all 0"
                )

    def make(self, rng: random.Random) -> TaskSample:
        """Draw one problem with ``rng``."""
        n = rng.randint(self.min_terms, self.max_terms)
        nums = [rng.randint(0, self.max_operand) for _ in range(n)]
        ops = [rng.choice("+-") for _ in range(n - 1)]
        style = self.styles[0] if len(self.styles) == 1 else rng.choices(self.styles, self.style_weights)[0]
        prompt = str(nums[0]) + "".join(o + str(x) for o, x in zip(ops, nums[1:])) + "="
        acc, steps = nums[0], []
        for o, x in zip(ops, nums[1:]):
            new = acc + x if o == "+" else acc - x
            if style == "words":
                steps.append(f"{acc} {'plus' if o == '+' else 'minus'} {x} is {new}")
            else:
                steps.append(f"{acc}{o}{x}={new}")
            acc = new
        sep = ", " if style == "words" else ","
        return TaskSample(prompt=prompt, answer=str(acc), solution=sep.join(steps) + f"#{acc}")

    def sample(self, n: int, seed: int) -> list[TaskSample]:
        """``n`` problems, a pure function of ``seed`` (so a resumed run sees the same prompts)."""
        rng = random.Random(seed)
        return [self.make(rng) for _ in range(n)]

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        """The task's built-in exact-answer reward (:func:`arithmetic_reward`); with ``required_style``, only a
        completion written wholly in that style (:func:`solution_style`) can score."""
        if self.required_style is not None and solution_style(completion) != self.required_style:
            return 0.0
        return arithmetic_reward(prompt, completion, answer)
