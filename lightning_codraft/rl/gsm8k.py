"""GSM8K prompts and a numeric answer verifier.

Problems come from a local JSONL file (fields ``question`` and ``answer``, the final number after
``#### ``) or, for users who are online, from the hub through ``datasets`` (``openai/gsm8k``, config
``main``). A 200-problem excerpt of the training split ships with the package (:data:`EXCERPT_PATH`, MIT).
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from lightning_codraft.rl.tasks import TaskSample

EXCERPT_PATH = Path(__file__).parent / "data" / "gsm8k_excerpt.jsonl"
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


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{lineno} lacks 'question'/'answer' fields (has {sorted(row)})")
            rows.append(row)
    return rows


def load_gsm8k(source: str | os.PathLike = EXCERPT_PATH, split: str = "train", limit: int | None = None,
               template: str = PROMPT_TEMPLATE) -> list[TaskSample]:
    """Load GSM8K problems as :class:`TaskSample` items.

    Args:
        source: a local ``.jsonl`` path, ``"excerpt"`` for the bundled excerpt, or a hub dataset name
            (``"openai/gsm8k"``) read with ``datasets.load_dataset(name, "main", split=split)``.
        split: the hub split (ignored for local files).
        limit: keep only the first ``limit`` problems.
        template: prompt format with a ``{question}`` field.

    Returns:
        One sample per problem: ``prompt`` = template applied, ``answer`` = the normalised final number,
        ``solution`` = ``" " + answer text`` (worked steps ending in ``#### N``).
    """
    src = str(source)
    if src == "excerpt":
        src = str(EXCERPT_PATH)
    if src.endswith(".jsonl") or os.path.exists(src):
        if not os.path.exists(src):
            raise FileNotFoundError(f"GSM8K file {src!r} does not exist; pass a JSONL path, 'excerpt' or "
                                    f"'openai/gsm8k'")
        rows = _read_jsonl(Path(src))
    else:
        try:
            import datasets  # optional: only the hub path needs it
        except ImportError as e:
            raise ImportError(f"GSM8K source {src!r} is a hub dataset, which needs the `datasets` package: "
                              f'pip install "lightning_codraft[hub]" (or use a local JSONL path / "excerpt")') from e

        rows = list(datasets.load_dataset(src, "main", split=split))
    if limit is not None:
        rows = rows[:limit]
    out = []
    for row in rows:
        ans = extract_answer(row["answer"])
        if ans is None:
            raise ValueError(f"GSM8K answer has no final number: {row['answer'][-80:]!r}")
        out.append(TaskSample(prompt=template.format(question=row["question"]), answer=ans,
                              solution=" " + row["answer"]))
    if not out:
        raise ValueError(f"no GSM8K problems loaded from {src!r} (limit={limit})")
    return out


@dataclass
class GSM8KTask:
    """GSM8K as a task: ``sample(n, seed)`` draws training problems, ``reward`` verifies the final number.

    Attributes:
        source: local JSONL path, ``"excerpt"`` or a hub name (see :func:`load_gsm8k`).
        split: hub split.
        limit: use only the first ``limit`` problems.
        heldout: the last ``heldout`` problems are reserved: :meth:`sample` never draws them and
            :meth:`heldout_samples` returns them, so evaluation (and a speed-up measured on them) uses problems
            neither the policy nor the draft trained on.
    """

    source: str = "excerpt"
    split: str = "train"
    limit: int | None = None
    heldout: int = 0
    samples: list[TaskSample] = field(init=False, repr=False)

    def __post_init__(self):
        self.samples = load_gsm8k(self.source, self.split, self.limit)
        if not 0 <= self.heldout < len(self.samples):
            raise ValueError(f"heldout={self.heldout} must be in [0, {len(self.samples)}): the {self.source!r} "
                             f"problems (limit={self.limit}) must leave at least one to train on")

    @property
    def num_train(self) -> int:
        """Problems :meth:`sample` draws from (the first ``len(samples) - heldout``)."""
        return len(self.samples) - self.heldout

    def sample(self, n: int, seed: int) -> list[TaskSample]:
        """``n`` training problems drawn without replacement (reshuffled once exhausted), a pure function of
        ``seed``; never one of the held-out tail."""
        rng = random.Random(seed)
        idx = []
        while len(idx) < n:
            perm = list(range(self.num_train))
            rng.shuffle(perm)
            idx.extend(perm)
        return [self.samples[i] for i in idx[:n]]

    def heldout_samples(self, n: int) -> list[TaskSample]:
        """The first ``n`` held-out problems (a fixed set: the same ones every call)."""
        if n > self.heldout:
            raise ValueError(f"{n} held-out problems asked for, but the task holds out heldout={self.heldout}; "
                             f"raise task.heldout")
        return self.samples[self.num_train:self.num_train + n]

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        """:func:`gsm8k_reward`."""
        return gsm8k_reward(prompt, completion, answer)
