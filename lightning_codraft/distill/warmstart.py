"""The draft's self-distillation warm start, cached on disk by the policy's weights.

EAGLE-3's prescription: fit the draft on the POLICY'S OWN responses to the task's training prompts, sampled at
the rollout temperature, through the chat template the rollouts use. :func:`warm_start_draft` does it in four
stages, each cached under ``cache_dir`` so a later run (or a run that changes only the fit settings) skips
what it can:

1. ``corpus-<key>/``: the policy's responses (embedded engine, no draft) to training prompts; the task's last
   ``heldout_prompts`` problems are never used, so acceptance can be measured on prompts the draft never saw.
2. the draft vocabulary: the ``Vd`` most frequent completion tokens of the corpus
   (:func:`~lightning_codraft.models.vocab.build_vocab_mapping`), ``lm_head`` rows re-initialised from the
   policy's.
3. ``features-<key>/``: the policy's taps and soft targets, kept from the sampling forwards of stage 1 when it
   ran (:class:`~lightning_codraft.distill.capture.FeatureRecorder`: no second pass over the corpus),
   else computed once by :func:`~lightning_codraft.distill.cache.build_feature_cache`.
4. ``draft-<key>/``: the fitted draft (:func:`~lightning_codraft.distill.fit.fit_draft`) in vLLM's EAGLE-3
   format, plus ``report.json``. Its key hashes the policy's state dict, the draft config, the training prompts
   and these settings, so a different policy (one changed weight) never loads a stale draft.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from lightning_codraft.distill.cache import FeatureCache, build_feature_cache
from lightning_codraft.distill.calibration import calibrate_draft_temperature
from lightning_codraft.distill.capture import FeatureRecorder
from lightning_codraft.distill.fit import (DraftFitConfig, FitResult, coerce_floats, fit_draft,
                                                 implied_acceptance_length)
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.models.precision import AUTO, resolve_dtype, resolve_precision
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.models.vocab import count_tokens
from lightning_codraft.rollout import SpeculativeEngine

_COMPLETE = "COMPLETE"


@dataclass
class WarmStartSettings:
    """What the warm start generates and how it fits (``fit``); every field enters the draft's cache key."""

    num_prompts: int = 512
    """Training prompts to sample one response each for (at most the task's problems minus the held-out ones)."""
    heldout_prompts: int = 500
    """The task's last ``heldout_prompts`` problems (``task.samples``) are never trained on; evaluate on them."""
    max_new_tokens: int = 256
    """Response length cap."""
    temperature: float = 0.8
    """Sampling temperature of the responses: the rollouts' temperature."""
    top_p: float = 1.0
    """Nucleus sampling of the responses (the rollouts')."""
    generation_batch: int = 64
    """Prompts per ``generate`` call."""
    generation_budget_s: float | None = None
    """Generation budget in seconds (no batch starts that would end later); None: all ``num_prompts``."""
    time_budget_s: float | None = None
    """Wall-time budget of the whole warm start: generation gets ``generation_share`` of it (no batch starts that
    would end later), and the fit what is left after the feature pass (``fit.time_budget_s`` caps it further)."""
    generation_share: float = 0.45
    """Share of ``time_budget_s`` given to sampling the corpus."""
    generation_dtype: str | None = None
    """``"bfloat16"``: sample from a bf16 copy of the policy (as bf16 rollout engines do; faster decoding on a CPU with
    AMX, slower on an AVX2-only one: docs/design/measurements.md); ``"auto"``: bf16 where it is fast, else float32
    (:func:`~lightning_codraft.models.precision.resolve_dtype`); None: the policy as it is. The features and soft
    targets always come from the policy."""
    rebuild_vocab: bool = True
    """Build the draft vocabulary from the corpus' completion-token counts (and re-initialise the draft from the
    policy for it); False keeps the draft's map and weights."""
    feature_dtype: str = "float16"
    """Storage dtype of the cached taps and logits (``"float16"`` or ``"float32"``)."""
    feature_batch_tokens: int = 4096
    """Tokens per policy forward while building the feature cache."""
    capture_features: bool = True
    """Keep the policy's taps and soft targets from the forwards that sample the corpus (when it is sampled in
    this run) instead of a second pass over it: the same features up to the rounding of the decode's shapes, in
    the sampling dtype (``generation_dtype``; ``feature_precision`` then applies only to a corpus loaded from
    the cache), at the cost of spilling them to disk under the cache directory while sampling (~4.6 KB a token at
    H = 576; removed once the feature cache is written)."""
    feature_precision: str = "32-true"
    """``"32-true"``, ``"bf16-mixed"`` (the policy's feature pass under bf16 autocast: faster on a CPU with AMX;
    taps and targets then carry bf16 rounding, unlike the fp32 engine's taps at rollout time) or ``"auto"``
    (bf16-mixed where bf16 is fast). Every ``"auto"`` here and in ``fit.precision`` is resolved for the policy's
    device before the cache keys are taken."""
    calibrate_temperature: bool = True
    """After the fit, sharpen the draft's proposals by the scale of highest implied acceptance at ``temperature``
    on the fit's held-out documents, folded into ``lm_head``
    (:func:`~lightning_codraft.distill.calibration.calibrate_draft_temperature`; lossless, greedy unchanged)."""
    seed: int = 0
    """Prompt order, sampling and draft initialisation."""
    fit: DraftFitConfig = field(default_factory=DraftFitConfig)
    """How the draft is trained on the cached features."""

    def __post_init__(self):
        if isinstance(self.fit, dict):
            self.fit = DraftFitConfig(**self.fit)
        coerce_floats(self)
        for name in ("num_prompts", "max_new_tokens", "generation_batch", "feature_batch_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"WarmStartSettings.{name}={getattr(self, name)} must be >= 1")
        if self.generation_dtype not in (None, AUTO, "bfloat16", "float16", "float32"):
            raise ValueError(f"generation_dtype={self.generation_dtype!r} must be None, 'auto', 'bfloat16', "
                             "'float16' or 'float32'")
        if self.feature_precision not in (AUTO, "32-true", "bf16-mixed"):
            raise ValueError(f"feature_precision={self.feature_precision!r} must be 'auto', '32-true' or 'bf16-mixed'")
        if not 0 < self.generation_share < 1:
            raise ValueError(f"generation_share={self.generation_share} must be in (0, 1)")
        if self.heldout_prompts < 0 or self.temperature <= 0:
            raise ValueError(f"heldout_prompts={self.heldout_prompts} must be >= 0 and temperature="
                             f"{self.temperature} > 0 (the warm start samples, like the rollouts)")


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


def state_fingerprint(module: torch.nn.Module) -> str:
    """blake2b hex digest of a module's state dict: names, dtypes, shapes and bytes of every tensor."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _digest(*parts) -> str:
    return hashlib.blake2b(json.dumps(parts, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def resolve_settings(settings: WarmStartSettings, device) -> WarmStartSettings:
    """``settings`` with every ``"auto"`` dtype and precision resolved for ``device``."""
    fit = dataclasses.replace(settings.fit, precision=resolve_precision(settings.fit.precision, device))
    return dataclasses.replace(settings, generation_dtype=resolve_dtype(settings.generation_dtype, device),
                               feature_precision=resolve_precision(settings.feature_precision, device), fit=fit)


def split_prompts(task, settings: WarmStartSettings) -> tuple[list[str], list[str]]:
    """``(training prompts, held-out prompts)`` of ``task``.

    With a fixed problem list (``task.samples``, e.g. :class:`~lightning_codraft.rl.gsm8k.GSM8KTask`) the last
    ``heldout_prompts`` problems are held out and ``num_prompts`` of the rest are drawn in a ``seed`` order;
    a generated task (``task.sample(n, seed)`` only) gives ``num_prompts`` training prompts and no held-out ones.
    """
    reserved = getattr(task, "heldout", 0)
    if reserved > settings.heldout_prompts:
        raise ValueError(f"heldout_prompts={settings.heldout_prompts} is below task.heldout={reserved}: the warm "
                         f"start would train the draft on problems the evaluation and the speed-up are measured on; "
                         f"raise heldout_prompts")
    samples = getattr(task, "samples", None)
    if samples is None:
        return [s.prompt for s in task.sample(settings.num_prompts, settings.seed)], []
    n_train = len(samples) - settings.heldout_prompts
    if n_train < 1:
        raise ValueError(f"heldout_prompts={settings.heldout_prompts} leaves no training prompt of the task's "
                         f"{len(samples)} problems; lower heldout_prompts or use a larger problem file")
    order = list(range(n_train))
    random.Random(settings.seed).shuffle(order)
    return ([samples[i].prompt for i in order[:settings.num_prompts]],
            [s.prompt for s in samples[n_train:]])


def generate_corpus(policy, tokenizer, prompts: list[list[int]], settings: WarmStartSettings,
                    log: Callable[[str], None] = print, budget_s: float | None = None,
                    recorder: FeatureRecorder | None = None) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, completion ids)`` of the policy's own samples, by the embedded engine without a draft; the
    first batch always runs, a later one only when it should end within ``budget_s`` seconds. ``recorder`` sees
    the sampling forwards, response ``j`` as request ``j``."""
    if settings.generation_dtype is not None:
        policy = copy.deepcopy(policy).to(getattr(torch, settings.generation_dtype))
    engine = SpeculativeEngine(policy, None, 0)
    t0, out, bs, last = time.perf_counter(), [], settings.generation_batch, 0.0
    for c in range(0, len(prompts), bs):
        if budget_s is not None and c and time.perf_counter() - t0 + last > budget_s:
            break  # the next batch (about as long as the last) would end past the budget
        t1 = time.perf_counter()
        chunk = prompts[c:c + bs]
        if recorder is not None:
            recorder.request_offset = c
        res = engine.generate(chunk, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                              top_p=settings.top_p, seed=settings.seed * 1_000_003 + c,
                              stop_token_ids=[tokenizer.eos_token_id], observer=recorder)
        out.extend((p, list(r.token_ids)) for p, r in zip(chunk, res))  # the engine emits >= 1 token a request
        last, dt = time.perf_counter() - t1, time.perf_counter() - t0
        n = sum(len(x) for _, x in out)
        log(f"  warm start: generated {len(out)}/{len(prompts)} responses, {n} tokens in {dt:.0f}s "
            f"({n / max(dt, 1e-9):.0f} tok/s)")
    return out


def install_vocab(policy, draft, corpus, settings: WarmStartSettings) -> None:
    """Draft vocabulary: the most frequent completion tokens of the corpus; the draft re-initialised from the
    policy for it (``lm_head`` rows = the policy's, see :meth:`Eagle3Draft.from_policy`)."""
    c = draft.config
    counts = count_tokens(torch.tensor([t for _, comp in corpus for t in comp]), int(c.vocab_size))
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        fresh = Eagle3Draft.from_policy(policy, draft_vocab_size=int(c.draft_vocab_size), taps=tuple(c.taps),
                                        token_counts=counts)
    draft.load_state_dict(fresh.state_dict())


def warm_start_draft(policy, tokenizer, task, draft, settings: WarmStartSettings, cache_dir,
                     log: Callable[[str], None] = print,
                     on_eval: Callable[[dict], None] | None = None) -> WarmStartReport:
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
    t_start = time.perf_counter()
    settings = resolve_settings(settings, next(policy.parameters()).device)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    train_texts, _ = split_prompts(task, settings)
    limit = int(policy.config.max_position_embeddings) - settings.max_new_tokens
    prompts = [p for p in (encode_prompt(tokenizer, t) for t in train_texts) if 0 < len(p) < limit]
    if not prompts:
        raise ValueError(f"no training prompt fits the context: every one is longer than max_position_embeddings - "
                         f"max_new_tokens = {limit} tokens")
    policy_key = state_fingerprint(policy)
    gen = {k: v for k, v in asdict(settings).items() if k in ("num_prompts", "heldout_prompts", "max_new_tokens",
                                                              "temperature", "top_p", "generation_batch",
                                                              "generation_budget_s", "generation_dtype", "seed",
                                                              "time_budget_s", "generation_share")}
    corpus_key = _digest(policy_key, gen, prompts)
    key = _digest(corpus_key, asdict(draft.config), asdict(settings))
    draft_dir = cache_dir / f"draft-{key}"
    if (draft_dir / _COMPLETE).is_file():
        loaded = Eagle3Draft.from_pretrained(draft_dir, dtype=draft.fc.weight.dtype, device=draft.fc.weight.device)
        draft.load_state_dict(loaded.state_dict())
        saved = json.loads((draft_dir / "report.json").read_text())
        saved.update(cache_hit=True, draft_dir=str(draft_dir), total_s=time.perf_counter() - t_start)
        log(f"draft warm start: cache hit {draft_dir} (implied acceptance {saved['val_acceptance']:.2f})")
        return WarmStartReport(**saved)

    report = WarmStartReport(cache_hit=False, draft_dir=str(draft_dir), key=key, precision=dict(
        generation_dtype=settings.generation_dtype, feature_precision=settings.feature_precision,
        fit_precision=settings.fit.precision))
    log(f"draft warm start: sampling in {settings.generation_dtype or 'the policy dtype'}, features "
        f"{settings.feature_precision}, fit {settings.fit.precision}")
    corpus_dir = cache_dir / f"corpus-{corpus_key}"
    t0, recorder = time.perf_counter(), None
    if (corpus_dir / "samples.json").is_file():
        corpus = [(p, c) for p, c in json.loads((corpus_dir / "samples.json").read_text())]
        log(f"draft warm start: {len(corpus)} cached responses from {corpus_dir}")
    else:
        budgets = [b for b in (settings.generation_budget_s, settings.time_budget_s and
                                settings.time_budget_s * settings.generation_share) if b]
        if settings.capture_features:
            recorder = FeatureRecorder(policy, draft.config.taps, settings.temperature, settings.feature_dtype,
                                       spill_dir=cache_dir / f"capture-{corpus_key}.tmp")
        try:
            corpus = generate_corpus(policy, tokenizer, prompts, settings, log, min(budgets) if budgets else None,
                                     recorder)
            if not corpus:
                raise ValueError("the policy produced no response token for any training prompt")
        except BaseException:
            if recorder is not None:
                recorder.close()
            raise
        corpus_dir.mkdir(exist_ok=True)
        (corpus_dir / "samples.tmp").write_text(json.dumps(corpus))
        (corpus_dir / "samples.tmp").rename(corpus_dir / "samples.json")
    report.generation_s = time.perf_counter() - t0
    report.prompts, report.generated_tokens = len(corpus), sum(len(c) for _, c in corpus)

    if settings.rebuild_vocab:
        install_vocab(policy, draft, corpus, settings)
    target_ids = draft.draft_to_target(torch.arange(int(draft.config.draft_vocab_size), device=draft.d2t.device))
    feat_key = _digest(corpus_key, target_ids.tolist(), list(draft.config.taps), settings.feature_dtype,
                       settings.feature_precision)
    feat_dir = cache_dir / f"features-{feat_key}"
    t0 = time.perf_counter()
    docs = [(p + c, len(p) - 1) for p, c in corpus]
    if (feat_dir / "meta.json").is_file():
        cache = FeatureCache(feat_dir)
        if recorder is not None:
            recorder.close()
    elif recorder is not None:
        with recorder:  # its spilled records are removed once the cache is written
            cache = recorder.write(docs, list(range(len(docs))), target_ids, feat_dir)
        log(f"  warm start: features of {len(docs)} documents kept from the sampling forwards "
            f"({time.perf_counter() - t0:.0f}s)")
    else:
        every = max(1, report.generated_tokens // 10)
        state = {"next": every}

        def progress(done: int, total: int) -> None:
            if done >= state["next"] or done == total:
                state["next"] = done + every
                log(f"  warm start: features {done}/{total} tokens ({time.perf_counter() - t0:.0f}s)")

        with torch.no_grad():
            cache = build_feature_cache(policy, docs, target_ids, draft.config.taps, feat_dir,
                                        batch_tokens=settings.feature_batch_tokens, dtype=settings.feature_dtype,
                                        temperature=settings.temperature, precision=settings.feature_precision,
                                        on_progress=progress)
    report.features_s = time.perf_counter() - t0
    report.entropy, report.argmax_coverage = cache.meta["entropy"], cache.meta["argmax_coverage"]
    log(f"draft warm start: {cache.meta['loss_rows']} target rows, policy entropy at T={settings.temperature} "
        f"{report.entropy:.3f} nats/token, draft vocabulary {cache.draft_vocab_size} covers "
        f"{report.argmax_coverage:.3f} of the policy's top-1")

    outside = [0.0]  # seconds spent in on_eval (the caller's measurements are not warm-start time)

    def elapsed() -> float:
        """Warm-start seconds so far, ``on_eval`` time excluded."""
        return time.perf_counter() - t_start - outside[0]

    def eval_hook(entry: dict) -> None:
        if on_eval is not None:
            t = time.perf_counter()
            on_eval({**entry, "warmstart_seconds": t - t_start - outside[0]})
            outside[0] += time.perf_counter() - t

    fit = settings.fit
    if settings.time_budget_s:
        left = settings.time_budget_s - elapsed() - 10.0  # 10 s for saving the draft
        fit = dataclasses.replace(fit, time_budget_s=max(1e-3, min(left, fit.time_budget_s or left)))
    t0 = time.perf_counter()
    result: FitResult = fit_draft(draft, policy.embed, cache, fit, log=log, on_eval=eval_hook)
    report.fit_s = time.perf_counter() - t0 - outside[0]
    report.fit = result.as_dict()
    report.val_accuracy = list(result.history[-1]["val_accuracy"]) if result.history else []
    report.val_acceptance = implied_acceptance_length(report.val_accuracy)
    unused = settings.time_budget_s - elapsed() if settings.time_budget_s else 0.0
    if result.ended_by == "epochs" and unused > 60:
        log(f"draft warm start: the fit ran its {fit.epochs:g} epochs ({result.planned_steps} steps) with "
            f"{unused / 60:.1f} min of the budget left: a larger corpus (generation_share) or more epochs would use "
            f"it")
    held_out = cache.split(fit.val_docs)[1]  # the documents the fit reported on
    if settings.calibrate_temperature and held_out:
        t0 = time.perf_counter()
        cal = calibrate_draft_temperature(draft, policy.embed, cache, held_out, fit, settings.temperature)
        report.calibration = asdict(cal)
        report.fit_s += time.perf_counter() - t0
        log(f"draft warm start: proposal temperature scale {cal.scale:g} (implied acceptance by overlap "
            f"{cal.acceptance[0]:.2f} -> {max(cal.acceptance):.2f} on {cal.rows} held-out rows)")

    shutil.rmtree(draft_dir, ignore_errors=True)
    draft.save_pretrained(draft_dir)
    report.total_s = elapsed()
    (draft_dir / "report.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (draft_dir / _COMPLETE).write_text(key)
    log(f"draft warm start: {report.total_s:.0f}s (generation {report.generation_s:.0f}s, features "
        f"{report.features_s:.0f}s, fit {report.fit_s:.0f}s), {result.tokens_seen} tokens seen, held-out step-0 acc "
        f"{report.val_accuracy[0] if report.val_accuracy else float('nan'):.3f}, implied acceptance "
        f"{report.val_acceptance:.2f}; saved {draft_dir}")
    return report
