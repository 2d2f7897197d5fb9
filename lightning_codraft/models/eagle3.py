"""The EAGLE-3 draft: fc fusion of three policy taps, one decoder layer with a 2H-wide attention input, final norm,
``lm_head`` over a draft vocabulary, in vLLM's ``LlamaForCausalLMEagle3`` parameter names.

Read top to bottom: :class:`DraftDecoderLayer` -> :class:`Eagle3Draft` (training unroll
:meth:`~Eagle3Draft.ttt_forward`, decode :meth:`~Eagle3Draft.step`); its shape is
:class:`~lightning_codraft.models.config.Eagle3Config`, its fused decode lives in models/decode.py and its vLLM
checkpoint I/O in models/eagle3_io.py.

One draft step on hidden input ``h`` (``fc(cat(taps))`` at step 0, the previous step's pre-norm output after)
and the embedding ``e`` of the next token (the policy's embedding, passed in detached: the draft holds none)::

    x   = cat(input_layernorm(e), hidden_norm(h))          # (.., 2H)
    a   = o_proj(attention(q_proj(x), k_proj(x), v_proj(x))) + h
    out = mlp(post_attention_layernorm(a)) + a              # next step's h
    logits = lm_head(norm(out))                             # (.., Vd)

which is vLLM's ``llama_eagle3`` layer with ``norm_before_residual=False`` (the residual is ``h`` itself).
The TTT unroll (EAGLE-3 / SpecForge "branch attention"): step ``k`` runs at RoPE positions ``position_ids + k`` and
its query at row ``i`` attends to the step-0 keys of rows ``j <= i`` of its document plus its own row's keys of
steps ``1..k``, in one softmax (:func:`lightning_codraft.attention.codraft_attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_codraft.attention.cached import cached_attention
from lightning_codraft.attention.codraft import codraft_attention
from lightning_codraft.attention.packing import suffix_rows, validate_cu_seqlens
from lightning_codraft.models import eagle3_io
from lightning_codraft.models.config import Eagle3Config
from lightning_codraft.models.decode import DraftDecoder, ModuleDraftDecoder, custom_decode_math, plain_parameters
from lightning_codraft.models.fused_decode import FusedDraftDecoder
from lightning_codraft.models.kv_cache import KVCache
from lightning_codraft.models.layers import GatedMLP, RMSNorm
from lightning_codraft.models.rope import RotaryEmbedding, apply_rotary
from lightning_codraft.models.vocab import build_vocab_mapping


class DraftAttention(nn.Module):
    """q/k/v projections from the 2H-wide input, o_proj back to H (no biases)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, D = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, D
        self.q_proj = nn.Linear(2 * H, self.num_heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(2 * H, self.num_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=False)


class DraftDecoderLayer(nn.Module):
    """vLLM's ``midlayer``: norms of the two halves of the attention input, attention, gated MLP."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = GatedMLP(H, config.intermediate_size)

    def qkv(self, hidden: Tensor, embeds: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hidden, embeds ``(..., H)``; cos/sin ``(..., D)`` -> q ``(..., Hq, D)``, k/v ``(..., Hkv, D)``."""
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        a, lead = self.self_attn, hidden.shape[:-1]
        q = a.q_proj(x).view(*lead, a.num_heads, a.head_dim)
        k = a.k_proj(x).view(*lead, a.num_kv_heads, a.head_dim)
        v = a.v_proj(x).view(*lead, a.num_kv_heads, a.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def finish(self, attn: Tensor, residual: Tensor) -> Tensor:
        """attn ``(..., Hq, D)`` attention output, residual ``(..., H)`` the hidden input -> ``(..., H)``."""
        h = self.self_attn.o_proj(attn.flatten(-2)) + residual
        return self.mlp(self.post_attention_layernorm(h)) + h


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft with vLLM names: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``; buffers ``d2t``
    ``(Vd,)`` int64 (``target_id = draft_id + d2t[draft_id]``) and ``t2d`` ``(V,)`` bool.

    Args:
        config: the draft shape; see :class:`Eagle3Config`. The vocabulary map starts as the first Vd target
            ids; :meth:`from_policy` builds it from token counts.
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = DraftDecoderLayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # ----- construction -----

    @classmethod
    def from_policy(
        cls,
        policy,
        draft_vocab_size: int | None = None,
        taps: Sequence[int] | None = None,
        token_counts: Tensor | None = None,
    ) -> Eagle3Draft:
        """A fresh draft shaped for ``policy`` (a :class:`~lightning_codraft.models.Policy`).

        The attention / MLP shapes, RoPE and norm epsilon are the policy's; ``lm_head`` starts as the policy's
        ``lm_head`` rows of the draft vocabulary and ``norm`` as the policy's final norm, the rest is random.

        Args:
            policy: the target model.
            draft_vocab_size: Vd; None keeps the policy's whole vocabulary (identity ``d2t``/``t2d``).
            taps: three increasing tap ids in ``[0, L]`` (L: the last layer's output, which vLLM captures);
                default ``policy.default_taps`` when those are distinct, else ``(0, 1, 2)`` for L = 3 and
                ``(1, L//2, L-1)`` for 4 <= L <= 6.
            token_counts: ``(V,)`` corpus frequencies of the policy's tokens; required when Vd < V (the draft
                vocabulary is the Vd most frequent tokens).
        """
        pc = policy.config
        V, L = int(pc.vocab_size), int(policy.num_layers)
        taps = _choose_taps(policy) if taps is None else tuple(policy.validate_taps(taps))
        if max(taps) > L:
            raise ValueError(
                f"tap id {max(taps)} out of range for a draft: vLLM collects aux hidden states entering "
                f"layers 0..{L - 1} and the last layer's output ({L}) of this {L}-layer policy; got "
                f"taps={taps}"
            )
        if token_counts is not None and torch.as_tensor(token_counts).numel() != V:
            raise ValueError(
                f"token_counts has {torch.as_tensor(token_counts).numel()} entries but the policy's "
                f"vocab_size is {V}; count tokens of the policy's tokenizer"
            )
        Vd = V if draft_vocab_size is None else int(draft_vocab_size)
        if not 1 <= Vd <= V:
            raise ValueError(f"draft_vocab_size={Vd} must be in [1, policy vocab_size={V}]")
        if Vd < V and token_counts is None:
            raise ValueError(
                f"draft_vocab_size={Vd} < vocab_size={V} needs token_counts (V,) to pick the most "
                "frequent tokens; pass token_counts or draft_vocab_size=None for the full vocabulary"
            )
        config = Eagle3Config(
            hidden_size=pc.hidden_size,
            intermediate_size=pc.intermediate_size,
            num_attention_heads=pc.num_attention_heads,
            num_key_value_heads=pc.num_key_value_heads,
            head_dim=pc.head_dim,
            vocab_size=V,
            draft_vocab_size=Vd,
            taps=taps,
            rms_norm_eps=pc.rms_norm_eps,
            rope_theta=pc.rope_theta,
            rope_scaling=pc.rope_scaling,
            max_position_embeddings=pc.max_position_embeddings,
        )
        w = policy.lm_head.weight
        draft = cls(config).to(device=w.device, dtype=w.dtype)
        if Vd < V:
            d2t, t2d = build_vocab_mapping(token_counts, Vd)
            draft.set_vocab_mapping(d2t, t2d)
        with torch.no_grad():
            draft.lm_head.weight.copy_(w[draft.draft_to_target(torch.arange(Vd, device=w.device))])
            draft.norm.weight.copy_(policy.model.norm.weight)
        return draft

    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install a vocabulary map (see :func:`~lightning_codraft.models.vocab.build_vocab_mapping`)."""
        Vd, V = self.config.draft_vocab_size, self.config.vocab_size
        if tuple(d2t.shape) != (Vd,) or tuple(t2d.shape) != (V,):
            raise ValueError(
                f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} must be ({Vd},) / ({V},) for this "
                "draft's draft_vocab_size / vocab_size"
            )
        targets = torch.arange(Vd) + d2t.cpu().long()
        if int(targets.min()) < 0 or int(targets.max()) >= V or targets.unique().numel() != Vd:
            raise ValueError(
                f"d2t maps draft ids to invalid or repeated target ids (range [{int(targets.min())}, "
                f"{int(targets.max())}], vocab_size={V})"
            )
        if not bool(t2d.cpu().bool()[targets].all()) or int(t2d.sum()) != Vd:
            raise ValueError("t2d must be True exactly on the target ids arange(Vd) + d2t")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def check_policy(self, policy) -> None:
        """Raise ``ValueError`` unless this draft fits ``policy`` (hidden size, vocabulary, tap ids)."""
        pc, c = policy.config, self.config
        if int(pc.vocab_size) != c.vocab_size:
            raise ValueError(
                f"vocab mismatch: the draft was built for a target vocab_size={c.vocab_size} but the "
                f"policy has vocab_size={pc.vocab_size}"
            )
        if int(pc.hidden_size) != c.hidden_size:
            raise ValueError(
                f"hidden_size mismatch: draft {c.hidden_size}, policy {pc.hidden_size}; the draft fuses "
                "policy taps and embeddings of the policy's width"
            )
        policy.validate_taps(c.taps)

    # ----- forward -----

    def fuse(self, taps: Sequence[Tensor]) -> Tensor:
        """``fc(cat(low, mid, high))``: three ``(..., H)`` policy taps -> ``(..., H)``."""
        if len(taps) != 3:
            raise ValueError(f"fuse needs the 3 policy taps {self.config.taps}, got {len(taps)} tensors")
        return self.fc(torch.cat(list(taps), dim=-1))

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids ``(...)`` -> target-vocabulary ids ``(...)``."""
        return draft_ids + self.d2t[draft_ids]

    def _rope(self, position_ids: Tensor, like: Tensor) -> tuple[Tensor, Tensor]:
        return self.rotary_emb(position_ids, like.dtype)

    def ttt_forward(
        self,
        taps: Sequence[Tensor],
        token_embeds: Sequence[Tensor],
        cu_seqlens: Tensor,
        position_ids: Tensor,
        cp_group=None,
        cu_seqlens_q: Tensor | None = None,
    ) -> list[tuple[Tensor, Tensor]]:
        """Training-time-test unroll of K steps on a packed batch.

        Args:
            taps: three ``(T, H)`` policy taps (detached by the caller), this CP rank's rows.
            token_embeds: K tensors ``(T, H)``; ``token_embeds[k]`` = policy embedding of the ids shifted left by
                ``k + 1`` inside each document (what rows ``i`` are fed at step ``k``: ``x_{i+1+k}``).
            cu_seqlens: ``(N + 1,)`` GLOBAL int32 prefix sum of document lengths.
            position_ids: ``(T,)`` int64 position of each row inside its document.
            cp_group: context-parallel group (None: the tensors hold the whole batch).
            cu_seqlens_q: without CP only: unroll just the last ``cu_seqlens_q[d + 1] - cu_seqlens_q[d]`` rows of
                each document (``Tq`` rows, :func:`~lightning_codraft.attention.packing.masked_suffix` of the loss
                rows with ``reach = K``); the other rows give only their step-0 keys. Their outputs equal the
                full unroll's at those rows. None: every row.

        Returns:
            K pairs ``(logits (T, Vd), hidden (T, H))`` (``Tq`` rows with ``cu_seqlens_q``); ``hidden`` is the
            pre-norm output fed to step k+1.
        """
        K = len(token_embeds)
        if K < 1:
            raise ValueError("ttt_forward needs K >= 1 unroll steps: pass at least one token_embeds tensor")
        if len(taps) != 3:
            raise ValueError(f"ttt_forward needs the 3 policy taps {self.config.taps}, got {len(taps)} tensors")
        T, H = taps[0].shape[0], self.config.hidden_size
        for name, ts in (("taps", taps), ("token_embeds", token_embeds)):
            for i, t in enumerate(ts):
                if tuple(t.shape) != (T, H):
                    raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)}, expected (T, H)=({T}, {H})")
        if tuple(position_ids.shape) != (T,):
            raise ValueError(f"position_ids has shape {tuple(position_ids.shape)}, expected ({T},)")
        world = dist.get_world_size(cp_group) if cp_group is not None else 1
        validate_cu_seqlens(cu_seqlens, total_tokens=T * world)
        if cu_seqlens_q is not None and world > 1:
            raise ValueError(
                "ttt_forward: cu_seqlens_q (unroll a suffix of each document) is not supported under "
                "context parallelism; pass cu_seqlens_q=None"
            )
        rows = None if cu_seqlens_q is None else suffix_rows(cu_seqlens, cu_seqlens_q).to(position_ids.device)
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))  # noqa: E731
        hidden = self.fuse(taps)
        positions = pick(position_ids)
        k0 = v0 = None
        branch_k: list[Tensor] = []
        branch_v: list[Tensor] = []
        outputs = []
        for k in range(K):
            if k == 0:  # keys and values of every row; queries (and all that follows) of the unrolled rows only
                cos, sin = self._rope(position_ids, hidden)
                q, k0, v0 = self.midlayer.qkv(hidden, token_embeds[0], cos, sin)
                q, hidden = pick(q), pick(hidden)
            else:
                cos, sin = self._rope(positions + k, hidden)
                q, key, value = self.midlayer.qkv(hidden, pick(token_embeds[k]), cos, sin)
                branch_k.append(key)
                branch_v.append(value)
            attn = codraft_attention(
                q,
                k0,
                v0,
                cu_seqlens,
                branch_k=tuple(branch_k),
                branch_v=tuple(branch_v),
                group=cp_group,
                cu_seqlens_q=cu_seqlens_q,
            )
            hidden = self.midlayer.finish(attn, hidden)
            outputs.append((self.lm_head(self.norm(hidden)), hidden))
        return outputs

    def step(
        self, hidden: Tensor, token_embeds: Tensor, kv_cache: KVCache, num_new: Tensor | int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Decode step with a key/value cache (chain drafting in the rollout engine).

        Args:
            hidden: ``(B, S, H)`` hidden input: ``fuse(taps)`` of verified positions, or a previous step's
                ``hidden_out``.
            token_embeds: ``(B, S, H)`` policy embeddings of the token following each position.
            kv_cache: one-layer :class:`KVCache`; the S new keys go to slots ``lengths[b] + arange(S)``.
            num_new: how far each row's length advances afterwards (int or ``(B,)``; default S).

        Returns:
            ``(hidden_out (B, S, H), logits (B, S, Vd))``.
        """
        if hidden.dim() != 3 or token_embeds.shape != hidden.shape:
            raise ValueError(
                f"step: hidden {tuple(hidden.shape)} and token_embeds {tuple(token_embeds.shape)} must "
                "both be (B, S, H)"
            )
        if kv_cache.num_layers != 1:
            raise ValueError(f"the draft has one layer; got a KVCache of {kv_cache.num_layers} layers")
        pos = kv_cache.positions(hidden.shape[1])
        cos, sin = self._rope(pos, hidden)
        q, key, value = self.midlayer.qkv(hidden, token_embeds, cos, sin)
        kv_cache.write(0, key, value)
        attn = cached_attention(q, kv_cache.k[0], kv_cache.v[0], pos)
        out = self.midlayer.finish(attn, hidden)
        kv_cache.advance(hidden.shape[1] if num_new is None else num_new)
        return out, self.lm_head(self.norm(out))

    def allocate_kv_cache(self, batch_size: int, capacity: int, device=None, dtype=None) -> KVCache:
        """An empty one-layer :class:`KVCache` for :meth:`step`."""
        w, c = self.fc.weight, self.config
        return KVCache.allocate(
            1, batch_size, c.num_key_value_heads, c.head_dim, capacity, dtype or w.dtype, device or w.device
        )

    # ----- decode and vLLM EAGLE-3 checkpoint I/O (models/decode.py, models/eagle3_io.py) -----

    def decoder(self, capacity: int, dtype: torch.dtype | None = None) -> DraftDecoder:
        """The decode-time step the rollout engine calls, over caches of at most ``capacity`` slots, in
        ``dtype`` (None: the parameters' dtype; e.g. bfloat16 decodes from a bf16 copy of the weights).

        A :class:`~lightning_codraft.models.decode.FusedDraftDecoder` (the math of :meth:`step` with fewer ops,
        reading the weights now: build one after any weight update); subclasses inherit it. Parameters that are
        not plain tensors (DTensor shards) and subclasses that override :meth:`fuse` or :meth:`step` (or swap a
        layer) get the module path, :meth:`fuse` and :meth:`step`; one that overrides only :meth:`ttt_forward` is
        refused (its decode math would silently be the base class's).
        """
        custom = custom_decode_math(self, Eagle3Draft, ("fuse", "step"))
        if not custom and type(self).ttt_forward is not Eagle3Draft.ttt_forward:
            raise ValueError(
                f"{type(self).__name__} overrides ttt_forward (the training math) but not step (the "
                f"decode math the rollout engine calls): override step (and fuse) with the same math, so "
                f"the draft that generates is the draft that trains"
            )
        if custom or not plain_parameters(self):
            return ModuleDraftDecoder(self)
        return FusedDraftDecoder(self, capacity, dtype)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the layout vLLM loads as ``LlamaForCausalLMEagle3``."""
        return eagle3_io.save_draft(self, path)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu", policy=None
    ) -> Eagle3Draft:
        """Load a directory written by :meth:`save_pretrained`, or another EAGLE-3 draft: vLLM's, SpecForge's
        export (its ``embed_tokens`` is checked against ``policy``'s and dropped) or speculators' format.

        Args:
            path: the draft directory (``config.json`` + ``*.safetensors``).
            dtype, device: where the draft's parameters go.
            policy: the target the draft serves: checks vocabulary, width and taps, supplies vLLM's default taps
                when the config has none, and is required for a checkpoint that carries ``embed_tokens.weight``.
        """
        return eagle3_io.load_draft(cls, path, dtype=dtype, device=device, policy=policy)

    def extra_repr(self) -> str:
        c = self.config
        return f"taps={c.taps}, vocab={c.vocab_size}, draft_vocab={c.draft_vocab_size}"


def _choose_taps(policy) -> tuple[int, int, int]:
    """``policy.default_taps`` when distinct, else a distinct triple in ``[0, L-1]`` (small policies)."""
    L = int(policy.num_layers)
    if L < 3:
        raise ValueError(
            f"a {L}-layer policy has fewer than 3 distinct tap ids in [0, L-1]; an EAGLE-3 draft needs "
            "three (use a policy with >= 3 layers)"
        )
    taps = (2, L // 2, L - 3)
    if len(set(taps)) < 3:
        taps = (0, 1, 2) if L == 3 else (1, L // 2, L - 1)
    return tuple(policy.validate_taps(taps))
