"""Warm-ups before RL: supervised fine-tuning of the policy on the task, and the draft's offline warm-start.

:func:`run_warmups` runs both as a recipe says; the pieces:

* :func:`sft_warmup` teaches a policy trained from scratch the task's answer format: cross-entropy on the
  completion rows of packed ``prompt + solution + eos`` documents (the next-token-aligned batch of
  :func:`~lightning_codraft.rl.experience.sft_batch`).
* :func:`draft_warmup` fits the EAGLE-3 draft to the policy it will serve, on the policy's OWN samples and
  features (taps and logits of a frozen policy): the TTT loss of
  :func:`~lightning_codraft.training.draft_loss.ttt_draft_loss` through the override points of
  :class:`~lightning_codraft.training.module.CoDraftModule`, the same code path as co-training.
* ``draft.warm_start`` replaces it by self-distillation on many more of the policy's responses, cached on disk
  (:func:`~lightning_codraft.distill.warmstart.warm_start_draft`): the real-model warm start.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from lightning_codraft.batch import RLBatch
from lightning_codraft.config import CoDraftConfig, ConfigError
from lightning_codraft.distill.fit import fit_loop
from lightning_codraft.distill.warmstart import WarmStartSettings, split_prompts, warm_start_draft
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.models.vocab import build_vocab_mapping
from lightning_codraft.rl.build import fit_prompts
from lightning_codraft.rl.experience import Rollout, build_rl_batch, sft_batch
from lightning_codraft.rl.tasks import TaskSample
from lightning_codraft.rollout.speculative import SpeculativeEngine
from lightning_codraft.training.optim import adamw, cosine_decay


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
    opt = adamw(policy.parameters(), lr, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: cosine_decay(i / steps, 0.1))
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


def draft_warmup(module, batches: Sequence[RLBatch], steps: int, lr: float,
                 on_step: Callable[[int, float, float], None] | None = None) -> list[float]:
    """Offline warm-start of ``module.draft`` on a FROZEN policy's own features.

    Each step runs the policy without gradient on one packed batch (capturing tap 0, the draft's taps and the
    soft-target logits), then the draft's TTT unroll and loss through the module's own override points
    (:meth:`CoDraftModule.draft_token_embeds`, :meth:`CoDraftModule.draft_step_logits`,
    :meth:`CoDraftModule.draft_loss`), exactly as in co-training.

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
    draft = module.draft
    params = list(draft.parameters())  # all of them: a draft frozen for RL (draft.mode=frozen) is warm-started too
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        return _fit_draft(module, batches, steps, params, lr, on_step)
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def _fit_draft(module, batches, steps, params, lr, on_step) -> list[float]:
    """The draft's loss on each batch through the module's override points, in the one draft fit loop."""
    policy, taps = module.policy, module.configure_taps()

    def loss(batch: RLBatch):
        with torch.no_grad():
            out = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids,
                         taps=(0, *taps))
        embeds = module.draft_token_embeds(out.taps[0], batch)
        step_logits = module.draft_step_logits(list(out.taps[1:]), embeds, batch)
        return module.draft_loss(step_logits, out.logits.detach(), batch)

    def report(i, out):
        if on_step is not None:
            on_step(i, float(out.loss.detach()), float(out.accuracy[0]))

    return fit_loop(params, itertools.cycle(batches), loss, steps, lr, betas=(0.9, 0.98), on_step=report).losses


DRAFT_POOL_SEED = 2 * 10**6
"""Seed offset of the draft warm-up's prompts and samples (the RL steps never use it)."""


def draft_pool(cfg: CoDraftConfig, policy, draft, tokenizer, task, context: int) -> list[RLBatch]:
    """Packed batches of the policy's OWN samples (the draft learns the distribution it will serve).

    ``min(draft.warmup_steps, 8)`` batches of ``draft.warmup_batch_size`` task prompts, sampled at the rollout
    temperature. With a draft vocabulary smaller than the policy's, the draft's vocabulary map is rebuilt from the
    pool's token counts.
    """
    bs = cfg.draft.warmup_batch_size
    n_batches = max(1, min(cfg.draft.warmup_steps, 8))
    samples = task.sample(bs * n_batches, seed=cfg.run.seed + DRAFT_POOL_SEED)
    prompts = fit_prompts([encode_prompt(tokenizer, s.prompt) for s in samples], context, cfg.rl.max_new_tokens)
    outs = SpeculativeEngine(policy, None, 0).generate(
        prompts, max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature, top_p=cfg.rl.top_p,
        seed=cfg.run.seed + DRAFT_POOL_SEED, stop_token_ids=[tokenizer.eos_token_id])
    rollouts = [Rollout(p, o.token_ids, [0.0] * len(o.token_ids), group=i) for i, (p, o) in
                enumerate(zip(prompts, outs)) if o.token_ids]
    V = policy.config.vocab_size
    if draft.config.draft_vocab_size < V:
        ids = torch.tensor([t for r in rollouts for t in r.prompt_ids + r.completion_ids])
        d2t, t2d = build_vocab_mapping(torch.bincount(ids, minlength=V), draft.config.draft_vocab_size)
        draft.set_vocab_mapping(d2t, t2d)
    return [build_rl_batch(rollouts[i:i + bs], [0.0] * len(rollouts[i:i + bs]), pad_id=tokenizer.pad_token_id)
            for i in range(0, len(rollouts), bs)]


def warm_start_settings(cfg: CoDraftConfig) -> WarmStartSettings:
    """``draft.warm_start`` as :class:`WarmStartSettings` (a :class:`ConfigError` naming the bad key or value)."""
    try:
        return WarmStartSettings(**dict(cfg.draft.warm_start))
    except TypeError as e:
        valid = ", ".join(f.name for f in dataclasses.fields(WarmStartSettings))
        raise ConfigError(f"draft.warm_start: {e}; valid keys: {valid}") from None
    except ValueError as e:
        raise ConfigError(f"draft.warm_start: {e}") from None


def run_warmups(cfg: CoDraftConfig, module, tokenizer, task, context: int,
                log: Callable[[str], None] = print) -> dict[str, float]:
    """The run's warm-ups on the whole modules: SFT of the policy (``sft.steps``), then the draft's offline
    warm-start on the policy's own samples: self-distillation with its cache (``draft.warm_start``) or
    ``draft.warmup_steps`` steps on a small pool; returns their final losses (and the warm start's implied
    acceptance)."""
    info: dict[str, float] = {}
    warm_start = None  # bad keys fail before the SFT runs
    if cfg.draft.mode != "none" and cfg.draft.warm_start is not None:
        warm_start = warm_start_settings(cfg)
        try:  # its split of the task's problems too (e.g. a held-out tail shorter than the task's)
            split_prompts(task, warm_start)
        except ValueError as e:
            raise ConfigError(f"draft.warm_start.{e}") from None
    if cfg.sft.steps > 0:
        t0 = time.perf_counter()
        every = max(1, cfg.sft.steps // 5)
        losses = sft_warmup(
            module.policy, tokenizer, task.sample, cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr,
            seed=cfg.run.seed * 7919 + 3 * 10**6, context=context,
            on_step=lambda i, l: (i + 1) % every == 0 and log(f"  SFT step {i + 1}/{cfg.sft.steps}: loss {l:.3f}"))
        info["sft_loss"] = losses[-1]
        log(f"SFT warm-up: {cfg.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    if warm_start is not None:
        report = warm_start_draft(module.policy, tokenizer, task, module.draft, warm_start,
                                  Path(cfg.draft.warm_start_cache).expanduser(), log=log)
        info["draft_warmstart_acceptance"] = report.val_acceptance
    elif cfg.draft.mode != "none" and cfg.draft.warmup_steps > 0:
        t0 = time.perf_counter()
        batches = draft_pool(cfg, module.policy, module.draft, tokenizer, task, context)
        every = max(1, cfg.draft.warmup_steps // 5)
        losses = draft_warmup(
            module, batches, cfg.draft.warmup_steps, cfg.draft.warmup_lr,
            on_step=lambda i, l, a: (i + 1) % every == 0 and log(
                f"  draft warm-up step {i + 1}/{cfg.draft.warmup_steps}: loss {l:.3f}, step-0 acc {a:.3f}"))
        info["draft_warmup_loss"] = losses[-1]
        log(f"draft warm-start: {cfg.draft.warmup_steps} steps in {time.perf_counter() - t0:.0f}s, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return info
