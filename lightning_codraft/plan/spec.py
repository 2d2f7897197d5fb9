"""What the memory plan is computed from: :class:`PlanSpec`, the run reduced to the numbers memory depends on.

:meth:`PlanSpec.from_config` reads a recipe (:class:`~lightning_codraft.config.CoDraftConfig`): the policy's
architecture (``models.presets.recipe_architecture``: the tiny fields, ``model.config``, a preset or a checkpoint's
config.json, never its weights), the mesh, the sharding and the precision, the step's batch and the engine. Tests
build a spec directly for models of their own.

Bytes per element for Lightning's precision strings (``parallel/fsdp.py``):

============  ==========  =========  ===================  ========================  ==========
precision     parameters  gradients  AdamW state (2 per)  compute (activations)     FSDP reduce
============  ==========  =========  ===================  ========================  ==========
32-true       4 (fp32)    4          4 + 4                4                         4
bf16-mixed    4 (master)  4          4 + 4                2 (FSDP2 param_dtype)     4
bf16-true     2           2          2 + 2                2                         2
============  ==========  =========  ===================  ========================  ==========
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_codraft.config import CoDraftConfig, ConfigError
from lightning_codraft.models.config import PolicyConfig
from lightning_codraft.models.presets import recipe_architecture

#: precision -> (parameter, gradient, optimizer-state, compute, reduce) bytes per element
PRECISION_BYTES = {"32-true": (4, 4, 4, 4, 4), "bf16-mixed": (4, 4, 4, 2, 4), "bf16-true": (2, 2, 2, 2, 2)}

VLLM_DEFAULT_MAX_SEQS = 64
"""Sequences vLLM batches when ``parallel.engine_batch_size`` is null (``RolloutWorker`` passes 64)."""


@dataclass(frozen=True)
class PlanSpec:
    """The numbers a run's per-rank memory depends on."""

    policy: PolicyConfig
    """The policy's architecture (the reference policy and the rollout engine's copy have the same)."""
    draft_vocab_size: Optional[int] = None
    """Vd, rows of the draft's ``lm_head``; None = the policy's vocabulary."""
    draft_mode: str = "cotrain"
    """``cotrain`` (trained: gradients, AdamW state, TTT activations), ``frozen`` (held and run without gradients)
    or ``none`` (held by the module, never run; the engine decodes without it)."""
    ttt_steps: int = 3
    """K, the draft's training-time-test unroll depth."""
    num_speculative_tokens: int = 4
    """Tokens the engine's draft proposes per verification round."""
    with_reference: bool = False
    """A frozen reference policy (``rl.kl_coef > 0`` or ``rl.track_drift``), pruned and sharded like the policy."""
    dp: int = 1
    """Data-parallel replicas."""
    pp: int = 1
    """Pipeline stages (``parallel/pipeline.py::StageLayout`` splits the layers)."""
    cp: int = 1
    """Context-parallel ranks (each holds ``1 / cp`` of every microbatch's tokens)."""
    sharding: Optional[str] = None
    """``fsdp`` / ``ddp`` / None (FSDP2 whenever dp * cp > 1), as ``CoDraftCore.resolved_sharding``."""
    precision: str = "32-true"
    """Lightning's precision string (see the module table)."""
    num_microbatches: int = 1
    """M: microbatches each replica's step batch is cut into."""
    pp_schedule: str = "1f1b"
    """``1f1b`` or ``gpipe`` (how many microbatches a stage holds at once, :meth:`in_flight`)."""
    layers_per_stage: Optional[tuple[int, ...]] = None
    """Decoder layers of every stage; None balances them."""
    samples_per_replica: int = 1
    """Documents (prompt + completion) each data-parallel replica trains on per step."""
    seq_len: int = 128
    """Longest document in tokens (the context: prompt + rl.max_new_tokens never exceeds it)."""
    engine: str = "embedded"
    """``embedded`` or ``vllm``."""
    accelerator: str = "cuda"
    """Where the run executes; vLLM sleeps (weights off the device) between rollouts only on an accelerator."""
    engine_batch_size: Optional[int] = None
    """Sequences the engine decodes together (null: all of the rank's for the embedded engine, 64 for vLLM)."""
    refit_bucket_bytes: int = 256 * 2**20
    """Bytes per refit bucket (``parallel.refit_bucket_mb``): a refit holds two and a checksum workspace."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISION_BYTES:
            raise ValueError(f"precision={self.precision!r} is not one of {tuple(PRECISION_BYTES)}")
        if self.draft_mode not in ("cotrain", "frozen", "none"):
            raise ValueError(f"draft_mode={self.draft_mode!r} is not one of ('cotrain', 'frozen', 'none')")
        for name in ("dp", "pp", "cp", "num_microbatches", "samples_per_replica", "seq_len", "ttt_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_config(cls, cfg: CoDraftConfig) -> PlanSpec:
        """The spec of a validated recipe (the architecture from ``models.presets.recipe_architecture``, no weights
        read; an invalid ``model.config`` is a :class:`~lightning_codraft.config.ConfigError`)."""
        p, r, d = cfg.parallel, cfg.rl, cfg.draft
        try:
            policy = recipe_architecture(cfg.model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        context = min(cfg.model.max_position_embeddings, policy.max_position_embeddings)
        return cls(
            policy=policy,
            draft_vocab_size=d.draft_vocab_size,
            draft_mode=d.mode,
            ttt_steps=d.ttt_steps,
            num_speculative_tokens=d.num_speculative_tokens,
            with_reference=r.kl_coef > 0 or r.track_drift,
            dp=p.dp,
            pp=p.pp,
            cp=p.cp,
            sharding=p.sharding,
            precision=p.precision,
            num_microbatches=p.num_microbatches,
            pp_schedule=p.pp_schedule,
            layers_per_stage=None if p.layers_per_stage is None else tuple(p.layers_per_stage),
            samples_per_replica=r.prompts_per_step // p.dp * r.group_size,
            seq_len=context,
            engine=p.engine,
            accelerator=p.accelerator,
            engine_batch_size=p.engine_batch_size,
            refit_bucket_bytes=int(p.refit_bucket_mb * 2**20),
        )

    # ------------------------------------------------------------------ derived
    @property
    def shards(self) -> int:
        """Ranks FSDP2 shards each stage over (dp * cp), or 1 where it does not shard."""
        return self.dp * self.cp if self.fsdp else 1

    @property
    def fsdp(self) -> bool:
        """FSDP2 is applied: sharding ``fsdp`` (explicit or by default) and dp * cp > 1."""
        return (self.sharding or "fsdp") == "fsdp" and self.dp * self.cp > 1

    @property
    def ddp_wrapper(self) -> bool:
        """A ``DistributedDataParallel`` wraps the module (``ddp``, no PP, dp * cp > 1)."""
        return self.sharding == "ddp" and self.pp == 1 and self.dp * self.cp > 1

    @property
    def bytes(self) -> tuple[int, int, int, int, int]:
        """(parameter, gradient, optimizer-state, compute, reduce) bytes per element."""
        return PRECISION_BYTES[self.precision]

    @property
    def trains_draft(self) -> bool:
        return self.draft_mode == "cotrain"

    @property
    def runs_draft(self) -> bool:
        return self.draft_mode != "none"

    @property
    def speculative_tokens(self) -> int:
        """K of the engine (0 without a draft)."""
        return 0 if self.draft_mode == "none" else self.num_speculative_tokens

    @property
    def microbatch_tokens(self) -> int:
        """Tokens of one microbatch on one rank: ``ceil(samples / M)`` documents of ``seq_len`` padded to a multiple
        of ``2 * cp`` (the packer's rule), divided by ``cp`` (each CP rank holds its zigzag share)."""
        docs = -(-self.samples_per_replica // self.num_microbatches)
        doc = -(-self.seq_len // (2 * self.cp)) * 2 * self.cp
        return docs * doc // self.cp

    def in_flight(self, stage: int) -> int:
        """Microbatches whose activations a stage holds at once.

        Without PP the module runs every microbatch's forward before the one backward (``CoDraftModule.forward``
        sums the M losses), so all ``M`` are held. Under PP, GPipe runs all forwards first (``M``); 1F1B holds at
        most ``pp - stage`` (its warm-up depth), never more than ``M``.
        """
        if self.pp == 1 or self.pp_schedule == "gpipe":
            return self.num_microbatches
        return min(self.num_microbatches, self.pp - stage)

    @property
    def engine_requests(self) -> int:
        """Requests each rank's engine generates per step: its replica's samples split over the replica's pp * cp
        ranks (issue #13: every rank generates)."""
        return -(-self.samples_per_replica // (self.pp * self.cp))

    @property
    def engine_concurrency(self) -> int:
        """Sequences the engine holds KV caches for at once."""
        limit = self.engine_batch_size or (VLLM_DEFAULT_MAX_SEQS if self.engine == "vllm" else None)
        return self.engine_requests if limit is None else min(limit, self.engine_requests)
