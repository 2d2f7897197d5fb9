"""A run's warm starts before RL: SFT of the policy, then the draft fitted to it, or weights loaded instead.

:func:`warm_start` is what both front ends call (the Fabric loop, rl/run/loop.py, and the Trainer's module,
rl/run/trainer.py): ``run.init_from`` or this run's own cached warm weights, else :func:`run_warm_starts`. The draft's
warm start has two sources of one fit (distill/): the small pool sampled here (distill/pool.py) or, with
``draft.warm_start.corpus``, the cached self-distillation corpus (distill/warmstart.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from lightning_codraft.config import CoDraftConfig, ConfigError
from lightning_codraft.distill.pool import POOL_SEED, fit_on_pool, pool_prompts, sample_pool
from lightning_codraft.distill.warmstart import split_prompts, warm_start_draft
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rl.run.build import fit_prompts
from lightning_codraft.rl.run.run_dir import RunCheckpoints
from lightning_codraft.rl.run.sft import SFT_SEED, sft_warmup


def warm_start(
    cfg: CoDraftConfig,
    module,
    tokenizer,
    task,
    context: int,
    log: Callable[[str], None] = print,
    cached: Optional[Path] = None,
) -> dict[str, Any]:
    """The warm starts of a run (SFT, the draft's) or the weights of ``run.init_from``, on the whole modules; the
    reference policy starts from the result. Returns what they report (kept in checkpoints). ``cached``: this run's
    own warmed-up weights from an earlier launch, loaded instead (with what they reported)."""
    init = cfg.run.init_from
    if cached is not None:
        extra = RunCheckpoints.load_warm(cached, module.policy, module.draft)
        log(f"warm-ups loaded from {cached} (an earlier launch of this run, same warm-up settings)")
    elif init:
        extra = RunCheckpoints.load_warm(init, module.policy, module.draft)
        for key in ("eval_before", "eval_before_scores"):  # scored on that run's task: this run scores its own
            extra.pop(key, None)
        log(f"warm-started policy and draft from {init}")
    else:
        extra = run_warm_starts(cfg, module, tokenizer, task, context, log=log)
    if module.reference is not None:
        module.reference.load_state_dict(module.policy.state_dict())
    return extra


def run_warm_starts(
    cfg: CoDraftConfig, module, tokenizer, task, context: int, log: Callable[[str], None] = print
) -> dict[str, float]:
    """SFT of the policy (``sft.steps``), then the draft's warm start (``draft.warm_start``); returns their final
    losses (and the corpus warm start's implied acceptance). A bad ``draft.warm_start.corpus`` fails before SFT."""
    ws = cfg.draft.warm_start
    if cfg.draft.mode != "none" and ws.corpus is not None:
        try:  # its split of the task's problems too (e.g. a held-out tail shorter than the task's)
            split_prompts(task, ws.corpus)
        except ValueError as e:
            raise ConfigError(f"draft.warm_start.corpus.{e}") from None
    info: dict[str, float] = {}
    if cfg.sft.steps > 0:
        t0 = time.perf_counter()
        every = max(1, cfg.sft.steps // 5)
        losses = sft_warmup(
            module.policy,
            tokenizer,
            task.sample,
            cfg.sft.steps,
            cfg.sft.batch_size,
            cfg.sft.lr,
            seed=cfg.run.seed * 7919 + SFT_SEED,
            context=context,
            on_step=lambda i, l: (i + 1) % every == 0 and log(f"  SFT step {i + 1}/{cfg.sft.steps}: loss {l:.3f}"),
        )
        info["sft_loss"] = losses[-1]
        log(
            f"SFT warm-up: {cfg.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
        )
    if cfg.draft.mode != "none":
        info.update(draft_warm_start(cfg, module, tokenizer, task, context, log))
    return info


def draft_warm_start(
    cfg: CoDraftConfig, module, tokenizer, task, context: int, log: Callable[[str], None] = print
) -> dict[str, float]:
    """Fit ``module.draft`` to ``module.policy`` from ``draft.warm_start``'s source: the cached corpus when
    ``corpus`` is set, else ``steps`` steps on a small pool of the policy's samples (none when 0)."""
    ws = cfg.draft.warm_start
    if ws.corpus is not None:
        report = warm_start_draft(
            module.policy, tokenizer, task, module.draft, ws.corpus, Path(ws.cache_dir).expanduser(), log=log
        )
        return {"draft_warmstart_acceptance": report.val_acceptance}
    if ws.steps <= 0:
        return {}
    t0 = time.perf_counter()
    seed = cfg.run.seed + POOL_SEED
    samples = task.sample(pool_prompts(ws), seed=seed)
    prompts = fit_prompts([encode_prompt(tokenizer, s.prompt) for s in samples], context, cfg.rl.max_new_tokens)
    batches = sample_pool(
        module.policy,
        module.draft,
        prompts,
        ws,
        max_new_tokens=cfg.rl.max_new_tokens,
        temperature=cfg.rl.temperature,
        top_p=cfg.rl.top_p,
        seed=seed,
        stop_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
    )
    every = max(1, ws.steps // 5)
    losses = fit_on_pool(
        module,
        batches,
        ws.steps,
        ws.lr,
        on_step=lambda i, l, a: (
            (i + 1) % every == 0
            and log(f"  draft warm-up step {i + 1}/{ws.steps}: loss {l:.3f}, step-0 acc {a[0]:.3f}")
        ),
    )
    log(
        f"draft warm-start: {ws.steps} steps in {time.perf_counter() - t0:.0f}s, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    )
    return {"draft_warmup_loss": losses[-1]}
