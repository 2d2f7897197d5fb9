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

A batch of requests (``max_batch_size`` at most) runs its rounds together: one drafter forward proposes every
row's block over per-row contexts (a ``(B, capacity, H)`` buffer of context features and each row's length), one
policy forward verifies them all, and a row that has stopped or spent its budget stays in the batch without
advancing. Every row proposes ``k`` tokens a round (``num_speculative_tokens``, less where every live row's budget
is shorter); a row keeps what its budget allows, so a request's tokens, log-probabilities and acceptance counts
are those it gets alone (tested). Not yet: a verify length chosen by the cost model (the adaptive controller of
rollout/embedded/round.py drives EAGLE-3's chain only), and leaving finished rows out of the forwards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_codraft.models.decode import policy_decoder
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.rollout.embedded.prefill import prefill
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
        max_batch_size: requests decoded together at most (None: all of a call's).
    """

    def __init__(
        self,
        policy: nn.Module,
        drafter: DFlashDraft,
        num_speculative_tokens: int | None = None,
        *,
        sampling: str = "coupled",
        max_batch_size: int | None = None,
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
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        self.policy, self.draft, self.num_speculative_tokens, self.sampling = policy, drafter, k, sampling
        self.max_batch_size = max_batch_size
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
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # the prefill groups rows by length
        size = self.max_batch_size or len(prompts)
        outs: list[RolloutOutput | None] = [None] * len(prompts)
        with torch.inference_mode():
            pdec = policy_decoder(self.policy, self.max_context + self.num_speculative_tokens + 1)
            for lo in range(0, len(order), size):
                rows = order[lo : lo + size]
                done = self._batch([prompts[i] for i in rows], [seeds[i] for i in rows], sampler, pdec)
                for i, out in zip(rows, done):
                    outs[i] = out
        return self.stamp(outs)

    def _batch(self, prompts: list[list[int]], seeds: list[int], sampler: TokenSampler, pdec) -> list[RolloutOutput]:
        """Prefill a batch of prompts (ascending lengths), then rounds until every row has stopped or spent its
        budget; a finished row stays in the batch without advancing (its results are dropped)."""
        params, taps, K = sampler.params, tuple(self.draft.config.taps), self.num_speculative_tokens
        device = next(self.policy.parameters()).device
        B, lengths = len(prompts), [len(p) for p in prompts]
        capacity = self.max_context + K + 1
        ids = torch.zeros(B, max(lengths), dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            ids[b, : len(p)] = torch.tensor(p, device=device)
        cache = pdec.allocate_cache(B, capacity)
        logits, captured = prefill(pdec, cache, ids, lengths, taps)
        cache.lengths = torch.tensor(lengths, device=device)
        noise = CounterNoise(seed_tensor(seeds, device))
        lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
        pending = sampler.first(lp, noise, torch.zeros(B, dtype=torch.long, device=device))
        first = pending.tolist()
        tokens = [[t] for t in first]
        logprobs = [[float(lp[b, t])] for b, t in enumerate(first)]
        ctx = self._context_buffer(B, capacity, captured, lengths)
        ctx_len = torch.tensor(lengths, device=device)  # context rows: the positions before the pending token
        stats = [AcceptanceStats(accepted_per_position=[0] * K, proposed_per_position=[0] * K) for _ in range(B)]
        budgets = [min(self.max_context - n, params.max_new_tokens) for n in lengths]
        stops = set(params.stop_token_ids)
        finish = ["stop" if t in stops else "length" for t in first]
        live = [finish[b] != "stop" and len(tokens[b]) < budgets[b] for b in range(B)]
        while any(live):
            k = min(K, max(budgets[b] - len(tokens[b]) for b in range(B) if live[b]))
            out_pos = torch.tensor([len(t) for t in tokens], device=device)
            rn = sampler.start_round(noise, out_pos, k)
            draft_ids, q = self._propose(pdec, ctx, ctx_len, pending, k, sampler, rn)
            committed = cache.lengths
            logits, seen = pdec.forward(torch.cat([pending[:, None], draft_ids], dim=1), cache, taps)
            lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
            accepted, bonus = sampler.verify(lp, draft_ids, q, rn)
            on = torch.tensor(live, device=device)
            a = torch.where(on, accepted, torch.full_like(accepted, -1))  # a finished row does not advance
            cache.lengths = committed + 1 + a
            self._extend_context(ctx, ctx_len, seen, a)
            ctx_len += 1 + a
            host_a, host_ids, host_bonus = a.tolist(), draft_ids.tolist(), bonus.tolist()
            for b in range(B):
                if not live[b]:
                    continue
                n_a, left = host_a[b], budgets[b] - len(tokens[b])
                new = host_ids[b][:n_a] + [host_bonus[b]]
                n = min(n_a + 1, left)
                stop_at = next((j for j in range(n) if new[j] in stops), None)
                if stop_at is not None:
                    n, finish[b] = stop_at + 1, "stop"
                tokens[b] += new[:n]
                logprobs[b] += lp[b, torch.arange(n_a + 1), torch.tensor(new)].tolist()[:n]
                stats[b].record_round(min(k, left), n - 1)  # what this row's budget let it propose
                live[b] = finish[b] != "stop" and len(tokens[b]) < budgets[b]
            pending = bonus
        return [
            RolloutOutput(token_ids=tokens[b], logprobs=logprobs[b], finish_reason=finish[b], stats=stats[b])
            for b in range(B)
        ]

    def _context_buffer(self, B: int, capacity: int, captured, lengths: list[int]) -> torch.Tensor:
        """``(B, capacity, H)`` the rows' context features, the prompts' filled in (rows past a prompt are zero and
        invisible)."""
        feats = self.draft.context(list(captured))  # (B, max_len, H)
        ctx = feats.new_zeros(B, capacity, feats.shape[-1])
        ctx[:, : feats.shape[1]] = feats
        return ctx

    def _extend_context(self, ctx: torch.Tensor, ctx_len: torch.Tensor, seen, a: torch.Tensor) -> None:
        """Write the verify forward's accepted rows (``0 .. a_b``; none where ``a_b < 0``) into the buffer."""
        feats = self.draft.context(list(seen))  # (B, k + 1, H)
        keep = torch.arange(feats.shape[1], device=a.device)[None, :] <= a[:, None]
        rows, cols = torch.nonzero(keep, as_tuple=True)
        ctx[rows, ctx_len[rows] + cols] = feats[rows, cols]

    def _propose(
        self, pdec, ctx: torch.Tensor, ctx_len: torch.Tensor, pending: torch.Tensor, k: int, sampler, rn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` proposals per row from ONE drafter forward over every row's block (anchored at its pending token,
        position ``ctx_len``); their q (rejection sampling only)."""
        d = self.draft
        block = pdec.embed(d.block_ids(pending))
        C = ctx.shape[1]
        positions = torch.arange(C, device=ctx.device).expand(ctx.shape[0], C)
        visible = positions < ctx_len[:, None]
        hidden = d(ctx, positions, block, ctx_len, visible)
        logits = d.logits(hidden[:, 1 : k + 1], self.policy.lm_head.weight)  # (B, k, V)
        draws = [sampler.draw(logits[:, j], rn, j) for j in range(k)]
        ids = torch.stack([p.ids for p in draws], dim=1)
        q = sampler.target_probs([p.q for p in draws]) if draws[0].q is not None else None
        return ids, q
