"""A run: its two front ends and what they share.

- ``loop``: the Fabric loop (``codraft fit``: :func:`fit`, :class:`CoDraftRun`); ``trainer``: the same RL step inside
  ``lightning.pytorch.Trainer.fit``. Siblings: neither imports the other; both build with ``build``, warm up with
  ``warm_start`` (``sft``, and distill/'s draft warm start) and keep their state in ``run_dir``;
- ``build``: the run's objects from a validated recipe; ``preflight``: the checks before launch;
- ``run_dir``: the run directory's checkpoints and warm weights, and the trained models out of it;
- ``evaluate``: greedy accuracy on the held-out prompts and the final rollout speed-up.
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.rl.run.loop import CoDraftRun, FitResult, fit
    from lightning_codraft.rl.run.run_dir import RunCheckpoints, export_run, load_run
    from lightning_codraft.rl.run.trainer import GRPOModule

_LAZY = {
    "fit": "lightning_codraft.rl.run.loop",
    "CoDraftRun": "lightning_codraft.rl.run.loop",
    "FitResult": "lightning_codraft.rl.run.loop",
    "GRPOModule": "lightning_codraft.rl.run.trainer",
    "load_run": "lightning_codraft.rl.run.run_dir",
    "export_run": "lightning_codraft.rl.run.run_dir",
    "RunCheckpoints": "lightning_codraft.rl.run.run_dir",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
