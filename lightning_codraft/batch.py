"""``RLBatch``: the packed, next-token-aligned RL training batch, and every rule of its layout.

One typed object crosses the layers (``rl`` builds it, ``parallel`` cuts and shards it, ``training`` scores it),
so its invariants live here and nowhere else (docs/design/interfaces.md, "The RL training batch"):

- **Packed (THD).** Documents (prompt + completion of one sample) are concatenated along dim 0; ``cu_seqlens``
  ``(N + 1,)`` int32 is the GLOBAL prefix sum of document lengths (never sharded); ``position_ids`` restart at
  0 in every document. Under context parallelism every document length is a multiple of ``2 * cp``.
- **Next-token aligned.** Row ``t`` carries what the logits at row ``t`` are scored against (``target_ids[t] =
  input_ids[t + 1]`` inside the document), so every RL quantity is row-local and CP never shifts it.
- **Sharded or whole.** ``cp_size == 1``: the rows are the whole batch. ``cp_size > 1``: the rows are CP rank
  ``cp_rank``'s zigzag shard (chunks ``r`` and ``2 * cp - 1 - r`` of every document), ``cu_seqlens`` still global.

Operations: :meth:`RLBatch.pack` (from documents), :meth:`split` (into microbatches of whole documents),
:meth:`pad_to` (one token count for every pipeline microbatch), :meth:`shard` (zigzag over CP), :meth:`shift_left`
(a row tensor shifted within documents, across CP shards through the halo exchange), :meth:`to` (device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_codraft.attention.packing import pack_documents, validate_cu_seqlens
from lightning_codraft.attention.zigzag import shift_left as zigzag_shift_left
from lightning_codraft.attention.zigzag import zigzag_shard

#: Per-row tensors of a batch, in field order (the optional ones may be None).
ROW_FIELDS = (
    "input_ids",
    "target_ids",
    "position_ids",
    "valid",
    "loss_mask",
    "old_logprobs",
    "advantages",
    "draft_mask",
    "ref_logprobs",
    "ref_greedy",
    "loss_weight",
    "draft_anchor",
)
_REQUIRED = (
    "input_ids",
    "target_ids",
    "position_ids",
    "cu_seqlens",
    "valid",
    "loss_mask",
    "old_logprobs",
    "advantages",
)


@dataclass(frozen=True)
class StepNorm:
    """What one optimizer step's objective divides by, global over every microbatch and every dp x cp rank.

    Computed once per step, before the microbatch loop (``training/objective.py``), so that every microbatch's loss is
    its share of ONE global objective and the shares add up to the same value and gradient on any layout.

    Attributes:
        tokens: scored completion tokens of the step (``loss_mask`` rows).
        samples: samples of the step with at least one scored token.
        rl: the RL loss's denominator (tokens, samples, or samples x ``max_new_tokens``, by the aggregation).
        draft: ``(K,)`` rows the draft loss scores at each unroll step (loss rows ``k + 1`` ahead in the document).
    """

    tokens: float
    samples: float
    rl: float
    draft: Tensor


@dataclass
class RLBatch:
    """A packed, next-token-aligned RL batch (whole, or one CP rank's zigzag shard).

    Attributes:
        input_ids: ``(T,)`` int64 prompt + completion tokens of every sample, each document padded.
        target_ids: ``(T,)`` int64 ``input_ids[t + 1]`` inside the same document, else the pad id.
        position_ids: ``(T,)`` int64 position of each row inside its document.
        cu_seqlens: ``(N + 1,)`` int32 GLOBAL prefix sum of padded document lengths (never sharded).
        valid: ``(T,)`` bool, True on real tokens (False on padding).
        loss_mask: ``(T,)`` float32, 1 where ``target_ids[t]`` is a generated (completion) token.
        old_logprobs: ``(T,)`` float32 log-prob of ``target_ids[t]`` under the sampling policy (0 off-mask).
        advantages: ``(T,)`` float32 the sample's advantage on its completion rows (0 off-mask).
        draft_mask: ``(T,)`` float32 rows whose policy distribution is a draft target; None means ``valid``.
        ref_logprobs: ``(T,)`` float32 reference-policy log-probs for the KL term, or None.
        ref_greedy: ``(T,)`` int64 the reference policy's most likely next token at every row (for the greedy
            agreement of the drift metrics), or None.
        loss_weight: ``(T,)`` float32 weight of each row in the step's RL objective, already divided by the step's
            global denominator (``norm.rl``): the objective is ``sum_t loss_weight_t * loss_t`` over every
            microbatch and rank. None until ``training.normalize.normalize_step`` (or the caller) sets it.
        norm: the step's global :class:`StepNorm` (set with ``loss_weight``), or None.
        draft_anchor: ``(T,)`` float32, 1 on the rows a block drafter anchors a training block at (drawn per
            document on the whole batch, before it is cut or sharded: ``training.drafter_terms``), or None.
        cp_rank: the CP rank whose zigzag shard the rows are (0 for a whole batch).
        cp_size: the CP size the rows are sharded over (1: the rows are the whole batch).
    """

    input_ids: Tensor
    target_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    valid: Tensor
    loss_mask: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    draft_mask: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    ref_greedy: Optional[Tensor] = None
    loss_weight: Optional[Tensor] = None
    norm: Optional[StepNorm] = None
    draft_anchor: Optional[Tensor] = None
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank={self.cp_rank} is outside a CP group of size cp_size={self.cp_size}")
        total = int(self.cu_seqlens[-1]) if self.cu_seqlens.numel() else 0
        if total % self.cp_size:
            raise ValueError(f"cu_seqlens[-1]={total} tokens cannot be sharded over cp_size={self.cp_size}")
        rows = total // self.cp_size
        for name, t in self.row_tensors().items():
            if t.dim() == 0 or t.shape[0] != rows:
                raise ValueError(
                    f"RLBatch.{name} has shape {tuple(t.shape)} but the batch has {rows} rows "
                    f"(cu_seqlens[-1]={total} / cp_size={self.cp_size}); every per-row tensor needs "
                    f"{rows} rows"
                )

    # ------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        """Tokens of the whole (global) batch, ``cu_seqlens[-1]``."""
        return int(self.cu_seqlens[-1])

    @property
    def num_rows(self) -> int:
        """Rows held here: ``num_tokens / cp_size``."""
        return int(self.input_ids.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def is_sharded(self) -> bool:
        return self.cp_size > 1

    @property
    def draft_targets(self) -> Tensor:
        """``(T,)`` float32 rows whose policy distribution the draft learns: ``draft_mask``, else ``valid``."""
        return self.draft_mask if self.draft_mask is not None else self.valid.to(torch.float32)

    def row_tensors(self) -> dict[str, Tensor]:
        """The per-row tensors that are set, by field name."""
        return {name: getattr(self, name) for name in ROW_FIELDS if getattr(self, name) is not None}

    def to_dict(self) -> dict[str, Tensor]:
        """The tensors as a dict (row fields that are set, and ``cu_seqlens``)."""
        return {**self.row_tensors(), "cu_seqlens": self.cu_seqlens}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], cp_rank: int = 0, cp_size: int = 1) -> RLBatch:
        """A batch from the dict layout (keys = field names); unknown keys are an error naming them."""
        missing = [k for k in _REQUIRED if k not in d]
        unknown = [k for k in d if k not in (*ROW_FIELDS, "cu_seqlens")]
        if missing or unknown:
            raise KeyError(
                f"an RL batch needs the keys {list(_REQUIRED)} (optional: draft_mask, ref_logprobs, "
                f"ref_greedy, loss_weight, draft_anchor); "
                f"missing {missing}, unknown {unknown}"
            )
        return cls(**{k: d[k] for k in d}, cp_rank=cp_rank, cp_size=cp_size)

    @classmethod
    def concat(cls, batches: Sequence[RLBatch]) -> RLBatch:
        """Whole batches packed into one (their documents one after the other): what a ``DataLoader`` with a
        ``batch_size`` collates (``lightning_codraft.pytorch`` registers it with torch's ``default_collate``).
        Batches already normalised for a step (``loss_weight``) or sharded cannot be merged."""
        if not batches:
            raise ValueError("RLBatch.concat of no batches")
        if any(b.is_sharded or b.loss_weight is not None for b in batches):
            raise ValueError(
                "RLBatch.concat takes whole batches not yet normalised for a step (cp_size 1, no loss_weight)"
            )
        if len(batches) == 1:
            return batches[0]
        keys = set(batches[0].row_tensors())
        if any(set(b.row_tensors()) != keys for b in batches):
            raise ValueError(
                "RLBatch.concat: the batches set different optional fields (draft_mask, ref_logprobs, ref_greedy)"
            )
        rows = {k: torch.cat([b.row_tensors()[k] for b in batches]) for k in keys}
        cu, offset = [0], 0
        for b in batches:
            cu.extend((b.cu_seqlens[1:].long() + offset).tolist())
            offset += b.num_tokens
        return cls.from_dict({**rows, "cu_seqlens": torch.tensor(cu, dtype=batches[0].cu_seqlens.dtype)})

    @classmethod
    def coerce(cls, batch: RLBatch | Mapping[str, Any]) -> RLBatch:
        """``batch`` itself, or a whole batch built from the dict layout."""
        if isinstance(batch, cls):
            return batch
        if isinstance(batch, Mapping):
            return cls.from_dict(batch)
        raise TypeError(f"expected an RLBatch (or a dict with its fields), got {type(batch).__name__}")

    @classmethod
    def pack(
        cls,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        advantages: Sequence[float],
        ref_logprobs: Optional[Sequence[Sequence[float]]] = None,
        multiple_of: int = 1,
        pad_id: int = 0,
    ) -> RLBatch:
        """Pack samples (prompt + completion each) into a whole batch.

        For a document ``prompt (n_p tokens) + completion (n_c tokens)`` starting at packed row ``s``, completion
        token ``j`` sits at row ``s + n_p + j`` and is predicted by the logits of row ``s + n_p + j - 1``; that
        row gets ``target_ids = completion[j]``, ``loss_mask = 1``, ``old_logprobs = logprobs[j]`` and the sample's
        advantage.

        Args:
            prompts: token ids of every sample's prompt (non-empty).
            completions: generated token ids of every sample (non-empty).
            logprobs: sampling log-prob of every completion token (``len == len(completion)``).
            advantages: one scalar per sample.
            ref_logprobs: optional reference log-prob of every completion token.
            multiple_of: every document is padded to a multiple of this (``2 * cp`` under CP).
            pad_id: token id of the padding and of target rows that predict nothing.
        """
        n = len(prompts)
        if n == 0:
            raise ValueError("an RL batch needs at least one sample")
        for name, seq in (("completions", completions), ("logprobs", logprobs), ("advantages", advantages)):
            if len(seq) != n:
                raise ValueError(f"got {len(seq)} {name} for {n} prompts")
        if ref_logprobs is not None and len(ref_logprobs) != n:
            raise ValueError(f"got {len(ref_logprobs)} ref_logprobs rows for {n} prompts")
        for i in range(n):
            if not prompts[i]:
                raise ValueError(f"sample {i} has an empty prompt")
            if not completions[i]:
                raise ValueError(f"sample {i} has an empty completion; the engine must generate >= 1 token")
            if len(logprobs[i]) != len(completions[i]):
                raise ValueError(f"sample {i}: {len(logprobs[i])} logprobs for {len(completions[i])} tokens")
        packed = pack_documents(
            [list(p) + list(c) for p, c in zip(prompts, completions)], multiple_of=multiple_of, pad_id=pad_id
        )
        T = packed.num_tokens
        target = torch.full((T,), pad_id, dtype=torch.int64)
        loss_mask, old_lp, adv = (torch.zeros(T, dtype=torch.float32) for _ in range(3))
        ref = torch.zeros(T, dtype=torch.float32) if ref_logprobs is not None else None
        for i, s in enumerate(packed.cu_seqlens[:-1].tolist()):
            n_p, n_c = len(prompts[i]), len(completions[i])
            end = s + n_p + n_c
            target[s : end - 1] = packed.input_ids[s + 1 : end]
            rows = slice(s + n_p - 1, end - 1)
            loss_mask[rows] = 1.0
            old_lp[rows] = torch.tensor(list(logprobs[i]), dtype=torch.float32)
            adv[rows] = float(advantages[i])
            if ref is not None:
                ref[rows] = torch.tensor(list(ref_logprobs[i]), dtype=torch.float32)
        return cls(
            input_ids=packed.input_ids,
            target_ids=target,
            position_ids=packed.position_ids,
            cu_seqlens=packed.cu_seqlens,
            valid=packed.valid,
            loss_mask=loss_mask,
            old_logprobs=old_lp,
            advantages=adv,
            draft_mask=packed.valid.to(torch.float32),
            ref_logprobs=ref,
        )

    # ------------------------------------------------------------------ layout operations
    def _require_whole(self, op: str) -> None:
        if self.is_sharded:
            raise ValueError(
                f"RLBatch.{op}() needs the whole batch, but this one is CP rank {self.cp_rank}'s shard "
                f"of cp_size={self.cp_size}; {op} first, then shard"
            )

    def _with_rows(self, rows: dict[str, Tensor], cu_seqlens: Tensor, **meta: Any) -> RLBatch:
        return dataclasses.replace(self, **rows, cu_seqlens=cu_seqlens, **meta)

    def split(self, num_microbatches: int) -> list[RLBatch]:
        """Cut the whole batch into ``M`` batches of consecutive whole documents.

        Documents are dealt as evenly as possible (the first ``N % M`` microbatches get one more); each gets its
        own ``cu_seqlens`` starting at 0. The split depends only on the batch, so one process and a pipeline of
        any depth cut the same microbatches.
        """
        self._require_whole("split")
        num_docs = self.num_docs
        if not 1 <= num_microbatches <= num_docs:
            raise ValueError(
                f"cannot split a batch of {num_docs} documents into num_microbatches={num_microbatches};"
                f" every microbatch needs at least one document (use 1 <= M <= {num_docs})"
            )
        if num_microbatches == 1:
            return [self]
        cu = self.cu_seqlens.long()
        base, extra = divmod(num_docs, num_microbatches)
        out, d0 = [], 0
        for m in range(num_microbatches):
            d1 = d0 + base + (1 if m < extra else 0)
            t0, t1 = int(cu[d0]), int(cu[d1])
            rows = {k: v[t0:t1] for k, v in self.row_tensors().items()}
            out.append(self._with_rows(rows, (cu[d0 : d1 + 1] - t0).to(self.cu_seqlens.dtype)))
            d0 = d1
        return out

    def every_nth_document(self, n: int) -> tuple[RLBatch, Tensor]:
        """Documents ``0, n, 2n, ...`` of this batch and ``(T',)`` the rows they occupy in it.

        Works on the whole batch and on a CP shard alike: a rank holds ``len / cp`` rows of every document, so its rows
        of the chosen documents are its zigzag shard of the smaller batch. ``norm.draft`` is divided by ``n`` (the
        chosen rows' expected share of the step's scored rows).
        """
        if n < 1:
            raise ValueError(f"every_nth_document needs n >= 1, got {n}")
        cu = self.cu_seqlens.long()
        lengths = cu[1:] - cu[:-1]
        local = lengths // self.cp_size
        starts = torch.cumsum(local, 0) - local
        keep = torch.arange(self.num_docs, device=cu.device) % n == 0
        rows = torch.cat(
            [
                torch.arange(int(s), int(s + m), device=cu.device)
                for s, m in zip(starts[keep].tolist(), local[keep].tolist())
            ]
        )
        new_cu = torch.cat([cu.new_zeros(1), torch.cumsum(lengths[keep], 0)]).to(self.cu_seqlens.dtype)
        norm = None if self.norm is None else dataclasses.replace(self.norm, draft=self.norm.draft / n)
        return self._with_rows({k: v[rows] for k, v in self.row_tensors().items()}, new_cu, norm=norm), rows

    def pad_to(self, num_tokens: int, pad_id: int = 0) -> RLBatch:
        """The whole batch with one padding document appended so it has ``num_tokens`` tokens.

        The pipeline schedule sends fixed-shape activations, so every microbatch of a step must have the same
        token count. The padding document has ``valid = False`` and every mask, advantage and log-prob 0, so it
        contributes nothing to either loss; attention never crosses documents.
        """
        self._require_whole("pad_to")
        pad = num_tokens - self.num_tokens
        if pad < 0:
            raise ValueError(f"cannot pad a batch of {self.num_tokens} tokens down to {num_tokens}")
        if pad == 0:
            return self
        fills = {"input_ids": pad_id, "target_ids": pad_id}
        rows = {}
        for k, v in self.row_tensors().items():
            if k == "position_ids":
                tail = torch.arange(pad, dtype=v.dtype, device=v.device)
            else:
                tail = v.new_full((pad,), fills.get(k, 0))
            rows[k] = torch.cat([v, tail])
        cu = torch.cat([self.cu_seqlens, self.cu_seqlens.new_tensor([num_tokens])])
        return self._with_rows(rows, cu)

    def shard(self, rank: int, world_size: int) -> RLBatch:
        """CP rank ``rank``'s zigzag shard of the whole batch (``cu_seqlens`` stays global)."""
        self._require_whole("shard")
        if world_size == 1:
            return self
        validate_cu_seqlens(self.cu_seqlens, total_tokens=self.num_tokens, multiple_of=2 * world_size)
        rows = {k: zigzag_shard(v, self.cu_seqlens, rank, world_size) for k, v in self.row_tensors().items()}
        return self._with_rows(rows, self.cu_seqlens, cp_rank=rank, cp_size=world_size)

    def shift_left(self, x: Tensor, shift: int, group: Optional[Any] = None, fill: float | int = 0) -> Tensor:
        """``y[i] = x[i + shift]`` when row ``i + shift`` is in the same document, else ``fill``.

        Args:
            x: ``(T, ...)`` a tensor of this batch's rows (a CP shard's rows when sharded).
            shift: non-negative row offset.
            group: the CP process group when the batch is sharded (the halo exchange crosses ranks).
        """
        if self.is_sharded and group is None:
            raise ValueError(
                f"shift_left on CP rank {self.cp_rank}'s shard (cp_size={self.cp_size}) needs the CP process group"
            )
        return zigzag_shift_left(x, self.cu_seqlens, shift, group=group if self.is_sharded else None, fill=fill)

    def to(self, device: torch.device | str) -> RLBatch:
        """The batch with every tensor on ``device`` (``cu_seqlens`` too)."""
        rows = {k: v.to(device) for k, v in self.row_tensors().items()}
        norm = self.norm and dataclasses.replace(self.norm, draft=self.norm.draft.to(device))
        return self._with_rows(rows, self.cu_seqlens.to(device), norm=norm)
