"""Built-in reward functions, with TRL's batched signature.

Every reward of ``task.rewards`` is called once per batch as ``fn(prompts, completions, **columns)``: ``prompts``
and ``completions`` are lists of strings, one per sample, and ``columns`` holds the task's reference ``answer`` and
every other column of the data set (``rl.tasks.dataset``), each a list aligned with the samples; the function returns a
list with one finite number per sample (TRL's ``reward_funcs`` convention, so a TRL reward works unchanged). The
built-ins below are named in a recipe by their key in :data:`BUILTINS`; their keyword options come from the
reward's ``kwargs``.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Optional

from lightning_codraft.task_config import REWARD_BUILTINS


def _final_answer(text: str) -> str:
    """The completion's final answer as written: after the last ``####`` or ``#`` marker, else inside the last
    ``\\boxed{...}``, else the last line; stripped."""
    for marker in ("####", "#"):
        if marker in text:
            tail = text.rsplit(marker, 1)[1].strip()
            return tail.splitlines()[0].strip() if tail else ""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        return boxed[-1].strip()
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _reference(a) -> str:
    """A reference answer, stripped; ``ValueError`` for an empty one (a data problem, reported with its sample)."""
    ref = "" if a is None else str(a).strip()
    if not ref:
        raise ValueError(f"the reference answer {a!r} is empty: an answer-based reward needs task.answer_column")
    return ref


def exact_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_) -> list[float]:
    """1.0 where the completion's final answer (after the last ``####`` / ``#``, else the last ``\\boxed{}``,
    else its last line) equals the reference ``answer`` character for character after stripping, else 0.0. An empty
    final answer never matches; an empty reference raises ``ValueError``."""
    refs = [_reference(a) for a in answer]
    return [1.0 if _final_answer(completion_text(c)) == ref else 0.0 for c, ref in zip(completions, refs)]


def _math_verify():
    try:
        import math_verify  # the maintained math-answer verifier (Hugging Face); a dependency of the package
    except ImportError as e:  # pragma: no cover - installed with the package
        raise ImportError("the math_equivalence reward needs math-verify: pip install 'math-verify[antlr4_9_3]'") from e
    return math_verify


def math_equivalence(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_) -> list[float]:
    """1.0 where the completion's answer is mathematically equal to the reference ``answer``, else 0.0.

    Both are parsed by ``math-verify`` (LaTeX, fractions, numbers with separators, percentages, ``\\boxed{}``;
    in a completion it takes the boxed answer, an anchored "the answer is", or the last expression), then compared
    symbolically: ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are equal, ``1,200`` equals ``1200``, ``-3`` is not ``3``.
    A reference math-verify cannot parse raises ``ValueError`` (a data problem, reported with the sample)."""
    mv = _math_verify()
    timeout: Optional[int] = 5 if threading.current_thread() is threading.main_thread() else None  # signal-based
    out = []
    for c, a in zip(completions, answer):
        gold = mv.parse(_reference(a), parsing_timeout=timeout)
        if not gold:
            raise ValueError(f"the reference answer {a!r} is not a mathematical expression math-verify can parse")
        guess = mv.parse(completion_text(c), parsing_timeout=timeout)
        out.append(1.0 if guess and mv.verify(gold, guess, timeout_seconds=timeout) else 0.0)
    return out


def format_match(
    prompts: Sequence[str], completions: Sequence[str], pattern: str = r"(?s).*#\s*-?\d+\s*", full: bool = True, **_
) -> list[float]:
    """1.0 where the completion matches the regular expression ``pattern`` (``full``: the whole stripped
    completion, else anywhere in it), else 0.0: a format check (e.g. ``"<think>.*</think>.*"``)."""
    rx = re.compile(pattern)
    match = rx.fullmatch if full else rx.search
    return [1.0 if match(completion_text(c).strip()) else 0.0 for c in completions]


def length_penalty(prompts: Sequence[str], completions: Sequence[str], max_chars: int = 512, **_) -> list[float]:
    """Length shaping: 0.0 for a completion of at most ``max_chars`` characters, falling linearly to -1.0 at twice
    that length (and staying there)."""
    if max_chars <= 0:
        raise ValueError(f"length_penalty: max_chars={max_chars} must be > 0")
    return [-min(1.0, max(0, len(completion_text(c)) - max_chars) / max_chars) for c in completions]


def completion_text(completion) -> str:
    """A completion's text: itself, or the content of its messages in TRL's conversational form
    (``[{"role": "assistant", "content": ...}]``)."""
    if isinstance(completion, (list, tuple)):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return completion


BUILTINS = {name: globals()[name] for name in REWARD_BUILTINS}
"""The built-in rewards by the name a recipe gives them in ``task.rewards[].fn`` (the names are task_config's, which
the recipe's checks read without importing this module)."""
