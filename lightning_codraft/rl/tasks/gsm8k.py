"""GSM8K: one configuration of the data-set task, and its answer extraction.

Problems come from a local JSONL file (fields ``question`` and ``answer``, the final number after ``#### ``) or, for
users who are online, from the hub (``openai/gsm8k``, config ``main``), both read with ``datasets``
(rl/tasks/dataset.py). A 200-problem excerpt of the training split ships with the package (:data:`EXCERPT_PATH`, MIT).
The reward is math equivalence (math-verify, rl/tasks/reward_funcs.py); :func:`gsm8k_reward` is the earlier exact
final-number check, kept for recipes that name it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lightning_codraft.rl.tasks.arithmetic import TaskSample
from lightning_codraft.rl.tasks.dataset import DatasetTask, RowFormat, file_format
from lightning_codraft.rl.tasks.reward_funcs import math_equivalence

EXCERPT_PATH = Path(__file__).parent / "data" / "gsm8k_excerpt.jsonl"
TRAIN_PATH = Path(__file__).parent / "data" / "gsm8k_train.jsonl.gz"
BUNDLED = {"excerpt": EXCERPT_PATH, "train": TRAIN_PATH}
"""The GSM8K files shipped with the package, by the ``task.source`` that names them: the first 200 problems of the
training split, and the whole split (7,473 problems, gzipped): a fresh clone runs the GSM8K recipes offline."""


def gsm8k_source(source: str | os.PathLike) -> str:
    """The file or hub name ``source`` stands for (``excerpt`` and ``train``: :data:`BUNDLED`)."""
    return str(BUNDLED.get(str(source), source))


PROMPT_TEMPLATE = "Question: {question}\nAnswer:"

_FINAL_RE = re.compile(r"####\s*([-+$0-9.,]+)")
_NUMBER_RE = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _normalise_number(text: str) -> str | None:
    t = text.strip().replace(",", "").replace("$", "").rstrip(".")
    if not t:
        return None
    try:
        v = float(t)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else repr(v)


def extract_answer(text: str) -> str | None:
    """The final numeric answer of a GSM8K-style text, normalised (``"1,200.00"`` -> ``"1200"``).

    Takes the number after ``####`` when present, else the last number in the text; None if there is none.
    """
    m = _FINAL_RE.search(text)
    if m is not None:
        got = _normalise_number(m.group(1))
        if got is not None:
            return got
    nums = _NUMBER_RE.findall(text)
    return _normalise_number(nums[-1]) if nums else None


def gsm8k_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the reference answer numerically, else 0.0."""
    got = extract_answer(completion)
    ref = extract_answer(answer)
    if ref is None:
        raise ValueError(f"reference answer {answer!r} has no number")
    return 1.0 if got is not None and got == ref else 0.0


def _solution(row: dict) -> str:
    return " " + row["answer"]


GSM8K_FORMAT = RowFormat(
    prompt_column="question",
    answer_column="answer",
    template=PROMPT_TEMPLATE,
    answer_fn=extract_answer,
    solution_fn=_solution,
)
"""How a GSM8K row becomes a sample: the question through :data:`PROMPT_TEMPLATE`, the answer's final number, the
worked answer as the solution."""


class GSM8KTask(DatasetTask):
    """GSM8K as one configuration of :class:`~lightning_codraft.rl.tasks.dataset.DatasetTask`: the ``question`` column
    through :data:`PROMPT_TEMPLATE`, the reference answer the final number of the ``answer`` column
    (:func:`extract_answer`), the worked solution that column itself, the reward math equivalence
    (``reward_funcs.math_equivalence``, math-verify).

    Args:
        source: a local JSONL path, ``"excerpt"`` / ``"train"`` (the bundled excerpt / training split) or a hub
            name (``openai/gsm8k``, read with its ``main`` configuration).
        split: the hub split (ignored for local files).
        limit: use only the first ``limit`` problems.
        heldout: the last ``heldout`` problems are reserved: :meth:`sample` never draws them and
            :meth:`heldout_samples` returns them, so evaluation (and a speed-up measured on them) uses problems
            neither the policy nor the draft trained on.
        template: the prompt format, over the row's columns.
    """

    def __init__(
        self,
        source: str | os.PathLike = "excerpt",
        split: str = "train",
        limit: int | None = None,
        heldout: int = 0,
        template: str = PROMPT_TEMPLATE,
    ):
        src = gsm8k_source(source)
        local = file_format(src) is not None or os.path.exists(src)
        f = GSM8K_FORMAT
        super().__init__(
            source=src,
            prompt_column=f.prompt_column,
            answer_column=f.answer_column,
            template=template,
            split=split,
            subset=None if local else "main",
            limit=limit,
            heldout=heldout,
            answer_fn=f.answer_fn,
            solution_fn=f.solution_fn,
            reward_fn=math_equivalence,
        )


def load_gsm8k(
    source: str | os.PathLike = EXCERPT_PATH,
    split: str = "train",
    limit: int | None = None,
    template: str = PROMPT_TEMPLATE,
) -> list[TaskSample]:
    """GSM8K problems as :class:`TaskSample` items (:class:`GSM8KTask`'s ``samples``): ``prompt`` = the template
    applied, ``answer`` = the normalised final number, ``solution`` = ``" " + answer text`` (worked steps ending in
    ``#### N``)."""
    return GSM8KTask(source, split, limit, template=template).samples
