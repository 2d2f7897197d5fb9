"""What a run reports, and how runs compare.

- ``run_log``: metrics.csv, TensorBoard, the progress display and PNG plots (``MetricsLogger``);
- ``extra_loggers``: the Lightning loggers a recipe names (``run.loggers``), light to import;
- ``compare``: arms run side by side from the same seeds; ``stats``: their paired statistics.
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.rl.reports.compare import compare_arms, write_report
    from lightning_codraft.rl.reports.run_log import MetricsLogger, read_metrics
    from lightning_codraft.rl.reports.stats import paired_difference

_LAZY = {
    "MetricsLogger": "lightning_codraft.rl.reports.run_log",
    "read_metrics": "lightning_codraft.rl.reports.run_log",
    "compare_arms": "lightning_codraft.rl.reports.compare",
    "write_report": "lightning_codraft.rl.reports.compare",
    "paired_difference": "lightning_codraft.rl.reports.stats",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
