"""Sampling utilities: temperature / top-k / top-p filtering and lossless speculative verification.

Everything here is batched and works on logits of any leading shape ``(..., V)``. Random choices take their
noise as arguments (counter-based noise, rollout/sampling/noise.py), so a rule is a pure function of its inputs. The
verification rules:

* **greedy** (temperature 0): accept the longest prefix of draft tokens that equals the policy's
  argmax at each position; the next token is the policy's argmax after that prefix. Output is
  token-for-token identical to plain greedy decoding.
* **coupled** (temperature > 0, the engine's default): position t's token is the policy's Gumbel-max sample
  ``y_t = argmax_v(log p_t(v) + G_t(v))``; the draft proposed ``argmax_v(log q_t(v) + G_t(v))`` with the SAME
  noise ``G_t``. Accept the longest prefix where the proposal equals ``y_t``; the next token is ``y_t`` at the
  first mismatch (or the bonus ``y_K``). Every emitted token is ``y_t``, so the output is distributed as the
  filtered policy and is a pure function of the context and the noise; the draft only decides how many
  tokens one verify emits. A proposal is accepted with probability ``sum_x 1 / sum_y max(p_y / p_x, q_y / q_x)``
  (the Gumbel coupling), between ``(1 - TV) / (1 + TV)`` and rejection sampling's ``1 - TV``.
* **rejection** (temperature > 0): accept draft token ``d_j`` drawn from ``q_j`` with probability
  ``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection draw from the residual
  ``norm(max(0, p_j - q_j))``; if all K are accepted draw a bonus token from ``p_K`` (Leviathan et al. 2023,
  Chen et al. 2023).

Both ``p`` and ``q`` are the *filtered* distributions (temperature, top-k, top-p applied to each), so the output
is distributed exactly as plain sampling from the filtered policy distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters shared by every engine."""

    max_new_tokens: int
    """Maximum number of generated tokens per sequence (>= 1)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus filtering: keep the smallest set of most likely tokens with total probability >= top_p; in (0, 1]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables top-k."""
    seed: int | None = None
    """Call-wide seed: request i samples with seed ``request_seed(seed, i)`` (rollout/sampling/noise.py); the same seed,
    prompts and weights give the same outputs."""
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    """Generation of a sequence stops after it emits one of these ids (the stop token is included)."""

    def __post_init__(self) -> None:
        if int(self.max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]; use 1.0 to disable nucleus filtering")
        if int(self.top_k) < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0; use 0 to disable top-k filtering")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask logits outside the top-k / top-p set with -inf.

    Args:
        logits: (..., V) logits, already divided by the temperature.
        top_k: keep tokens whose logit is >= the k-th largest (0 disables).
        top_p: keep the smallest prefix of tokens sorted by probability whose mass reaches top_p
            (the most likely token is always kept; 1.0 disables).

    Returns:
        (..., V) logits with filtered-out entries set to -inf.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits.float(), dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the sampling distribution (fp32).

    Args:
        logits: (..., V) raw policy (or draft) logits.
        temperature: > 0 scales logits by 1/temperature and applies top-k / top-p; 0 (greedy) returns
            the unscaled, unfiltered ``log_softmax(logits)`` (the policy's own distribution).

    Returns:
        (..., V) fp32 log-probabilities; filtered-out tokens are -inf.
    """
    logits = logits.float()
    if temperature == 0.0:
        return torch.log_softmax(logits, dim=-1)
    if temperature != 1.0:  # x / 1.0 == x exactly: skip the op
        logits = logits / temperature
    return torch.log_softmax(filter_logits(logits, top_k, top_p), dim=-1)


def gumbel_argmax(logits: torch.Tensor, gumbel: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max sample ``argmax_v(logits[..., v] + gumbel[..., v])``: distributed as ``softmax(logits)``.

    Args:
        logits: (..., V) unnormalised log-probabilities (-inf for excluded tokens; each row needs a finite one).
        gumbel: (..., V) standard Gumbel noise.

    Returns:
        (...,) int64 token ids.
    """
    return torch.argmax(logits + gumbel, dim=-1)


def greedy_verify(target_ids: torch.Tensor, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    Args:
        target_ids: (B, K+1) policy argmax at the K+1 verified positions.
        draft_ids: (B, K) drafted tokens (target vocabulary).

    Returns:
        num_accepted: (B,) int64 in [0, K]; next_ids: (B,) the policy's argmax after the accepted prefix.
    """
    matches = (target_ids[:, :-1] == draft_ids).long()
    num_accepted = torch.cumprod(matches, dim=1).sum(dim=1)
    next_ids = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_ids


def lazy_coupled_verify(
    target_logprobs: torch.Tensor, gumbel_at: Callable[[torch.Tensor, int], torch.Tensor], draft_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-coupled verification — the policy's own samples (:func:`gumbel_argmax` of its log-probabilities and the
    noise the draft proposed with) verified greedily against the proposals (``greedy_verify(gumbel_argmax(logprobs,
    gumbel), draft_ids)``: how many of its samples the draft guessed) — drawing the noise of a position only for the
    rows that reach it.

    Position j's sample decides a row's outcome only while the row's proposals 1..j all equalled the policy's
    samples, so the noise (a ``V``-wide draw per row and position, the costliest part of sampled verification at a
    large vocabulary) is drawn position by position for those rows alone; the samples that are drawn are the ones the
    whole-noise rule draws too, so both return the same tokens (tests/rollout/test_sampling_rules.py compares them).

    Args:
        target_logprobs: (B, K+1, V) filtered policy log-probabilities at the K+1 verified positions.
        gumbel_at: ``(rows, j) -> (n, V)`` the Gumbel noise of position j for the ``n`` rows ``rows`` (int64).
        draft_ids: (B, K) drafted tokens (target vocabulary).

    Returns:
        num_accepted: (B,) int64 in [0, K]; next_ids: (B,) the policy's sample after the accepted prefix.
    """
    batch, k_plus_1, _ = target_logprobs.shape
    samples = torch.full((batch, k_plus_1), -1, dtype=torch.long, device=target_logprobs.device)  # -1: not drawn
    rows = torch.arange(batch, device=target_logprobs.device)
    for j in range(k_plus_1):
        y = gumbel_argmax(target_logprobs[rows, j], gumbel_at(rows, j))
        samples[rows, j] = y
        if j + 1 == k_plus_1:
            break
        rows = rows[draft_ids[rows, j] == y]  # a row reaches position j + 1 only if proposal j + 1 was its sample
        if rows.numel() == 0:
            break
    return greedy_verify(samples, draft_ids)  # an undrawn position (-1) equals no proposal


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_ids: torch.Tensor,
    uniforms: torch.Tensor,
    next_noise: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling (lossless).

    Args:
        target_probs: (B, K+1, V) filtered policy distributions at the K+1 verified positions.
        draft_probs: (B, K, V) filtered draft distributions the draft tokens were drawn from (target
            vocabulary; tokens outside the draft vocabulary have probability 0).
        draft_ids: (B, K) int64 drafted tokens.
        uniforms: (B, K) uniforms in (0, 1) of the acceptance tests.
        next_noise: maps ``num_accepted`` (B,) to the (B, V) Gumbel noise of the token drawn after the
            accepted prefix (its position depends on the prefix).

    Returns:
        num_accepted: (B,) int64 in [0, K]; next_ids: (B,) the token drawn after the accepted prefix
        (from the residual distribution at the first rejection, from ``p_K`` if all were accepted).
    """
    batch, k_plus_1, vocab = target_probs.shape
    k = k_plus_1 - 1
    if k > 0:
        p_d = target_probs[:, :k].gather(2, draft_ids[..., None]).squeeze(2)
        q_d = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)
        accepted = (uniforms.to(p_d.dtype) * q_d <= p_d) & (p_d > 0)
        num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)
    else:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=target_probs.device)
    rows = torch.arange(batch, device=target_probs.device)
    p_next = target_probs[rows, num_accepted]
    if k > 0:
        padded_q = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)
        residual = torch.clamp(p_next - padded_q[rows, num_accepted], min=0.0)
        # p == q exactly leaves no residual mass; that position is then accepted with probability 1,
        # so this fallback is only reached with probability 0 (kept for numerical safety).
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        p_next = torch.where(empty, p_next, residual)
    next_ids = gumbel_argmax(torch.log(p_next), next_noise(num_accepted))
    return num_accepted, next_ids
