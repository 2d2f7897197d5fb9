"""Activations: the bytes autograd saves for the backward of one microbatch on one rank, and what a step holds
besides them. Counted from the code's own operations (``models/policy.py``, ``models/eagle3.py``,
``training/rl_loss.py``, ``training/draft_loss.py``), per token of the rank's share ``T`` of the microbatch (CP
divides it), with ``a`` the compute bytes (4 under ``32-true``, 2 under ``bf16-*``), widths ``H`` (hidden), ``I``
(MLP), ``q = heads * D``, ``kv = kv_heads * D``, vocabularies ``V`` and ``Vd``.

RMSNorm of a width-``W`` input that needs a gradient saves its fp32 input (the input itself at ``a = 4``, a
``float()`` copy at ``a = 2``: ``4W`` either way), ``rsqrt`` (4 bytes per row) and the normalised value before the
weight (``a W``): ``norm(W) = 4W + aW + 4``. Linear layers save their input (``a`` x width; a tensor read by
several projections once) and their weight (a parameter, not counted here). RoPE saves only ``cos``/``sin``.

Policy decoder layer (the same for every layer)::

    norm(H) + aH (q/k/v input) + a(2q + 2kv) (rotated q, k; v; attention output) + 4 heads (lse, fp32)
    + [Qwen3 q/k norms: norm(D) per head of q and of k] + norm(H) + aH (MLP input) + 4aI (gate, silu, up, product)

Once per stage: ``2aD`` (``cos``, ``sin``); the first stage 8 (the token ids the embedding saves). The last stage:
``norm(H) + aH`` (final norm, ``lm_head`` input), ``4V`` (``log_softmax`` of the logits, fp32) and the RL loss's
per-token tensors (``RL_LOSS_BYTES``, + 4 with the KL term).

The draft, on the last stage when it trains, per unroll step ``k < K`` (``training-time test``)::

    2aD (cos, sin at positions + k) + aH (norm of the detached token embedding) + norm(H) (hidden input)
    + 2aH (the concatenated q/k/v input) + a(2q + 2kv) + 4 heads + norm(H) + aH + 4aI (the layer's MLP)
    + norm(H) + aH (final norm, lm_head input) + loss(Vd)

where the soft cross-entropy (``soft_cross_entropy_sum``) saves the step's logits ``a Vd``, their ``logsumexp``
(4) and its row weights and targets, both views: without CP, weights of the shifted ``(T, 2)`` side rows (8) and
targets of the one softmaxed target tensor (``4 Vd``, once for all steps); under CP, both of the step's shifted
``(T, Vd + 2)`` rows (``4 (Vd + 2)``). Plus ``3aH`` once (``fc``'s input, the three concatenated taps); at
``a = 4`` a step's output is the next step's hidden input, saved by both norms, so ``4H (K - 1)`` comes off.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_codraft.models.config import Eagle3Config, PolicyConfig

RL_LOSS_BYTES = 32
"""Per-token bytes the RL loss saves: the ratio, two negated advantages, both surrogates (fp32), the loss mask
(fp32) and the target ids ``gather`` reads (int64)."""


def norm_saved(width: int, a: int) -> int:
    """Bytes an RMSNorm that needs a gradient saves per row of ``width`` (see the module docstring)."""
    return 4 * width + a * width + 4


def attention_saved(q: int, kv: int, heads: int, a: int) -> int:
    """Rotated q, k, v and the output in the compute dtype, the fp32 log-sum-exp per head (per token)."""
    return a * (2 * q + 2 * kv) + 4 * heads


def policy_layer_saved(c: PolicyConfig, a: int) -> int:
    """Bytes one policy decoder layer saves per token."""
    H, D = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    qk_norm = (norm_saved(D, a) * (c.num_attention_heads + c.num_key_value_heads)) if c.qk_norm else 0
    return (
        norm_saved(H, a)
        + a * H
        + attention_saved(q, kv, c.num_attention_heads, a)
        + qk_norm
        + norm_saved(H, a)
        + a * H
        + 4 * a * c.intermediate_size
    )


def draft_step_saved(c: Eagle3Config, a: int) -> int:
    """Bytes one training-time-test step of the draft saves per token."""
    H, D = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    return (
        2 * a * D
        + a * H
        + norm_saved(H, a)
        + 2 * a * H
        + attention_saved(q, kv, c.num_attention_heads, a)
        + norm_saved(H, a)
        + a * H
        + 4 * a * c.intermediate_size
        + norm_saved(H, a)
        + a * H
        + a * c.draft_vocab_size
        + 4
    )


def draft_saved(c: Eagle3Config, steps: int, a: int, cp: bool = False) -> int:
    """Bytes the draft's K-step unroll and its loss save per token (``cp``: under context parallelism)."""
    overlap = 4 * c.hidden_size * (steps - 1) if a == 4 else 0
    targets = steps * 4 * (c.draft_vocab_size + 2) if cp else steps * 8 + 4 * c.draft_vocab_size
    return 3 * a * c.hidden_size + steps * draft_step_saved(c, a) + targets - overlap


@dataclass(frozen=True)
class StageShape:
    """What the activations of one pipeline stage depend on."""

    layers: int
    """Decoder layers the stage runs."""
    first: bool
    """Holds the embeddings."""
    last: bool
    """Holds the final norm, ``lm_head``, the losses and the draft."""


def saved_per_token(
    policy: PolicyConfig,
    draft: Eagle3Config,
    stage: StageShape,
    a: int,
    ttt_steps: int,
    trains_draft: bool,
    kl: bool,
    cp: bool = False,
) -> int:
    """Bytes autograd saves per token of one microbatch on one rank of ``stage`` (formulas in the module
    docstring; ``cp``: context parallelism is on)."""
    total = 2 * a * policy.head_dim + stage.layers * policy_layer_saved(policy, a)
    if stage.first:
        total += 8
    if stage.last:
        total += norm_saved(policy.hidden_size, a) + a * policy.hidden_size + 4 * policy.vocab_size
        total += RL_LOSS_BYTES + (4 if kl else 0)
        if trains_draft:
            total += draft_saved(draft, ttt_steps, a, cp)
    return total


def loss_workspace_per_token(
    policy: PolicyConfig, draft: Eagle3Config, a: int, ttt_steps: int, runs_draft: bool
) -> int:
    """Bytes per token alive, but not saved, while the last stage computes the losses of one microbatch.

    The logits in the compute dtype (``aV``; under PP the schedule keeps them until the microbatch's backward),
    their fp32 copy for ``log_softmax`` at ``a = 2`` (``4V``); with the draft the detached fp32 policy logits
    again at ``a = 2`` (``4V``), the restricted target logits ``4 (Vd + 2)`` and the K step logits ``K a Vd``.
    """
    V = policy.vocab_size
    total = a * V + (4 * V if a != 4 else 0)
    if runs_draft:
        total += (4 * V if a != 4 else 0) + 4 * (draft.draft_vocab_size + 2) + ttt_steps * a * draft.draft_vocab_size
    return total
