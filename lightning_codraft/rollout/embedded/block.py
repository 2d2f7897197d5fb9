"""Speculative decoding with a block drafter (DFlash): a whole block proposed in ONE draft forward, verified by the
rules of every embedded round.

A round of request ``i`` at policy length ``L`` (its pending token ``x_L`` not yet in the policy's cache):

1. **choose** how many proposals to verify: ``num_speculative_tokens`` for a fixed engine; for an adaptive one the
   controller (rollout/embedded/adaptive.py) picks k in ``0..K`` from the acceptance measured in earlier rounds and
   the cost model's measured seconds (a verify of 1 + k tokens, the drafter's one forward whatever k is), before the
   round's proposals exist, so the choice cannot favour proposals that happen to be accepted (k = 0: a plain step);
2. **propose**: the drafter's forward over the block ``[x_L, MASK x (B - 1)]`` (the policy's embedding) with the
   request's context features at positions ``< L`` (docs/design/drafters.md); its first ``k`` proposal rows (rows
   ``1 .. k`` for DFlash, ``0 .. k - 1`` for DSpark) give ``k`` distributions through the policy's head, and one proposal is drawn from each (``TokenSampler.draw``: greedy,
   coupled or rejection sampling, as the EAGLE-3 rounds draw theirs);
3. **verify** ``[x_L, proposals]`` with ONE policy forward (``TokenSampler.verify``: the accepted prefix and the
   bonus token, lossless: greedy output equals plain decoding, samples follow the policy exactly);
4. **extend the context** with the verify forward's taps of the accepted rows, and emit.

A batch of requests (``max_batch_size`` at most) runs its rounds together: one drafter forward proposes every
row's block over per-row contexts (a ``(B, capacity, H)`` buffer of context features and each row's length), one
policy forward verifies them all. A row that has stopped or spent its budget leaves the batch before the next round
(its cache slot is filled by a live row: :func:`~lightning_codraft.models.kv_cache.hole_filling_order`). Every row
verifies the round's k (less where every live row's budget is shorter); a row keeps what its budget allows, so with
a fixed k a request's tokens, log-probabilities and acceptance counts are those it gets alone (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lightning_codraft.models.decode import policy_decoder
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.kv_cache import KVCache, hole_filling_order
from lightning_codraft.rollout.embedded.adaptive import AcceptanceEstimates, AdaptiveConfig, SpeculationController
from lightning_codraft.rollout.embedded.cost_model import CostModel, RoundClock
from lightning_codraft.rollout.embedded.prefill import prefill
from lightning_codraft.rollout.embedded.prefix import costed_length, threshold_length
from lightning_codraft.rollout.embedded.round import charge_round
from lightning_codraft.rollout.embedded.weights import EmbeddedWeights, mark_rows
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput, validate_prompts
from lightning_codraft.rollout.sampling.noise import CounterNoise, resolve_request_seeds, seed_tensor
from lightning_codraft.rollout.sampling.rules import SamplingParams, sampling_logprobs
from lightning_codraft.rollout.sampling.sampler import SAMPLING_MODES, TokenSampler


def block_controller(max_k: int, config: AdaptiveConfig | None = None) -> SpeculationController:
    """An adaptive controller for a block drafter: its cost model charges one drafter forward to every round that
    proposes, whatever k, and no catch-up (:class:`~lightning_codraft.rollout.embedded.cost_model.CostModel`)."""
    config = config or AdaptiveConfig()
    return SpeculationController(max_k, config, CostModel(config.cost_history, one_forward_draft=True))


@dataclass
class _Rows:
    """The live rows of one batch and everything indexed by them."""

    active: list[int]  # each row's index in the batch's outputs
    cache: KVCache  # the policy's
    ctx: torch.Tensor  # (B, capacity, H) context features (positions < ctx_len visible)
    ctx_len: torch.Tensor  # (B,) context rows: the positions before the pending token
    pending: torch.Tensor  # (B,) emitted token not yet fed to the policy
    noise: CounterNoise
    estimates: AcceptanceEstimates | None

    def keep(self, rows: list[int]) -> None:
        """Keep ``rows`` (an order :meth:`KVCache.compact` accepts), slot ``i`` taking row ``rows[i]``."""
        sel = torch.tensor(rows, device=self.pending.device)
        self.active = [self.active[i] for i in rows]
        self.cache = self.cache.compact(rows)
        self.ctx, self.ctx_len, self.pending = self.ctx[sel], self.ctx_len[sel], self.pending[sel]
        self.noise = self.noise.select(sel)
        if self.estimates is not None:
            self.estimates.select(rows)


@dataclass
class _Outputs:
    """What a batch's requests emitted so far (indexed as the batch's prompts)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stats: list[AcceptanceStats]
    finish: list[str]
    budgets: list[int]
    stops: frozenset[int]

    def done(self, i: int) -> bool:
        return self.finish[i] == "stop" or len(self.tokens[i]) >= self.budgets[i]


class BlockSpeculativeEngine(EmbeddedWeights):
    """Speculative decoding of ``policy`` with a :class:`~lightning_codraft.models.dflash.DFlashDraft`.

    Args:
        policy: a :class:`~lightning_codraft.models.Policy` (its ``decoder``, ``embed`` and ``lm_head``).
        drafter: the block drafter; it proposes ``num_speculative_tokens`` tokens a round (at most its
            ``num_proposals``: ``B - 1`` for DFlash, ``B`` for DSpark's next-token layout).
        num_speculative_tokens: proposals verified per round (the most, with ``adaptive``); default
            ``drafter.num_proposals``.
        sampling: ``coupled`` or ``rejection`` at temperature > 0 (as :class:`SpeculativeEngine`).
        max_batch_size: requests decoded together at most (None: all of a call's).
        adaptive: choose each round's k in ``0..K`` to maximise expected tokens per second (True: a
            :func:`block_controller`, kept across calls as its estimates and cost fits are; or one to use).
        verify_length: ``fixed`` (verify the round's k) or ``confidence`` (a DSpark drafter's confidence head
            shortens it, from the block's hidden states before any proposal is drawn: rollout/embedded/prefix.py).
        confidence_threshold: ``confidence`` without ``adaptive``: the least mean probability a verified position
            is reached and accepted.
    """

    def __init__(
        self,
        policy: nn.Module,
        drafter: DFlashDraft,
        num_speculative_tokens: int | None = None,
        *,
        sampling: str = "coupled",
        max_batch_size: int | None = None,
        adaptive: bool | SpeculationController = False,
        verify_length: str = "fixed",
        confidence_threshold: float = 0.5,
    ):
        if sampling not in SAMPLING_MODES:
            raise ValueError(f"sampling={sampling!r} must be one of {SAMPLING_MODES}")
        most = int(drafter.num_proposals)  # B - 1 (DFlash), B (DSpark's next-token layout)
        k = most if num_speculative_tokens is None else int(num_speculative_tokens)
        if not 1 <= k <= most:
            raise ValueError(f"num_speculative_tokens={k} must be in [1, the drafter's proposals per block = {most}]")
        pc, dc = policy.config, drafter.config
        if int(dc.hidden_size) != int(pc.hidden_size) or int(dc.vocab_size) != int(pc.vocab_size):
            raise ValueError(
                f"the drafter (hidden {dc.hidden_size}, vocab {dc.vocab_size}) does not fit the policy "
                f"(hidden {pc.hidden_size}, vocab {pc.vocab_size}): DFlashDraft.from_policy(policy)"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        if verify_length not in ("fixed", "confidence"):
            raise ValueError(f"verify_length={verify_length!r} must be 'fixed' or 'confidence'")
        if verify_length == "confidence":
            if getattr(drafter, "confidence_head", None) is None:
                raise ValueError("verify_length='confidence' needs a drafter with a confidence head (DSpark's)")
            if drafter.config.confidence_with_markov:
                raise ValueError(
                    "verify_length='confidence' with a confidence head that reads the previous drafted token "
                    "(confidence_with_markov): the length would depend on the proposals themselves, which breaks "
                    "rejection sampling's exactness (docs/design/drafters.md); use a head on the hidden state alone"
                )
        if not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold={confidence_threshold} must be in [0, 1]")
        self.verify_length, self.confidence_threshold = verify_length, float(confidence_threshold)
        self.policy, self.draft, self.num_speculative_tokens, self.sampling = policy, drafter, k, sampling
        self.max_batch_size = max_batch_size
        self.weight_versions = {"policy": -1, "draft": -1}
        self.controller: SpeculationController | None = None
        if adaptive is not False:
            ctl = adaptive if isinstance(adaptive, SpeculationController) else block_controller(k)
            if ctl.max_k != k or not ctl.costs.one_forward_draft:
                raise ValueError(
                    f"the controller (max_k={ctl.max_k}, one_forward_draft={ctl.costs.one_forward_draft}) does not "
                    f"fit a block engine of num_speculative_tokens={k}: build it with block_controller({k})"
                )
            self.controller = ctl

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
        started, marks = dict(self.weight_versions), [[] for _ in prompts]  # in-flight updates (poll_weights)
        with torch.inference_mode():
            pdec = self._policy_decoder()
            for lo in range(0, len(order), size):
                rows = order[lo : lo + size]
                mark_rows(marks, rows, started, self.weight_versions)  # weights updated during an earlier batch
                done, pdec = self._batch(
                    [prompts[i] for i in rows], [seeds[i] for i in rows], sampler, pdec, [marks[i] for i in rows]
                )
                for i, out in zip(rows, done):
                    outs[i] = out
        return self.stamp(outs, started, marks)

    def _policy_decoder(self):
        """The policy's decoder from its weights now, over the whole context plus one round's K + 1 slots."""
        return policy_decoder(self.policy, self.max_context + self.num_speculative_tokens + 1)

    def _batch(
        self, prompts: list[list[int]], seeds: list[int], sampler: TokenSampler, pdec, marks: list[list]
    ) -> tuple[list[RolloutOutput], object]:
        """Prefill a batch of prompts (ascending lengths), then rounds until every row has stopped or spent its
        budget (finished rows leave the batch). Between rounds, newer weights from ``weight_source`` are loaded
        (the policy's decoder rebuilt from them, the caches kept) and each live row's ``marks`` get ``(its token
        count, the new version)``. Returns the outputs and the policy decoder now in use."""
        params, taps, K = sampler.params, tuple(self.draft.config.taps), self.num_speculative_tokens
        device = next(self.policy.parameters()).device
        B, lengths = len(prompts), [len(p) for p in prompts]
        # slots the batch can use: its longest prompt plus what it may emit, and a round's K + 1 written past the
        # committed length (not the model's whole context: every round attends the whole buffer)
        capacity = max(n + min(self.max_context - n, sampler.params.max_new_tokens) for n in lengths) + K + 1
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
        stops = frozenset(params.stop_token_ids)
        out = _Outputs(
            tokens=[[t] for t in first],
            logprobs=[[float(lp[b, t])] for b, t in enumerate(first)],
            stats=[AcceptanceStats(accepted_per_position=[0] * K, proposed_per_position=[0] * K) for _ in range(B)],
            finish=["stop" if t in stops else "length" for t in first],
            budgets=[min(self.max_context - n, params.max_new_tokens) for n in lengths],
            stops=stops,
        )
        key = ("greedy",) if params.greedy else (self.sampling, params.temperature, params.top_k, params.top_p)
        rows = _Rows(
            active=list(range(B)),
            cache=cache,
            ctx=self._context_buffer(B, capacity, captured),
            ctx_len=torch.tensor(lengths, device=device),
            pending=pending,
            noise=noise,
            estimates=None if self.controller is None else self.controller.new_batch(B, key),
        )
        done = [out.done(b) for b in range(B)]
        while not all(done):
            if any(done):
                rows.keep(hole_filling_order([not d for d in done]))
            done = self._round(rows, out, sampler, pdec)
            if self.poll_weights():
                pdec = self._policy_decoder()
                for b in rows.active:
                    marks[b].append((len(out.tokens[b]), self.weight_versions["policy"]))
        return [
            RolloutOutput(token_ids=out.tokens[b], logprobs=out.logprobs[b], finish_reason=out.finish[b], stats=s)
            for b, s in enumerate(out.stats)
        ], pdec

    def _round(self, r: _Rows, out: _Outputs, sampler: TokenSampler, pdec) -> list[bool]:
        """Advance every live row by one round; which rows finished."""
        params, taps, ctl = sampler.params, tuple(self.draft.config.taps), self.controller
        n, clock = len(r.active), RoundClock(r.pending.device)
        remaining = [out.budgets[i] - len(out.tokens[i]) for i in r.active]
        if ctl is None:
            k = min(self.num_speculative_tokens, max(remaining))
        else:  # chosen from earlier rounds only: before this round's proposals exist
            if ctl.needs_calibration(n):
                self._calibrate(r, sampler, pdec)
                clock.restart()  # the calibration is not this round's cost
            k = ctl.choose(r.estimates, remaining)
        with clock.block("draft"):
            hidden = self._block_hidden(pdec, r.ctx, r.ctx_len, r.pending, k)
            if k and self.verify_length == "confidence":  # from the hidden states: before any proposal exists
                k = self._confident_length(hidden, remaining)
        with clock.block("policy"):  # rejection sampling draws the round's noise now (timed with the verify)
            out_pos = torch.tensor([len(out.tokens[i]) for i in r.active], device=r.pending.device)
            rn = sampler.start_round(r.noise, out_pos, k)
        with clock.block("draft"):
            draft_ids, q = self._draw(hidden, r.pending, k, sampler, rn)
        with clock.block("policy"):
            committed = r.cache.lengths
            logits, seen = pdec.forward(torch.cat([r.pending[:, None], draft_ids], dim=1), r.cache, taps)
            lp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
            accepted, bonus = sampler.verify(lp, draft_ids, q, rn)
            host_a, host_ids, host_bonus = accepted.tolist(), draft_ids.tolist(), bonus.tolist()
        r.cache.lengths = committed + 1 + accepted
        self._extend_context(r.ctx, r.ctx_len, seen, accepted)
        r.ctx_len += 1 + accepted
        r.pending = bonus
        emitted, done = [], []
        for b, i in enumerate(r.active):
            n_a, left = host_a[b], out.budgets[i] - len(out.tokens[i])
            new = host_ids[b][:n_a] + [host_bonus[b]]
            m = min(n_a + 1, left)
            stop_at = next((j for j in range(m) if new[j] in out.stops), None)
            if stop_at is not None:
                m, out.finish[i] = stop_at + 1, "stop"
            out.tokens[i] += new[:m]
            out.logprobs[i] += lp[b, torch.arange(n_a + 1), torch.tensor(new)].tolist()[:m]
            out.stats[i].record_round(min(k, left), m - 1)  # what this row's budget let it propose
            emitted.append(m)
            done.append(out.done(i))
        if ctl is not None:
            ctl.observe(r.estimates, k, host_a)
            ctl.record_round(n, k, clock["policy"], clock["draft"], clock.rest(), drafted=1 if k else 0)
            plain = None if k == 0 else ctl.costs.plain_seconds(n, 1)
            charge_round([out.stats[i] for i in r.active], emitted, clock.elapsed(), plain)
        return done

    def _calibrate(self, r: _Rows, sampler: TokenSampler, pdec) -> None:
        """Time verify forwards and the drafter's forward on the live rows (:meth:`CostModel.calibrate_block`)."""
        K = self.num_speculative_tokens

        def propose(n: int) -> None:
            noise = r.noise.select(torch.arange(n, device=r.pending.device))
            rn = sampler.start_round(noise, torch.zeros(n, dtype=torch.long, device=r.pending.device), K)
            self._propose(pdec, r.ctx[:n], r.ctx_len[:n], r.pending[:n], K, sampler, rn)

        self.controller.calibrate_block(pdec, r.cache, r.pending, tuple(self.draft.config.taps), sampler, propose)

    def _context_buffer(self, B: int, capacity: int, captured) -> torch.Tensor:
        """``(B, capacity, H)`` the rows' context features, the prompts' filled in (rows past a prompt are zero and
        invisible)."""
        feats = self.draft.context(list(captured))  # (B, max_len, H)
        ctx = feats.new_zeros(B, capacity, feats.shape[-1])
        ctx[:, : feats.shape[1]] = feats
        return ctx

    def _extend_context(self, ctx: torch.Tensor, ctx_len: torch.Tensor, seen, a: torch.Tensor) -> None:
        """Write the verify forward's accepted rows (``0 .. a_b``) into the buffer."""
        feats = self.draft.context(list(seen))  # (B, k + 1, H)
        keep = torch.arange(feats.shape[1], device=a.device)[None, :] <= a[:, None]
        rows, cols = torch.nonzero(keep, as_tuple=True)
        ctx[rows, ctx_len[rows] + cols] = feats[rows, cols]

    def _propose(
        self, pdec, ctx: torch.Tensor, ctx_len: torch.Tensor, pending: torch.Tensor, k: int, sampler, rn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` proposals per row from ONE drafter forward over every row's block (anchored at its pending token,
        position ``ctx_len``); their q (rejection sampling only). k = 0: none, and no forward."""
        return self._draw(self._block_hidden(pdec, ctx, ctx_len, pending, k), pending, k, sampler, rn)

    def _block_hidden(
        self, pdec, ctx: torch.Tensor, ctx_len: torch.Tensor, pending: torch.Tensor, k: int
    ) -> torch.Tensor | None:
        """``(B, k, H)`` the drafter's hidden states at every row's first ``k`` proposal rows (one forward over the
        blocks anchored at the pending tokens, position ``ctx_len``); None for k = 0 (no forward)."""
        if k == 0:
            return None
        d = self.draft
        block = pdec.embed(d.block_ids(pending))
        C = ctx.shape[1]
        positions = torch.arange(C, device=ctx.device).expand(ctx.shape[0], C)
        visible = positions < ctx_len[:, None]
        return d(ctx, positions, block, ctx_len, visible)[:, d.first_slot : d.first_slot + k]

    def _confident_length(self, hidden: torch.Tensor, remaining: list[int]) -> int:
        """How many proposals to verify, from the confidence head on ``hidden`` ``(B, k, H)`` alone
        (rollout/embedded/prefix.py)."""
        probs = torch.sigmoid(self.draft.confidence_logits(hidden, None).float())
        if self.controller is not None:
            return costed_length(self.controller, probs, remaining)
        return threshold_length(probs, self.confidence_threshold)

    def _draw(
        self, hidden: torch.Tensor | None, pending: torch.Tensor, k: int, sampler, rn
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``k`` proposals per row drawn from the first ``k`` of ``hidden``'s rows; their q (rejection sampling
        only). k = 0: none."""
        if k == 0:
            return pending.new_zeros(pending.shape[0], 0), None
        d, hidden = self.draft, hidden[:, :k]
        logits = d.logits(hidden, self.policy.lm_head.weight)  # (B, k, V)
        markov = getattr(d, "markov_head", None)  # DSpark: each position biased by the token drawn before it
        if markov is None:
            draws = [sampler.draw(logits[:, j], rn, j) for j in range(k)]
        else:
            draws = []

            def pick(step: torch.Tensor, j: int) -> torch.Tensor:  # the engine's sampler, its q kept for verify
                draws.append(sampler.draw(step, rn, j))
                return draws[-1].ids

            markov.draw(logits, pending, pick, hidden)
        ids = torch.stack([p.ids for p in draws], dim=1)
        q = sampler.target_probs([p.q for p in draws]) if draws[0].q is not None else None
        return ids, q
