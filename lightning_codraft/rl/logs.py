"""Run outputs: per-step CSV + TensorBoard metrics, rich progress, and PNG plots at the end.

The CSV (``metrics.csv``) is the run's record; on resume it is cut back to the checkpointed step so a
resumed run's file equals an uninterrupted one's (time columns aside).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

#: Columns of metrics.csv, in order. Missing values are written empty.
COLUMNS = (
    "step", "reward", "reward_std", "accuracy", "acceptance_length", "acceptance_rate", "draft_loss",
    "draft_acc0", "policy_loss", "clip_frac", "kl", "completion_tokens", "reward_failures", "rollout_s",
    "train_s", "sync_s", "step_s", "tokens_per_s",
)
#: Columns that depend on wall time (excluded when comparing a resumed run with an uninterrupted one).
TIME_COLUMNS = ("rollout_s", "train_s", "sync_s", "step_s", "tokens_per_s")


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """Rows of a metrics.csv as dicts of floats (empty cells are NaN)."""
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [{k: (float(v) if v != "" else math.nan) for k, v in row.items()} for row in csv.DictReader(f)]


class MetricsLogger:
    """Append one row per RL step to ``out_dir/metrics.csv`` and, optionally, TensorBoard.

    Args:
        out_dir: run directory.
        tensorboard: also write TensorBoard scalars under ``out_dir/tb``.
        resume_step: keep only existing rows with ``step <= resume_step`` (0 = start a fresh file).
    """

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_step: int = 0):
        self.path = Path(out_dir) / "metrics.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step else []
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for r in kept:
                w.writerow({k: _fmt(r.get(k)) for k in COLUMNS})
        self.rows = kept
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(out_dir) / "tb"), purge_step=resume_step + 1 if resume_step else None)

    def log(self, metrics: Mapping[str, float]) -> None:
        """Write one row; ``metrics["step"]`` is required, unknown keys are rejected."""
        unknown = set(metrics) - set(COLUMNS)
        if unknown:
            raise KeyError(f"unknown metric(s) {sorted(unknown)}; metrics.csv has columns {COLUMNS}")
        row = {k: float(metrics[k]) if k in metrics and metrics[k] is not None else math.nan for k in COLUMNS}
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=COLUMNS).writerow({k: _fmt(v) for k, v in row.items()})
        self.rows.append(row)
        if self._tb is not None:
            step = int(row["step"])
            for k, v in row.items():
                if k != "step" and not math.isnan(v):
                    self._tb.add_scalar(f"rl/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return repr(float(v))


def plot_curves(series: Mapping[str, Sequence[Mapping[str, float]]], path: str | Path,
                keys: Sequence[str] = ("reward", "acceptance_length"), title: str = "") -> Path:
    """One PNG with a panel per metric in ``keys``, one line per run in ``series`` (label -> rows)."""
    import matplotlib

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
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("reward {task.fields[reward]}  accept {task.fields[accept]}  {task.fields[tps]} tok/s"),
                TimeElapsedColumn(), transient=False)
            self._task = self._progress.add_task(description, total=total, completed=start, reward="-",
                                                 accept="-", tps="-")

    def __enter__(self) -> "StepProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, metrics: Mapping[str, float]) -> None:
        reward, acc, tps = metrics.get("reward"), metrics.get("acceptance_length"), metrics.get("tokens_per_s")
        if self._progress is not None:
            self._progress.update(self._task, advance=1, reward=f"{reward:.3f}", accept=f"{acc:.2f}",
                                  tps=f"{tps:.0f}")
        else:
            print(f"step {int(metrics['step'])}: reward {reward:.3f}  acceptance length {acc:.2f}  "
                  f"{tps:.0f} tok/s", flush=True)

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
