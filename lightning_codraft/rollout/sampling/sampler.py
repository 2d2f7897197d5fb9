"""How the embedded engine draws each token: greedy, Gumbel-coupled or rejection sampling, from counter-based noise.

One :class:`TokenSampler` serves one ``generate`` call. Every random number it uses is the batch's
:class:`~lightning_codraft.rollout.sampling.noise.CounterNoise` at the output position being sampled (0 = the first
generated token), so a request's samples depend on its seed, not on the batch around it:

- **coupled** (default): the token at position t is ``argmax_v(log p_t(v) + G_t(v))`` (purpose TOKEN), and the
  draft proposes ``argmax_v(log q_t(v) + G_t(v))`` with the same noise (each draft-vocabulary id scored with the
  noise of its target id). Rollouts are a pure function of (seed, prompt, weights): the same with or without a
  draft, for every speculation length.
- **rejection**: the draft samples with its own noise (purpose DRAFT), the acceptance tests use uniforms (ACCEPT)
  and the token after the accepted prefix is drawn with the TOKEN noise of its position, so plain decoding
  (no draft, or k = 0) draws the same tokens in both modes; with a draft the samples depend on the speculation
  lengths too.
- **greedy** (temperature 0): argmax everywhere, no noise.

rules.py holds the rules (module docstring); this module only feeds them the right noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_codraft.rollout.sampling.noise import ACCEPT, DRAFT, TOKEN, CounterNoise
from lightning_codraft.rollout.sampling.rules import (
    SamplingParams,
    filter_logits,
    greedy_verify,
    gumbel_argmax,
    lazy_coupled_verify,
    rejection_sample,
)

SAMPLING_MODES = ("coupled", "rejection")


class TokenSampler:
    """The sampling rule of one ``generate`` call.

    Args:
        params: the call's sampling parameters.
        mode: "coupled" or "rejection" (ignored when greedy).
        vocab_size: V, the policy's vocabulary.
        draft_index: (Vd,) target id of every draft-vocabulary id; None when the draft has the target vocabulary
            (or there is no draft).
    """

    def __init__(self, params: SamplingParams, mode: str, vocab_size: int, draft_index: torch.Tensor | None = None):
        if mode not in SAMPLING_MODES:
            raise ValueError(f"sampling={mode!r} is not one of {SAMPLING_MODES}")
        self.params, self.mode, self.vocab_size, self.index = params, mode, int(vocab_size), draft_index
        self.greedy = params.greedy
        self._ids: torch.Tensor | None = None

    @property
    def uses_draft_probs(self) -> bool:
        """True when verification needs the draft's distributions (rejection sampling at temperature > 0)."""
        return not self.greedy and self.mode == "rejection"

    def _vocab(self, device: torch.device) -> torch.Tensor:
        if self._ids is None or self._ids.device != device:
            self._ids = torch.arange(self.vocab_size, device=device)
        return self._ids

    def first(self, logprobs: torch.Tensor, noise: CounterNoise, positions: torch.Tensor) -> torch.Tensor:
        """The token after the prompt.

        Args:
            logprobs: (B, V) filtered policy log-probabilities.
            noise: the batch's noise; positions: (B,) output positions being sampled.

        Returns:
            (B,) int64 token ids.
        """
        if self.greedy:
            return torch.argmax(logprobs, dim=-1)
        return gumbel_argmax(logprobs, noise.gumbel(positions[:, None], TOKEN, self._vocab(logprobs.device))[:, 0])

    def start_round(self, noise: CounterNoise, positions: torch.Tensor, k: int) -> RoundNoise:
        """A round's noise: k proposals and k + 1 verified positions from ``positions`` (B,). Rejection sampling's
        is drawn now; coupled sampling's TOKEN noise when a proposal or a verified position needs it (the
        proposals over the draft vocabulary only, each verified position only for the rows that reach it)."""
        out = RoundNoise(noise, positions)
        if self.greedy or self.mode == "coupled" or not k:
            return out
        at = positions[:, None] + torch.arange(k, device=positions.device)  # (B, k)
        out.draft = noise.gumbel(at, DRAFT, self._draft_vocab(positions.device))
        out.accept = noise.uniform(at, ACCEPT)[..., 0]
        return out

    def token_noise(self, rn: RoundNoise, j: int, ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """(n, N) coupled TOKEN noise of the round's position j (output position ``rn.positions + j``) over token
        ids ``ids`` (N,), for rows ``rows`` (n,) or every row; an id's noise does not depend on the other ids drawn."""
        noise, at = (rn.noise, rn.positions) if rows is None else (rn.noise.select(rows), rn.positions[rows])
        return noise.gumbel((at + j)[:, None], TOKEN, ids)[:, 0]

    def _draft_vocab(self, device: torch.device) -> torch.Tensor:
        return self.index if self.index is not None else self._vocab(device)

    def draw(self, draft_logits: torch.Tensor, rn: RoundNoise, j: int, confidence: bool = False) -> Proposal:
        """The round's j-th draft token per row.

        Args:
            draft_logits: (B, Vd) the draft's raw logits.
            rn: the round's noise (:meth:`start_round`).
            confidence: also return each proposal's probability under the distribution it was drawn from (the
                draft's softmax; tempered and filtered when sampling): what the adaptive controller predicts its
                acceptance from.

        Returns:
            :class:`Proposal`: ids (B,) target-vocabulary ids; q (B, Vd) the filtered draft distribution (rejection
            sampling only, else None); confidence (B,) fp32 (None unless asked).
        """
        if self.greedy:
            d = torch.argmax(draft_logits, dim=-1)
            conf = torch.softmax(draft_logits.float(), dim=-1).gather(1, d[:, None])[:, 0] if confidence else None
            return Proposal(self._target_ids(d), None, conf)
        logits = draft_logits.float()
        if self.params.temperature != 1.0:  # x / 1.0 == x exactly: skip the op
            logits = logits / self.params.temperature
        logits = filter_logits(logits, self.params.top_k, self.params.top_p)
        if self.mode == "coupled":  # each draft id scored with the noise of its target id
            d = gumbel_argmax(logits, self.token_noise(rn, j, self._draft_vocab(logits.device)))
            q = torch.softmax(logits, dim=-1) if confidence else None
            return Proposal(self._target_ids(d), None, None if q is None else q.gather(1, d[:, None])[:, 0])
        d = gumbel_argmax(logits, rn.draft[:, j])
        q = torch.softmax(logits, dim=-1)
        return Proposal(self._target_ids(d), q, q.gather(1, d[:, None])[:, 0] if confidence else None)

    def _target_ids(self, d: torch.Tensor) -> torch.Tensor:
        return d if self.index is None else self.index[d]

    def target_probs(self, draft_probs: list[torch.Tensor]) -> torch.Tensor:
        """(B, k, V) target-space q from k draft-space (B, Vd) distributions (0 outside the draft vocabulary)."""
        q = torch.stack(draft_probs, dim=1)
        if self.index is None:
            return q
        out = q.new_zeros(*q.shape[:2], self.vocab_size)
        return out.index_copy_(2, self.index, q)

    def verify(
        self, logprobs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, rn: RoundNoise
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Verify k proposals per row.

        Args:
            logprobs: (B, k+1, V) filtered policy log-probabilities at the verified positions.
            draft_ids: (B, k) proposals (target vocabulary); draft_probs: (B, k, V) their q (rejection only).
            rn: the round's noise (:meth:`start_round` with this k).

        Returns:
            num_accepted: (B,) int64 in [0, k]; next_ids: (B,) the policy's token after the accepted prefix.
        """
        if self.greedy:
            return greedy_verify(torch.argmax(logprobs, dim=-1), draft_ids)
        if self.mode == "coupled":
            vocab = self._vocab(logprobs.device)
            return lazy_coupled_verify(logprobs, lambda rows, j: self.token_noise(rn, j, vocab, rows), draft_ids)
        batch, k = draft_ids.shape
        if draft_probs is None:  # no draft: an empty proposal, the next token comes from p_0
            draft_probs = logprobs.new_zeros(batch, 0, logprobs.shape[-1])
        uniforms = rn.accept[:, :k] if k else logprobs.new_zeros(batch, 0)  # a round may verify fewer than drawn
        ids = self._vocab(logprobs.device)
        return rejection_sample(
            logprobs.exp(),
            draft_probs,
            draft_ids,
            uniforms,
            lambda accepted: rn.noise.gumbel((rn.positions + accepted)[:, None], TOKEN, ids)[:, 0],
        )


class Proposal(NamedTuple):
    """One draft token per row (:meth:`TokenSampler.draw`)."""

    ids: torch.Tensor
    """(B,) int64 target-vocabulary ids."""
    q: torch.Tensor | None
    """(B, Vd) the filtered draft distribution the ids were drawn from (rejection sampling only)."""
    confidence: torch.Tensor | None = None
    """(B,) fp32 each proposal's probability under that distribution (when asked)."""


@dataclass
class RoundNoise:
    """The noise of one round (:meth:`TokenSampler.start_round`)."""

    noise: CounterNoise
    """The batch's noise."""
    positions: torch.Tensor
    """(B,) output position of each row's first verified token (coupled sampling draws its TOKEN noise from
    these as it needs it: :meth:`TokenSampler.token_noise`)."""
    draft: torch.Tensor | None = None
    """(B, k, Vd) Gumbel DRAFT noise of the proposals over the draft vocabulary (rejection sampling)."""
    accept: torch.Tensor | None = None
    """(B, k) uniforms of the acceptance tests (rejection sampling)."""
