"""The draft warm start's feature cache: a frozen policy's taps and soft targets over a corpus, computed once.

The draft's TTT loss (:func:`~lightning_codraft.training.draft_loss.ttt_draft_loss`) needs, per packed row, the
policy's three taps ``(3, H)`` and the policy's distribution restricted to the draft vocabulary. A frozen policy
gives the same features every epoch, so they are computed ONCE (:func:`build_feature_cache`) into a
:class:`FeatureCache` of memory-mapped ``.npy`` files, and every epoch of
:func:`~lightning_codraft.distill.fit.fit_draft` costs the draft alone.

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
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_codraft.attention.packing import position_ids_from_cu_seqlens
from lightning_codraft.distill.settings import PRECISION_NAMES
from lightning_codraft.models.precision import resolve_precision

STORAGE_DTYPES = {"float16": (np.float16, torch.float16), "float32": (np.float32, torch.float32)}
_META = "meta.json"
OUTSIDE, INSIDE = 1.0, -1.0  # extra compact column: argmax outside / inside the draft vocabulary
PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16}  # autocast dtype; AUTO resolves to one of these


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
            raise FileNotFoundError(
                f"{meta_file} not found: {self.path} is not a complete feature cache; build it "
                "with build_feature_cache(...)"
            )
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
            out.append((ids[: s + 1], ids[s + 1 :]))
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
            logits[row + s : row + s + b - a] = self.targets[a:b]
            mask[row + s : row + s + b - a] = 1.0
            row += int(n)
        cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
        cu[1:] = torch.from_numpy(np.cumsum(lengths)).to(torch.int32)
        return {
            "input_ids": torch.from_numpy(ids.astype(np.int64)),
            "cu_seqlens": cu,
            "position_ids": position_ids_from_cu_seqlens(cu).long(),
            "taps": torch.from_numpy(taps).transpose(0, 1),
            "compact_logits": torch.from_numpy(logits),
            "loss_mask": torch.from_numpy(mask),
        }


def compact_vocab(draft_vocab_size: int) -> tuple[Tensor, Tensor]:
    """``(d2t, t2d)`` to pass :func:`ttt_draft_loss` with compact logits: identity ids, extra column excluded."""
    t2d = torch.ones(draft_vocab_size + 1, dtype=torch.bool)
    t2d[-1] = False
    return torch.zeros(draft_vocab_size, dtype=torch.int64), t2d


def compact_logits(policy_logits: Tensor, target_ids: Tensor) -> Tensor:
    """``(T, V)`` policy logits -> ``(T, Vd + 1)`` compact logits (module docstring) for target ids ``(Vd,)``."""
    restricted = policy_logits.float()[:, target_ids]
    outside = policy_logits.float().max(-1, keepdim=True).values > restricted.max(-1, keepdim=True).values
    return compact_restricted(restricted, outside[:, 0])


def compact_restricted(restricted: Tensor, outside: Tensor) -> Tensor:
    """``(T, Vd)`` logits on the draft vocabulary and ``(T,)`` bool "the full-vocabulary argmax lies outside it"
    -> ``(T, Vd + 1)`` compact logits (module docstring)."""
    rmax = restricted.max(-1, keepdim=True).values
    extra = torch.where(outside[:, None], OUTSIDE, INSIDE).to(restricted.dtype)
    return torch.cat([restricted - rmax, extra], dim=-1)


class CacheWriter:
    """Writes a :class:`FeatureCache` directory: memory-mapped files sized from the documents, filled by groups
    of consecutive documents (:meth:`write`), ``meta.json`` last (:meth:`finish`), then moved into place.

    Args:
        path: the cache directory (replaced when :meth:`finish` runs; written under ``<path>.tmp`` until then).
        docs: ``(token_ids, loss_start)`` per document (:func:`build_feature_cache`).
        hidden_size: H, the taps' width.
        draft_vocab_size: Vd.
        dtype: ``"float16"`` or ``"float32"`` storage of taps and logits.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        docs: Sequence[tuple[Sequence[int], int]],
        hidden_size: int,
        draft_vocab_size: int,
        dtype: str = "float16",
    ):
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype={dtype!r} must be one of {sorted(STORAGE_DTYPES)}")
        for i, (ids, start) in enumerate(docs):
            if len(ids) < 2 or not 0 <= int(start) <= len(ids) - 2:
                raise ValueError(
                    f"document {i}: {len(ids)} tokens with loss_start={start}; need >= 2 tokens and "
                    f"0 <= loss_start <= len - 2"
                )
        np_dtype = STORAGE_DTYPES[dtype][0]
        self.path, self.dtype = Path(path), dtype
        self.hidden_size, self.draft_vocab_size = int(hidden_size), int(draft_vocab_size)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.lengths = [len(ids) for ids, _ in docs]
        self.loss_start = np.asarray([int(s) for _, s in docs], dtype=np.int64)
        self.doc_off = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        n_loss = np.asarray(self.lengths, dtype=np.int64) - 1 - self.loss_start
        self.loss_off = np.concatenate([[0], np.cumsum(n_loss)]).astype(np.int64)
        mm = lambda name, shape, dt: np.lib.format.open_memmap(
            self.tmp / f"{name}.npy",
            mode="w+",  # noqa: E731
            dtype=dt,
            shape=shape,
        )
        tokens = int(self.doc_off[-1])
        self.ids, self.taps = mm("ids", (tokens,), np.int32), mm("taps", (tokens, 3, hidden_size), np_dtype)
        self.targets = mm("targets", (int(self.loss_off[-1]), draft_vocab_size + 1), np_dtype)
        np.save(self.tmp / "doc_offsets.npy", self.doc_off)
        np.save(self.tmp / "loss_offsets.npy", self.loss_off)
        np.save(self.tmp / "loss_start.npy", self.loss_start)
        self.entropy_sum, self.covered = 0.0, 0

    def write(self, first: int, last: int, ids: Tensor, taps: Tensor, compact: Tensor, entropy_sum: float) -> None:
        """Documents ``first .. last`` (inclusive): ``ids`` ``(n,)``, ``taps`` ``(n, 3, H)`` over their tokens,
        ``compact`` ``(n_loss, Vd + 1)`` over their loss rows, ``entropy_sum`` the sum of the policy's per-row
        entropies over those loss rows."""
        np_dtype = STORAGE_DTYPES[self.dtype][0]
        a, b = int(self.doc_off[first]), int(self.doc_off[last + 1])
        la, lb = int(self.loss_off[first]), int(self.loss_off[last + 1])
        if ids.shape[0] != b - a or taps.shape != (b - a, 3, self.hidden_size) or compact.shape[0] != lb - la:
            raise ValueError(
                f"documents {first}..{last}: got {tuple(ids.shape)} ids, {tuple(taps.shape)} taps and "
                f"{tuple(compact.shape)} targets for {b - a} tokens and {lb - la} loss rows"
            )
        self.ids[a:b] = ids.cpu().numpy().astype(np.int32)
        self.taps[a:b] = taps.float().cpu().numpy().astype(np_dtype)
        self.targets[la:lb] = compact.float().cpu().numpy().astype(np_dtype)
        self.entropy_sum += float(entropy_sum)
        self.covered += int((compact[:, -1] == INSIDE).sum())

    def finish(self, taps: Sequence[int], temperature: float, **extra) -> FeatureCache:
        """Write ``meta.json`` (``extra`` keys included), move the directory into place and open it."""
        for arr in (self.ids, self.taps, self.targets):
            arr.flush()
        del self.ids, self.taps, self.targets
        total_loss = max(int(self.loss_off[-1]), 1)
        meta = dict(
            version=1,
            num_docs=len(self.lengths),
            tokens=int(self.doc_off[-1]),
            loss_rows=int(self.loss_off[-1]),
            hidden_size=self.hidden_size,
            draft_vocab_size=self.draft_vocab_size,
            taps=[int(t) for t in taps],
            dtype=self.dtype,
            temperature=float(temperature),
            entropy=self.entropy_sum / total_loss,
            argmax_coverage=self.covered / total_loss,
            **extra,
        )
        (self.tmp / _META).write_text(json.dumps(meta, indent=1) + "\n")
        shutil.rmtree(self.path, ignore_errors=True)
        self.tmp.rename(self.path)
        return FeatureCache(self.path)


def row_entropy(logits: Tensor, temperature: float) -> Tensor:
    """``(..., V)`` logits -> ``(...,)`` entropy (nats) of ``softmax(logits / temperature)``, in fp32."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def build_feature_cache(
    policy,
    docs: Sequence[tuple[Sequence[int], int]],
    target_ids: Tensor,
    taps: Sequence[int],
    path: str | os.PathLike,
    *,
    batch_tokens: int = 4096,
    dtype: str = "float16",
    temperature: float = 1.0,
    precision: str = "32-true",
    on_progress: Callable[[int, int], None] | None = None,
) -> FeatureCache:
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
        precision: ``"32-true"``, ``"bf16-mixed"`` (the policy under bf16 autocast: faster on a CPU with AMX,
            docs/design/measurements.md; taps and logits carry bf16 rounding) or ``"auto"`` (bf16 where it is fast,
            ``resolve_precision``).
        on_progress: called with ``(tokens done, tokens total)`` after every forward.
    """
    if precision not in PRECISION_NAMES:
        raise ValueError(f"precision={precision!r} must be one of {PRECISION_NAMES}")
    writer = CacheWriter(path, docs, int(policy.config.hidden_size), int(target_ids.numel()), dtype)
    lengths = writer.lengths
    target_ids = target_ids.long().to(next(policy.parameters()).device)
    dev, amp = target_ids.device, PRECISIONS[resolve_precision(precision, target_ids.device)]
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
        writer.write(
            group[0],
            group[-1],
            ids,
            torch.stack(out.taps, dim=1),
            compact_logits(logits, target_ids),
            float(row_entropy(logits, temperature).sum()),
        )
        if on_progress is not None:
            on_progress(int(writer.doc_off[group[-1] + 1]), int(writer.doc_off[-1]))
    return writer.finish(taps, temperature)
