"""DFlash: a block drafter that proposes a whole block of tokens in one forward, conditioned on the policy's taps.

Definitions (docs/design/drafters.md):

- **Context feature.** ``c_j = hidden_norm(fc(cat(taps_j)))`` for every row ``j`` of the policy's forward (the taps
  are the draft's ``config.taps``, hidden states entering those policy layers: tap ``l`` is HF's
  ``hidden_states[l]``, z-lab's ``target_layer_ids`` entry ``l - 1``).
- **Block.** For an anchor row ``a`` holding token ``x_a``, the block is ``[x_a, MASK x (B - 1)]``, embedded with
  the POLICY's token embedding at positions ``a, a + 1, .., a + B - 1``; after the draft's layers and final norm,
  block position ``k >= 1`` predicts ``x_{a+k}`` through the POLICY's ``lm_head``. The drafter owns neither: they
  are read detached, so the draft's loss never reaches the policy.
- **Attention.** Every draft layer projects the context features with its own k / v projections and places them
  before the block's keys: a block row sees the context rows of its document BEFORE the anchor (``j < a``) and all
  ``B`` rows of its own block (bidirectional), never another block. One softmax over both key sets.

A DFlash forward here takes many blocks at once (the training forward: anchors sampled per document; the engine:
one block per request). This module is the model only: its loss is training/dflash_loss.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_codraft.models.config import DrafterShape
from lightning_codraft.models.dflash_export import save_dflash
from lightning_codraft.models.layers import GatedMLP, RMSNorm
from lightning_codraft.models.rope import apply_rotary, rope_cos_sin, rope_inv_freq


@dataclass
class DFlashConfig(DrafterShape):
    """Shape of a DFlash drafter; the attention geometry defaults to the policy's (:meth:`DFlashDraft.from_policy`)."""

    taps: tuple[int, ...]
    """Policy tap ids whose hidden states form the context feature (tap l = the state entering policy layer l)."""
    num_hidden_layers: int = 1
    """Draft decoder layers (z-lab's Qwen3-8B drafter: 5)."""
    block_size: int = 8
    """B: the block's rows, the anchor included; a round proposes up to ``B - 1`` tokens."""
    mask_token_id: int = 0
    """The policy token id whose embedding fills the block after its anchor."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon of every norm of the drafter."""
    rope_theta: float = 10000.0
    """RoPE base of the draft's attention (the policy's)."""
    rope_scaling: Optional[dict] = None
    """HF ``rope_scaling`` of the draft's attention (the policy's), or None."""
    max_position_embeddings: int = 4096
    """Longest position the drafter is used at."""
    extra: dict = field(default_factory=dict)
    """Other keys of a loaded config, kept for the round trip."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the field out of range."""
        if self.block_size < 2:
            raise ValueError(f"block_size={self.block_size} must be >= 2 (the anchor and at least one proposal)")
        if not self.taps:
            raise ValueError("taps is empty; the context feature needs at least one policy tap")
        if len(set(self.taps)) != len(self.taps):
            raise ValueError(
                f"taps={tuple(self.taps)} repeats a tap: give each policy tap once (vLLM's DFlash reads "
                f"each target layer once)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id={self.mask_token_id} is not a policy token id (vocab {self.vocab_size})")


class DFlashAttention(nn.Module):
    """One draft layer's attention: block queries over [context keys before the anchor | the block's own keys]."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self, x: Tensor, ctx: Tensor, rope_blk: tuple[Tensor, Tensor], rope_ctx: tuple[Tensor, Tensor], visible: Tensor
    ) -> Tensor:
        """Attention of the blocks.

        Args:
            x: ``(N, B, H)`` the blocks' hidden states (after the layer's input norm).
            ctx: ``(T, H)`` the context features (every row of the policy's forward), or ``(N, T, H)`` one context
                per block (the engine's batched rounds).
            rope_blk, rope_ctx: ``(cos, sin)`` of the block rows ``(N, B, D)`` and the context rows (``ctx``'s
                leading shape ``+ (D,)``).
            visible: ``(N, T)`` bool, context row ``j`` visible to block ``n`` (same document, before the anchor).

        Returns:
            ``(N, B, H)``.
        """
        N, B, _ = x.shape
        q = apply_rotary(self.q_norm(self.q_proj(x).view(N, B, self.heads, self.head_dim)), *rope_blk)
        k_blk = apply_rotary(self.k_norm(self.k_proj(x).view(N, B, self.kv_heads, self.head_dim)), *rope_blk)
        v_blk = self.v_proj(x).view(N, B, self.kv_heads, self.head_dim)
        lead = ctx.shape[:-1]  # (T,) one context for every block, or (N, C) one per block
        k_ctx = apply_rotary(self.k_norm(self.k_proj(ctx).view(*lead, self.kv_heads, self.head_dim)), *rope_ctx)
        v_ctx = self.v_proj(ctx).view(*lead, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k_blk, v_blk = k_blk.repeat_interleave(rep, dim=2), v_blk.repeat_interleave(rep, dim=2)
        k_ctx, v_ctx = k_ctx.repeat_interleave(rep, dim=-2), v_ctx.repeat_interleave(rep, dim=-2)
        scale = 1.0 / math.sqrt(self.head_dim)
        per_block = ctx.dim() == 3
        pattern = "nbhd,nthd->nhbt" if per_block else "nbhd,thd->nhbt"
        s_ctx = torch.einsum(pattern, q, k_ctx) * scale  # (N, heads, B, T)
        s_ctx = s_ctx.masked_fill(~visible[:, None, None, :], float("-inf"))
        s_blk = torch.einsum("nbhd,nchd->nhbc", q, k_blk) * scale  # (N, heads, B, B)
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)  # one softmax over both
        T = s_ctx.shape[-1]
        pattern = "nhbt,nthd->nbhd" if per_block else "nhbt,thd->nbhd"
        out = torch.einsum(pattern, p[..., :T], v_ctx) + torch.einsum("nhbc,nchd->nbhd", p[..., T:], v_blk)
        return self.o_proj(out.reshape(N, B, self.heads * self.head_dim))


class DFlashLayer(nn.Module):
    """A pre-norm decoder layer whose attention also reads the context features."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size)

    def forward(self, x: Tensor, ctx: Tensor, rope_blk, rope_ctx, visible: Tensor) -> Tensor:
        """``(N, B, H) -> (N, B, H)``; see :meth:`DFlashAttention.forward`."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_blk, rope_ctx, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The DFlash block drafter (module docstring); the policy's embedding and head are passed in, never owned."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(len(config.taps) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_policy(
        cls,
        policy: nn.Module,
        taps: tuple[int, ...] | None = None,
        num_hidden_layers: int = 1,
        block_size: int = 8,
        mask_token_id: int | None = None,
    ) -> DFlashDraft:
        """A drafter for ``policy``: its attention geometry, the policy's default taps (or ``taps``), mask token
        the policy's pad token (or ``mask_token_id``)."""
        pc = policy.config
        heads = int(pc.num_attention_heads)
        head_dim = int(getattr(pc, "head_dim", None) or int(pc.hidden_size) // heads)
        mask = mask_token_id if mask_token_id is not None else int(getattr(pc, "pad_token_id", None) or 0)
        return cls(
            DFlashConfig(
                hidden_size=int(pc.hidden_size),
                intermediate_size=int(pc.intermediate_size),
                num_attention_heads=heads,
                num_key_value_heads=int(getattr(pc, "num_key_value_heads", None) or heads),
                head_dim=head_dim,
                vocab_size=int(pc.vocab_size),
                taps=tuple(taps) if taps is not None else tuple(dict.fromkeys(policy.default_taps)),
                num_hidden_layers=num_hidden_layers,
                block_size=block_size,
                mask_token_id=mask,
                rms_norm_eps=float(pc.rms_norm_eps),
                rope_theta=float(getattr(pc, "rope_theta", 10000.0)),
                rope_scaling=getattr(pc, "rope_scaling", None),
                max_position_embeddings=int(pc.max_position_embeddings),
            )
        )

    def context(self, taps: list[Tensor]) -> Tensor:
        """The context features ``(T, H)`` from the policy's taps (each ``(T, H)``, in ``config.taps`` order)."""
        if len(taps) != len(self.config.taps):
            raise ValueError(f"{len(taps)} taps given; this drafter reads {len(self.config.taps)} ({self.config.taps})")
        return self.hidden_norm(self.fc(torch.cat(list(taps), dim=-1)))

    @property
    def first_slot(self) -> int:
        """The block row of the first proposal: 1 (DFlash's at-position layout: row ``k >= 1`` predicts
        ``x_{a+k}``; the anchor's row predicts nothing)."""
        return 1

    @property
    def num_proposals(self) -> int:
        """Proposals one block makes: the rows from :attr:`first_slot` on (``B - 1`` here)."""
        return int(self.config.block_size) - self.first_slot

    def block_ids(self, anchor_ids: Tensor) -> Tensor:
        """``(N,)`` anchor token ids -> ``(N, B)`` block ids ``[anchor, MASK, ..]``."""
        block = torch.full(
            (anchor_ids.shape[0], self.config.block_size),
            self.config.mask_token_id,
            dtype=torch.long,
            device=anchor_ids.device,
        )
        block[:, 0] = anchor_ids
        return block

    def forward(
        self, ctx: Tensor, ctx_positions: Tensor, block_embeds: Tensor, anchor_positions: Tensor, visible: Tensor
    ) -> Tensor:
        """The blocks' final hidden states.

        Args:
            ctx: ``(T, H)`` context features (:meth:`context`), or ``(N, T, H)`` one context per block.
            ctx_positions: ``(T,)`` (or ``(N, T)``) position of each context row within its document.
            block_embeds: ``(N, B, H)`` the blocks' input embeddings (the policy's embedding of :meth:`block_ids`,
                detached).
            anchor_positions: ``(N,)`` the anchors' positions within their documents (block row ``k`` sits at
                ``anchor + k``).
            visible: ``(N, T)`` bool, context row ``j`` visible to block ``n``.

        Returns:
            ``(N, B, H)`` after the final norm; row ``k >= 1`` predicts the token ``k`` after the anchor (through the
            policy's head: :meth:`logits`).
        """
        N, B, _ = block_embeds.shape
        T = ctx.shape[-2]
        if visible.shape != (N, T) or (ctx.dim() == 3 and ctx.shape[0] != N):
            raise ValueError(
                f"visible has shape {tuple(visible.shape)} and ctx {tuple(ctx.shape)}: for {N} blocks visible must be "
                f"(N, T) = ({N}, {T}), a per-block ctx (N, T, H)"
            )
        offsets = torch.arange(B, device=anchor_positions.device)
        rope_blk = rope_cos_sin(anchor_positions[:, None] + offsets, self.inv_freq, block_embeds.dtype)
        rope_ctx = rope_cos_sin(ctx_positions, self.inv_freq, ctx.dtype)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, rope_blk, rope_ctx, visible)
        return self.norm(x)

    def save_pretrained(self, path: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the layout vLLM loads with ``method: dflash``
        (models/dflash_export.py; read back by ``models.dflash_io.load_dflash``)."""
        return save_dflash(self, path)

    @staticmethod
    def logits(hidden: Tensor, head_weight: Tensor) -> Tensor:
        """``(..., H)`` block hidden states -> ``(..., V)`` through the policy's ``lm_head`` weight, read detached."""
        return F.linear(hidden, head_weight.detach())
