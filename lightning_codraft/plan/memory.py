"""The per-rank memory plan: what each kind of rank holds in the TRAINING phase and in the ROLLOUT phase.

Lines of a rank (``plan/state.py`` and ``plan/activations.py`` give the formulas; ``a`` compute bytes, ``T``
tokens of one microbatch on the rank, ``M`` microbatches, ``F`` of them in flight, ``H`` hidden, ``V`` vocab):

- both phases: parameters, gradients (``optimizer_step`` zeroes them only when the next step starts), AdamW
  state, buffers, the reference policy, DDP's gradient buckets (a second gradient copy), under PP the pipeline
  schedule's receive buffers (``M`` activations on every stage but the first, ``M`` gradients on every stage but
  the last, ``M`` for the reference's forward: ``T H a`` each, times the :data:`CACHED_SCHEDULES` schedules a
  runner keeps for the step lengths it has seen) and, with FSDP2
  under PP, the reference stage root that stays all-gathered.
- training, during the forward/backward (summed): the saved activations ``F x`` one microbatch's, what the
  pipeline keeps besides them (a stage's outputs until their backward; on the last stage the TapChannel's landing
  buffers per remote tap, for a window of ``pp`` microbatches under 1F1B and ``M`` under GPipe, and the local taps
  of the microbatch being received), the loss workspace of one
  microbatch, and FSDP2's all-gathered units (the root for the whole step, two layers or the draft at once, the
  unsharded gradients and the fp32 reduce-scatter input of one unit) or, without FSDP2 under ``bf16-mixed``,
  autocast's bf16 weight copies (autocast's activations, a mix of fp32 norms and bf16 matmuls, are counted with
  the fp32 formulas: an upper bound, docs/design/measurements.md). Before it, the
  reference's forward (one microbatch's logits at a time, reduced to a log-prob and an argmax per row that the
  step keeps for all ``M`` microbatches, twice under PP where the schedule merges them); after
  it, AdamW's foreach temporaries (one state-sized tensor). The phase's total takes the largest of the three.
- rollout: the engine's whole policy + draft in the compute dtype (issue #13: every rank generates; zero when
  the embedded engine decodes with the whole training modules), its KV cache for the sequences it decodes at once
  (``(prompt + completion + 2(K+1))`` slots of ``2 kv_heads D`` per policy layer and one draft layer), the logits
  of one verification round (``B (K+1) V``, compute + fp32) and, where the engine holds copies of sharded or
  pruned modules, one parameter gathered whole and two buckets while the weights are refitted (rollout/refit/buckets.py).

The engine's weights count in the training phase too unless it can leave the device: vLLM on an accelerator
sleeps (level 2: weights and cache discarded, the refit re-pushes both models) while training runs; the embedded engine releases the storage
of its copies (``RolloutWorker.release``) and frees its KV cache between rollouts; vLLM on CPU has no sleep mode and
keeps both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_codraft.parallel.pp_runner import PipelineRunner
from lightning_codraft.plan.activations import StageShape, loss_workspace_per_token, saved_per_token
from lightning_codraft.plan.spec import PlanSpec
from lightning_codraft.plan.state import MetaModels, state_bytes

CACHED_SCHEDULES = PipelineRunner.max_cached_schedules
"""Pipeline schedules a runner keeps, each with the receive buffers of its own ``(M, T)``: RL steps vary in
length, so a long run fills the cache and holds this many sets."""

BOTH, TRAINING, BEFORE, AFTER, ROLLOUT = "both", "training", "before", "after", "rollout"
"""Where a line counts: both phases; the training step (summed); before it / after it (the phase takes the largest
of the step, before and after); the rollout phase."""


@dataclass(frozen=True)
class Line:
    """One term of a rank's memory."""

    key: str
    """JSON key, e.g. ``activations``."""
    label: str
    """What the text table prints."""
    bytes: int
    """Bytes on the rank."""
    phase: str
    """:data:`BOTH`, :data:`TRAINING`, :data:`BEFORE`, :data:`AFTER` or :data:`ROLLOUT`."""


@dataclass
class RankPlan:
    """The memory of one kind of rank (the stages with the same numbers)."""

    stages: tuple[int, ...]
    """Pipeline stages of this kind (shard rank 0 of each: the one holding the most)."""
    label: str
    """e.g. ``every rank``, ``stage 0 (first)``."""
    tokens: int
    """T: tokens of one microbatch on the rank."""
    in_flight: int
    """Microbatches whose activations it holds at once."""
    activations_per_microbatch: int
    """Bytes autograd saves for one microbatch."""
    lines: list[Line] = field(default_factory=list)
    """Every term, in table order."""

    def get(self, key: str) -> int:
        """Bytes of line ``key`` (0 when the rank has none)."""
        return sum(line.bytes for line in self.lines if line.key == key)

    def _sum(self, *phases: str) -> int:
        return sum(line.bytes for line in self.lines if line.phase in phases)

    @property
    def training_total(self) -> int:
        """Resident lines + the largest of (the step's lines, the reference forward, the optimizer step)."""
        return self._sum(BOTH) + max(self._sum(TRAINING), self._sum(BEFORE), self._sum(AFTER))

    @property
    def rollout_total(self) -> int:
        """Resident lines + the engine's."""
        return self._sum(BOTH, ROLLOUT)


def _stage_label(stages: tuple[int, ...], pp: int) -> str:
    if pp == 1:
        return "every rank"
    role = "first" if stages[0] == 0 else ("last" if stages[-1] == pp - 1 else "middle")
    where = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages[0]}-{stages[-1]}"
    return f"{where} ({role})"


def plan_rank(
    spec: PlanSpec, models: MetaModels, stage: int, shard_rank: int = 0, tokens: Optional[int] = None
) -> RankPlan:
    """The memory of one rank.

    Args:
        spec: the run.
        models: ``MetaModels.build(spec)``.
        stage: its pipeline stage.
        shard_rank: its index among the stage's dp * cp ranks (0 holds the most).
        tokens: T, tokens of one microbatch on this rank; default ``spec.microbatch_tokens`` (the longest the run
            admits).
    """
    p_b, g_b, o_b, a, r_b = spec.bytes
    if spec.precision == "bf16-mixed" and not spec.fsdp:
        a = 4  # autocast keeps the residual stream and the norms in fp32: the fp32 layout bounds it from above
    pol, dcfg = spec.policy, models.draft.config
    H, V, M, pp = pol.hidden_size, pol.vocab_size, spec.num_microbatches, spec.pp
    T = spec.microbatch_tokens if tokens is None else int(tokens)
    first, last = stage == 0, stage == pp - 1
    start, stop = models.layout.layer_range(stage)
    F = spec.in_flight(stage)
    s = state_bytes(models, spec, stage, shard_rank)
    per_mb = T * saved_per_token(
        pol,
        dcfg,
        StageShape(stop - start, first, last),
        a,
        spec.ttt_steps,
        spec.trains_draft,
        spec.with_reference,
        spec.cp > 1,
    )
    lines = [
        Line("parameters", "parameters", s.parameters, BOTH),
        Line("gradients", "gradients", s.gradients, BOTH),
        Line("optimizer", "AdamW state", s.optimizer, BOTH),
        Line("buffers", "buffers", s.buffers, BOTH),
        Line("reference", "reference policy", s.reference, BOTH),
    ]
    lines.append(Line("ddp_buckets", "DDP gradient buckets", s.gradients if spec.ddp_wrapper else 0, BOTH))
    recv, held = _pipeline_bytes(spec, models, stage, T * H * a, F, a == 4)
    lines.append(Line("pipeline_buffers", f"pipeline receive buffers (x{CACHED_SCHEDULES} schedules)", recv, BOTH))
    lines.append(Line("reference_root_unsharded", "reference root all-gathered", s.reference_root_unsharded, BOTH))
    lines.append(Line("activations", "activations (saved for backward)", F * per_mb, TRAINING))
    lines.append(Line("pipeline_held", "pipeline outputs and taps", held, TRAINING))
    workspace = 0
    if last:
        logits_held = (F - 1) * T * V * a if pp > 1 else 0  # the schedule keeps every in-flight output
        workspace = T * loss_workspace_per_token(pol, dcfg, a, spec.ttt_steps, spec.runs_draft) + logits_held
    lines.append(Line("loss_workspace", "loss workspace", workspace, TRAINING))
    unsharded = s.root_unsharded + s.largest_unit_unsharded * 2 + s.largest_trained_unit * (a + r_b)
    lines.append(Line("fsdp_unsharded", "FSDP2 all-gathered units", unsharded if spec.fsdp else 0, TRAINING))
    autocast = s.trained_whole_elements * 2 if (not spec.fsdp and spec.precision == "bf16-mixed") else 0
    lines.append(Line("autocast_copies", "autocast bf16 weight copies", autocast, TRAINING))
    ref = 0
    if spec.with_reference:
        # one microbatch's logits (+ fp32 log-softmax) at a time, reduced to (log-prob, argmax) fp32 per row; under
        # PP the schedule keeps every microbatch's reduced output and merges them (x2)
        ref = (T * V * (a + 4) + M * (2 if pp > 1 else 1) * T * 2 * 4) if last else 0
        if spec.fsdp:
            ref += s.largest_unit_unsharded + (s.root_unsharded if pp == 1 else 0)
    lines.append(Line("reference_forward", "reference forward (before the step)", ref, BEFORE))
    lines.append(Line("optimizer_step", "AdamW temporaries (after the step)", s.trained_elements * o_b, AFTER))
    lines += _rollout_lines(spec, models)
    return RankPlan(
        stages=(stage,),
        label=_stage_label((stage,), pp),
        tokens=T,
        in_flight=F,
        activations_per_microbatch=per_mb,
        lines=lines,
    )


def _pipeline_bytes(spec: PlanSpec, models: MetaModels, stage: int, act: int, F: int, fp32: bool) -> tuple[int, int]:
    """``(receive buffers, held outputs and taps)`` of a pipeline stage (0, 0 without PP); ``act``: one microbatch's
    activation bytes ``T * H * a``, ``F``: microbatches in flight, ``fp32``: activations saved in fp32."""
    M, pp = spec.num_microbatches, spec.pp
    first, last = stage == 0, stage == pp - 1
    if pp == 1:
        return 0, 0
    overlap = F * act if (fp32 and not first) else 0  # the input buffer is layer 0's saved input
    per_schedule = (0 if first else M) + (0 if last else M) + (M if spec.with_reference and not first else 0)
    recv = CACHED_SCHEDULES * per_schedule * act - overlap
    held = 0 if last else F * act  # the stage's outputs, kept by the schedule until their backward
    if last and spec.runs_draft:
        start = models.layout.layer_range(stage)[0]
        owners = models.layout.tap_owners((0, *models.draft.config.taps))
        remote = sum(1 for t, o in owners.items() if o != stage)
        local = sum(1 for t, o in owners.items() if o == stage and t != start)
        window = min(M, pp) if spec.pp_schedule == "1f1b" else M  # TapChannel landing buffers posted at once
        held += window * remote * act + max(0, local * act - (F * local * act if fp32 else 0))
    return recv, held


def _rollout_lines(spec: PlanSpec, models: MetaModels) -> list[Line]:
    """The engine's weights, KV cache, verification logits and the refit's gathered tensor and buckets."""
    p_b, a = spec.bytes[0], spec.bytes[3]
    K = spec.speculative_tokens
    shares = spec.engine == "embedded" and spec.pp == 1 and not spec.fsdp  # decodes with the training modules
    a_e = p_b if shares else a
    policy_params = {id(p): p for p in models.policy.parameters()}
    draft_params = list(models.draft.parameters()) if K else []
    weights = (
        0 if shares else (sum(p.numel() for p in policy_params.values()) + sum(p.numel() for p in draft_params)) * a_e
    )
    sleeps = spec.engine == "vllm" and spec.accelerator != "cpu"
    keeps_cache = spec.engine == "vllm" and not sleeps
    pol, dcfg = spec.policy, models.draft.config
    per_token = 2 * pol.num_hidden_layers * pol.num_key_value_heads * pol.head_dim
    if K:
        per_token += 2 * dcfg.num_key_value_heads * dcfg.head_dim
    B = spec.engine_concurrency
    kv = B * (spec.seq_len + 2 * (K + 1)) * per_token * a_e
    refit = 0
    if not shares:  # the largest tensor gathered whole and the collective's own copy of it (measured on gloo:
        # FSDP2's all-gather, the stage broadcast), two buckets and the checksum's workspace (rollout/refit/buckets.py)
        largest = max(p.numel() for p in [*policy_params.values(), *draft_params])
        refit = 2 * largest * p_b + int(2.25 * min(spec.refit_bucket_bytes, max(weights, largest * a_e)))
    released = sleeps or spec.engine == "embedded"  # vLLM asleep / the embedded engine's released copies
    return [
        Line("engine_weights", "engine weights (policy + draft)", weights, ROLLOUT if released else BOTH),
        Line(
            "kv_cache", f"engine KV cache ({B} sequence{'s' if B != 1 else ''})", kv, BOTH if keeps_cache else ROLLOUT
        ),
        Line("engine_workspace", "engine verification logits", B * (K + 1) * pol.vocab_size * (a_e + 4), ROLLOUT),
        Line(
            "refit", f"refit (a tensor gathered, two {spec.refit_bucket_bytes / 2**20:g} MiB buckets)", refit, ROLLOUT
        ),
    ]


@dataclass
class MemoryPlan:
    """Per-rank memory of a run against a device's capacity."""

    spec: PlanSpec
    """The run."""
    ranks: list[RankPlan]
    """Every distinct kind of rank (the stages with equal numbers merged), in stage order."""
    device_memory: int
    """Bytes of one device."""
    notes: list[str] = field(default_factory=list)
    """Assumptions worth reading next to the numbers."""

    @property
    def worst_training(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.training_total)

    @property
    def worst_rollout(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.rollout_total)

    @property
    def fits(self) -> bool:
        """Both phases of every rank fit the device."""
        return max(self.worst_training.training_total, self.worst_rollout.rollout_total) <= self.device_memory


def plan_memory(spec: PlanSpec, device_memory: int = 80 * 2**30) -> MemoryPlan:
    """The memory plan of every kind of rank (shard rank 0 of every stage: it holds the most).

    Raises:
        ValueError: the pipeline cannot split the policy (``StageLayout.split``) or the draft vocabulary is invalid.
    """
    models = MetaModels.build(spec)
    ranks: list[RankPlan] = []
    for stage in range(spec.pp):
        plan = plan_rank(spec, models, stage)
        prev = ranks[-1] if ranks else None
        if prev is not None and prev.lines == plan.lines and stage != spec.pp - 1 and prev.stages[0] != 0:
            prev.stages = prev.stages + (stage,)
            prev.label = _stage_label(prev.stages, spec.pp)
            continue
        ranks.append(plan)
    return MemoryPlan(spec=spec, ranks=ranks, device_memory=int(device_memory), notes=_notes(spec))


def _notes(spec: PlanSpec) -> list[str]:
    notes = [
        "training totals count the gradients next to the peak activations (the backward frees the one while it "
        "fills the other: an upper bound); no allowance for the CUDA context, communication buffers and "
        "allocator fragmentation (a few GiB)"
    ]
    if spec.engine == "vllm":
        notes.append(
            "vLLM sleeps (level 2) while training on an accelerator: its weights and KV cache count in the "
            "rollout phase only"
            if spec.accelerator != "cpu"
            else "vLLM on CPU has no sleep mode: its weights and KV cache stay resident in both phases"
        )
    else:
        notes.append(
            "the embedded engine's copies (under FSDP2 / PP) are released while training runs and refilled "
            "one tensor at a time before each rollout phase; its KV cache is freed between rollouts"
        )
    if spec.pp > 1:
        notes.append(
            f"pipeline receive buffers: torch.distributed.pipelining allocates them for all M microbatches "
            f"of a step and PipelineRunner keeps {CACHED_SCHEDULES} schedule; the TapChannel's landing "
            f"buffers cover {'pp microbatches (1F1B)' if spec.pp_schedule == '1f1b' else 'all M (GPipe)'}"
        )
    if spec.precision == "bf16-mixed" and not spec.fsdp:
        notes.append(
            "bf16-mixed without FSDP2 runs under autocast: its activations are counted with the fp32 "
            "formulas (an upper bound)"
        )
    if spec.with_reference:
        notes.append("the reference policy is planned as CoDraftModule(reference=...), sharded like the policy")
    return notes
