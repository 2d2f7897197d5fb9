"""Rotary position embeddings (RoPE), Hugging Face conventions, shared by the policy and the EAGLE-3 draft.

Public functions (import them from here):

- :func:`rope_inv_freq` ``(head_dim, rope_theta, rope_scaling=None) -> (head_dim // 2,) fp32`` inverse
  frequencies, with the ``rope_scaling`` types ``default``, ``linear`` and ``llama3`` (Llama 3.1+).
- :func:`rope_scaling_type` ``(rope_scaling) -> str`` the scaling kind of a HF dict (``"default"`` for None).
- :func:`rope_cos_sin` ``(position_ids (...,), inv_freq, dtype) -> (cos, sin)`` each ``(..., head_dim)``,
  the half-split layout ``cat(freqs, freqs)`` of HF's ``rotate_half``.
- :func:`apply_rotary` ``(x (..., H, D), cos (..., D), sin (..., D)) -> (..., H, D)``: cos/sin broadcast
  over the head dimension, so packed ``x (T, H, D)`` takes ``cos (T, D)`` and decode ``x (B, S, H, D)``
  takes ``cos (B, S, D)``.
- :class:`RotaryEmbedding` a module holding ``inv_freq`` (a non-persistent buffer, so it never appears in a
  state dict); ``rotary(position_ids) -> (cos, sin)``.

Positions are converted to fp32 and multiplied by ``inv_freq`` exactly as ``transformers`` does, so cos/sin
are bit-identical to HF's ``LlamaRotaryEmbedding`` in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_scaling_type(rope_scaling: Mapping[str, Any] | None) -> str:
    """``rope_type`` (or legacy ``type``) of a HF ``rope_scaling`` dict; ``"default"`` for None or empty."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None = None) -> Tensor:
    """Inverse frequencies of RoPE.

    Args:
        head_dim: rotary dimension D (even).
        rope_theta: RoPE base.
        rope_scaling: HF ``rope_scaling`` dict or None. ``{"rope_type": "linear", "factor": f}`` divides every
            frequency by f; ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
            "original_max_position_embeddings"}`` is Llama 3.1's smooth wavelength-dependent scaling.

    Returns:
        ``(D // 2,)`` fp32 inverse frequencies.
    """
    if head_dim % 2:
        raise ValueError(f"rotary head_dim={head_dim} must be even")
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = rope_scaling_type(rope_scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        try:
            factor = float(rope_scaling["factor"])
            low = float(rope_scaling["low_freq_factor"])
            high = float(rope_scaling["high_freq_factor"])
            old_len = float(rope_scaling["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(
                f"llama3 rope_scaling {dict(rope_scaling)} lacks {e.args[0]!r}; it needs factor, "
                "low_freq_factor, high_freq_factor, original_max_position_embeddings"
            ) from None
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {SUPPORTED_ROPE_TYPES}")


def rope_cos_sin(position_ids: Tensor, inv_freq: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """cos/sin tables for the given positions.

    Args:
        position_ids: ``(...)`` integer positions (``(T,)`` packed, ``(B, S)`` decode).
        inv_freq: ``(D // 2,)`` from :func:`rope_inv_freq`.
        dtype: dtype of the returned tables (computed in fp32, then cast).

    Returns:
        ``(cos, sin)`` each ``(..., D)``.
    """
    freqs = position_ids[..., None].float() * inv_freq.to(device=position_ids.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """``(..., D) -> (..., D)``: ``cat(-x2, x1)`` of the two halves of the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate queries or keys.

    Args:
        x: ``(..., H, D)`` per-head vectors (``(T, H, D)`` packed or ``(B, S, H, D)``).
        cos: ``(..., D)`` with the leading shape of ``x`` minus the head dimension.
        sin: like ``cos``.

    Returns:
        ``(..., H, D)`` rotated ``x``.
    """
    if cos.shape[-1] != x.shape[-1] or cos.shape[:-1] != x.shape[:-2]:
        raise ValueError(
            f"apply_rotary: cos {tuple(cos.shape)} does not match x {tuple(x.shape)}; "
            "expected cos of shape x.shape[:-2] + (D,)"
        )
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """RoPE tables as a module: ``rotary(position_ids) -> (cos, sin)`` each ``(..., head_dim)``.

    Args:
        head_dim: rotary dimension D.
        rope_theta: RoPE base.
        rope_scaling: HF ``rope_scaling`` dict or None (see :func:`rope_inv_freq`).
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: Mapping[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta, rope_scaling), persistent=False)

    def forward(self, position_ids: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(position_ids, self.inv_freq, dtype)
