"""The drafter protocol: every part of the library a drafter touches, and where each drafter implements it.

A recipe names its drafter (``draft.type``: ``eagle3`` | ``dflash`` | ``dspark``, NeMo-RL's ``speculator_type``
names); a :class:`DrafterKind` says what that name means to every part (docs/design/drafters.md has the table):

- **the model**: EAGLE-3 ``models.eagle3.Eagle3Draft``; DFlash ``models.dflash.DFlashDraft``; DSpark
  ``models.dspark.DSparkDraft`` (DFlash plus the Markov and confidence heads).
- **taps, the loss over a packed batch, CP / PP / FSDP2, implied rounds, the A/B, the warm start's loss**: EAGLE-3
  ``training.drafter.Eagle3Term`` (TTT unroll, branch attention merged into the ring); DFlash
  ``training.dflash_term.DFlashTerm`` (anchors per document, the context on the ring, the mask embedding over PP);
  DSpark ``training.dspark_term.DSparkTerm`` (DFlash's, plus the teacher-forced Markov bias and the three-term loss).
- **the engine round**: EAGLE-3 ``rollout.embedded.speculative.SpeculativeEngine``; DFlash and DSpark
  ``rollout.embedded.block.BlockSpeculativeEngine`` (DSpark's proposals drawn one position at a time through the
  Markov head, from one drafter forward).
- **export / load**: ``Eagle3Draft.save_pretrained`` / ``from_pretrained`` (vLLM ``eagle3``);
  ``DFlashDraft.save_pretrained`` / ``models.dflash_io.load_dflash`` (vLLM ``dflash``);
  ``DSparkDraft.save_pretrained`` / ``models.dspark_io.load_dspark`` (vLLM ``dspark``).
- **refit**: the drafter's state dict, bucketed (``rollout.refit.sync``), for every kind (a block drafter owns no
  embedding and no head: the policy's are pushed with the policy).

A research drafter registers a kind of its own (:func:`register_drafter`) and a term for its model class
(``training.drafter.register_draft_term``); a subclass of a drafter's model keeps its kind and term.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.dflash_io import load_dflash
from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.models.dspark_io import load_dspark
from lightning_codraft.models.eagle3 import Eagle3Draft
from lightning_codraft.rollout.embedded.batch import decode_dtype
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine


@dataclass(frozen=True)
class DrafterKind:
    """What one drafter type is to every part of the library.

    Attributes:
        name: its ``draft.type``.
        model: its model class (a subclass is the same kind).
        build: ``build(policy, draft_config) -> drafter``, fresh, for ``policy``.
        engine: ``engine(policy, drafter, k, sampling=, adaptive=, max_batch_size=, dtype=, verify_length=,
            confidence_threshold=) -> RolloutEngine``, the embedded engine that decodes with it.
        save: ``save(drafter, directory) -> directory``, in the format vLLM loads for it.
        load: ``load(directory) -> drafter``.
    """

    name: str
    model: type
    build: Callable[[nn.Module, Any], nn.Module]
    engine: Callable[..., Any]
    save: Callable[[nn.Module, Path], Path]
    load: Callable[[Path], nn.Module]


def _build_eagle3(policy: nn.Module, d) -> Eagle3Draft:
    """A fresh EAGLE-3 draft; below the policy's vocabulary its map starts uniform (the warm start installs one)."""
    V = policy.config.vocab_size
    counts = torch.ones(V) if d.draft_vocab_size is not None and d.draft_vocab_size < V else None
    return Eagle3Draft.from_policy(policy, draft_vocab_size=d.draft_vocab_size, token_counts=counts)


def _build_dflash(policy: nn.Module, d) -> DFlashDraft:
    return DFlashDraft.from_policy(policy, num_hidden_layers=d.num_layers, block_size=d.block_size)


def _build_dspark(policy: nn.Module, d) -> DSparkDraft:
    return DSparkDraft.from_policy(
        policy,
        markov_rank=d.markov_rank,
        markov_head_type=d.markov_head_type,
        confidence_head=d.confidence_head,
        num_hidden_layers=d.num_layers,
        block_size=d.block_size,
    )


def _eagle3_engine(policy, draft, k, *, sampling, adaptive, max_batch_size=None, dtype=None, **prefix):
    if prefix.get("verify_length", "fixed") != "fixed":
        raise ValueError(f"verify_length={prefix['verify_length']!r}: an EAGLE-3 draft has no confidence head")
    return SpeculativeEngine(
        policy, draft, k, max_batch_size=max_batch_size, adaptive=adaptive, sampling=sampling, dtype=dtype
    )


def _dflash_engine(policy, draft, k, *, sampling, adaptive, max_batch_size=None, dtype=None, **prefix):
    if draft is None or k == 0:  # plain decoding
        return SpeculativeEngine(policy, None, 0, max_batch_size=max_batch_size, sampling=sampling, dtype=dtype)
    weights = next(policy.parameters())
    if decode_dtype(dtype, weights.device) not in (None, weights.dtype):
        raise ValueError(
            f"dtype={dtype!r}: the block engine decodes in the weights' dtype ({weights.dtype}); pass None"
        )
    return BlockSpeculativeEngine(
        policy, draft, k, sampling=sampling, max_batch_size=max_batch_size, adaptive=adaptive, **prefix
    )


DRAFTERS: dict[str, DrafterKind] = {
    "eagle3": DrafterKind(
        "eagle3", Eagle3Draft, _build_eagle3, _eagle3_engine, Eagle3Draft.save_pretrained, Eagle3Draft.from_pretrained
    ),
    "dflash": DrafterKind(
        "dflash", DFlashDraft, _build_dflash, _dflash_engine, DFlashDraft.save_pretrained, load_dflash
    ),
    "dspark": DrafterKind(
        "dspark", DSparkDraft, _build_dspark, _dflash_engine, DSparkDraft.save_pretrained, load_dspark
    ),
}
"""Every drafter type by its ``draft.type``."""


def register_drafter(kind: DrafterKind) -> None:
    """Add (or replace) a drafter type."""
    DRAFTERS[kind.name] = kind


def drafter_kind(draft: str | nn.Module) -> DrafterKind:
    """The kind of a ``draft.type`` name, or of a drafter (the nearest registered model class on its MRO)."""
    if isinstance(draft, str):
        if draft not in DRAFTERS:
            raise ValueError(f"draft.type={draft!r} is none of the drafters {sorted(DRAFTERS)}")
        return DRAFTERS[draft]
    for cls in type(draft).__mro__:
        for kind in DRAFTERS.values():
            if kind.model is cls:
                return kind
    raise TypeError(f"a {type(draft).__name__} is none of the registered drafters' models ({sorted(DRAFTERS)})")
