"""Run outputs: per-step metrics (``metrics.csv``, TensorBoard, any Lightning logger), rich progress, PNG plots.

``metrics.csv`` is the run's record (:class:`MetricsFile`): rows are appended as steps end and nothing is ever
deleted before what replaces it is on disk. On resume the rows of the steps after the checkpoint (which the resumed
run recomputes) are replaced, so a resumed run's file equals an uninterrupted one's (time columns aside); a column
that appears later (a reward added on resume) extends the header and earlier rows keep their values, empty in the
new column; TensorBoard purges the events after the checkpoint's step. ``completions.jsonl`` follows the same rule.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from lightning.fabric.loggers import TensorBoardLogger
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from lightning_codraft.rl.step_metrics import COLUMNS, StepMetrics
from lightning_codraft.run_config import replace_file


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.csv as dicts of floats (empty cells are NaN)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [
            {k: (float(v) if v not in ("", None) else math.nan) for k, v in row.items()} for row in csv.DictReader(f)
        ]


class MetricsFile:
    """An append-only CSV of per-step rows (see the module docstring).

    Args:
        path: the file.
        columns: the columns this run writes; the file's existing columns are kept (first, in their order).
        resume_step: keep the existing rows with ``step <= resume_step`` (0: start a new file).
    """

    def __init__(self, path: Path, columns: Sequence[str], resume_step: int = 0):
        self.path = path
        old_columns: list[str] = []
        if resume_step and path.exists():
            with open(path, newline="") as f:
                old_columns = list(csv.DictReader(f).fieldnames or [])
        self.rows = [r for r in read_metrics(path) if r["step"] <= resume_step] if resume_step else []
        self.columns = [*old_columns, *(c for c in columns if c not in old_columns)]
        self._rewrite()

    def _rewrite(self) -> None:
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=self.columns)
        writer.writeheader()
        writer.writerows(self._cells(r) for r in self.rows)
        replace_file(self.path, text.getvalue())

    def _cells(self, row: Mapping[str, float]) -> dict[str, Any]:
        return {
            k: (
                ""
                if row.get(k) is None or (isinstance(row[k], float) and math.isnan(row[k]))
                else (int(row[k]) if k == "step" else row[k])
            )
            for k in self.columns
        }

    def append(self, row: Mapping[str, float]) -> None:
        """Append one row; a column the file lacks extends its header (the file is rewritten whole, atomically)."""
        self.rows.append(dict(row))
        if set(row) - set(self.columns):
            self.columns += [k for k in row if k not in self.columns]
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(self._cells(row))


class MetricsLogger:
    """One row per RL step into ``out_dir/metrics.csv`` (:class:`MetricsFile`), ``out_dir/tb`` and more Lightning
    loggers.

    Args:
        out_dir: run directory.
        tensorboard: also write TensorBoard scalars (``rl/<column>``) under ``out_dir/tb``.
        resume_step: keep only existing rows with ``step <= resume_step`` (0 = start a fresh file).
        extra_columns: columns beyond :data:`~lightning_codraft.rl.step.COLUMNS` (the ``reward/<name>`` of each of
            ``task.rewards``).
        loggers: more Lightning loggers the rows also go to (``build_loggers``: ``run.loggers``).
        completions: completions of every step kept in ``out_dir/completions.jsonl`` (``run.log_completions``; cut
            back to ``resume_step`` like metrics.csv) and shown as a table (:meth:`log_completions`).

    Attributes:
        rows: every row of the run so far (kept ones included), as dicts of floats.
    """

    def __init__(
        self,
        out_dir: str | Path,
        tensorboard: bool = True,
        resume_step: int = 0,
        extra_columns: Sequence[str] = (),
        loggers: Sequence[Any] = (),
        completions: int = 0,
    ):
        self.columns = (*COLUMNS, *extra_columns)
        self.loggers = list(loggers)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.completions, self.completions_path = int(completions), out_dir / "completions.jsonl"
        if self.completions > 0:  # a resumed run's file equals an uninterrupted one's
            old = (
                self.completions_path.read_text().splitlines() if resume_step and self.completions_path.exists() else []
            )
            replace_file(
                self.completions_path,
                "".join(line + "\n" for line in old if line.strip() and json.loads(line)["step"] <= resume_step),
            )
        self.file = MetricsFile(out_dir / "metrics.csv", self.columns, resume_step)
        self.tb: Optional[TensorBoardLogger] = None
        if tensorboard:
            self.tb = TensorBoardLogger(
                root_dir=out_dir,
                name="tb",
                version="",
                default_hp_metric=False,
                purge_step=resume_step + 1 if resume_step else None,
            )
        self.rows: list[dict[str, float]] = [{k: r.get(k, math.nan) for k in self.file.columns} for r in self.file.rows]

    @property
    def path(self) -> Path:
        return self.file.path

    def _write(self, row: Mapping[str, float]) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"unknown metric(s) {sorted(unknown)}; metrics.csv has columns {self.columns}")
        values = {k: float(row[k]) if row.get(k) is not None else math.nan for k in self.columns}
        step = int(values.pop("step"))
        self.file.append({"step": float(step), **values})
        if self.tb is not None:
            self.tb.log_metrics({f"rl/{k}": v for k, v in values.items() if not math.isnan(v)}, step=step)
        for logger in self.loggers:
            logger.log_metrics({k: v for k, v in values.items() if not math.isnan(v)}, step=step)
        self.rows.append({"step": float(step), **values})

    def log(self, metrics: StepMetrics | Mapping[str, float]) -> None:
        """Write one step's row (``step`` is required; unknown keys are rejected)."""
        self._write(metrics.as_dict() if isinstance(metrics, StepMetrics) else metrics)

    def log_completions(self, step: int, samples: Sequence[Mapping]) -> None:
        """The first ``completions`` of a step's ``samples`` (prompt, completion, reward, each reward's): appended
        to completions.jsonl with their ``step``, and as a table in TensorBoard's text tab (``completions``) and in
        every extra logger that has one (``log_text``, e.g. W&B)."""
        picked = list(samples)[: self.completions]
        if not picked:
            return
        with open(self.completions_path, "a") as f:
            f.writelines(
                json.dumps(
                    {"step": step, **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in s.items()}}
                )
                + "\n"
                for s in picked
            )
        rows = [{k: ("" if v is None else v) for k, v in s.items()} for s in picked]
        keys = list(rows[0])
        table = "\n".join(
            [
                "| " + " | ".join(keys) + " |",
                "|" + "---|" * len(keys),
                *(
                    "| " + " | ".join(str(r[k]).replace("|", "\\|").replace("\n", " ") for k in keys) + " |"
                    for r in rows
                ),
            ]
        )
        if self.tb is not None:
            self.tb.experiment.add_text("completions", table, global_step=step)
        for logger in self.loggers:
            if callable(getattr(logger, "log_text", None)):
                logger.log_text(key="completions", columns=keys, data=[[r[k] for k in keys] for r in rows], step=step)

    def close(self) -> None:
        for logger in self.loggers:
            logger.finalize("success")
        if self.tb is not None:
            self.tb.finalize("success")


def plot_curves(
    series: Mapping[str, Sequence[Mapping[str, float]]],
    path: str | Path,
    keys: Sequence[str] = ("reward", "acceptance_length"),
    title: str = "",
) -> Path:
    """One PNG with a panel per metric in ``keys``, one line per run in ``series`` (label -> rows)."""
    import matplotlib  # here, not at the top: selecting the Agg backend must not happen on import of the package

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for label, rows in series.items():
            pts = [(r["step"], r[key]) for r in rows if key in r and not math.isnan(r[key])]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=label)
        ax.set_xlabel("RL step")
        ax.set_ylabel(key.replace("_", " "))
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class StepProgress:
    """A rich progress bar over RL steps showing reward, acceptance length and tokens/s (or plain lines)."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, description: str = "GRPO"):
        self.enabled = enabled
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}  accept {task.fields[accept]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(),
                transient=False,
            )
            self._task = self._progress.add_task(
                description, total=total, completed=start, reward="-", accept="-", tps="-"
            )

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, metrics: Mapping[str, float]) -> None:
        reward, acc, tps = metrics.get("reward"), metrics.get("acceptance_length"), metrics.get("tokens_per_s")
        if self._progress is not None:
            self._progress.update(self._task, advance=1, reward=f"{reward:.3f}", accept=f"{acc:.2f}", tps=f"{tps:.0f}")
        else:
            print(
                f"step {int(metrics['step'])}: reward {reward:.3f}  acceptance length {acc:.2f}  {tps:.0f} tok/s",
                flush=True,
            )

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()


def summarize(rows: Iterable[Mapping[str, float]], key: str, head: int = 3) -> tuple[float, float]:
    """Mean of ``key`` over the first and over the last ``head`` rows (smooths single-step noise)."""
    vals = [r[key] for r in rows if not math.isnan(r[key])]
    if not vals:
        return math.nan, math.nan
    n = max(1, min(head, len(vals) // 2 or 1))
    return sum(vals[:n]) / n, sum(vals[-n:]) / n


def plot_run(rows: Sequence[Mapping[str, float]], out: Path, mode: str, task: str) -> None:
    """A finished run's plots: ``out/curves.png`` (reward and acceptance length per step) and, where the live A/B
    scored a reference draft, ``out/ab.png`` (the engine's acceptance and the two implied ones)."""
    plot_curves({mode: rows}, out / "curves.png", title=f"{task}: reward and acceptance length per RL step")
    if any(math.isfinite(r.get("reference_acceptance", math.nan)) for r in rows):
        series = (
            ("engine, live draft", "acceptance_length"),
            ("implied, live draft", "implied_acceptance"),
            ("implied, reference draft", "reference_acceptance"),
        )
        ab = {label: [{"step": r["step"], "acceptance": r[key]} for r in rows] for label, key in series}
        plot_curves(ab, out / "ab.png", keys=("acceptance",), title="the live A/B")
