"""The memory plan (``codraft plan``): per-rank bytes of a recipe's training and rollout phases, from its models
built on the meta device, its mesh, sharding and precision (see docs/design/architecture.md, "Memory plan")."""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.plan.memory import Line, MemoryPlan, RankPlan, plan_memory, plan_rank
    from lightning_codraft.plan.report import format_bytes, parse_bytes, plan_dict, render_text
    from lightning_codraft.plan.spec import PlanSpec
    from lightning_codraft.plan.state import MetaModels, StateBytes, state_bytes

_LAZY = {
    "PlanSpec": "lightning_codraft.plan.spec",
    "MetaModels": "lightning_codraft.plan.state",
    "StateBytes": "lightning_codraft.plan.state",
    "state_bytes": "lightning_codraft.plan.state",
    "Line": "lightning_codraft.plan.memory",
    "RankPlan": "lightning_codraft.plan.memory",
    "MemoryPlan": "lightning_codraft.plan.memory",
    "plan_rank": "lightning_codraft.plan.memory",
    "plan_memory": "lightning_codraft.plan.memory",
    "parse_bytes": "lightning_codraft.plan.report",
    "format_bytes": "lightning_codraft.plan.report",
    "render_text": "lightning_codraft.plan.report",
    "plan_dict": "lightning_codraft.plan.report",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
