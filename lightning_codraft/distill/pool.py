"""The warm start's small source: a pool of the policy's own samples, drawn in the run and not cached.

:func:`fit_on_pool` fits any drafter on it through its term's warm-start loss (``DraftTerm.warm_start_loss``:
EAGLE-3's through the module's override points, DFlash's on anchors redrawn every pass).

The other source is the cached corpus of distill/warmstart.py; both fit the draft by the one fit loop
(:func:`~lightning_codraft.distill.fit.fit_loop`). Here each step runs a FROZEN policy without gradient on one
packed batch of the pool (capturing tap 0, the draft's taps and the soft-target logits), then the drafter's loss,
exactly as in co-training.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from lightning_codraft.batch import RLBatch
from lightning_codraft.distill.fit import fit_loop
from lightning_codraft.distill.settings import WarmStartConfig
from lightning_codraft.models.vocab import build_vocab_mapping
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine

POOL_SEED = 2 * 10**6
"""Seed offset of the pool's prompts and samples (the RL steps never use it)."""


def pool_prompts(config: WarmStartConfig) -> int:
    """How many prompts the pool answers: ``min(steps, 8)`` batches (at least one) of ``batch_size``."""
    return config.batch_size * max(1, min(config.steps, 8))


def sample_pool(
    policy,
    draft,
    prompts: Sequence[list[int]],
    config: WarmStartConfig,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    stop_ids: Sequence[int],
    pad_id: int,
) -> list[RLBatch]:
    """Packed batches of the policy's OWN samples of ``prompts`` (the draft learns the distribution it will serve).

    Args:
        policy, draft: the modules (with a draft vocabulary smaller than the policy's, the draft's vocabulary map
            is rebuilt from the pool's token counts).
        prompts: the pool's prompt ids (:func:`pool_prompts` of them), each leaving room for ``max_new_tokens``.
        config: ``batch_size`` sequences per batch.
        max_new_tokens, temperature, top_p, seed, stop_ids: how the rollouts sample.
        pad_id: the tokenizer's padding id.

    Returns:
        ``ceil(len(kept) / batch_size)`` next-token-aligned batches of the non-empty responses.
    """
    outs = SpeculativeEngine(policy, None, 0).generate(
        list(prompts),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        stop_token_ids=list(stop_ids),
    )
    kept = [(p, list(o.token_ids)) for p, o in zip(prompts, outs) if o.token_ids]
    V = policy.config.vocab_size
    draft_vocab = getattr(draft.config, "draft_vocab_size", None)  # a block drafter uses the policy's head
    if draft_vocab is not None and draft_vocab < V:
        ids = torch.tensor([t for p, c in kept for t in p + c])
        d2t, t2d = build_vocab_mapping(torch.bincount(ids, minlength=V), draft_vocab)
        draft.set_vocab_mapping(d2t, t2d)
    bs = config.batch_size
    return [
        RLBatch.pack(
            [p for p, _ in chunk],
            [c for _, c in chunk],
            [[0.0] * len(c) for _, c in chunk],
            [0.0] * len(chunk),
            multiple_of=2,
            pad_id=pad_id,
        )
        for chunk in (kept[i : i + bs] for i in range(0, len(kept), bs))
    ]


def fit_on_pool(
    module,
    batches: Sequence[RLBatch],
    steps: int,
    lr: float,
    on_step: Callable[[int, float, list[float]], None] | None = None,
) -> list[float]:
    """Fit ``module.draft`` to ``module.policy`` (frozen) on ``batches``, cycled over.

    Args:
        module: a single-process :class:`~lightning_codraft.training.module.CoDraftModule`.
        batches: packed next-token-aligned batches (:func:`sample_pool`).
        steps: optimizer steps.
        lr: AdamW learning rate of the draft (cosine decay to 10%).
        on_step: called with ``(step, loss, top-1 accuracy of every position)`` (EAGLE-3's unroll steps, a
            block's positions).

    Returns:
        The draft loss of every step.
    """
    if steps <= 0:
        return []
    if not batches:
        raise ValueError("fit_on_pool needs at least one batch")
    params = list(module.draft.parameters())  # all of them: a draft frozen for RL (draft.mode=frozen) too
    flags = [p.requires_grad for p in params]
    steps_done = itertools.count()

    def loss(batch: RLBatch):
        return module.draft_term.warm_start_loss(module, batch, next(steps_done))

    def report(i, out):
        if on_step is not None:
            on_step(i, float(out.loss.detach()), out.accuracy.tolist())

    try:
        for p in params:
            p.requires_grad_(True)
        return fit_loop(params, itertools.cycle(batches), loss, steps, lr, betas=(0.9, 0.98), on_step=report).losses
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
