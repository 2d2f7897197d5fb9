"""The optimisation half of :class:`~lightning_codraft.training.module.CoDraftModule`: parameter groups, learning-rate
schedules, the optimizer, and what happens to the gradients between backward and step.

A mixin of the module (it reads ``config``, ``policy``, ``draft``, ``parallel_dims``, ``pipeline``, ``sharding`` and
``train_draft_this_step``); a subclass overrides these like any module hook. The step that calls them is
``training.step.optimizer_step``, shared by the Trainer and Fabric.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_codraft.parallel.strategy_core import reduce_gradients
from lightning_codraft.training.optim import adamw, cosine_decay
from lightning_codraft.training.step import grad_norms


class OptimizationHooks:
    """Two AdamW parameter groups (policy, draft), each with its own learning rate and schedule."""

    def param_groups(self) -> list[dict[str, Any]]:
        """AdamW parameter groups: ``policy`` and (when trained) ``draft``, each with its own LR."""
        c = self.config
        groups = [
            {"name": "policy", "params": [p for p in self.policy.parameters() if p.requires_grad], "lr": c.policy_lr}
        ]
        if c.trains_draft:
            groups.append(
                {"name": "draft", "params": [p for p in self.draft.parameters() if p.requires_grad], "lr": c.draft_lr}
            )
        return groups

    def lr_lambda(self, group_name: str):
        """The schedule multiplier of group ``group_name`` as a function of the optimizer step."""
        c = self.config
        warmup = c.policy_lr_warmup_steps if group_name == "policy" else c.draft_lr_warmup_steps

        def fn(step: int) -> float:
            if warmup > 0 and step < warmup:
                return (step + 1) / warmup
            if c.schedule == "cosine":
                return cosine_decay((step - warmup) / max(1, c.total_steps - warmup))
            return 1.0

        return fn

    def build_optimizer(self) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        """One AdamW with two parameter groups (policy, draft) and one LambdaLR with a schedule per group.

        Call after the strategy set the module up, so that under PP only this stage's parameters are held.
        """
        c = self.config
        groups = self.param_groups()
        optimizer = adamw(groups, c.policy_lr, betas=c.betas, weight_decay=c.weight_decay, eps=c.adam_eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [self.lr_lambda(g["name"]) for g in groups])
        return optimizer, scheduler

    def configure_optimizers(self):
        """Trainer hook: :meth:`build_optimizer`, the scheduler stepped every optimizer step."""
        optimizer, scheduler = self.build_optimizer()
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def after_backward(self) -> dict[str, Tensor]:
        """Finish the gradients (under PP: summed over dp x cp), clip, and return ``grad_norm/{policy,draft}``."""
        dims = self.parallel_dims
        if self.pipeline is not None and self.sharding != "fsdp":  # FSDP2 reduced them in the backward
            reduce_gradients([p for p in self.parameters() if p.requires_grad], dims.dp_cp_group)
        groups = {"policy": self.policy.parameters()}
        if self.config.trains_draft and self.train_draft_this_step:
            groups["draft"] = self.draft.parameters()
        elif self.config.trains_draft:  # an off step: AdamW skips parameters without a gradient (none if not run)
            for p in self.draft.parameters():
                p.grad = None
        return grad_norms(groups, self.config.grad_clip, dims.pp_group)
