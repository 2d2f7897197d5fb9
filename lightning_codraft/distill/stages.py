"""The warm start's stages, each with the cache key it owns (distill/warmstart.py runs them in order).

1. **corpus** (``corpus-<key>/``, :func:`corpus_key`: the policy's weights, the sampling settings, the prompts):
   :func:`sample_corpus`, the policy's own responses;
2. **vocabulary**: :func:`install_vocab`, the draft vocabulary from the corpus (no cache of its own: the draft's
   key covers it);
3. **features** (``features-<key>/``, :func:`features_key`: the corpus, the draft vocabulary's target ids, the taps,
   the storage dtype and precision): :func:`corpus_features`, the policy's taps and soft targets;
4. **draft** (``draft-<key>/``, :func:`draft_key`: the corpus, the draft's config and every setting): the fitted,
   calibrated draft (``warmstart.warm_start_draft``).

A later run, or one that changes only later stages' settings, reuses every earlier stage's cache.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_codraft.distill.cache import FeatureCache, build_feature_cache
from lightning_codraft.distill.capture import FeatureRecorder
from lightning_codraft.distill.settings import CORPUS, FEATURES, WarmStartSettings, stage_fields
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.models.vocab import count_tokens
from lightning_codraft.rollout import SpeculativeEngine

Corpus = list[tuple[list[int], list[int]]]
"""``(prompt ids, completion ids)`` of every response."""

GENERATION_FIELDS = stage_fields(WarmStartSettings, CORPUS)
"""The settings the corpus depends on (its key hashes these only): the fields whose metadata names the corpus."""
FEATURE_FIELDS = stage_fields(WarmStartSettings, FEATURES)
"""The settings the feature cache adds to the corpus' key."""


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


def corpus_key(policy_key: str, prompts: list[list[int]], settings: WarmStartSettings) -> str:
    """Stage 1's key: the policy's :func:`state_fingerprint`, the sampling settings, the prompts."""
    return _digest(policy_key, {k: v for k, v in asdict(settings).items() if k in GENERATION_FIELDS}, prompts)


def features_key(corpus: str, target_ids: torch.Tensor, taps, settings: WarmStartSettings) -> str:
    """Stage 3's key: the corpus' key, the draft vocabulary's target ids, the taps, storage dtype and precision."""
    return _digest(corpus, target_ids.tolist(), list(taps), *(getattr(settings, k) for k in FEATURE_FIELDS))


def draft_key(corpus: str, draft, settings: WarmStartSettings) -> str:
    """Stage 4's key: the corpus' key, the draft's config, every setting (the fit's ``loss_type`` only when it is not
    the default ``ce``, so drafts fitted before the setting existed keep their key)."""
    every = asdict(settings)
    if every["fit"].get("loss_type") == "ce":
        del every["fit"]["loss_type"]
    return _digest(corpus, asdict(draft.config), every)


def sample_corpus(
    policy,
    tokenizer,
    prompts: list[list[int]],
    taps,
    settings: WarmStartSettings,
    cache_dir: Path,
    key: str,
    log: Callable[[str], None],
) -> tuple[Corpus, FeatureRecorder | None]:
    """Stage 1: the corpus from ``corpus-<key>/``, or sampled (within the settings' generation budget) and saved
    there; with ``settings.capture_features``, a freshly sampled corpus comes with the
    :class:`FeatureRecorder` that kept its features (the caller closes it)."""
    corpus_dir = cache_dir / f"corpus-{key}"
    if (corpus_dir / "samples.json").is_file():
        corpus = [(p, c) for p, c in json.loads((corpus_dir / "samples.json").read_text())]
        log(f"draft warm start: {len(corpus)} cached responses from {corpus_dir}")
        return corpus, None
    budgets = [
        b
        for b in (
            settings.generation_budget_s,
            settings.time_budget_s and settings.time_budget_s * settings.generation_share,
        )
        if b
    ]
    recorder = None
    if settings.capture_features:
        recorder = FeatureRecorder(
            policy, taps, settings.temperature, settings.feature_dtype, spill_dir=cache_dir / f"capture-{key}.tmp"
        )
    try:
        corpus = generate_corpus(policy, tokenizer, prompts, settings, log, min(budgets) if budgets else None, recorder)
        if not corpus:
            raise ValueError("the policy produced no response token for any training prompt")
    except BaseException:
        if recorder is not None:
            recorder.close()
        raise
    corpus_dir.mkdir(exist_ok=True)
    (corpus_dir / "samples.tmp").write_text(json.dumps(corpus))
    (corpus_dir / "samples.tmp").rename(corpus_dir / "samples.json")
    return corpus, recorder


def corpus_features(
    policy,
    corpus: Corpus,
    recorder: FeatureRecorder | None,
    target_ids: torch.Tensor,
    taps,
    settings: WarmStartSettings,
    cache_dir: Path,
    key: str,
    log: Callable[[str], None],
) -> FeatureCache:
    """Stage 3: the feature cache ``features-<key>/``: loaded, written from ``recorder``'s records of the
    sampling forwards, or computed by a pass of the policy over the corpus. Closes ``recorder``."""
    feat_dir, t0 = cache_dir / f"features-{key}", time.perf_counter()
    docs = [(p + c, len(p) - 1) for p, c in corpus]
    if (feat_dir / "meta.json").is_file():
        if recorder is not None:
            recorder.close()
        return FeatureCache(feat_dir)
    if recorder is not None:
        with recorder:  # its spilled records are removed once the cache is written
            cache = recorder.write(docs, list(range(len(docs))), target_ids, feat_dir)
        log(
            f"  warm start: features of {len(docs)} documents kept from the sampling forwards "
            f"({time.perf_counter() - t0:.0f}s)"
        )
        return cache
    every = max(1, sum(len(c) for _, c in corpus) // 10)
    state = {"next": every}

    def progress(done: int, total: int) -> None:
        if done >= state["next"] or done == total:
            state["next"] = done + every
            log(f"  warm start: features {done}/{total} tokens ({time.perf_counter() - t0:.0f}s)")

    with torch.no_grad():
        return build_feature_cache(
            policy,
            docs,
            target_ids,
            taps,
            feat_dir,
            batch_tokens=settings.feature_batch_tokens,
            dtype=settings.feature_dtype,
            temperature=settings.temperature,
            precision=settings.feature_precision,
            on_progress=progress,
        )


def generate_corpus(
    policy,
    tokenizer,
    prompts: list[list[int]],
    settings: WarmStartSettings,
    log: Callable[[str], None] = print,
    budget_s: float | None = None,
    recorder: FeatureRecorder | None = None,
) -> list[tuple[list[int], list[int]]]:
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
        chunk = prompts[c : c + bs]
        if recorder is not None:
            recorder.request_offset = c
        res = engine.generate(
            chunk,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            seed=settings.seed * 1_000_003 + c,
            stop_token_ids=[tokenizer.eos_token_id],
            observer=recorder,
        )
        out.extend((p, list(r.token_ids)) for p, r in zip(chunk, res))  # the engine emits >= 1 token a request
        last, dt = time.perf_counter() - t1, time.perf_counter() - t0
        n = sum(len(x) for _, x in out)
        log(
            f"  warm start: generated {len(out)}/{len(prompts)} responses, {n} tokens in {dt:.0f}s "
            f"({n / max(dt, 1e-9):.0f} tok/s)"
        )
    return out


def install_vocab(policy, draft, corpus, settings: WarmStartSettings) -> None:
    """Draft vocabulary: the most frequent completion tokens of the corpus; the draft re-initialised from the
    policy for it (``lm_head`` rows = the policy's, see :meth:`Eagle3Draft.from_policy`)."""
    c = draft.config
    counts = count_tokens(torch.tensor([t for _, comp in corpus for t in comp]), int(c.vocab_size))
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        fresh = Eagle3Draft.from_policy(
            policy, draft_vocab_size=int(c.draft_vocab_size), taps=tuple(c.taps), token_counts=counts
        )
    draft.load_state_dict(fresh.state_dict())
