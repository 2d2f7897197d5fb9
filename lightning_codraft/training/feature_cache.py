"""The draft warm start's feature cache: a frozen policy's taps and soft targets over a corpus, computed once.

The draft's TTT loss (:func:`~lightning_codraft.training.draft_loss.ttt_draft_loss`) needs, per packed row, the
policy's three taps ``(3, H)`` and the policy's distribution restricted to the draft vocabulary. A frozen policy
gives the same features every epoch, so they are computed ONCE (:func:`build_feature_cache`) into a
:class:`FeatureCache` of memory-mapped ``.npy`` files, and every epoch of
:func:`~lightning_codraft.training.draft_fit.fit_draft` costs the draft alone.

What the cache stores, and why it reproduces the loss: ``ttt_draft_loss`` reads the policy logits of a row
through (a) the softmax over the draft vocabulary's target ids and (b) whether the full-vocabulary argmax lies
in that vocabulary (and, if it does, which draft id it is, for the accuracy). The cache keeps (a) as the
restricted logits minus their row maximum (shift-invariant softmax; fp16 is finest near 0, where the mass is)
plus one extra column, ``+1`` when the argmax lies outside the draft vocabulary and ``-1`` otherwise. Calling
``ttt_draft_loss`` on these ``(T, Vd + 1)`` "compact logits" with the identity map ``d2t = 0`` and ``t2d =
[True] * Vd + [False]`` gives the same loss, per-step losses and accuracies as the full ``(T, V)`` logits with
the draft's own map (tested equal in fp32). A top-k cache would drop the tail of the soft target and change
the loss; the full restricted distribution costs ``2 Vd`` bytes a row.

Only rows whose distribution is a draft target (the completion's) keep logits; every row keeps its taps, since
the draft attends to the whole prefix (prompt included).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from lightning_codraft.attention.packing import position_ids_from_cu_seqlens
from lightning_codraft.models.precision import AUTO, resolve_precision

_DTYPES = {"float16": (np.float16, torch.float16), "float32": (np.float32, torch.float32)}
_META = "meta.json"
OUTSIDE, INSIDE = 1.0, -1.0  # extra compact column: argmax outside / inside the draft vocabulary
PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16}  # autocast dtype; AUTO resolves to one of these
PRECISION_NAMES = sorted([*PRECISIONS, AUTO])


def pack_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive document indices grouped so each group holds at most ``max_tokens`` tokens (a longer
    document forms a group of its own)."""
    groups: list[list[int]] = []
    cur, n = [], 0
    for i, length in enumerate(lengths):
        if cur and n + length > max_tokens:
            groups.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += int(length)
    if cur:
        groups.append(cur)
    return groups


class FeatureCache:
    """A directory of a frozen policy's features over a corpus of ``N`` documents, memory-mapped.

    Files: ``ids.npy`` ``(Ntok,)`` int32 token ids; ``doc_offsets.npy`` ``(N + 1,)`` int64 token offsets;
    ``loss_start.npy`` ``(N,)`` int64, the first row of each document whose distribution is a draft target
    (rows ``loss_start .. len - 2`` are; the last row predicts past the document); ``loss_offsets.npy``
    ``(N + 1,)`` int64 offsets into ``targets.npy`` ``(Nloss, Vd + 1)`` compact logits (module docstring);
    ``taps.npy`` ``(Ntok, 3, H)``; ``meta.json`` (written last: its presence marks a complete cache).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        meta_file = self.path / _META
        if not meta_file.is_file():
            raise FileNotFoundError(f"{meta_file} not found: {self.path} is not a complete feature cache; build it "
                                    "with build_feature_cache(...)")
        self.meta = json.loads(meta_file.read_text())
        load = lambda name: np.load(self.path / f"{name}.npy", mmap_mode="r")  # noqa: E731
        self.ids, self.doc_offsets, self.loss_start = load("ids"), load("doc_offsets"), load("loss_start")
        self.loss_offsets, self.targets, self.taps = load("loss_offsets"), load("targets"), load("taps")

    @property
    def num_docs(self) -> int:
        return len(self.loss_start)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.meta["draft_vocab_size"])

    def split(self, val_docs: int) -> tuple[list[int], list[int]]:
        """``(training, held-out)`` document ids: the last ``val_docs`` (at most all but one) are held out."""
        n = max(1, self.num_docs - val_docs)
        return list(range(n)), list(range(n, self.num_docs))

    def corpus(self) -> list[tuple[list[int], list[int]]]:
        """``(prompt ids, completion ids)`` of every document, split after its row ``loss_start`` (the prompt's
        last token for a ``prompt + completion`` document: :func:`build_feature_cache`)."""
        out = []
        for d in range(self.num_docs):
            a, b, s = int(self.doc_offsets[d]), int(self.doc_offsets[d + 1]), int(self.loss_start[d])
            ids = self.ids[a:b].tolist()
            out.append((ids[:s + 1], ids[s + 1:]))
        return out

    def doc_lengths(self) -> np.ndarray:
        """``(N,)`` token count of each document."""
        return np.diff(self.doc_offsets)

    def batch(self, docs: Sequence[int]) -> dict[str, Tensor]:
        """Documents ``docs`` packed into one fp32 training batch.

        Returns:
            ``input_ids`` ``(T,)`` int64, ``cu_seqlens`` ``(n + 1,)`` int32, ``position_ids`` ``(T,)`` int64,
            ``taps`` ``(3, T, H)`` fp32, ``compact_logits`` ``(T, Vd + 1)`` fp32 (0 off the loss rows) and
            ``loss_mask`` ``(T,)`` fp32.
        """
        lo, hi = self.doc_offsets[docs], self.doc_offsets[np.asarray(docs) + 1]
        lengths = hi - lo
        T, vd1 = int(lengths.sum()), self.draft_vocab_size + 1
        ids = np.concatenate([self.ids[a:b] for a, b in zip(lo, hi)])
        taps = np.concatenate([self.taps[a:b] for a, b in zip(lo, hi)]).astype(np.float32)
        logits = np.zeros((T, vd1), dtype=np.float32)
        mask = np.zeros(T, dtype=np.float32)
        row = 0
        for d, n in zip(docs, lengths):
            s = int(self.loss_start[d])
            a, b = int(self.loss_offsets[d]), int(self.loss_offsets[d + 1])
            logits[row + s: row + s + b - a] = self.targets[a:b]
            mask[row + s: row + s + b - a] = 1.0
            row += int(n)
        cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
        cu[1:] = torch.from_numpy(np.cumsum(lengths)).to(torch.int32)
        return {"input_ids": torch.from_numpy(ids.astype(np.int64)), "cu_seqlens": cu,
                "position_ids": position_ids_from_cu_seqlens(cu).long(),
                "taps": torch.from_numpy(taps).transpose(0, 1), "compact_logits": torch.from_numpy(logits),
                "loss_mask": torch.from_numpy(mask)}


def compact_vocab(draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """``(d2t, t2d)`` to pass :func:`ttt_draft_loss` with compact logits: identity ids, extra column excluded."""
    t2d = torch.ones(draft_vocab_size + 1, dtype=torch.bool)
    t2d[-1] = False
    return torch.zeros(draft_vocab_size, dtype=torch.int64), t2d


def compact_logits(policy_logits: Tensor, target_ids: Tensor) -> Tensor:
    """``(T, V)`` policy logits -> ``(T, Vd + 1)`` compact logits (module docstring) for target ids ``(Vd,)``."""
    restricted = policy_logits.float()[:, target_ids]
    rmax = restricted.max(-1, keepdim=True).values
    outside = policy_logits.float().max(-1, keepdim=True).values > rmax
    extra = torch.where(outside, OUTSIDE, INSIDE).to(restricted.dtype)
    return torch.cat([restricted - rmax, extra], dim=-1)


@torch.no_grad()
def build_feature_cache(policy, docs: Sequence[tuple[Sequence[int], int]], target_ids: Tensor, taps: Sequence[int],
                        path: str | os.PathLike, *, batch_tokens: int = 4096, dtype: str = "float16",
                        temperature: float = 1.0, precision: str = "32-true",
                        on_progress: Callable[[int, int], None] | None = None) -> FeatureCache:
    """Run the frozen ``policy`` once over ``docs`` and store its taps and compact logits.

    Args:
        policy: a :class:`~lightning_codraft.models.Policy` (packed forward with ``taps=``).
        docs: ``(token_ids, loss_start)`` per document: rows ``loss_start .. len - 2`` are draft targets (for a
            ``prompt + completion`` document, ``loss_start = len(prompt) - 1``); documents need >= 2 tokens.
        target_ids: ``(Vd,)`` target id of each draft id (``arange(Vd) + d2t``).
        taps: the draft's three policy tap ids.
        path: the cache directory (replaced when it exists).
        batch_tokens: tokens per policy forward (documents are packed whole).
        dtype: ``"float16"`` (default) or ``"float32"`` storage of taps and logits.
        temperature: the policy's mean per-token entropy at this temperature over the target rows is recorded
            in ``meta["entropy"]`` (with ``meta["argmax_coverage"]``, the share of target rows whose top-1 is
            in the draft vocabulary).
        precision: ``"32-true"``, ``"bf16-mixed"`` (the policy under bf16 autocast: 4x faster on a CPU with AMX;
            taps and logits carry bf16 rounding) or ``"auto"`` (bf16 where it is fast, ``resolve_precision``).
        on_progress: called with ``(tokens done, tokens total)`` after every forward.
    """
    if precision not in PRECISION_NAMES or dtype not in _DTYPES:
        raise ValueError(f"precision={precision!r} must be one of {PRECISION_NAMES} and dtype={dtype!r} one of "
                         f"{sorted(_DTYPES)}")
    for i, (ids, start) in enumerate(docs):
        if len(ids) < 2 or not 0 <= int(start) <= len(ids) - 2:
            raise ValueError(f"document {i}: {len(ids)} tokens with loss_start={start}; need >= 2 tokens and "
                             f"0 <= loss_start <= len - 2")
    np_dtype = _DTYPES[dtype][0]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lengths = [len(ids) for ids, _ in docs]
    n_loss = [n - 1 - int(s) for n, (_, s) in zip(lengths, docs)]
    doc_off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    loss_off = np.concatenate([[0], np.cumsum(n_loss)]).astype(np.int64)
    H, Vd = int(policy.config.hidden_size), int(target_ids.numel())
    mm = lambda name, shape, dt: np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", dtype=dt,  # noqa: E731
                                                           shape=shape)
    out_ids, out_taps = mm("ids", (int(doc_off[-1]),), np.int32), mm("taps", (int(doc_off[-1]), 3, H), np_dtype)
    out_targets = mm("targets", (int(loss_off[-1]), Vd + 1), np_dtype)
    np.save(tmp / "doc_offsets.npy", doc_off)
    np.save(tmp / "loss_offsets.npy", loss_off)
    np.save(tmp / "loss_start.npy", np.asarray([int(s) for _, s in docs], dtype=np.int64))
    target_ids = target_ids.long().to(next(policy.parameters()).device)
    dev, amp = target_ids.device, PRECISIONS[resolve_precision(precision, target_ids.device)]
    entropy_sum, covered = 0.0, 0
    for group in pack_batches(lengths, batch_tokens):
        ids = torch.cat([torch.as_tensor(docs[d][0], dtype=torch.int64) for d in group])
        cu = torch.zeros(len(group) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor([lengths[d] for d in group]).cumsum(0)
        pos = position_ids_from_cu_seqlens(cu).long().to(dev)
        with torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
            out = policy(ids.to(dev), cu_seqlens=cu.to(dev), position_ids=pos, taps=tuple(taps))
        starts = cu.tolist()
        rows = torch.cat([torch.arange(starts[j] + int(docs[d][1]), starts[j + 1] - 1) for j, d in enumerate(group)])
        logits = out.logits[rows.to(dev)].float()
        compact = compact_logits(logits, target_ids)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        entropy_sum += float(-(logp.exp() * logp).sum())
        covered += int((compact[:, -1] == INSIDE).sum())
        a, b = int(doc_off[group[0]]), int(doc_off[group[-1] + 1])
        out_ids[a:b] = ids.numpy().astype(np.int32)
        out_taps[a:b] = torch.stack(out.taps, dim=1).float().cpu().numpy().astype(np_dtype)
        out_targets[int(loss_off[group[0]]):int(loss_off[group[-1] + 1])] = compact.cpu().numpy().astype(np_dtype)
        if on_progress is not None:
            on_progress(b, int(doc_off[-1]))
    for arr in (out_ids, out_taps, out_targets):
        arr.flush()
    del out_ids, out_taps, out_targets
    total_loss = max(int(loss_off[-1]), 1)
    meta = dict(version=1, num_docs=len(docs), tokens=int(doc_off[-1]), loss_rows=int(loss_off[-1]), hidden_size=H,
                draft_vocab_size=Vd, taps=[int(t) for t in taps], dtype=dtype, temperature=float(temperature),
                entropy=entropy_sum / total_loss, argmax_coverage=covered / total_loss)
    (tmp / _META).write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return FeatureCache(path)
