"""Speculative decoding with a block drafter (DFlash): a whole block proposed in ONE draft forward, verified by the
rules of every embedded round.

A round of request ``i`` at policy length ``L`` (its pending token ``x_L`` not yet in the policy's cache):

1. **propose**: the drafter's forward over the block ``[x_L, MASK x (B - 1)]`` (the policy's embedding) with the
   request's context features at positions ``< L`` (docs/design/drafters.md); block rows ``1 .. k`` give ``k``
   distributions through the policy's head, and one proposal is drawn from each (``TokenSampler.draw``: greedy,
   coupled or rejection sampling, as the EAGLE-3 rounds draw theirs);
2. **verify** ``[x_L, proposals]`` with ONE policy forward (``TokenSampler.verify``: the accepted prefix and the
   bonus token, lossless: greedy output equals plain decoding, samples follow the policy exactly);
3. **extend the context** with the verify forward's taps of the accepted rows, and emit.

Requests decode one after another, each with its own cache (batch-invariant by construction: a request's tokens
are a function of its seed, prompt and the weights). This is the correctness-first engine of the block drafter;
the batched rounds of rollout/embedded/round.py and the adaptive controller do not drive it yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_codraft.models.decode import policy_decoder
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.rollout.embedded.weights import EmbeddedWeights
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput, validate_prompts
from lightning_codraft.rollout.sampling.noise import CounterNoise, resolve_request_seeds, seed_tensor
from lightning_codraft.rollout.sampling.rules import SamplingParams, sampling_logprobs
from lightning_codraft.rollout.sampling.sampler import SAMPLING_MODES, TokenSampler


class BlockSpeculativeEngine(EmbeddedWeights):
    """Speculative decoding of ``policy`` with a :class:`~lightning_codraft.models.dflash.DFlashDraft`.

    Args:
        policy: a :class:`~lightning_codraft.models.Policy` (its ``decoder``, ``embed`` and ``lm_head``).
        drafter: the block drafter; it proposes ``num_speculative_tokens`` tokens a round (at most ``B - 1``).
        num_speculative_tokens: proposals verified per round; default ``block_size - 1``.
        sampling: ``coupled`` or ``rejection`` at temperature > 0 (as :class:`SpeculativeEngine`).
    """

    def __init__(
        self,
        policy: nn.Module,
        drafter: DFlashDraft,
        num_speculative_tokens: int | None = None,
        *,
        sampling: str = "coupled",
    ):
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling={sampling!r} must be one of {SAMPLING_MODES}")
        B = int(drafter.config.block_size)
        k = B - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
        if not 1 <= k <= B - 1:
            raise ValueError(f"num_speculative_tokens={k} must be in [1, block_size - 1 = {B - 1}]")
        pc, dc = policy.config, drafter.config
        if int(dc.hidden_size) != int(pc.hidden_size) or int(dc.vocab_size) != int(pc.vocab_size):
            raise ValueError(
                f"the drafter (hidden {dc.hidden_size}, vocab {dc.vocab_size}) does not fit the policy "
                f"(hidden {pc.hidden_size}, vocab {pc.vocab_size}): DFlashDraft.from_policy(policy)"
            )
        self.policy, self.draft, self.num_speculative_tokens, self.sampling = policy, drafter, k, sampling
        self.weight_versions = {"policy": -1, "draft": -1}

    @property
    def vocab_size(self) -> int:
        return int(self.policy.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(self.policy.config.max_position_embeddings)

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
        """One continuation per prompt (the arguments of :meth:`SpeculativeEngine.generate`)."""
        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
        )
        validate_prompts(prompts, self.vocab_size, self.max_context)
        seeds = resolve_request_seeds(len(prompts), seed, request_seeds)
        sampler = TokenSampler(params, self.sampling, self.vocab_size)
        device = next(self.policy.parameters()).device
        with torch.inference_mode():
            pdec = policy_decoder(self.policy, self.max_context + self.num_speculative_tokens + 1)
            outs = [self._one(p, sampler, CounterNoise(seed_tensor([s], device)), pdec) for p, s in zip(prompts, seeds)]
        return self.stamp(outs)

    def _one(self, prompt: list[int], sampler: TokenSampler, noise: CounterNoise, pdec) -> RolloutOutput:
        """Prefill, then rounds until a stop token, the budget or the context ends the request."""
        params, taps = sampler.params, tuple(self.draft.config.taps)
        device = next(self.policy.parameters()).device
        P = len(prompt)
        budget = min(self.max_context - P, params.max_new_tokens)
        cache = pdec.allocate_cache(1, self.max_context + self.num_speculative_tokens + 1)
        ids = torch.tensor([prompt], device=device)
        logits, captured = pdec.forward(ids, cache, taps, logit_rows=torch.tensor([P - 1], device=device))
        cache.lengths = torch.tensor([P], device=device)
        lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
        pending = sampler.first(lp, noise, torch.zeros(1, dtype=torch.long, device=device))
        tokens, logprobs = [int(pending)], [float(lp[0, pending])]
        ctx = self.draft.context([t[0] for t in captured])
        stats = AcceptanceStats(
            accepted_per_position=[0] * self.num_speculative_tokens,
            proposed_per_position=[0] * self.num_speculative_tokens,
        )
        stops = set(params.stop_token_ids)
        finish = "stop" if tokens[0] in stops else "length"
        while finish != "stop" and len(tokens) < budget:
            k = min(self.num_speculative_tokens, budget - len(tokens))
            rn = sampler.start_round(noise, torch.tensor([len(tokens)], device=device), k)
            draft_ids, q = self._propose(pdec, ctx, pending, P + len(tokens) - 1, k, sampler, rn)
            committed = cache.lengths  # a decoder forward replaces the lengths tensor (advanced by its rows)
            logits, seen = pdec.forward(torch.cat([pending[:, None], draft_ids], dim=1), cache, taps)
            lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
            accepted, bonus = sampler.verify(lp, draft_ids, q, rn)
            a = int(accepted)
            cache.lengths = committed + 1 + a  # the rejected rows' slots are overwritten next round
            new = draft_ids[0, :a].tolist() + [int(bonus)]
            ctx = torch.cat([ctx, self.draft.context([t[0, : a + 1] for t in seen])])
            n = min(a + 1, budget - len(tokens))
            stop_at = next((j for j in range(n) if new[j] in stops), None)
            if stop_at is not None:
                n, finish = stop_at + 1, "stop"
            tokens += new[:n]
            logprobs += lp[0, torch.arange(a + 1), torch.tensor(new)].tolist()[:n]
            stats.record_round(k, n - 1)
            pending = bonus
        return RolloutOutput(token_ids=tokens, logprobs=logprobs, finish_reason=finish, stats=stats)

    def _propose(
        self, pdec, ctx: torch.Tensor, pending: torch.Tensor, anchor: int, k: int, sampler: TokenSampler, rn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` proposals from ONE drafter forward over the block anchored at position ``anchor``; their q
        (rejection sampling only)."""
        d = self.draft
        block = pdec.embed(d.block_ids(pending))
        positions = torch.arange(ctx.shape[0], device=ctx.device)
        visible = torch.ones(1, ctx.shape[0], dtype=torch.bool, device=ctx.device)
        hidden = d(ctx, positions, block, torch.tensor([anchor], device=ctx.device), visible)
        logits = d.logits(hidden[0, 1 : k + 1], self.policy.lm_head.weight)  # (k, V)
        draws = [sampler.draw(logits[j][None], rn, j) for j in range(k)]
        ids = torch.stack([p.ids for p in draws], dim=1)
        q = sampler.target_probs([p.q for p in draws]) if draws[0].q is not None else None
        return ids, q
