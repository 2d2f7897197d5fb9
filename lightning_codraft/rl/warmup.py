"""Warm-ups before RL: supervised fine-tuning of the policy on the task, and the draft's offline warm-start.

* :func:`sft_warmup` teaches a policy trained from scratch the task's answer format: cross-entropy on the
  completion rows of packed ``prompt + solution + eos`` documents (the next-token-aligned batch of
  :func:`~lightning_codraft.rl.experience.sft_batch`).
* :func:`draft_warmup` fits the EAGLE-3 draft to the policy it will serve, on the policy's OWN samples and
  features (taps and logits of a frozen policy): the TTT loss of
  :func:`~lightning_codraft.training.draft_loss.ttt_draft_loss` through
  :meth:`~lightning_codraft.training.module.CoDraftModule.draft_step_loss`, the same code path as co-training.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from lightning_codraft.rl.build import encode_prompt
from lightning_codraft.rl.experience import sft_batch
from lightning_codraft.rl.tasks import TaskSample


def encode_samples(tokenizer, samples: Sequence[TaskSample]) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompt_ids, solution_ids + [eos])`` of each sample."""
    prompts = [encode_prompt(tokenizer, s.prompt) for s in samples]
    sols = [tokenizer.encode(s.solution) + [tokenizer.eos_token_id] for s in samples]
    return prompts, sols


def completion_loss(policy, batch: dict) -> torch.Tensor:
    """Mean next-token cross-entropy of ``policy`` on the batch's ``loss_mask`` rows (packed forward)."""
    out = policy(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], position_ids=batch["position_ids"])
    mask = batch["loss_mask"] > 0
    return F.cross_entropy(out.logits[mask].float(), batch["target_ids"][mask])


def sft_warmup(policy, tokenizer, sample_fn: Callable[[int, int], list[TaskSample]], steps: int,
               batch_size: int, lr: float, seed: int, context: int,
               on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Supervised warm-up of ``policy`` on worked solutions.

    Args:
        policy: the :class:`~lightning_codraft.models.Policy`, trained in place.
        tokenizer: the project's tokenizer protocol.
        sample_fn: ``sample_fn(n, seed) -> samples`` (a task's ``sample``).
        steps, batch_size, lr: AdamW steps, sequences per step, learning rate (cosine decay to 10%).
        seed: step ``i`` trains on ``sample_fn(batch_size, seed + i)``.
        context: documents longer than this are dropped.
        on_step: called with ``(step, loss)`` after every step (progress display).

    Returns:
        The loss of every step.
    """
    if steps <= 0:
        return []
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    policy.train()
    losses = []
    for i in range(steps):
        prompts, sols = encode_samples(tokenizer, sample_fn(batch_size, seed + i))
        keep = [j for j in range(len(prompts)) if len(prompts[j]) + len(sols[j]) <= context]
        if not keep:
            raise ValueError(f"every SFT document is longer than the context {context}; raise "
                             f"model.max_position_embeddings")
        batch = sft_batch([prompts[j] for j in keep], [sols[j] for j in keep], pad_id=tokenizer.pad_token_id)
        loss = completion_loss(policy, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(i, losses[-1])
    return losses


def draft_warmup(module, batches: Sequence[dict], steps: int, lr: float,
                 on_step: Callable[[int, float, float], None] | None = None) -> list[float]:
    """Offline warm-start of ``module.draft`` on a FROZEN policy's own features.

    Each step runs the policy without gradient on one packed batch (capturing the draft's taps and the
    soft-target logits), then the draft's TTT unroll and loss through the module's own override points
    (:meth:`CoDraftModule.draft_step_logits`, :meth:`CoDraftModule.draft_loss`), exactly as in co-training.

    Args:
        module: a single-process :class:`~lightning_codraft.training.module.CoDraftModule`.
        batches: packed next-token-aligned batches (e.g. the policy's own samples); cycled over.
        steps: optimizer steps.
        lr: AdamW learning rate of the draft (cosine decay to 10%).
        on_step: called with ``(step, loss, top-1 accuracy of unroll step 0)``.

    Returns:
        The draft loss of every step.
    """
    if steps <= 0:
        return []
    if not batches:
        raise ValueError("draft_warmup needs at least one batch")
    draft, policy = module.draft, module.policy
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    taps = module.configure_taps()
    losses = []
    for i in range(steps):
        batch = batches[i % len(batches)]
        with torch.no_grad():
            out = policy(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], position_ids=batch["position_ids"],
                         taps=taps)
        step_logits = module.draft_step_logits([t.detach() for t in out.taps], batch)
        d = module.draft_loss(step_logits, out.logits.detach(), batch)
        opt.zero_grad(set_to_none=True)
        d.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(d.loss.detach()))
        if on_step is not None:
            on_step(i, losses[-1], float(d.accuracy[0]))
    return losses
