"""Supervised fine-tuning of the policy before RL: it learns the task's answer format from worked solutions.

:func:`sft_warmup` trains a policy (e.g. one built from scratch) with cross-entropy on the completion rows of packed
``prompt + solution + eos`` documents (the next-token-aligned batch of
:func:`~lightning_codraft.rl.experience.sft_batch`). The draft's warm start is another job: rl/run/warm_start.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from lightning_codraft.batch import RLBatch
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rl.experience import sft_batch
from lightning_codraft.rl.tasks.arithmetic import TaskSample
from lightning_codraft.training.optim import adamw, cosine_decay

SFT_SEED = 3 * 10**6
"""Seed offset of the SFT's samples: step ``i`` of a run with seed ``s`` trains on ``sample(n, s * 7919 + SFT_SEED
+ i)``."""


def encode_samples(tokenizer, samples: Sequence[TaskSample]) -> tuple[list[list[int]], list[list[int]]]:
    """``(prompt_ids, solution_ids + [eos])`` of each sample."""
    prompts = [encode_prompt(tokenizer, s.prompt) for s in samples]
    sols = [tokenizer.encode(s.solution) + [tokenizer.eos_token_id] for s in samples]
    return prompts, sols


def completion_loss(policy, batch: RLBatch) -> torch.Tensor:
    """Mean next-token cross-entropy of ``policy`` on the batch's ``loss_mask`` rows (packed forward)."""
    out = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids)
    mask = batch.loss_mask > 0
    return F.cross_entropy(out.logits[mask].float(), batch.target_ids[mask])


def sft_warmup(
    policy,
    tokenizer,
    sample_fn: Callable[[int, int], list[TaskSample]],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    context: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
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
    opt = adamw(policy.parameters(), lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: cosine_decay(i / steps, 0.1))
    policy.train()
    losses = []
    for i in range(steps):
        prompts, sols = encode_samples(tokenizer, sample_fn(batch_size, seed + i))
        keep = [j for j in range(len(prompts)) if len(prompts[j]) + len(sols[j]) <= context]
        if not keep:
            raise ValueError(
                f"every SFT document is longer than the context {context}; raise model.max_position_embeddings"
            )
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
