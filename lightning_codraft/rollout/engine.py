"""The rollout-engine protocol and its output types.

Every engine (the embedded :class:`~lightning_codraft.rollout.embedded.speculative.SpeculativeEngine`, the
vLLM-backed :class:`~lightning_codraft.rollout.vllm.engine.VLLMEngine`) takes prompts as token ids
and returns, per prompt, the generated ids, their log-probabilities under the policy's sampling
distribution, why generation stopped, and speculative-decoding acceptance statistics.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

import torch

from lightning_codraft.rollout.refit.buckets import WeightBucket


class RolloutError(RuntimeError):
    """Generation failed; the message names the request(s) in flight and the cause is chained."""


@dataclass
class AcceptanceStats:
    """Speculative-decoding acceptance counters (summable across sequences and calls).

    A round verifies k draft tokens: K every round for a fixed engine, 0..K with adaptive speculation
    (k = 0 is a plain step, counted in :attr:`plain_rounds`).
    """

    draft_steps: int = 0
    """Number of verification rounds in which the draft proposed tokens (k > 0)."""
    drafted: int = 0
    """Total draft tokens proposed (the sum of each round's k; draft_steps * K for a fixed engine)."""
    accepted: int = 0
    """Total draft tokens accepted by the policy."""
    accepted_per_position: list[int] = field(default_factory=list)
    """accepted_per_position[j]: rounds in which draft position j (0-based) was accepted; length K."""
    policy_forwards: int = 0
    """Policy forward passes spent on this sequence after the prompt prefill (one per round)."""
    proposed_per_position: list[int] = field(default_factory=list)
    """proposed_per_position[j]: rounds in which draft position j was proposed (k > j); length K. Engines that
    do not count it leave it empty (then every drafting round counts as proposing every position)."""
    plain_rounds: int = 0
    """Rounds in which no draft token was proposed (k = 0)."""
    round_s: float = 0.0
    """Seconds of the decode rounds charged to this sequence (1/B of each round it took part in; adaptive engines
    only, else 0)."""
    plain_s: float = 0.0
    """Seconds plain decoding would have spent on the tokens this sequence emitted in those rounds: a plain round's
    measured share, a drafting round's tokens times the cost model's plain step at the round's batch, ``T(B, 0) / B``
    (adaptive engines only, else 0). ``plain_s - round_s`` is what speculation saved."""

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per drafting round: 1 + accepted / draft_steps (1.0 without drafting)."""
        return 1.0 + self.accepted / self.draft_steps if self.draft_steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens accepted (0.0 without drafting)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_k(self) -> float:
        """Mean draft tokens proposed per round, plain rounds included: drafted / policy_forwards."""
        return self.drafted / self.policy_forwards if self.policy_forwards else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Mean tokens emitted per round, plain rounds included: 1 + accepted / policy_forwards."""
        return 1.0 + self.accepted / self.policy_forwards if self.policy_forwards else 1.0

    @property
    def saving_s(self) -> float:
        """Decode seconds speculation saved against plain decoding at the same batch (NaN where no cost model
        estimated plain decoding: fixed-K engines, vLLM)."""
        return self.plain_s - self.round_s if self.plain_s > 0 else math.nan

    def per_position_rate(self) -> list[float]:
        """Acceptance rate of each draft position j: accepted_per_position[j] / rounds that proposed it."""
        return [a / n if n else 0.0 for a, n in zip(self.accepted_per_position, self._proposed())]

    def _proposed(self) -> list[int]:
        return self.proposed_per_position or [self.draft_steps] * len(self.accepted_per_position)

    def record_round(self, k: int, accepted: int) -> None:
        """Count one round that proposed k draft tokens and accepted ``accepted`` of them."""
        self.policy_forwards += 1
        if k == 0:
            self.plain_rounds += 1
            return
        self.draft_steps += 1
        self.drafted += k
        self.accepted += accepted
        for j in range(accepted):
            self.accepted_per_position[j] += 1
        for j in range(k):
            self.proposed_per_position[j] += 1

    def __add__(self, other: AcceptanceStats) -> AcceptanceStats:
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        pad = lambda xs: list(xs) + [0] * (n - len(xs))  # noqa: E731
        return AcceptanceStats(
            draft_steps=self.draft_steps + other.draft_steps,
            drafted=self.drafted + other.drafted,
            accepted=self.accepted + other.accepted,
            accepted_per_position=[
                a + b for a, b in zip(pad(self.accepted_per_position), pad(other.accepted_per_position))
            ],
            policy_forwards=self.policy_forwards + other.policy_forwards,
            proposed_per_position=[a + b for a, b in zip(pad(self._proposed()), pad(other._proposed()))],
            plain_rounds=self.plain_rounds + other.plain_rounds,
            round_s=self.round_s + other.round_s,
            plain_s=self.plain_s + other.plain_s,
        )

    @staticmethod
    def total(stats: Iterable[AcceptanceStats]) -> AcceptanceStats:
        out = AcceptanceStats()
        for s in stats:
            out = out + s
        return out

    def as_dict(self) -> dict[str, float]:
        d = {
            "draft_steps": float(self.draft_steps),
            "drafted": float(self.drafted),
            "accepted": float(self.accepted),
            "acceptance_length": self.acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "plain_rounds": float(self.plain_rounds),
            "mean_k": self.mean_k,
        }
        d.update({f"acc/pos{j}": r for j, r in enumerate(self.per_position_rate())})
        return d


@dataclass
class RolloutOutput:
    """One generated sequence."""

    token_ids: list[int]
    """Generated token ids only (the prompt is not repeated)."""
    logprobs: list[float]
    """logprobs[t]: log-probability of token_ids[t] under the policy's sampling distribution
    (temperature-scaled, top-k / top-p filtered; at temperature 0 the unscaled policy distribution)."""
    finish_reason: str
    """"stop" (emitted a stop token, included in token_ids) or "length" (max_new_tokens or the context)."""
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    """Acceptance statistics of this sequence."""
    policy_version: int = -1
    """The version (optimizer steps of the training state) of the policy that generated it; -1: never versioned."""
    draft_version: int = -1
    """The version of the draft that proposed for it (a draft that is not refreshed keeps its version)."""
    token_versions: Optional[list[int]] = None
    """The policy version that generated each token where weights changed during the sequence (in-flight weight
    updates: ``policy_version`` is the first token's); None: every token ``policy_version``."""

    @classmethod
    def from_dict(cls, d: Mapping) -> RolloutOutput:
        """The output ``dataclasses.asdict`` wrote (a checkpoint entry), its stats rebuilt."""
        return cls(**{**d, "stats": AcceptanceStats(**d["stats"])})

    @property
    def version_span(self) -> int:
        """Policy versions between the sequence's first token and its last (0 without an in-flight update)."""
        return 0 if not self.token_versions else self.token_versions[-1] - self.token_versions[0]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from an inference engine."""

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        request_seeds: Sequence[int] | None = None,
    ) -> list[RolloutOutput]:
        """Generate one continuation per prompt (prompts are token-id lists).

        Randomness is per request: ``request_seeds[i]`` (in ``[0, 2**63)``) fixes request i's samples whatever
        else is in the call; with only ``seed``, request i uses ``rollout.sampling.noise.request_seed(seed, i)``; with
        neither, fresh seeds. Passing both is an error.
        """
        ...

    def update_weights(
        self, policy_state: Mapping[str, torch.Tensor] | None, draft_state: Mapping[str, torch.Tensor] | None
    ) -> None:
        """Load full HF-named policy / vLLM-named draft state dicts (None leaves that model unchanged)."""
        ...

    def load_buckets(self, buckets: Iterable[WeightBucket], verify: str = "buckets") -> None:
        """Load a bucketed refit (:mod:`lightning_codraft.rollout.refit.buckets`): each bucket checked as it lands
        (``verify="buckets"``), the push refused (:class:`~lightning_codraft.rollout.refit.buckets.RefitError`) when a
        bucket is corrupted, stale, missing, or a tensor of the engine stays unfilled; afterwards the engine holds
        the buckets' version of each model they carried (:attr:`weight_versions`)."""
        ...

    weight_versions: dict[str, int]
    """``{"policy": v, "draft": v}``: the versions the engine decodes with (-1 before any versioned load); every
    :class:`RolloutOutput` carries them."""

    keeps_own_weights: bool
    """True when the engine holds its weights apart from the modules it was built from (vLLM, in processes of its
    own); False when it decodes those modules themselves (the embedded engine)."""

    supports_sleep: bool
    """Whether :meth:`sleep` / :meth:`wake_up` free and restore the engine's memory between rollout phases."""

    verify_updates: bool
    """Verify every parameter (both models) after the next refits, beyond the per-bucket checks (the RL loop sets
    it for a run's first and last refit); an engine with nothing more to verify keeps it and ignores it."""

    def sleep(self, level: int = 1) -> None:
        """Free the engine's memory until :meth:`wake_up` (only where ``supports_sleep``)."""
        ...

    def wake_up(self, *, refit: bool = False) -> None:
        """Restore what :meth:`sleep` freed (only where ``supports_sleep``); ``refit``: a full refit of both models
        follows at once (the RL loop's), so nothing is pushed or verified here."""
        ...

    def close(self) -> None:
        """Stop what the engine runs apart from the caller (vLLM's processes); idempotent; a no-op where nothing
        runs apart."""
        ...


class ForwardObserver(Protocol):
    """Sees the policy's forwards of a ``SpeculativeEngine.generate`` call (e.g. to keep the policy's features of
    the sampled sequences instead of recomputing them: ``distill/capture.py``).

    Requests are indices into the call's ``prompts``; positions are token positions in ``prompt + output``.
    Tensors are the engine's own (its decode dtype and device) and valid during the call only: copy what you keep.
    """

    taps: Sequence[int]
    """The policy tap ids to receive (tap ``l``: hidden state entering layer ``l``; ``L``: last layer's output)."""

    def prefill(
        self, requests: list[int], lengths: list[int], taps: tuple[torch.Tensor, ...], last_logits: torch.Tensor
    ) -> None:
        """The prompts' forward: ``taps`` each ``(B, S, H)`` (row i valid up to ``lengths[i]``), ``last_logits``
        ``(B, V)`` at each prompt's last position."""
        ...

    def decode(
        self,
        requests: list[int],
        start: list[int],
        counts: list[int],
        taps: tuple[torch.Tensor, ...],
        logits: torch.Tensor,
    ) -> None:
        """One decode (verify) forward: row i fed positions ``start[i] .. start[i] + counts[i] - 1`` of its
        sequence (its emitted tokens; positions past the request's final length, after a stop token, may occur
        and are not part of it); ``taps`` each ``(B, S, H)`` and ``logits`` ``(B, S, V)`` at those positions."""
        ...


def validate_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_context: int) -> None:
    """Raise ValueError naming the first bad request: empty, out-of-vocabulary id, or no room to generate."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt (a list of token ids)")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"request {i}: prompt is empty; every prompt needs at least one token id")
        if len(prompt) >= max_context:
            raise ValueError(
                f"request {i}: prompt has {len(prompt)} tokens but the context holds "
                f"{max_context}; prompts must be shorter than the context to generate anything"
            )
        if not all(isinstance(t, numbers.Integral) for t in prompt):
            bad = next(t for t in prompt if not isinstance(t, numbers.Integral))
            raise ValueError(
                f"request {i}: token ids must be Python ints, got {type(bad).__name__} {bad!r}; "
                "encode text with the tokenizer first"
            )
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"request {i}: token id {bad} is outside the vocabulary [0, {vocab_size})")
