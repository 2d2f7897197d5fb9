"""Where the RL loop's rollouts are generated, and how the engines get the trained weights.

:class:`RolloutWorker` owns this rank's rollout engine and the whole modules it decodes with.

**Every rank generates.** A data-parallel replica's requests are split over all of its ``pp x cp`` ranks
(contiguous shares: rank ``j`` of the replica takes the ``j``-th share), every rank decodes its share with its own
engine (embedded or vLLM) on a whole policy + draft, and the outputs are all-gathered over the replica so every
rank builds the same training batch. Request ``i``'s sampling seed is a function of ``(run seed, step, prompt,
sample)`` only and the embedded engine's coupled sampling makes each token a function of that seed and its position,
so the rollouts do not depend on the placement: 1, 2 or 4 processes and any (dp, pp, cp) generate the same tokens.
Groups of ranks sharing one engine (tensor-parallel vLLM for models that do not fit one device) are the next step:
``share`` is the seam, it would hand a group's requests to the group's engine rank.

**Weights, one tensor at a time.** Without PP or FSDP2 every rank's training modules are whole and the embedded
engine decodes with them. Otherwise the engine's modules are copies whose parameter storage is released while
training runs and refilled before every rollout phase from the sharded training state, one tensor at a time
(``parallel.stream.stream_full_state`` through ``rollout.refit.sync.WeightSync``, the one sync path, in checksummed
buckets: rollout/refit/buckets.py): no whole extra copy is held across the step. vLLM keeps its own weights; it sleeps at
level 2 while training runs where the platform supports it (not vLLM-CPU); every bucket is checked where it lands,
and both models are fully verified on the first and the last refit.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.drafters import drafter_kind
from lightning_codraft.parallel.collectives import is_distributed
from lightning_codraft.parallel.stream import stream_full_state
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput
from lightning_codraft.rollout.refit.buckets import WeightBucket, copy_into
from lightning_codraft.rollout.refit.sync import WeightSync, refill_parameters, release_parameters
from lightning_codraft.rollout.sampling.noise import request_seed
from lightning_codraft.rollout.vllm.engine import VLLMEngine


def rollout_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """The sampling seed of one RL request: a hash of the run's seed, the step, the prompt's index in the step and
    the sample's index in its group, nothing else (placement-invariant rollouts); in ``[0, 2**63)``."""
    return request_seed(request_seed(request_seed(seed, step), prompt), sample)


def share(num_requests: int, parts: int, index: int) -> range:
    """Request indices of part ``index`` of ``parts`` contiguous, as-even-as-possible shares."""
    base, extra = divmod(num_requests, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


class _Split:
    """One ordered stream of ``(prefix.name, tensor)`` read as one iterator per prefix, in stream order."""

    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]]):
        self._stream, self._pending = stream, None

    def part(self, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
        while True:
            item = self._pending if self._pending is not None else next(self._stream, None)
            self._pending = None
            if item is None:
                return
            if not item[0].startswith(prefix):
                self._pending = item
                return
            yield item[0][len(prefix) :], item[1]


class RolloutWorker:
    """This rank's part in generating rollouts and keeping its engine's weights current.

    Args:
        cfg: the run's config (``draft``, ``rl``, ``parallel``, ``run.out_dir``).
        dims: this process' (dp, pp, cp) layout.
        device: the device the engine's modules live on.
        eos_token_id: the stop token of every request.

    Attributes:
        engine: this rank's rollout engine.
        policy, draft: the whole modules the embedded engine decodes with (the training modules when they are whole,
            else copies whose parameters are released between rollout phases).
        requests_generated: how many requests this rank decoded (all calls).
    """

    def __init__(self, cfg: CoDraftConfig, dims, device: torch.device | str = "cpu", eos_token_id: int = 0):
        self.cfg, self.dims, self.device = cfg, dims, torch.device(device)
        self.eos_token_id = int(eos_token_id)
        d = cfg.draft
        self.num_speculative_tokens = 0 if d.mode == "none" else d.num_speculative_tokens
        self.engine = None
        self.policy: Optional[nn.Module] = None
        self.draft: Optional[nn.Module] = None
        self.module: Optional[nn.Module] = None
        self.sync: Optional[WeightSync] = None
        self.requests_generated = 0
        self._awake = True
        self._phases = 0  # rollout phases prepared: the WeightSync step of the next refill
        self._source: Optional[Mapping[str, torch.Tensor]] = None  # a snapshot the refit in progress reads

    # ------------------------------------------------------------------ placement and lifecycle
    @property
    def training_modules_whole(self) -> bool:
        """Whether every rank's training modules stay whole: no PP (pruned stages) and no FSDP2 (sharded)."""
        fsdp = (self.cfg.parallel.sharding or "fsdp") == "fsdp" and self.dims.dp_cp > 1
        return not (self.dims.pp_enabled or fsdp)

    @property
    def shares_training_modules(self) -> bool:
        """Whether the embedded engine decodes the training modules themselves: they are whole and nothing trains
        them while it decodes (an asynchronous run's producer decodes copies, ``rl.async_level > 0``)."""
        return self.training_modules_whole and self.cfg.rl.async_level == 0

    @property
    def holds_copies(self) -> bool:
        """Whether the engine's weights are its own (vLLM, or copies of pruned / sharded modules) and need syncs."""
        return self.cfg.parallel.engine == "vllm" or not self.shares_training_modules

    @property
    def _copies(self) -> tuple[nn.Module, ...]:
        """The engine's own module copies (released between rollout phases): none when it decodes with the
        training modules themselves."""
        if self.shares_training_modules:
            return ()
        return tuple(m for m in (self.policy, self.draft) if m is not None)

    def start(self, module: nn.Module) -> None:
        """Choose the modules and build this rank's engine; call BEFORE the strategy sets ``module`` up (while it
        is whole). Copies are released at once: they are refilled from the training state before each rollout."""
        self.module = module
        if self.shares_training_modules:
            self.policy, self.draft = module.policy, module.draft
        else:
            policy, draft = copy.deepcopy((module.policy, module.draft))  # one memo: tied tensors stay tied
            self.policy = policy.requires_grad_(False).to(self.device)
            self.draft = draft.requires_grad_(False).to(self.device)
        self.engine = self._build_engine()
        if self.holds_copies:
            self.sync = WeightSync(self, self._states, bucket_bytes=int(self.cfg.parallel.refit_bucket_mb * 2**20))
            self.release()

    def _build_engine(self):
        k, p, d = self.num_speculative_tokens, self.cfg.parallel, self.cfg.draft
        draft = self.draft if k else None
        if p.engine == "vllm":
            workdir = Path(self.cfg.run.out_dir) / "vllm" / f"rank{self.dims.rank}"
            context = min(self.cfg.model.max_position_embeddings, int(self.policy.config.max_position_embeddings))
            return VLLMEngine.from_modules(
                self.policy,
                draft,
                k,
                workdir=workdir,
                max_model_len=context,
                max_num_seqs=p.engine_batch_size or 64,
                draft_sample_method="probabilistic",
            )
        return drafter_kind(d.type).engine(
            self.policy,
            draft,
            k,
            max_batch_size=p.engine_batch_size,
            adaptive=bool(d.adaptive and k),
            sampling=d.sampling,
            dtype=p.engine_dtype,
            verify_length=d.verify_length,
            confidence_threshold=d.confidence_threshold,
        )

    def release(self) -> None:
        """The training phase begins: free the engine's copies (or put vLLM to sleep where it can)."""
        if not self.holds_copies or not self._awake:
            return
        if self.engine.supports_sleep:
            self.engine.sleep(level=2)  # nothing offloaded to the host: every wake is followed by a full refit
        for m in self._copies:  # never the training modules themselves (vLLM over whole modules)
            release_parameters(m)
        self.sync.release_buffers()  # the refit's two buckets, kept through the rollout phase
        self._awake = False

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the training state's policy and draft tensors (whole modules only): what :meth:`prepare`
        refits from on another thread while the trainer goes on changing the modules (rl/bounded_rollouts.py)."""
        if not self.training_modules_whole:
            raise ValueError("a snapshot of pruned or sharded training modules is not supported")
        return {
            k: v.detach().clone() for k, v in self.module.state_dict().items() if k.startswith(("policy.", "draft."))
        }

    def prepare(
        self,
        versions: Optional[Mapping[str, int]] = None,
        full_verify: bool = False,
        state: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> float:
        """The rollout phase begins: refill the engine's weights from the training state (a collective over the
        mesh: call on every rank) tagged with ``versions`` (``{"policy": v, "draft": v}``: optimizer steps of the
        training state, ``rl.step.weight_versions``); returns the seconds it took. Every bucket is checked as it
        lands; an engine that can (vLLM) also verifies every parameter on the first refit and where
        ``full_verify`` (the run's last). ``state``: refit from this :meth:`snapshot` instead of the live modules."""
        versions = dict(versions or {"policy": self._phases, "draft": self._phases})
        if not self.holds_copies:  # the engine decodes the training modules themselves: it holds what they hold
            self.engine.weight_versions.update(versions)
            return 0.0
        start = time.perf_counter()
        for m in self._copies:
            refill_parameters(m)
        if self.engine.supports_sleep:
            self.engine.wake_up(refit=True)
        self.engine.verify_updates = full_verify or self._phases == 0
        self._phases += 1
        self._source = state
        try:
            self.sync(self._phases, versions=versions)  # always due: one refill per rollout phase
        finally:
            self._source = None
        self._awake = True
        return time.perf_counter() - start

    def _states(self) -> tuple[Iterable, Iterable]:
        live = self.module.state_dict() if self._source is None else self._source
        state = {k: v for k, v in live.items() if k.startswith(("policy.", "draft."))}
        split = _Split(stream_full_state(state, self.dims, self.device))
        return split.part("policy."), split.part("draft.")

    @property
    def keeps_own_weights(self) -> bool:
        """The engine's (the :class:`WeightSync` packs shared-memory buckets for an engine in other processes)."""
        return bool(self.engine.keeps_own_weights)

    def load_buckets(self, buckets: Iterable[WeightBucket], verify: str = "buckets") -> None:
        """The :class:`WeightSync` target: the engine loads the refit's buckets (the embedded engine into the copies
        it decodes, in place). An engine that keeps its own weights (vLLM) leaves the copies behind, so each bucket
        fills them too on its way: the final speed-up measurement decodes with them."""
        if self.engine.keeps_own_weights and self._copies:
            buckets = self._filling_copies(buckets)
        self.engine.load_buckets(buckets, verify=verify)

    def _filling_copies(self, buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
        targets = {"policy": self.policy, "draft": self.draft}
        params = {k: m.state_dict(keep_vars=True) for k, m in targets.items() if m is not None}
        for bucket in buckets:
            if bucket.kind in params:
                copy_into(params[bucket.kind], bucket.tensors(), bucket)
            yield bucket

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        requests: Sequence[list[int]],
        seeds: Sequence[int],
        temperature: Optional[float] = None,
        group: Any = "replica",
    ) -> tuple[list[RolloutOutput], AcceptanceStats, float]:
        """``requests`` decoded by the ranks of ``group`` (default: this replica), each rank its share.

        Args:
            requests: the group's requests (prompt token ids), the same list on every rank of the group.
            seeds: one sampling seed per request (see :func:`rollout_seed`).
            temperature: default ``rl.temperature``.
            group: ``"replica"`` (the replica's pp x cp ranks), ``"world"``, or None (this rank alone).

        Returns:
            ``(outputs of every request in order, their total acceptance statistics, the slowest rank's seconds)``.
        """
        group = (
            {"replica": self.dims.replica_group, "world": dist.group.WORLD if is_distributed() else None}.get(
                group, group
            )
            if isinstance(group, str)
            else group
        )
        parts = dist.get_world_size(group) if group is not None else 1
        index = dist.get_rank(group) if group is not None else 0
        mine = share(len(requests), parts, index)
        r = self.cfg.rl
        t0 = time.perf_counter()
        outs: list[RolloutOutput] = []
        if len(mine):
            outs = self.engine.generate(
                [list(requests[i]) for i in mine],
                max_new_tokens=r.max_new_tokens,
                temperature=r.temperature if temperature is None else temperature,
                top_p=r.top_p,
                request_seeds=[int(seeds[i]) for i in mine],
                stop_token_ids=[self.eos_token_id],
            )
        seconds = time.perf_counter() - t0
        self.requests_generated += len(mine)
        gathered = [(outs, seconds)]
        if group is not None and parts > 1:
            gathered = [None] * parts
            dist.all_gather_object(gathered, (outs, seconds), group=group)
        outputs = [o for part, _ in gathered for o in part]
        return outputs, AcceptanceStats.total(o.stats for o in outputs), max(s for _, s in gathered)

    def close(self) -> None:
        """Stop an engine that runs processes of its own (vLLM)."""
        if self.engine is not None:  # None until start(): a run that failed before it
            self.engine.close()
