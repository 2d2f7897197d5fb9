"""Where the RL loop's rollouts are generated, and how the engines get the trained weights.

:class:`RolloutWorker` owns the rollout engine of this rank (or none), the whole modules it decodes with, and the
weight sync after every optimizer step (``rollout.weight_sync.WeightSync``, the one sync path).

Placement: one engine per data-parallel replica, on its *lead*, ``(pp_rank 0, cp_rank 0)`` of its ``dp_rank``
(``ParallelDims.is_replica_lead``). The lead generates the replica's requests and broadcasts the outputs over the
replica's ``pp x cp`` ranks, which all build the identical RL batch. Without PP the embedded engine decodes with the
lead's training modules themselves; under PP a rank holds only its pipeline stage, so the lead keeps whole copies
of policy and draft (made before the stages are pruned) refreshed by every sync, as is any engine that holds
weights of its own (vLLM).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput
from lightning_codraft.rollout.speculative import SpeculativeEngine
from lightning_codraft.rollout.vllm_engine import VLLMEngine
from lightning_codraft.rollout.weight_sync import WeightSync


class RolloutWorker:
    """This rank's part in generating rollouts and syncing weights into engines.

    Args:
        cfg: the run's config (``draft``, ``parallel``, ``run.out_dir``).
        dims: this process' (dp, pp, cp) layout.
        device: the device the engine's copies live on.
        eos_token_id: the stop token of every request.

    Attributes:
        engine: the rollout engine on a replica lead, None on every other rank.
        policy, draft: on a lead, the whole modules the engine decodes with (the training modules without PP,
            synced copies under PP); None elsewhere.
    """

    def __init__(self, cfg: CoDraftConfig, dims, device: torch.device | str = "cpu", eos_token_id: int = 0):
        self.cfg, self.dims, self.device = cfg, dims, torch.device(device)
        self.eos_token_id = int(eos_token_id)
        d = cfg.draft
        self.num_speculative_tokens = 0 if d.mode == "none" else d.num_speculative_tokens
        self.engine = None
        self.policy: Optional[nn.Module] = None
        self.draft: Optional[nn.Module] = None
        self.sync: Optional[WeightSync] = None

    # ------------------------------------------------------------------ placement
    @property
    def training_modules_whole(self) -> bool:
        """Whether every rank's training modules stay whole: no PP (pruned stages) and no FSDP2 (sharded)."""
        fsdp = (self.cfg.parallel.sharding or "fsdp") == "fsdp" and self.dims.dp_cp > 1
        return not (self.dims.pp_enabled or fsdp)

    @property
    def holds_copies(self) -> bool:
        """Whether the engine decodes with weights of its own, refreshed after every optimizer step: vLLM always,
        the embedded engine under PP or FSDP2 (where no rank holds the whole training module)."""
        return self.cfg.parallel.engine == "vllm" or not self.training_modules_whole

    def take_models(self, module: nn.Module) -> None:
        """Choose the whole modules a lead decodes with; call BEFORE the strategy sets ``module`` up.

        Without PP or FSDP2 these are the training modules. Otherwise the strategy prunes or shards them, so the
        lead keeps deep copies (on its device), made now while the modules are whole.
        """
        if not self.dims.is_replica_lead:
            return
        if self.training_modules_whole:
            self.policy, self.draft = module.policy, module.draft
            return
        policy, draft = copy.deepcopy((module.policy, module.draft))  # one memo: shared tensors stay shared
        self.policy = policy.requires_grad_(False).to(self.device)
        self.draft = draft.requires_grad_(False).to(self.device)

    def start(self, module: nn.Module) -> None:
        """Build the engine on replica leads and the weight sync on every rank (after ``take_models``)."""
        if self.dims.is_replica_lead:
            self.engine = self._build_engine()
        if self.holds_copies:
            self.sync = WeightSync(self if self.engine is not None else None, module.full_state_dicts)

    def _build_engine(self):
        k, p = self.num_speculative_tokens, self.cfg.parallel
        draft = self.draft if k else None
        if p.engine == "vllm":  # a separate engine holding copies: synced after every step
            out = Path(self.cfg.run.out_dir)
            workdir = out / ("vllm" if self.dims.dp == 1 else f"vllm-dp{self.dims.dp_rank}")
            return VLLMEngine.from_modules(self.policy, draft, k, workdir=workdir,
                                           max_num_seqs=p.engine_batch_size or 64)
        return SpeculativeEngine(self.policy, draft, k, max_batch_size=p.engine_batch_size)

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[list[int]], seed: int, temperature: Optional[float] = None
                 ) -> tuple[list[RolloutOutput], AcceptanceStats, float]:
        """The replica's rollouts of ``requests``: generated on its lead, identical on every rank of the replica.

        Returns:
            ``(outputs, acceptance statistics, seconds the lead spent generating)``.
        """
        generated = None
        if self.engine is not None:
            r = self.cfg.rl
            self.policy.eval()
            t0 = time.perf_counter()
            outs = self.engine.generate(list(requests), max_new_tokens=r.max_new_tokens,
                                        temperature=r.temperature if temperature is None else temperature,
                                        top_p=r.top_p, seed=seed, stop_token_ids=[self.eos_token_id])
            seconds = time.perf_counter() - t0
            stats = getattr(self.engine, "last_stats", None) or AcceptanceStats.total(o.stats for o in outs)
            generated = (outs, stats, seconds)
        return self._from_lead(generated)

    def _from_lead(self, value: Any) -> Any:
        """``value`` as the replica's lead holds it, on every rank of the replica (a broadcast over the replica's
        ``pp x cp`` group, lead = its rank 0; call on every rank)."""
        group = self.dims.replica_group
        if group is None:
            return value
        box = [value if self.dims.is_replica_lead else None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        return box[0]

    # ------------------------------------------------------------------ weights
    def after_step(self, step: int) -> float:
        """Push the weights of optimizer step ``step`` to the engine where it holds copies; returns seconds (a
        collective under PP: call on every rank)."""
        if self.sync is None:
            return 0.0
        return self.sync(step) or 0.0

    def after_load(self, module: nn.Module) -> None:
        """Under PP / FSDP2, after a checkpoint was loaded into the stages or shards: gather them into the lead's
        copies (a collective: call on every rank)."""
        if self.training_modules_whole:
            return
        policy_state, draft_state = module.full_state_dicts()
        if self.dims.is_replica_lead:
            self.load_copies(policy_state, draft_state)

    def load_copies(self, policy_state: dict, draft_state: Optional[dict]) -> None:
        """Load whole state dicts into the lead's copies (strict: every tensor must be there)."""
        self.policy.load_state_dict(policy_state)
        if draft_state is not None and self.draft is not None:
            self.draft.load_state_dict(draft_state)

    def update_weights(self, policy_state: dict, draft_state: Optional[dict]) -> None:
        """The :class:`WeightSync` target on a lead: refresh the copies (under PP / FSDP2) and the engine."""
        if not self.training_modules_whole and getattr(self.engine, "policy", None) is not self.policy:
            self.load_copies(policy_state, draft_state)  # vLLM: the copies serve the final speed-up
        self.engine.update_weights(policy_state, draft_state)

    def close(self) -> None:
        """Stop an engine that runs processes of its own (vLLM)."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
