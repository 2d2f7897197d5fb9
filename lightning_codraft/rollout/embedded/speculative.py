"""The embedded speculative-decoding engine: a policy verifies EAGLE-3 draft proposals, batched, in PyTorch.

One *round* for a batch of B sequences whose caches hold ``L_b`` tokens and whose next token
``x_{L_b}`` (the *pending* token) is already emitted, drafting k tokens (k = K, or chosen per round by the
adaptive controller, rollout/embedded/adaptive.py):

1. **Draft** k tokens by chaining the EAGLE-3 draft: the step-0 proposal comes from the draft's
   output at position ``L_b - 1`` (input ``fuse(taps_{L_b-1})`` and ``emb(x_{L_b})``, computed at the
   end of the previous round); steps 1..k-1 feed the draft its own output hidden state and the
   token it just proposed. The draft's KV cache is rolled back to ``L_b`` afterwards. An adaptive engine
   measures the draft's confidence in each proposal and may stop the chain after any of them, verifying
   fewer (0..k) where the controller predicts that more would not pay (rollout/embedded/round.py, confidence.py).
2. **Verify** with ONE policy forward over ``[x_{L_b}, d_1, .., d_k]`` (positions ``L_b .. L_b+k``),
   capturing the draft's taps. Greedy: accept the longest prefix equal to the policy's argmax;
   sampling: Gumbel-coupled verification (default: accept the longest prefix equal to the policy's own
   Gumbel-max samples, drawn with the noise the draft proposed with) or rejection sampling
   (rollout/sampling/sampler.py, rollout/sampling/rules.py).
   ``a_b`` accepted tokens plus one token from the policy are emitted (from ``p_k`` when all k are accepted,
   from ``p_0`` when k = 0); the policy cache is rolled back to ``L_b + 1 + a_b``.
3. **Catch up** the draft: one draft forward over positions ``L_b .. L_b+a_b`` with the policy's real
   taps (not the draft's own guesses) and the now-known next tokens; its output at ``L_b + a_b`` is
   the next round's step-0 proposal. After a k = 0 round the catch-up is deferred (the round's taps are
   kept) and done in one forward when drafting resumes; past ``AdaptiveConfig.resume_window`` deferred
   positions only the last ones are caught up, so a draft that does not pay costs nothing while unused. An
   adaptive engine defers the draft's pass over the prompts the same way, to the batch's first drafting round.

The forwards run through the models' decoders (``Policy.decoder`` / ``Eagle3Draft.decoder``, models/decode.py:
the modules' math with fewer ops per layer; modules without a ``decoder`` are called through their own
``forward(kv_cache=)`` / ``step``), and the per-row bookkeeping (stop tokens, budgets, finished rows) is done in
Python on the round's accepted counts, new tokens and log-probs, copied to the host once per round. Sequences
that finish (stop token, budget) leave the batch and its caches, so the rest do not pay for them. With no draft
(or K = 0) the same loop is plain decoding: one policy forward per token.

Randomness is counter-based (rollout/sampling/noise.py): the noise of request i at output position t is a hash of (its
seed, t, purpose), so chunking, batch composition and request order never change a request's samples; with
coupled sampling neither do the draft and the speculation lengths (fixed or adaptive): the output is the
policy's Gumbel-max sample at every position. Token-for-token equality holds up to floating-point near-ties:
a position's logits come out of verify forwards of different shapes, which may round their last bits
differently, and that flips a sample only when two noisy scores are that close.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_codraft.models.decode import DraftDecoder, PolicyDecoder, draft_decoder, policy_decoder
from lightning_codraft.models.kv_cache import hole_filling_order
from lightning_codraft.rollout.embedded.adaptive import SpeculationController
from lightning_codraft.rollout.embedded.batch import LiveRows, decode_dtype
from lightning_codraft.rollout.embedded.prefill import prefill
from lightning_codraft.rollout.embedded.round import Chunk, catch_up, pick, run_round
from lightning_codraft.rollout.embedded.weights import EmbeddedWeights, mark_rows
from lightning_codraft.rollout.engine import (
    AcceptanceStats,
    ForwardObserver,
    RolloutError,
    RolloutOutput,
    validate_prompts,
)
from lightning_codraft.rollout.sampling.noise import CounterNoise, resolve_request_seeds, seed_tensor
from lightning_codraft.rollout.sampling.rules import SamplingParams, sampling_logprobs
from lightning_codraft.rollout.sampling.sampler import SAMPLING_MODES, TokenSampler


class SpeculativeEngine(EmbeddedWeights):
    """Batched speculative decoding with a policy and an (optional) EAGLE-3 draft.

    Args:
        policy: a :class:`~lightning_codraft.models.Policy` (any module with its ``forward(ids, kv_cache=,
            taps=)``, ``embed`` and ``config``).
        draft: an :class:`~lightning_codraft.models.Eagle3Draft` fitted to ``policy``, or None for plain decoding.
        num_speculative_tokens: K, draft tokens proposed per round (the most, with ``adaptive``); 0 means plain
            decoding.
        max_batch_size: prompts are generated in chunks of at most this many sequences (None: all at once).
        adaptive: choose each round's k in ``0..K`` to maximise expected tokens per second (True: a default
            :class:`~lightning_codraft.rollout.embedded.adaptive.SpeculationController`, kept across calls as
            :attr:`controller`; or a controller of your own). Output is unchanged in distribution (and token
            for token when greedy or coupled; with ``sampling="rejection"`` the samples depend on each round's k,
            which follows measured times).
        sampling: how tokens are drawn at temperature > 0: "coupled" (Gumbel-coupled verification: the rollouts are a
            pure function of each request's seed and prompt, whatever the draft, K, adaptivity, batch size or request
            order) or "rejection" (speculative rejection sampling: slightly longer acceptance,
            docs/design/measurements.md; samples that depend on the speculation lengths). Both sample the policy
            exactly.
        dtype: decode in this dtype (``torch.bfloat16`` or ``"bfloat16"``: what rollout engines serve an
            fp32-trained policy in; float32, float16; ``"auto"``: bf16 where it is fast), from a cast copy of the
            weights taken at each ``generate`` call, KV caches and taps in it too; logits are upcast to fp32 for
            sampling and log-probs. Speculation stays lossless against plain decoding in the same dtype (the
            policy sampled is the cast one, so the returned log-probs are the behaviour policy's). None: the
            modules' own dtype.

    The engine decodes with the modules it is given (no copies unless ``dtype`` casts them);
    :meth:`update_weights` loads new weights into them in place.
    """

    def __init__(
        self,
        policy: nn.Module,
        draft: nn.Module | None = None,
        num_speculative_tokens: int = 3,
        *,
        max_batch_size: int | None = None,
        adaptive: bool | SpeculationController = False,
        sampling: str = "coupled",
        dtype: torch.dtype | str | None = None,
    ):
        if sampling not in SAMPLING_MODES:
            raise ValueError(
                f"sampling={sampling!r} must be one of {SAMPLING_MODES}: 'coupled' (Gumbel-coupled, "
                "rollouts independent of the draft and batch) or 'rejection'"
            )
        if int(num_speculative_tokens) < 0:
            raise ValueError(
                f"num_speculative_tokens={num_speculative_tokens} must be >= 0 (0 = plain decoding without the draft)"
            )
        if max_batch_size is not None and int(max_batch_size) < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        for role, module in (("policy", policy), ("draft", draft)):
            if module is not None and any(isinstance(p, DTensor) for p in module.parameters()):
                raise ValueError(
                    f"the engine's {role} holds FSDP2 / DTensor shards: every rank would decode its own "
                    f"prompts through collectives the other ranks are not in. Build the engine over a "
                    f"separate, unsharded copy and fill it with the training module's full weights each "
                    f"step (CoDraftModule.full_state_dicts(); the RL loop's RolloutWorker and "
                    f"lightning_codraft.pytorch.WeightSyncCallback do this), or train with "
                    f"CoDraftStrategy(sharding='ddp')"
                )
        self.policy = policy
        self.draft = draft if int(num_speculative_tokens) > 0 else None
        self.num_speculative_tokens = int(num_speculative_tokens) if draft is not None else 0
        self.max_batch_size = max_batch_size
        self.sampling = sampling
        self.dtype = decode_dtype(dtype, next(policy.parameters()).device)
        self._check_draft()
        self._draft_to_target: torch.Tensor | None = None
        self._draft_is_identity = False
        self.controller: SpeculationController | None = None
        self.weight_versions = {"policy": -1, "draft": -1}
        if adaptive is not False and self.draft is not None:
            ctl = (
                adaptive
                if isinstance(adaptive, SpeculationController)
                else SpeculationController(self.num_speculative_tokens)
            )
            if ctl.max_k != self.num_speculative_tokens:
                raise ValueError(
                    f"the controller's max_k={ctl.max_k} differs from num_speculative_tokens="
                    f"{self.num_speculative_tokens}; build it with SpeculationController(K)"
                )
            self.controller = ctl

    # ------------------------------------------------------------------ setup
    @property
    def vocab_size(self) -> int:
        return int(self.policy.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(self.policy.config.max_position_embeddings)

    def _check_draft(self) -> None:
        if self.draft is None:
            return
        missing = [name for name in ("config", "draft_to_target") if not hasattr(self.draft, name)]
        if not callable(getattr(self.draft, "decoder", None)):
            missing += [name for name in ("fuse", "step") if not callable(getattr(self.draft, name, None))]
        if missing:
            raise TypeError(
                f"the engine's draft {type(self.draft).__name__} lacks {missing}: a draft needs the "
                f"EAGLE-3 decode contract (config, draft_to_target, and decoder() or fuse + step); "
                f"subclass lightning_codraft.models.Eagle3Draft"
            )
        pc, dc = self.policy.config, self.draft.config
        if int(dc.hidden_size) != int(pc.hidden_size):
            raise ValueError(
                f"draft hidden_size={dc.hidden_size} does not fit the policy's "
                f"hidden_size={pc.hidden_size}; build the draft with Eagle3Draft.from_policy(policy)"
            )
        if int(dc.vocab_size) != int(pc.vocab_size):
            raise ValueError(
                f"draft vocab_size={dc.vocab_size} (target vocabulary) does not match the policy's "
                f"vocab_size={pc.vocab_size}; build the draft with Eagle3Draft.from_policy(policy)"
            )
        taps = tuple(int(t) for t in dc.taps)
        num_layers = int(pc.num_hidden_layers)
        if len(taps) != 3 or any(t < 0 or t > num_layers for t in taps):
            raise ValueError(f"draft taps={taps} must be 3 tap ids in [0, {num_layers}] of the policy")

    def _draft_index(self, device: torch.device) -> torch.Tensor:
        """(Vd,) target id of every draft-vocabulary id."""
        if self._draft_to_target is None or self._draft_to_target.device != device:
            vd = int(self.draft.config.draft_vocab_size)
            self._draft_to_target = self.draft.draft_to_target(torch.arange(vd, device=device)).long()
            identity = torch.arange(vd, device=device)
            self._draft_is_identity = vd == self.vocab_size and bool((self._draft_to_target == identity).all())
        return self._draft_to_target

    def _device(self) -> torch.device:
        return next(self.policy.parameters()).device

    # ------------------------------------------------------------------ public API
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
        observer: ForwardObserver | None = None,
    ) -> list[RolloutOutput]:
        """Generate one continuation per prompt.

        Args:
            prompts: B lists of token ids (non-empty, shorter than the context).
            max_new_tokens: generated tokens per sequence at most (also capped by the context length).
            temperature, top_p, top_k: sampling distribution (temperature 0 = greedy).
            seed: call-wide seed: request i samples with ``request_seed(seed, i)`` (rollout/sampling/noise.py); None (and
                no ``request_seeds``): fresh randomness.
            stop_token_ids: a sequence finishes after emitting one of these (included in its output).
            request_seeds: B seeds in ``[0, 2**63)``, exclusive with ``seed``: request i's samples depend only on
                ``request_seeds[i]``, its prompt and the weights (the noise at its output position t is a hash
                of (seed, t)).
            observer: sees every policy forward with the taps it asks for (:class:`ForwardObserver`); outputs are
                unchanged.

        Returns:
            B :class:`RolloutOutput` in prompt order.
        """
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
        device = self._device()
        chunk = self.max_batch_size or len(prompts)
        with torch.inference_mode():
            index = None if self.draft is None else self._draft_index(device)
        sampler = TokenSampler(params, self.sampling, self.vocab_size, None if self._draft_is_identity else index)
        outputs: list[RolloutOutput | None] = [None] * len(prompts)
        started, marks = dict(self.weight_versions), [[] for _ in prompts]  # in-flight updates (poll_weights)
        built, pdec, ddec = None, None, None
        for start in range(0, len(prompts), chunk):  # each chunk's rows by prompt length (rollout/embedded/prefill.py)
            order = sorted(range(start, min(start + chunk, len(prompts))), key=lambda i: len(prompts[i]))
            batch = [prompts[i] for i in order]
            mark_rows(marks, order, started, self.weight_versions)  # weights updated during an earlier chunk
            if built != self.weight_versions:  # decoders of the weights now (the first chunk, or after an update)
                with torch.inference_mode():
                    (pdec, ddec), built = self._decoders(), dict(self.weight_versions)
            noise = CounterNoise(seed_tensor([seeds[i] for i in order], device))
            try:
                with torch.inference_mode():
                    done = self._generate_batch(batch, sampler, noise, pdec, ddec, observer, order, marks)
                    for i, out in zip(order, done):
                        outputs[i] = out
            except Exception as err:  # noqa: BLE001 - re-raised with the failing requests named
                lens = [len(p) for p in batch]
                shown = lens if len(lens) <= 8 else f"{min(lens)}..{max(lens)} over {len(lens)} prompts"
                raise RolloutError(
                    f"generation failed for requests {start}..{start + len(batch) - 1} "
                    f"(prompt lengths {shown}, max_new_tokens={max_new_tokens}, "
                    f"K={self.num_speculative_tokens}): {type(err).__name__}: {err}"
                ) from err
        return self.stamp(outputs, started, marks)

    def _decoders(self) -> tuple[PolicyDecoder, DraftDecoder | None]:
        """The policy's and the draft's decoders from the weights now; every cache of a call fits max_context +
        2(K+1) slots (_generate_batch)."""
        capacity = self.max_context + 2 * (self.num_speculative_tokens + 1)
        ddec = None if self.draft is None else draft_decoder(self.draft, capacity, self.dtype)
        return policy_decoder(self.policy, capacity, self.dtype), ddec

    def _take_new_weights(self, b: LiveRows, chunk: Chunk, marks: list[list]) -> None:
        """Between rounds: newer weights from ``weight_source`` are loaded, the decoders rebuilt from them (the
        caches kept), and every live row marked: its next tokens are the new version's."""
        if not self.poll_weights():
            return
        pdec, ddec = self._decoders()
        chunk.pdec, chunk.ddec = pdec, ddec if chunk.ddec is not None else None
        for i in b.active:
            marks[chunk.requests[i]].append((len(chunk.tokens[i]), self.weight_versions["policy"]))

    def _weights_changed(self) -> None:
        self._draft_to_target = None
        if self.draft is not None:
            self._check_draft()

    # ------------------------------------------------------------------ decoding
    def _generate_batch(
        self,
        prompts: list[list[int]],
        sampler: TokenSampler,
        noise: CounterNoise,
        pdec: PolicyDecoder,
        ddec: DraftDecoder | None,
        observer: ForwardObserver | None = None,
        requests: list[int] | None = None,
        marks: list[list] | None = None,
    ) -> list[RolloutOutput]:
        """Decode one chunk (prompts sorted by length): prefill, then rounds (rollout/embedded/round.py) until every row is
        done; ``requests[i]``: row i's index in the call (the observer's); ``marks``: the call's in-flight update
        marks, by request (``EmbeddedWeights.stamp``)."""
        K, batch, params = self.num_speculative_tokens, len(prompts), sampler.params
        draft_taps = tuple(int(t) for t in self.draft.config.taps) if self.draft is not None and K > 0 else None
        seen = tuple(int(t) for t in observer.taps) if observer is not None else ()
        # a row may overshoot its budget by K+1 slots in its last round (then it leaves the batch), and every
        # round writes K+1 slots past the committed length before rolling back: 2(K+1) spare slots. The caches
        # start at the prompts' size and grow in blocks as rows lengthen (KVCache.reserve), so that on CPU the
        # attention reads each whole cache instead of copying a slice of it (attention.cached.attended_slots)
        fwd_taps = draft_taps if observer is None else tuple(dict.fromkeys((draft_taps or ()) + seen))
        chunk = Chunk(
            pdec=pdec,
            ddec=ddec if draft_taps else None,
            sampler=sampler,
            controller=self.controller,
            max_k=K,
            spare=2 * (K + 1),
            fwd_taps=fwd_taps,
            draft_taps=draft_taps,
            observer_taps=seen,
            observer=observer,
            requests=list(range(batch)) if requests is None else requests,
            stops=frozenset(params.stop_token_ids),
        )
        b, first_lp = self._start(prompts, chunk, noise)
        chunk.tokens = [[t] for t in b.pending.tolist()]
        chunk.logprobs = [[x] for x in first_lp.tolist()]
        chunk.stats = [
            AcceptanceStats(accepted_per_position=[0] * K, proposed_per_position=[0] * K) for _ in range(batch)
        ]
        chunk.finish = ["stop" if t[0] in chunk.stops else "length" for t in chunk.tokens]
        done = [chunk.finish[i] == "stop" or b.budget[i] <= 1 for i in range(batch)]
        while not all(done):
            if any(done):  # drop finished rows from the caches and the batch (moving only a few rows)
                b.keep(hole_filling_order([not d for d in done]))
                done = [False] * len(b.active)
            run_round(b, chunk, done)
            if marks is not None:
                self._take_new_weights(b, chunk, marks)
        return [
            RolloutOutput(
                token_ids=chunk.tokens[i],
                logprobs=chunk.logprobs[i],
                finish_reason=chunk.finish[i],
                stats=chunk.stats[i],
            )
            for i in range(batch)
        ]

    def _start(self, prompts: list[list[int]], chunk: Chunk, noise: CounterNoise) -> tuple[LiveRows, torch.Tensor]:
        """The chunk's live rows after the prefill: every row's first token sampled (pending) and the draft caught
        up on the prompts (deferred to the first drafting round for an adaptive engine); its log-probabilities."""
        device, batch, params = self._device(), len(prompts), chunk.sampler.params
        host_lens = [len(p) for p in prompts]
        lens = torch.tensor(host_lens, device=device)
        budget = [min(self.max_context - n, params.max_new_tokens) for n in host_lens]  # tokens each row may emit
        capacity = max(host_lens) + chunk.spare
        key = ("greedy",) if params.greedy else (self.sampling, params.temperature, params.top_k, params.top_p)
        b = LiveRows(
            active=list(range(batch)),
            emitted=[1] * batch,
            budget=budget,
            pcache=chunk.pdec.allocate_cache(batch, capacity),
            dcache=chunk.ddec.allocate_cache(batch, capacity) if chunk.drafts else None,
            pending=lens,
            length=lens.clone(),
            doff=torch.zeros_like(lens),
            h_last=None,
            dl_last=None,
            backlog=[],
            estimates=None if self.controller is None else self.controller.new_batch(batch, key),
            noise=noise,
            out_pos=torch.zeros_like(lens),
        )
        # prefill, right-padded per group of similar lengths (padding slots lie beyond each row's length)
        ids = torch.zeros(batch, max(host_lens), dtype=torch.long, device=device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        last_logits, taps = prefill(chunk.pdec, b.pcache, ids, host_lens, chunk.fwd_taps)  # rows sorted by length
        if chunk.observer is not None:
            chunk.observer.prefill(
                list(chunk.requests), host_lens, pick(taps, chunk.fwd_taps, chunk.observer_taps), last_logits
            )
            taps = pick(taps, chunk.fwd_taps, chunk.draft_taps)
        b.pcache.lengths = lens
        lp = sampling_logprobs(last_logits, params.temperature, params.top_k, params.top_p)
        rows = torch.arange(batch, device=device)
        b.pending = chunk.sampler.first(lp, b.noise, b.out_pos)
        b.out_pos = b.out_pos + 1
        if chunk.drafts:
            next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
            next_ids[rows, lens - 1] = b.pending
            if self.controller is None:
                catch_up(chunk.pdec, chunk.ddec, b, taps, next_ids, lens - 1, lens)
            else:  # deferred to the first drafting round (resume): a batch that never drafts skips it
                b.prompt = (taps, next_ids, lens)
        return b, lp[rows, b.pending]
