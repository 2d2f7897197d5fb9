"""The draft's features kept while the policy samples its corpus, instead of a second pass over it.

A self-distillation corpus is sampled by the policy itself (distill/warmstart.py), and every forward of that
sampling already computes what the draft's feature cache stores (distill/cache.py): the taps of each
fed token and the policy's distribution of the token after it. :class:`FeatureRecorder` watches the engine's
forwards (it is a ``rollout.engine.ForwardObserver``: ``SpeculativeEngine.generate(..., observer=)``) and
keeps, per request and position,

* the draft's three taps of every fed position (the prompt's from the prefill, each emitted token's from the
  decode forward that feeds it);
* at each loss position (the prompt's last one and every fed output position): the last layer's output ``h``
  (tap ``L``, fp32), the full-vocabulary argmax and the entropy at ``temperature`` of the engine's logits.

The wide records (taps, ``h``) are appended to files in a spill directory as they come, so a corpus of any size
costs disk rather than memory; the cache is assembled from them, memory-mapped, by groups of documents.

The draft vocabulary is chosen from the corpus AFTER sampling, so the soft targets cannot be written as the
tokens come; :meth:`FeatureRecorder.write` builds them then from ``h``: ``lm_head[target_ids](norm(h))`` is the
policy's logits restricted to the draft vocabulary (the policy's head, in its own dtype), and the argmax tells
whether the full-vocabulary top-1 lies outside it. The result is a :class:`FeatureCache` equal to
:func:`~lightning_codraft.distill.cache.build_feature_cache` over the same documents up to the rounding
of the decode's shapes (tested), except the taps of each document's LAST token, which no forward feeds and
which are stored as zeros: the draft's row there is no loss row and, attention being causal, no loss row
reads it, so the loss and its gradients are unchanged (tested).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_codraft.distill.cache import STORAGE_DTYPES, CacheWriter, FeatureCache, compact_restricted, row_entropy


class FeatureRecorder:
    """Keeps the features of the sequences an engine samples (a ``rollout.engine.ForwardObserver``).

    Args:
        policy: the :class:`~lightning_codraft.models.Policy` whose head builds the soft targets (the sampling
            engine may decode a cast copy of it).
        draft_taps: the draft's three policy tap ids.
        temperature: the per-token entropy recorded is that of ``softmax(logits / temperature)``.
        dtype: ``"float16"`` (default) or ``"float32"`` storage of the taps while sampling and in the cache.
        spill_dir: where the wide records go as they come (taps ``3 H`` values a fed token, last-layer output
            ``H`` fp32 values a loss row: ~4.6 KB a token at H = 576), so a corpus of any size costs disk, not
            memory; created if missing, removed by :meth:`close`. None: a fresh temporary directory.

    Attributes:
        request_offset: added to every request index the engine reports: set it to the first prompt's index
            in the corpus before each ``generate`` call of a chunked corpus.
    """

    def __init__(
        self,
        policy,
        draft_taps: Sequence[int],
        temperature: float = 1.0,
        dtype: str = "float16",
        spill_dir: str | os.PathLike | None = None,
    ):
        if len(draft_taps) != 3 or dtype not in STORAGE_DTYPES:
            raise ValueError(
                f"draft_taps={tuple(draft_taps)} must be 3 tap ids and dtype={dtype!r} one of {sorted(STORAGE_DTYPES)}"
            )
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        self.policy, self.temperature, self.dtype = policy, float(temperature), dtype
        self.draft_taps = tuple(int(t) for t in draft_taps)
        self.taps = self.draft_taps + (int(policy.config.num_hidden_layers),)  # tap L: the head's input
        self.request_offset = 0
        self.spill_dir = Path(spill_dir) if spill_dir is not None else Path(tempfile.mkdtemp(prefix="codraft-capture-"))
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._files = {name: open(self.spill_dir / f"{name}.bin", "wb") for name in ("taps", "hidden")}
        self._taps: list[tuple[np.ndarray, np.ndarray]] = []  # (request, position) of each taps record
        self._heads: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []  # (req, pos, argmax, entropy)

    def close(self) -> None:
        """Remove the spilled records (the recorder cannot write a cache afterwards)."""
        for f in self._files.values():
            f.close()
        shutil.rmtree(self.spill_dir, ignore_errors=True)

    def __enter__(self) -> FeatureRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ ForwardObserver
    def prefill(self, requests: list[int], lengths: list[int], taps: tuple[Tensor, ...], last_logits: Tensor) -> None:
        lens = torch.as_tensor(lengths, device=taps[0].device)
        valid = self._valid(lens, taps[0].shape[1])
        self._keep_taps(*self._positions(requests, torch.zeros_like(lens), valid), taps, valid)
        last = lens - 1
        rows = torch.arange(len(requests), device=lens.device)
        self._keep_heads(torch.as_tensor(requests), last, taps[3][rows, last], last_logits)

    def decode(
        self, requests: list[int], start: list[int], counts: list[int], taps: tuple[Tensor, ...], logits: Tensor
    ) -> None:
        valid = self._valid(torch.as_tensor(counts, device=logits.device), logits.shape[1])
        req, pos = self._positions(requests, torch.as_tensor(start, device=logits.device), valid)
        self._keep_taps(req, pos, taps, valid)
        self._keep_heads(req, pos, taps[3][valid], logits[valid])

    # ------------------------------------------------------------------ keeping
    @staticmethod
    def _valid(counts: Tensor, width: int) -> Tensor:
        """``(B, width)`` bool: row i's first ``counts[i]`` positions."""
        return torch.arange(width, device=counts.device)[None, :] < counts[:, None]

    @staticmethod
    def _positions(requests: list[int], first: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
        """``(n,)`` request and ``(n,)`` position of each valid entry of ``valid`` ``(B, S)``, row i's entries at
        positions ``first[i] + 0 .. S - 1``."""
        S = valid.shape[1]
        pos = (first[:, None] + torch.arange(S, device=valid.device)[None, :])[valid]
        return torch.as_tensor(requests, device=valid.device)[:, None].expand(-1, S)[valid], pos

    def _keep_taps(self, req: Tensor, pos: Tensor, taps: tuple[Tensor, ...], valid: Tensor) -> None:
        stacked = torch.stack([t[valid] for t in taps[:3]], dim=1)  # (n, 3, H)
        self._files["taps"].write(stacked.float().cpu().numpy().astype(STORAGE_DTYPES[self.dtype][0]).tobytes())
        self._taps.append((req.cpu().numpy() + self.request_offset, pos.cpu().numpy()))

    def _keep_heads(self, req: Tensor, pos: Tensor, hidden: Tensor, logits: Tensor) -> None:
        self._files["hidden"].write(hidden.float().cpu().numpy().tobytes())
        entropy = row_entropy(logits, self.temperature).double()
        self._heads.append(
            (
                req.cpu().numpy().astype(np.int64) + self.request_offset,
                pos.cpu().numpy(),
                logits.argmax(-1).cpu().numpy(),
                entropy.cpu().numpy(),
            )
        )

    # ------------------------------------------------------------------ writing
    @torch.no_grad()
    def write(
        self,
        docs: Sequence[tuple[Sequence[int], int]],
        requests: Sequence[int],
        target_ids: Tensor,
        path: str | os.PathLike,
        docs_per_write: int = 64,
    ) -> FeatureCache:
        """The recorded features of ``docs`` as a feature cache.

        Args:
            docs: ``(prompt + completion ids, len(prompt) - 1)`` per document, as
                :func:`~lightning_codraft.distill.cache.build_feature_cache` takes them.
            requests: the request index (``request_offset`` included) each document was sampled as.
            target_ids: ``(Vd,)`` target id of each draft id.
            path: the cache directory (replaced when it exists).
            docs_per_write: documents assembled at once.

        Raises:
            ValueError: a document's loss position was never seen (its request was not recorded, or the
                document is not what the request produced).
        """
        if len(docs) != len(requests):
            raise ValueError(f"{len(docs)} documents but {len(requests)} request indices")
        H = int(self.policy.config.hidden_size)
        writer = CacheWriter(path, docs, H, int(target_ids.numel()), self.dtype)
        doc_of = {int(r): d for d, r in enumerate(requests)}
        if len(doc_of) != len(requests):
            raise ValueError("request indices repeat: each document must be a distinct request")
        fed_end = np.asarray(writer.lengths, np.int64) - 1  # the last token is never fed
        t_rows, t_vals = self._destinations(self._taps, doc_of, writer.doc_off, np.zeros(len(docs), np.int64), fed_end)
        h_rows, h_vals = self._destinations(self._heads, doc_of, writer.loss_off, writer.loss_start, fed_end)
        for what, rows, want in (
            ("loss rows", h_rows, int(writer.loss_off[-1])),
            ("fed positions", t_rows, int(writer.doc_off[-1]) - len(docs)),
        ):
            if len(rows) != want or len(np.unique(rows)) != len(rows):
                raise ValueError(
                    f"the recorded forwards cover {len(np.unique(rows))} of the documents' {want} "
                    f"{what}: record the generate calls that sampled them (with request_offset set to "
                    "each call's first request index)"
                )
        taps_all, hidden = self._spilled("taps", (3, H), STORAGE_DTYPES[self.dtype][0]), self._spilled("hidden", (H,))
        argmax = torch.from_numpy(np.concatenate([x[2] for x in self._heads]))
        entropy = np.concatenate([x[3] for x in self._heads])
        t_order, h_order = np.argsort(t_rows, kind="stable"), np.argsort(h_rows, kind="stable")
        t_sorted, h_sorted = t_rows[t_order], h_rows[h_order]
        param = self.policy.lm_head.weight
        targets = target_ids.long().to(param.device)
        inside = torch.zeros(param.shape[0], dtype=torch.bool)
        inside[targets.cpu()] = True
        for first in range(0, len(docs), docs_per_write):
            last = min(first + docs_per_write, len(docs)) - 1
            a, b = int(writer.doc_off[first]), int(writer.doc_off[last + 1])
            i, j = np.searchsorted(t_sorted, [a, b])
            taps = np.zeros((b - a, 3, H), dtype=taps_all.dtype)
            taps[t_sorted[i:j] - a] = taps_all[t_vals[t_order[i:j]]]
            la, lb = int(writer.loss_off[first]), int(writer.loss_off[last + 1])
            i, j = np.searchsorted(h_sorted, [la, lb])
            rows = h_vals[h_order[i:j]]
            sel = torch.from_numpy(rows)
            h = torch.from_numpy(np.asarray(hidden[rows])).to(device=param.device, dtype=param.dtype)
            restricted = F.linear(self.policy.model.norm(h), param[targets]).float()
            compact = compact_restricted(restricted, ~inside[argmax[sel]].to(restricted.device))
            ids = torch.cat([torch.as_tensor(docs[d][0], dtype=torch.int64) for d in range(first, last + 1)])
            writer.write(first, last, ids, torch.from_numpy(taps), compact, float(entropy[rows].sum()))
        return writer.finish(self.draft_taps, self.temperature, source="sampling")

    def _spilled(self, name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """The records spilled to ``<name>.bin``, memory-mapped ``(n, *shape)``."""
        self._files[name].flush()
        path = self.spill_dir / f"{name}.bin"
        n = path.stat().st_size // (np.dtype(dtype).itemsize * int(np.prod(shape)))
        return np.memmap(path, dtype=dtype, mode="r", shape=(n, *shape)) if n else np.zeros((0, *shape), dtype)

    @staticmethod
    def _destinations(
        records, doc_of: dict[int, int], offsets: np.ndarray, lo: np.ndarray, hi: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Row in the cache (``offsets[doc] + pos - lo[doc]``) and index in the concatenated records of every
        recorded position ``lo[doc] <= pos < hi[doc]`` of a kept document."""
        if not records:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        req = np.concatenate([r[0] for r in records])
        pos = np.concatenate([r[1] for r in records]).astype(np.int64)
        table = np.full(max(max(doc_of, default=0), int(req.max(initial=0))) + 1, -1, dtype=np.int64)
        table[list(doc_of)] = list(doc_of.values())
        doc = table[req]
        keep = doc >= 0
        keep[keep] &= (pos[keep] >= lo[doc[keep]]) & (pos[keep] < hi[doc[keep]])
        idx = np.nonzero(keep)[0]
        return offsets[doc[idx]] + pos[idx] - lo[doc[idx]], idx
