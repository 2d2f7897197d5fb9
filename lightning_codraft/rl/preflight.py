"""Check what a run will touch before it launches, in a second and without torch: the task's data file parses
(a bad record is named by file and line), its columns are there, every reward imports and scores one sample, the
loggers' packages are installed, and no setting makes GRPO learn nothing (a greedy ``rl.temperature``).

``codraft fit --dry-run`` and the start of every ``codraft fit`` call :func:`preflight`; a problem is a message
naming the recipe key or the file and line, and the CLI exits 2 on any. Only local JSON Lines files are read here
(other formats and hub data sets are checked when the run loads them, through ``datasets``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.rl.gsm8k import EXCERPT_PATH, PROMPT_TEMPLATE, extract_answer
from lightning_codraft.rl.loggers import logger_class
from lightning_codraft.rl.reward_funcs import BUILTINS
from lightning_codraft.rl.rewards import build_reward
from lightning_codraft.rl.tasks import ArithmeticTask, TaskSample

SCANNED_ROWS = 100_000
"""JSON Lines rows checked before launch (each parsed, its columns looked up)."""


def _columns(cfg: CoDraftConfig) -> tuple[str, Optional[str], Optional[str], Optional[str]]:
    """``(prompt, answer, solution, template)`` columns of the recipe's data-set task."""
    t = cfg.task
    if t.name == "gsm8k":
        return "question", "answer", "answer", PROMPT_TEMPLATE
    return t.prompt_column, t.answer_column, t.solution_column, t.template


def check_jsonl(path: Path, cfg: CoDraftConfig) -> tuple[list[str], Optional[dict[str, Any]]]:
    """``(problems, first row)`` of a JSON Lines data file: every line one JSON object holding the recipe's
    columns (at most :data:`SCANNED_ROWS` lines are read; the first problem of each kind is reported)."""
    prompt, answer, solution, template = _columns(cfg)
    needed = [c for c in (prompt if template is None else None, answer, solution) if c is not None]
    problems, first = [], None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if lineno > SCANNED_ROWS:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return [f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"], first
            if not isinstance(row, dict):
                return [f"{path}:{lineno}: a {type(row).__name__}, not a JSON object with columns"], first
            missing = [c for c in needed if c not in row]
            if missing:
                return [f"{path}:{lineno}: no column {missing[0]!r} (task.prompt_column / answer_column / "
                        f"solution_column); the row has {sorted(row)}"], first
            if template is not None:
                try:
                    template.format(**row)
                except KeyError as e:
                    return [f"{path}:{lineno}: task.template {template!r} names the column {e.args[0]!r}, which "
                            f"the row does not have ({sorted(row)})"], first
            first = first if first is not None else row
    if first is None:
        problems.append(f"{path}: no rows")
    return problems, first


def _sample(cfg: CoDraftConfig, row: Optional[dict[str, Any]]) -> Optional[TaskSample]:
    """One sample of the task to score: the data file's first row, or a drawn arithmetic problem."""
    t = cfg.task
    if t.name == "arithmetic":
        return ArithmeticTask(min_terms=t.min_terms, max_terms=t.max_terms, max_operand=t.max_operand,
                              styles=tuple(t.styles)).sample(1, seed=0)[0]
    if row is None:
        return None
    prompt_col, answer_col, solution_col, template = _columns(cfg)
    answer = "" if answer_col is None else str(row[answer_col])
    if t.name == "gsm8k":
        answer = extract_answer(answer) or answer
    prompt = str(row[prompt_col]) if template is None else template.format(**row)
    return TaskSample(prompt=prompt, answer=answer, solution="" if solution_col is None else str(row[solution_col]),
                      columns=row)


def _reward_key(cfg: CoDraftConfig, name: str) -> str:
    for i, r in enumerate(cfg.task.rewards or ()):
        if r.label == name:
            return f"task.rewards[{i}] ({r.fn})"
    return f"task.reward ({cfg.task.reward})" if cfg.task.reward else "the task's built-in reward"


def preflight(cfg: CoDraftConfig) -> list[str]:
    """What would fail once the run started (see the module docstring); empty when nothing would."""
    t, problems, row = cfg.task, [], None
    if not cfg.rl.temperature > 0:  # valid for a test of the mechanics (greedy rollouts), never for a real run
        problems.append(f"rl.temperature={cfg.rl.temperature} makes every sample of a group the same (greedy): "
                        f"GRPO's advantages are then all 0 and the policy learns nothing; use a temperature > 0 "
                        f"(e.g. 1.0)")
    for i, entry in enumerate(cfg.run.loggers):
        try:
            logger_class(entry, i)
        except ValueError as e:
            problems.append(str(e))
    if t.name in ("gsm8k", "dataset"):
        source = str(EXCERPT_PATH) if (t.name == "gsm8k" and t.source == "excerpt") else t.source
        path = Path(source).expanduser()
        if path.suffix.lower() in (".json", ".jsonl", ".parquet", ".csv") and not path.is_file():
            return problems + [f"task.source: the data file {str(path)!r} does not exist"]
        if path.suffix.lower() == ".jsonl":
            bad_rows, row = check_jsonl(path, cfg)
            if bad_rows:
                return problems + bad_rows
    for i, r in enumerate(t.rewards or ()):
        if r.fn not in BUILTINS and ":" not in r.fn and "." not in r.fn:
            problems.append(f"task.rewards[{i}].fn={r.fn!r} is not a built-in reward {sorted(BUILTINS)}")
    try:
        rewards = build_reward(t, _BuiltinReward(t.name))
    except ValueError as e:  # an import failed: resolve_reward names the path
        return problems + [f"{'task.rewards' if t.rewards else 'task.reward'}: {e}"]
    sample = _sample(cfg, row)
    if sample is not None:
        completion = sample.solution or sample.answer
        scores = rewards.score([sample.prompt], [completion], [sample])
        for failure in scores.failures:
            name = failure.function.split(" (")[0]
            problems.append(f"{_reward_key(cfg, name)}: a one-sample call failed: {failure.reason}")
    return problems


class _BuiltinReward:
    """Stands in for the task while checking rewards: its built-in reward is the real one, built without loading
    data (math equivalence for data sets and GSM8K, the exact answer for arithmetic)."""

    def __init__(self, name: str):
        self.reward_fn = None if name == "arithmetic" else BUILTINS["math_equivalence"]
        self.reward = ArithmeticTask().reward
