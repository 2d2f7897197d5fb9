"""A task over a data set of prompts: local JSON / JSONL / parquet / CSV files or a hub data set, read with Hugging
Face ``datasets``, with a mapping of which column is the prompt, which the reference answer; every other column
travels with its sample to the rewards (rl/tasks/rewards.py).

``task.name: dataset`` in a recipe builds one (rl/run/build.py); GSM8K is one configuration of it (rl/tasks/gsm8k.py).
Sampling is a pure function of the seed, and the last ``heldout`` rows (or the rows of ``eval_source``) are
reserved for evaluation, never drawn for training.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_codraft.rl.tasks.arithmetic import TaskSample
from lightning_codraft.rl.tasks.reward_funcs import math_equivalence

FILE_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
"""File suffixes a local source may have, and the ``datasets`` builder that reads each (JSON, JSON Lines and CSV
also gzipped: ``.jsonl.gz``)."""


def file_format(source) -> Optional[str]:
    """The ``datasets`` builder of a local file ``source`` by its suffix (:data:`FILE_FORMATS`), else None."""
    suffixes = [x.lower() for x in Path(str(source)).suffixes]
    if suffixes[-1:] == [".gz"] and suffixes[-2:-1] != [".parquet"]:
        suffixes = suffixes[:-1]
    return FILE_FORMATS.get(suffixes[-1]) if suffixes else None


def _datasets():
    try:
        import datasets  # a dependency of the package; imported here, when a data set is read
    except ImportError as e:  # pragma: no cover - installed with the package
        raise ImportError("a data-set task needs the `datasets` package: pip install datasets") from e
    return datasets


def load_rows(source, split: str = "train", subset: Optional[str] = None) -> list[dict[str, Any]]:
    """The rows of ``source`` as dicts: a local file (by its suffix, :data:`FILE_FORMATS`), a local directory
    ``datasets`` can read, a hub name (``subset``: its configuration; needs network access), or, from Python, a
    ``datasets.Dataset`` object (or a list of row dicts) itself.

    Raises:
        FileNotFoundError: ``source`` looks like a file (a known suffix) that does not exist.
        ValueError: the hub data set could not be loaded (offline, unknown name or split).
    """
    if not isinstance(source, (str, Path)):  # a datasets.Dataset (or any iterable of row dicts) given in Python
        rows = [dict(row) for row in source]
        if rows and not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"task.source: a {type(source).__name__} whose rows are not dicts of columns")
        return rows
    path = Path(source).expanduser()
    ds = _datasets()
    if file_format(path) is not None:
        if not path.is_file():
            raise FileNotFoundError(f"data file {str(path)!r} does not exist (task.source)")
        data = ds.load_dataset(file_format(path), data_files=str(path), split="train")
    elif path.is_dir():
        data = ds.load_dataset(str(path), subset, split=split)
    else:
        try:
            data = ds.load_dataset(source, subset, split=split)
        except Exception as e:  # noqa: BLE001 - hub errors take many types; say which source and what to do
            raise ValueError(
                f"could not load the data set {source!r} (subset {subset!r}, split {split!r}): "
                f"{type(e).__name__}: {e}. task.source must be a local .json/.jsonl/.parquet/.csv "
                f"file, a directory, or a hub name reachable from this machine"
            ) from e
    return [dict(row) for row in data]


def solution_column(name: str) -> Callable[[dict], str]:
    """A ``solution_fn`` reading the worked solution from column ``name``."""

    def solution(row: dict) -> str:
        if name not in row:
            raise ValueError(f"no column {name!r} (task.solution_column); the columns are {sorted(row)}")
        return str(row[name])

    return solution


@dataclass(frozen=True)
class RowFormat:
    """How a data set's row becomes a :class:`TaskSample` (the same for a run and for the checks before launch)."""

    prompt_column: str = "prompt"
    """The column holding the prompt (its text, unless ``template`` says otherwise)."""
    answer_column: Optional[str] = "answer"
    """The column holding the reference answer (None: no answer; rewards see ``answer=""``)."""
    template: Optional[str] = None
    """The prompt text, ``str.format`` over the row's columns; None: the prompt column as it is."""
    answer_fn: Optional[Callable[[str], Optional[str]]] = None
    """Maps the answer column's text to the reference answer (e.g. GSM8K's final number)."""
    solution_fn: Optional[Callable[[dict], str]] = None
    """The worked solution of a row for the SFT warm-up (None: ``""``)."""

    def sample(self, row: dict, where: str) -> TaskSample:
        """``row`` as a sample; ``ValueError`` naming ``where`` (e.g. ``"'data.jsonl' row 3"``) and the row's
        columns when a column is missing, the template names another, or the answer has no reference in it."""
        needed = [c for c in (self.prompt_column, self.answer_column) if c is not None]
        missing = [c for c in needed if c not in row]
        if missing:
            raise ValueError(
                f"{where} has no column {missing[0]!r} (task.prompt_column / task.answer_column); its "
                f"columns are {sorted(row)}"
            )
        raw = row[self.prompt_column]
        if isinstance(raw, (list, tuple)):  # TRL's conversational form: rendered by the chat template, not repr'd
            if self.template is not None:
                raise ValueError(
                    f"{where}: task.template formats text, but column {self.prompt_column!r} holds chat "
                    f"messages; drop the template (the tokenizer's chat template renders them)"
                )
            return TaskSample(
                prompt=chat_messages(raw, f"{where} column {self.prompt_column!r}"),
                answer=self._answer(row, where),
                solution=self._solution(row),
                columns=row,
            )
        if not isinstance(raw, str) and self.template is None:
            raise ValueError(
                f"{where}: column {self.prompt_column!r} holds a value of type {type(raw).__name__} "
                f"({raw!r}), not a prompt text or a list of chat messages"
            )
        try:
            prompt = raw if self.template is None else self.template.format(**row)
        except KeyError as e:
            raise ValueError(
                f"task.template {self.template!r} names the column {e.args[0]!r}, which {where} does "
                f"not have; its columns are {sorted(row)}"
            ) from None
        return TaskSample(prompt=prompt, answer=self._answer(row, where), solution=self._solution(row), columns=row)

    def _answer(self, row: dict, where: str) -> str:
        answer = "" if self.answer_column is None else str(row[self.answer_column])
        if self.answer_fn is not None:
            got = self.answer_fn(answer)
            if got is None:
                raise ValueError(f"{where}: no reference answer in {answer[-80:]!r}")
            answer = got
        return answer

    def _solution(self, row: dict) -> str:
        return self.solution_fn(row) if self.solution_fn is not None else ""


def chat_messages(value, where: str) -> list[dict[str, str]]:
    """``value`` as a conversation in TRL's form (a non-empty list of ``{"role": str, "content": str}``); a
    ``ValueError`` naming ``where`` and the first bad message otherwise."""
    if not value:
        raise ValueError(f"{where} is an empty list of chat messages")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {i} is {m!r}; a chat message is {{'role': str, 'content': str}}")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def is_conversational(sample: TaskSample) -> bool:
    """Whether ``sample``'s prompt is a conversation (TRL's conversational form) rather than a text."""
    return isinstance(sample.prompt, (list, tuple))


@dataclass
class DatasetTask:
    """Prompts and reference answers from a data set (see the module docstring).

    Attributes:
        source: a local file / directory, a hub name, or a ``datasets.Dataset`` object (:func:`load_rows`).
        prompt_column: the column holding the prompt (used by ``template``'s default).
        answer_column: the column holding the reference answer (None: no answer; rewards see ``answer=""``).
        template: the prompt text, ``str.format`` over the row's columns (e.g. ``"Question: {question}\\nAnswer:"``);
            None: the prompt column as it is.
        split, subset: the hub split and configuration (local files: ignored).
        limit: use only the first ``limit`` rows.
        heldout: reserve the last ``heldout`` rows for evaluation.
        eval_source: evaluation rows from another file / split instead (then ``heldout`` counts its rows).
        answer_fn: maps the answer column's text to the reference answer (e.g. GSM8K's final number).
        solution_fn: the worked solution of a row for the SFT warm-up (default: none, ``""``).
        reward_fn: the task's built-in batched reward (TRL signature), used when the recipe names none.
    """

    source: Any
    prompt_column: str = "prompt"
    answer_column: Optional[str] = "answer"
    template: Optional[str] = None
    split: str = "train"
    subset: Optional[str] = None
    limit: Optional[int] = None
    heldout: int = 0
    eval_source: Optional[str] = None
    answer_fn: Optional[Callable[[str], Optional[str]]] = None
    solution_fn: Optional[Callable[[dict], str]] = None
    reward_fn: Callable = math_equivalence
    samples: list[TaskSample] = field(init=False, repr=False)
    eval_samples: list[TaskSample] = field(init=False, repr=False)

    def __post_init__(self):
        rows = load_rows(self.source, self.split, self.subset)
        if self.limit is not None:
            rows = rows[: self.limit]
        if not rows:
            raise ValueError(f"no rows in {self.where} (split {self.split!r}, limit={self.limit})")
        fmt = self.format
        self.samples = [fmt.sample(row, f"{self.where} row {i}") for i, row in enumerate(rows)]
        if self.eval_source is not None:
            self.eval_samples = [
                fmt.sample(r, f"{self.eval_source!r} row {i}")
                for i, r in enumerate(load_rows(self.eval_source, self.split, self.subset))
            ]
            if self.heldout > len(self.eval_samples):
                raise ValueError(
                    f"heldout={self.heldout} exceeds the {len(self.eval_samples)} rows of "
                    f"eval_source {self.eval_source!r}"
                )
            return
        if not 0 <= self.heldout < len(self.samples):
            raise ValueError(
                f"heldout={self.heldout} must be in [0, {len(self.samples)}): the {len(self.samples)} "
                f"rows of {self.where} (limit={self.limit}) must leave at least one to train on"
            )
        self.eval_samples = self.samples[len(self.samples) - self.heldout :]

    @property
    def where(self) -> str:
        """How messages name the source: its path or hub name, or the kind of object given in Python."""
        return (
            repr(str(self.source))
            if isinstance(self.source, (str, Path))
            else f"the {type(self.source).__name__} given as the task"
        )

    @property
    def format(self) -> RowFormat:
        """How this task's rows become samples."""
        return RowFormat(self.prompt_column, self.answer_column, self.template, self.answer_fn, self.solution_fn)

    @property
    def num_train(self) -> int:
        """Rows :meth:`sample` draws from."""
        return len(self.samples) - (0 if self.eval_source is not None else self.heldout)

    def sample(self, n: int, seed: int) -> list[TaskSample]:
        """``n`` training rows drawn without replacement (reshuffled once exhausted), a pure function of ``seed``;
        never a held-out one."""
        rng = random.Random(seed)
        idx: list[int] = []
        while len(idx) < n:
            perm = list(range(self.num_train))
            rng.shuffle(perm)
            idx.extend(perm)
        return [self.samples[i] for i in idx[:n]]

    def heldout_samples(self, n: int) -> list[TaskSample]:
        """The first ``n`` held-out rows (a fixed set: the same ones every call)."""
        if n > self.heldout:
            raise ValueError(
                f"{n} held-out problems asked for, but the task holds out heldout={self.heldout}; raise task.heldout"
            )
        return self.eval_samples[:n]

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        """The built-in reward of one sample (``reward_fn`` on a batch of one)."""
        return self.reward_fn([prompt], [completion], answer=[answer])[0]
