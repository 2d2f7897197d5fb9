"""The draft's self-distillation warm start, cached on disk by the policy's weights.

EAGLE-3's prescription: fit the draft on the POLICY'S OWN responses to the task's training prompts, sampled at
the rollout temperature, through the chat template the rollouts use. :func:`warm_start_draft` runs the four stages
of distill/stages.py (corpus, vocabulary, features, draft), each cached under ``cache_dir`` by the key it owns, so
a later run (or a run that changes only the fit settings) skips what it can. The task's last ``heldout_prompts``
problems are never used, so acceptance can be measured on prompts the draft never saw; the draft's key hashes the
policy's state dict, the draft config, the training prompts and these settings, so a different policy (one
changed weight) never loads a stale draft.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lightning_codraft.distill.calibration import calibrate_draft_temperature
from lightning_codraft.distill.fit import FitResult, fit_draft, implied_acceptance_length
from lightning_codraft.distill.settings import WarmStartSettings
from lightning_codraft.distill.stages import (
    corpus_features,
    corpus_key,
    draft_key,
    features_key,
    install_vocab,
    sample_corpus,
    state_fingerprint,
)
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.models.precision import resolve_dtype, resolve_precision
from lightning_codraft.models.tokenizer import encode_prompt

_COMPLETE = "COMPLETE"


@dataclass
class WarmStartReport:
    """What :func:`warm_start_draft` did (times in seconds of wall clock)."""

    cache_hit: bool
    """The finished draft was loaded from ``draft_dir``; nothing was generated or trained."""
    draft_dir: str
    """Where the fitted draft lives (``Eagle3Draft.from_pretrained`` loads it)."""
    key: str
    """The draft's cache key."""
    prompts: int = 0
    """Training prompts answered."""
    generated_tokens: int = 0
    """Completion tokens of the corpus."""
    generation_s: float = 0.0
    """Sampling the corpus (0 when it came from the cache)."""
    features_s: float = 0.0
    """The policy's feature pass (0 when the feature cache existed)."""
    fit_s: float = 0.0
    """Training the draft, its held-out reports included."""
    total_s: float = 0.0
    """Wall time of the whole warm start, ``on_eval`` time excluded (on a cache hit: of loading the draft)."""
    entropy: float = float("nan")
    """Policy's mean per-token entropy (nats) at ``temperature`` over the corpus' completion rows."""
    argmax_coverage: float = float("nan")
    """Share of completion rows whose policy top-1 lies in the draft vocabulary."""
    val_accuracy: list[float] = field(default_factory=list)
    """Per-unroll-step top-1 accuracy on the feature cache's held-out documents at the end."""
    val_acceptance: float = float("nan")
    """Implied acceptance length ``1 + sum_k prod_{j<=k} acc_j`` of ``val_accuracy``."""
    fit: dict = field(default_factory=dict)
    """:class:`~lightning_codraft.distill.fit.FitResult` as a dict."""
    calibration: dict = field(default_factory=dict)
    """:class:`~lightning_codraft.distill.calibration.TemperatureCalibration` as a dict (empty when not
    calibrated); ``scale`` is the factor the draft's logits were divided by."""
    precision: dict = field(default_factory=dict)
    """The dtypes the stages ran in (``"auto"`` resolved): ``generation_dtype``, ``feature_precision``,
    ``fit_precision``."""


def resolve_settings(settings: WarmStartSettings, device) -> WarmStartSettings:
    """``settings`` with every ``"auto"`` dtype and precision resolved for ``device``."""
    fit = dataclasses.replace(settings.fit, precision=resolve_precision(settings.fit.precision, device))
    return dataclasses.replace(
        settings,
        generation_dtype=resolve_dtype(settings.generation_dtype, device),
        feature_precision=resolve_precision(settings.feature_precision, device),
        fit=fit,
    )


def split_prompts(task, settings: WarmStartSettings) -> tuple[list[str], list[str]]:
    """``(training prompts, held-out prompts)`` of ``task``.

    With a fixed problem list (``task.samples``, e.g. :class:`~lightning_codraft.rl.tasks.gsm8k.GSM8KTask`) the last
    ``heldout_prompts`` problems are held out and ``num_prompts`` of the rest are drawn in a ``seed`` order;
    a generated task (``task.sample(n, seed)`` only) gives ``num_prompts`` training prompts and no held-out ones.
    """
    reserved = getattr(task, "heldout", 0)
    if reserved > settings.heldout_prompts:
        raise ValueError(
            f"heldout_prompts={settings.heldout_prompts} is below task.heldout={reserved}: the warm "
            f"start would train the draft on problems the evaluation and the speed-up are measured on; "
            f"raise heldout_prompts"
        )
    samples = getattr(task, "samples", None)
    if samples is None:
        return [s.prompt for s in task.sample(settings.num_prompts, settings.seed)], []
    n_train = len(samples) - settings.heldout_prompts
    if n_train < 1:
        raise ValueError(
            f"heldout_prompts={settings.heldout_prompts} leaves no training prompt of the task's "
            f"{len(samples)} problems; lower heldout_prompts or use a larger problem file"
        )
    order = list(range(n_train))
    random.Random(settings.seed).shuffle(order)
    return ([samples[i].prompt for i in order[: settings.num_prompts]], [s.prompt for s in samples[n_train:]])


def warm_start_draft(
    policy,
    tokenizer,
    task,
    draft,
    settings: WarmStartSettings,
    cache_dir,
    log: Callable[[str], None] = print,
    on_eval: Callable[[dict], None] | None = None,
) -> WarmStartReport:
    """Fit ``draft`` (in place) to ``policy`` by self-distillation, or load it from the on-disk cache.

    Args:
        policy: the frozen :class:`~lightning_codraft.models.Policy` the draft will serve.
        tokenizer: the project's tokenizer protocol (``encode_prompt`` applies the chat template when present).
        task: prompts: ``task.samples`` (held-out tail excluded) or ``task.sample(n, seed)``.
        draft: an :class:`~lightning_codraft.models.Eagle3Draft` built for ``policy`` (its ``draft_vocab_size``
            and taps are kept; its vocabulary map and weights are rebuilt when ``settings.rebuild_vocab``).
        settings: see :class:`WarmStartSettings`.
        cache_dir: directory of the corpus, feature and draft caches (created when missing).
        log: progress lines.
        on_eval: called at each held-out report of the fit with its dict (see
            :attr:`~lightning_codraft.distill.fit.FitResult.history`) plus ``warmstart_seconds``, the
            warm start's time so far (generation + features + training, reports excluded); the draft holds the
            weights of that moment.

    Returns:
        :class:`WarmStartReport`.
    """
    clock = _Clock(time.perf_counter(), on_eval)
    settings = resolve_settings(settings, next(policy.parameters()).device)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    prompts = _training_prompts(policy, tokenizer, task, settings)
    corpus = corpus_key(state_fingerprint(policy), prompts, settings)
    key = draft_key(corpus, draft, settings)
    draft_dir = cache_dir / f"draft-{key}"
    if (draft_dir / _COMPLETE).is_file():
        return _load_cached(draft, draft_dir, clock, log)
    report = WarmStartReport(
        cache_hit=False,
        draft_dir=str(draft_dir),
        key=key,
        precision=dict(
            generation_dtype=settings.generation_dtype,
            feature_precision=settings.feature_precision,
            fit_precision=settings.fit.precision,
        ),
    )
    log(
        f"draft warm start: sampling in {settings.generation_dtype or 'the policy dtype'}, features "
        f"{settings.feature_precision}, fit {settings.fit.precision}"
    )
    cache = _corpus_and_features(policy, tokenizer, draft, prompts, settings, cache_dir, corpus, report, log)
    result = _fit_and_calibrate(policy, draft, cache, settings, report, clock, log)
    shutil.rmtree(draft_dir, ignore_errors=True)
    draft.save_pretrained(draft_dir)
    report.total_s = clock.elapsed()
    (draft_dir / "report.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (draft_dir / _COMPLETE).write_text(key)
    log(
        f"draft warm start: {report.total_s:.0f}s (generation {report.generation_s:.0f}s, features "
        f"{report.features_s:.0f}s, fit {report.fit_s:.0f}s), {result.tokens_seen} tokens seen, held-out step-0 acc "
        f"{report.val_accuracy[0] if report.val_accuracy else float('nan'):.3f}, implied acceptance "
        f"{report.val_acceptance:.2f}; saved {draft_dir}"
    )
    return report


class _Clock:
    """The warm start's wall clock, the caller's ``on_eval`` time excluded (its measurements are not warm start)."""

    def __init__(self, start: float, on_eval: Callable[[dict], None] | None):
        self.start, self.on_eval, self.outside = start, on_eval, 0.0

    def elapsed(self) -> float:
        """Warm-start seconds so far."""
        return time.perf_counter() - self.start - self.outside

    def eval_hook(self, entry: dict) -> None:
        """The fit's held-out report, passed on to ``on_eval`` with ``warmstart_seconds``."""
        if self.on_eval is not None:
            t = time.perf_counter()
            self.on_eval({**entry, "warmstart_seconds": t - self.start - self.outside})
            self.outside += time.perf_counter() - t


def _training_prompts(policy, tokenizer, task, settings: WarmStartSettings) -> list[list[int]]:
    """The training prompts' ids that leave room for ``max_new_tokens`` in the policy's context."""
    train_texts, _ = split_prompts(task, settings)
    limit = int(policy.config.max_position_embeddings) - settings.max_new_tokens
    prompts = [p for p in (encode_prompt(tokenizer, t) for t in train_texts) if 0 < len(p) < limit]
    if not prompts:
        raise ValueError(
            f"no training prompt fits the context: every one is longer than max_position_embeddings - "
            f"max_new_tokens = {limit} tokens"
        )
    return prompts


def _load_cached(draft, draft_dir: Path, clock: _Clock, log: Callable[[str], None]) -> WarmStartReport:
    """A finished draft of the cache, loaded into ``draft``; its saved report, marked a cache hit."""
    loaded = Eagle3Draft.from_pretrained(draft_dir, dtype=draft.fc.weight.dtype, device=draft.fc.weight.device)
    draft.load_state_dict(loaded.state_dict())
    saved = json.loads((draft_dir / "report.json").read_text())
    saved.update(cache_hit=True, draft_dir=str(draft_dir), total_s=clock.elapsed())
    log(f"draft warm start: cache hit {draft_dir} (implied acceptance {saved['val_acceptance']:.2f})")
    return WarmStartReport(**saved)


def _corpus_and_features(
    policy,
    tokenizer,
    draft,
    prompts,
    settings,
    cache_dir: Path,
    corpus: str,
    report: WarmStartReport,
    log: Callable[[str], None],
):
    """Stages 1-3 (stages.py): the corpus, the draft vocabulary, the feature cache; their times in ``report``."""
    t0 = time.perf_counter()
    samples, recorder = sample_corpus(policy, tokenizer, prompts, draft.config.taps, settings, cache_dir, corpus, log)
    report.generation_s = time.perf_counter() - t0
    report.prompts, report.generated_tokens = len(samples), sum(len(c) for _, c in samples)
    try:
        if settings.rebuild_vocab:
            install_vocab(policy, draft, samples, settings)
        target_ids = draft.draft_to_target(torch.arange(int(draft.config.draft_vocab_size), device=draft.d2t.device))
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise
    t0 = time.perf_counter()
    taps = draft.config.taps
    key = features_key(corpus, target_ids, taps, settings)
    cache = corpus_features(policy, samples, recorder, target_ids, taps, settings, cache_dir, key, log)
    report.features_s = time.perf_counter() - t0
    report.entropy, report.argmax_coverage = cache.meta["entropy"], cache.meta["argmax_coverage"]
    log(
        f"draft warm start: {cache.meta['loss_rows']} target rows, policy entropy at T={settings.temperature} "
        f"{report.entropy:.3f} nats/token, draft vocabulary {cache.draft_vocab_size} covers "
        f"{report.argmax_coverage:.3f} of the policy's top-1"
    )
    return cache


def _fit_and_calibrate(
    policy,
    draft,
    cache,
    settings: WarmStartSettings,
    report: WarmStartReport,
    clock: _Clock,
    log: Callable[[str], None],
) -> FitResult:
    """Stage 4: the fit within what is left of the budget, then the proposal temperature; results in ``report``."""
    fit = settings.fit
    if settings.time_budget_s:
        left = settings.time_budget_s - clock.elapsed() - 10.0  # 10 s for saving the draft
        fit = dataclasses.replace(fit, time_budget_s=max(1e-3, min(left, fit.time_budget_s or left)))
    t0, outside = time.perf_counter(), clock.outside
    result: FitResult = fit_draft(draft, policy.embed, cache, fit, log=log, on_eval=clock.eval_hook)
    report.fit_s = time.perf_counter() - t0 - (clock.outside - outside)
    report.fit = result.as_dict()
    report.val_accuracy = list(result.history[-1]["val_accuracy"]) if result.history else []
    report.val_acceptance = implied_acceptance_length(report.val_accuracy)
    unused = settings.time_budget_s - clock.elapsed() if settings.time_budget_s else 0.0
    if result.ended_by == "epochs" and unused > 60:
        log(
            f"draft warm start: the fit ran its {fit.epochs:g} epochs ({result.planned_steps} steps) with "
            f"{unused / 60:.1f} min of the budget left: a larger corpus (generation_share) or more epochs would use "
            f"it"
        )
    held_out = cache.split(fit.val_docs)[1]  # the documents the fit reported on
    if settings.calibrate_temperature and held_out:
        t0 = time.perf_counter()
        cal = calibrate_draft_temperature(draft, policy.embed, cache, held_out, fit, settings.temperature)
        report.calibration = asdict(cal)
        report.fit_s += time.perf_counter() - t0
        log(
            f"draft warm start: proposal temperature scale {cal.scale:g} (implied acceptance by overlap "
            f"{cal.acceptance[0]:.2f} -> {max(cal.acceptance):.2f} on {cal.rows} held-out rows)"
        )
    return result
