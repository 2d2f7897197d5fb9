"""Check what a run will touch before it launches, in a second and without torch: the task's data file parses
(a bad record is named by file and line), its columns are there, every reward imports and scores one sample, the
loggers' packages are installed, and no setting makes GRPO learn nothing (a greedy ``rl.temperature``).

``codraft fit --dry-run`` and the start of every ``codraft fit`` call :func:`preflight`; a problem is a message
naming the recipe key or the file and line, and the CLI exits 2 on any. Only local JSON Lines files are read here
(other formats and hub data sets are checked when the run loads them, through ``datasets``).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Optional

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.models.tokenizer import CharTokenizer
from lightning_codraft.rl.reports.extra_loggers import logger_class
from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask, TaskSample
from lightning_codraft.rl.tasks.dataset import RowFormat, file_format, is_conversational, solution_column
from lightning_codraft.rl.tasks.gsm8k import GSM8K_FORMAT, gsm8k_source
from lightning_codraft.rl.tasks.reward_funcs import BUILTINS
from lightning_codraft.rl.tasks.rewards import build_reward
from lightning_codraft.run_config import warm_weights

SCANNED_ROWS = 100_000
"""JSON Lines rows checked before launch (each parsed, its columns looked up)."""


def row_format(cfg: CoDraftConfig) -> RowFormat:
    """How the recipe's data-set task reads a row (GSM8K's own format, or the recipe's columns)."""
    t = cfg.task
    if t.name == "gsm8k":
        return GSM8K_FORMAT
    return RowFormat(
        t.prompt_column,
        t.answer_column,
        t.template,
        solution_fn=None if t.solution_column is None else solution_column(t.solution_column),
    )


def check_jsonl(path: Path, cfg: CoDraftConfig) -> tuple[list[str], Optional[TaskSample], int]:
    """``(problems, the first row's sample, rows read)`` of a JSON Lines data file (gzipped too): every line one JSON
    object that the task reads as a sample (:class:`RowFormat`; at most :data:`SCANNED_ROWS` lines; the first problem
    is reported) whose prompt the tiny model's tokenizer can encode."""
    fmt, first, rows = row_format(cfg), None, 0
    chars = CharTokenizer() if cfg.model.source == "tiny" else None
    with (gzip.open if path.suffix.lower() == ".gz" else open)(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if lineno > SCANNED_ROWS:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                return [f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})"], first, rows
            if not isinstance(row, dict):
                return [f"{path}:{lineno}: a {type(row).__name__}, not a JSON object with columns"], first, rows
            try:
                sample = fmt.sample(row, f"{path}:{lineno}")
            except ValueError as e:
                return [str(e)], first, rows
            if chars is not None and not is_conversational(sample):
                try:
                    chars.encode(sample.prompt)
                except ValueError as e:
                    return [f"{path}:{lineno}: {e}"], first, rows
            first, rows = first if first is not None else sample, rows + 1
    return ([] if first is not None else [f"{path}: no rows"]), first, rows


def heldout_problem(cfg: CoDraftConfig, rows: int, path: Path) -> list[str]:
    """The held-out rows (``task.heldout``, else ``task.eval_prompts``) taking every one of ``rows`` training rows."""
    t = cfg.task
    heldout = t.eval_prompts if t.heldout is None else t.heldout
    if t.eval_source is not None or heldout < min(rows, t.limit or rows):
        return []
    return [
        f"task.heldout={heldout} holds out every one of the {rows} rows of {path} (task.heldout, or "
        f"task.eval_prompts when it is null): lower it or add rows, so some are left to train on"
    ]


def renders_chat(cfg: CoDraftConfig) -> Optional[bool]:
    """Whether the recipe's tokenizer has a chat template, read without loading it (None: cannot tell here)."""
    source = cfg.model.source
    if source == "tiny":
        return False
    if source == "smollm2-135m":
        return True
    path = Path(source).expanduser()
    config = path / "tokenizer_config.json"
    if (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file():
        return True
    if config.is_file():
        try:
            return bool(json.loads(config.read_text()).get("chat_template"))
        except (OSError, ValueError):
            return None
    return None


def _reward_key(cfg: CoDraftConfig, name: str) -> str:
    for i, r in enumerate(cfg.task.rewards or ()):
        if r.label == name:
            return f"task.rewards[{i}] ({r.fn})"
    return f"task.reward ({cfg.task.reward})" if cfg.task.reward else "the task's built-in reward"


def preflight(cfg: CoDraftConfig) -> list[str]:
    """What would fail once the run started (see the module docstring); empty when nothing would."""
    t, problems, sample = cfg.task, [], None
    if not cfg.rl.temperature > 0:  # valid for a test of the mechanics (greedy rollouts), never for a real run
        problems.append(
            f"rl.temperature={cfg.rl.temperature} makes every sample of a group the same (greedy): "
            f"GRPO's advantages are then all 0 and the policy learns nothing; use a temperature > 0 "
            f"(e.g. 1.0)"
        )
    ref, init = cfg.draft.reference, cfg.run.init_from
    if cfg.draft.mode == "cotrain" and ref not in ("start", "none") and not warm_weights(ref).is_file():
        problems.append(
            f"draft.reference={ref!r}: no weights.pt there; point it at the 'warm' directory of an "
            f"earlier run (or its weights.pt), or use start / none"
        )
    if init and not warm_weights(init).is_file():
        problems.append(
            f"run.init_from={init!r}: no weights.pt there; point it at the 'warm' directory of an earlier "
            f"run (or its weights.pt)"
        )
    for i, entry in enumerate(cfg.run.loggers):
        try:
            logger_class(entry, i)
        except ValueError as e:
            problems.append(str(e))
    if t.name in ("gsm8k", "dataset"):
        path = Path(gsm8k_source(t.source) if t.name == "gsm8k" else t.source).expanduser()
        if file_format(path) is not None and not path.is_file():
            return problems + [f"task.source: the data file {str(path)!r} does not exist"]
        if path.name.lower().endswith((".jsonl", ".jsonl.gz")):
            bad_rows, sample, rows = check_jsonl(path, cfg)
            if bad_rows:
                return problems + bad_rows
            problems += heldout_problem(cfg, rows, path)  # the rewards are still checked on the first row
    try:
        rewards = build_reward(t, _BuiltinReward(t.name))
    except ValueError as e:  # an import failed: resolve_reward names the path
        return problems + [f"{'task.rewards' if t.rewards else 'task.reward'}: {e}"]
    if sample is not None and is_conversational(sample) and renders_chat(cfg) is False:
        problems.append(
            f"task.prompt_column={t.prompt_column!r} holds chat messages (TRL's conversational form) but "
            f"the tokenizer of model.source={cfg.model.source!r} has no chat template to render them"
        )
    if t.name == "arithmetic":
        sample = ArithmeticTask(
            min_terms=t.min_terms, max_terms=t.max_terms, max_operand=t.max_operand, styles=tuple(t.styles)
        ).sample(1, seed=0)[0]
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
