"""Offline EAGLE-3 draft training on cached policy features (the self-distillation warm start).

:func:`fit_draft` trains a draft with the TTT loss on a :class:`~lightning_codraft.distill.cache.FeatureCache`
(the frozen policy's taps and soft targets, computed once: distill/cache.py), reporting held-out step
accuracies and the acceptance length they imply as it goes; :func:`draft_unroll` is the one unroll the fit, its
held-out reports and the proposal calibration (distill/calibration.py) share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from lightning_codraft.attention.packing import masked_suffix, shift_left_local, suffix_rows
from lightning_codraft.distill.cache import PRECISIONS, FeatureCache, compact_vocab, pack_batches
from lightning_codraft.distill.compiled import compiled_draft
from lightning_codraft.distill.settings import DraftFitConfig
from lightning_codraft.models.precision import resolve_precision
from lightning_codraft.training.draft_loss import ttt_draft_loss
from lightning_codraft.training.metrics import implied_acceptance_length
from lightning_codraft.training.optim import adamw, cosine_decay


@dataclass
class FitResult:
    """What :func:`fit_draft` did."""

    steps: int = 0
    """Optimizer steps taken."""
    tokens_seen: int = 0
    """Target rows (draft-loss rows of step 0) trained on, counting repeats across epochs."""
    train_seconds: float = 0.0
    """Training and held-out report time (``on_eval`` callbacks excluded)."""
    planned_steps: int = 0
    """Optimizer steps of ``epochs`` passes over the training documents."""
    losses: list[float] = field(default_factory=list)
    """Draft loss of every step."""
    history: list[dict] = field(default_factory=list)
    """One dict per report: ``step``, ``seconds``, ``tokens_seen``, ``loss``, ``val_accuracy`` (K,),
    ``val_acceptance`` (implied acceptance length on the held-out documents)."""

    @property
    def ended_by(self) -> str:
        """``"epochs"`` (the planned steps ran out) or ``"budget"`` (``time_budget_s`` ended the fit first)."""
        return "epochs" if self.steps >= self.planned_steps else "budget"

    def as_dict(self) -> dict:
        return {**asdict(self), "ended_by": self.ended_by}


def lr_factor(progress: float, config: DraftFitConfig) -> float:
    """Learning-rate multiplier at schedule position ``progress`` in [0, 1]."""
    p = min(max(progress, 0.0), 1.0)
    if config.warmup_frac > 0 and p < config.warmup_frac:
        return p / config.warmup_frac
    q = (p - config.warmup_frac) / (1 - config.warmup_frac)
    return cosine_decay(q, config.min_lr_ratio)


def draft_unroll(
    draft, embed: Callable[[Tensor], Tensor], batch: dict[str, Tensor], ttt_steps: int, precision: str = "32-true"
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """``draft``'s TTT unroll of K = ``ttt_steps`` steps on a :meth:`FeatureCache.batch`, fed the policy's token
    embedding ``embed``; ``precision``: ``"32-true"``, ``"bf16-mixed"`` (autocast) or ``"auto"``.

    Only the rows a loss row can reach are unrolled: per document, from K rows before its first loss row
    (:func:`~lightning_codraft.attention.packing.masked_suffix`); the prompt rows before them give only their
    step-0 keys (the rollout prompts are ~40% of GSM8K documents). The loss and accuracies equal the full unroll's.

    Returns:
        ``(steps, rows)``: K fp32 step logits ``(Tq, Vd)`` of the unrolled rows, and those rows' ``cu_seqlens``,
        ``compact_logits`` and ``loss_mask`` (documents without a loss row dropped), what
        :func:`ttt_draft_loss` reads.
    """
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    cu_q = masked_suffix(cu, batch["loss_mask"], ttt_steps)
    if int(cu_q[-1]) == 0:  # no loss row at all: unroll everything (the loss is 0, its accuracies count nothing)
        cu_q = cu
    picked = suffix_rows(cu, cu_q)
    with torch.no_grad():
        embeds = [embed(shift_left_local(ids, cu, k + 1)).detach() for k in range(ttt_steps)]
    dtype = PRECISIONS[resolve_precision(precision, ids.device)]
    with torch.autocast(ids.device.type, dtype=dtype, enabled=dtype is not None):
        steps = draft.ttt_forward(list(batch["taps"]), embeds, cu, batch["position_ids"], cu_seqlens_q=cu_q)
    rows = {
        "cu_seqlens": torch.unique_consecutive(cu_q),
        "compact_logits": batch["compact_logits"][picked],
        "loss_mask": batch["loss_mask"][picked],
    }
    return [lg.float() for lg, _ in steps], rows


def draft_batch_loss(
    draft,
    embed: Callable[[Tensor], Tensor],
    batch: dict[str, Tensor],
    ttt_steps: int,
    decay: float = 0.8,
    precision: str = "32-true",
    target_temperature: float = 1.0,
    loss_type: str = "ce",
):
    """:func:`ttt_draft_loss` (per-row loss ``loss_type``, step weight ratio ``decay``) of :func:`draft_unroll` on
    the same arguments, both distributions taken at ``target_temperature``
    (:attr:`DraftFitConfig.target_temperature`)."""
    steps, rows = draft_unroll(draft, embed, batch, ttt_steps, precision)
    compact = rows["compact_logits"]
    if target_temperature != 1.0:  # the last column is the argmax-outside flag, not a logit
        steps = [z / target_temperature for z in steps]
        compact = torch.cat([compact[:, :-1] / target_temperature, compact[:, -1:]], dim=1)
    return ttt_draft_loss(
        steps,
        compact,
        rows["cu_seqlens"],
        rows["loss_mask"],
        *compact_vocab(steps[0].shape[-1]),
        decay=decay,
        loss_type=loss_type,
    )


@torch.no_grad()
def evaluate_draft(draft, embed, cache: FeatureCache, docs: Sequence[int], config: DraftFitConfig) -> list[float]:
    """``(K,)`` top-1 accuracy of each unroll step over documents ``docs`` of ``cache``."""
    correct = total = None
    for group in pack_batches(cache.doc_lengths()[list(docs)], config.batch_tokens):
        out = draft_batch_loss(
            draft,
            embed,
            cache.batch([docs[i] for i in group]),
            config.eval_steps or config.ttt_steps,
            config.decay,
            config.precision,
        )
        correct = out.correct if correct is None else correct + out.correct
        total = out.total if total is None else total + out.total
    return [] if total is None else (correct / total.clamp(min=1)).tolist()


def fit_loop(
    params: list[Tensor],
    batches: Iterator,
    loss_fn: Callable[[object], object],
    total_steps: int,
    lr: float,
    *,
    betas: tuple[float, float],
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    schedule: Callable[[float], float] = lambda p: cosine_decay(p, 0.1),
    time_budget_s: float | None = None,
    report_every: int = 0,
    report: Callable[[int, FitResult, list[float]], float | None] | None = None,
    on_step: Callable[[int, object], None] | None = None,
) -> FitResult:
    """The one draft fit loop: AdamW over ``params`` on ``loss_fn(batch)`` for each batch of ``batches`` until
    ``total_steps`` steps (or the time budget) are done.

    The offline fit on cached features (:func:`fit_draft`) and the warm start on live policy forwards through the
    online objective's override points (``distill.pool.fit_on_pool``) both run it.

    Args:
        params: the trained tensors.
        batches: an iterator of batches (at least ``total_steps`` of them, or the loop ends with it).
        loss_fn: ``batch -> out`` with ``out.loss`` (scalar) and ``out.total`` (``(K,)`` target rows per unroll
            step), e.g. a :class:`~lightning_codraft.training.draft_loss.DraftLossOutput`.
        total_steps: optimizer steps planned; step ``i`` runs at learning rate ``lr * schedule(progress)``.
        lr, betas, weight_decay: AdamW's (``training.optim.adamw``).
        grad_clip: global gradient-norm clip of ``params`` (0 disables).
        schedule: learning-rate multiplier at ``progress`` in [0, 1] (default cosine to 10%).
        time_budget_s: stop once training and reports took this long; ``progress`` is then
            ``max(step share, time share)``, so the learning rate has decayed when the budget ends.
        report_every, report: ``report(step, result, losses since the last report)`` after every
            ``report_every``-th step and the last one (``result.train_seconds``: the time so far); its time
            counts towards the budget, less the seconds it returns (the loop reserves as much before the end as the
            last report took).
        on_step: ``on_step(step index, out)`` after every step (not timed).

    Returns:
        :class:`FitResult` (``steps``, ``losses``, ``tokens_seen``, ``train_seconds``, ``planned_steps``).
    """
    opt = adamw(params, lr, betas=betas, weight_decay=weight_decay)
    result = FitResult(planned_steps=total_steps)
    clock, report_cost, window = 0.0, 0.0, []
    for batch in batches:
        t0 = time.perf_counter()
        progress = result.steps / total_steps
        if time_budget_s:
            progress = max(progress, clock / time_budget_s)
        for g in opt.param_groups:
            g["lr"] = lr * schedule(progress)
        out = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        result.steps += 1
        result.losses.append(float(out.loss.detach()))
        window.append(result.losses[-1])
        result.tokens_seen += int(out.total[0])
        clock += time.perf_counter() - t0
        if on_step is not None:
            on_step(result.steps - 1, out)
        # stop early enough for the last report to fit in the budget too
        stop = result.steps >= total_steps or bool(time_budget_s and clock + report_cost >= time_budget_s)
        if report is not None and (stop or (report_every and result.steps % report_every == 0)):
            t0 = time.perf_counter()
            result.train_seconds = clock
            uncounted = report(result.steps, result, window) or 0.0
            report_cost = time.perf_counter() - t0 - uncounted
            clock += report_cost
            window = []
        if stop:
            break
    result.train_seconds = clock
    return result


def fit_draft(
    draft,
    embed: Callable[[Tensor], Tensor],
    cache: FeatureCache,
    config: DraftFitConfig,
    log: Callable[[str], None] | None = None,
    on_eval: Callable[[dict], None] | None = None,
) -> FitResult:
    """Train ``draft`` in place on ``cache`` with the TTT loss (:func:`fit_loop`), reporting accuracy on the
    documents :meth:`FeatureCache.split` holds out as it goes; returns a :class:`FitResult`.

    Args:
        draft: an :class:`~lightning_codraft.models.Eagle3Draft` whose vocabulary map is the one the cache was
            built with (``cache.meta["draft_vocab_size"]`` rows) and whose taps are ``cache.meta["taps"]``.
        embed: the policy's token embedding (e.g. ``policy.embed``), ``(T,)`` ids -> ``(T, H)``.
        cache: the policy's features (:func:`build_feature_cache`).
        config: see :class:`DraftFitConfig`.
        log: receives one progress line per report.
        on_eval: called with each report dict (see :attr:`FitResult.history`); its time is not counted.
    """
    if int(draft.config.draft_vocab_size) != cache.draft_vocab_size or list(draft.config.taps) != cache.meta["taps"]:
        raise ValueError(
            f"the draft (draft_vocab_size={draft.config.draft_vocab_size}, taps={draft.config.taps}) "
            f"does not match the feature cache (draft_vocab_size={cache.draft_vocab_size}, taps="
            f"{cache.meta['taps']}); rebuild the cache for this draft"
        )
    train_docs, val_docs = cache.split(config.val_docs)
    lengths = cache.doc_lengths()
    total_steps = max(1, math.ceil(config.epochs * len(pack_batches(lengths[train_docs], config.batch_tokens))))
    params = [p for p in draft.parameters() if p.requires_grad]
    config = replace(config, precision=resolve_precision(config.precision, params[0].device))
    rng = np.random.default_rng(config.seed)

    def epochs():
        while True:
            order = rng.permutation(len(train_docs))
            for group in pack_batches(lengths[order], config.batch_tokens):
                yield cache.batch([train_docs[order[i]] for i in group])

    ttt = (config.ttt_steps, config.decay, config.precision, config.target_temperature, config.loss_type)

    def loss(batch):
        return draft_batch_loss(draft, embed, batch, *ttt)

    report = _reporter(draft, embed, cache, val_docs, config, total_steps, log, on_eval)
    draft.train()
    with compiled_draft(draft, config.compile):
        result = fit_loop(
            params,
            epochs(),
            loss,
            total_steps,
            config.lr,
            betas=(0.9, 0.95),
            weight_decay=config.weight_decay,
            grad_clip=config.grad_clip,
            schedule=lambda p: lr_factor(p, config),
            time_budget_s=config.time_budget_s,
            report_every=config.eval_every,
            report=report,
        )
    draft.eval()
    return result


def _reporter(
    draft,
    embed,
    cache: FeatureCache,
    val_docs,
    config: DraftFitConfig,
    total_steps: int,
    log: Callable[[str], None] | None,
    on_eval: Callable[[dict], None] | None,
):
    """The fit's held-out report (:func:`fit_loop`'s ``report``): accuracy on ``val_docs``, one history entry, a
    progress line and ``on_eval``; returns the seconds of logging and ``on_eval`` (not counted as fit time)."""

    def report(step: int, result: FitResult, window: list[float]) -> float:
        t0 = time.perf_counter()
        draft.eval()
        acc = evaluate_draft(draft, embed, cache, val_docs, config) if val_docs else []
        draft.train()
        seconds = result.train_seconds + time.perf_counter() - t0
        entry = dict(
            step=step,
            seconds=round(seconds, 2),
            tokens_seen=result.tokens_seen,
            loss=float(np.mean(window)) if window else float("nan"),
            val_accuracy=acc,
            val_acceptance=implied_acceptance_length(acc),
        )
        result.history.append(entry)
        t0 = time.perf_counter()
        if log is not None:
            log(
                f"  draft fit step {step}/{total_steps} ({seconds:.0f}s, {result.tokens_seen} tokens, "
                f"{result.tokens_seen / max(seconds, 1e-9):.0f} tok/s): loss {entry['loss']:.3f}, held-out step-0 "
                f"acc {acc[0] if acc else float('nan'):.3f}, implied acceptance {entry['val_acceptance']:.2f}"
            )
        if on_eval is not None:
            on_eval(entry)
        return time.perf_counter() - t0  # logging and on_eval are not counted

    return report
