"""What one RL step measured: :class:`StepMetrics`, whose fields are the columns of ``metrics.csv``.

Three acceptance figures, one name each (training/metrics.py): ``acceptance_length`` (measured by the engine),
``draft_acc0`` with the module's ``draft/top1_acceptance`` (implied by top-1 accuracy) and ``implied_acceptance``
(implied by the draft's and the policy's distributions on the step's rollouts).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class StepMetrics:
    """What one RL step measured (the columns of ``metrics.csv``), global over every rank."""

    step: int
    """1-based index of the step."""
    reward: float
    """Mean reward of the step's samples."""
    reward_std: float
    """Standard deviation of the rewards (mean over replicas)."""
    accuracy: float
    """Share of samples with reward >= 1."""
    reward_failures: float
    """Samples whose reward failed and were skipped (``task.on_reward_error=skip``; left out of advantages, loss and
    the reward columns)."""
    completion_tokens: float
    """Generated tokens of the step, per replica (mean over replicas)."""
    acceptance_length: float
    """Tokens emitted per verification round of the rollouts (1 = no draft)."""
    acceptance_rate: float
    """Share of proposed draft tokens the policy accepted."""
    mean_k: float
    """Draft tokens proposed per round, plain rounds included (K for a fixed engine; adaptive chooses 0..K)."""
    tokens_per_round: float
    """Tokens emitted per policy forward, plain rounds included (the speed-up before costs)."""
    draft_loss: float
    """The draft's TTT loss on the step's batch (NaN without a draft)."""
    draft_acc0: float
    """Top-1 agreement of the draft's first unroll step with the policy on the step's batch (every scored row: one
    whose policy top-1 the draft vocabulary lacks is a miss, as greedy verification rejects it)."""
    draft_oov_share: float
    """Share of the draft's scored rows whose policy top-1 is outside the draft vocabulary (NaN without a draft)."""
    policy_loss: float
    """Clipped policy-gradient loss."""
    clip_frac: float
    """Share of the step's completion tokens whose ratio was clipped: a token mean whatever the aggregation (TRL's
    ``clip_ratio/region_mean``, verl's ``actor/pg_clipfrac``)."""
    kl: float
    """Drift: KL(policy || start policy), the k3 estimate's token mean over the step's completion tokens before the
    update, whatever the aggregation (TRL's ``kl``, verl's ``low_var_kl`` mean) (the
    start policy is the frozen reference; NaN without one: ``rl.track_drift=false`` and ``rl.kl_coef=0``)."""
    greedy_agreement: float
    """Drift: share of the step's completion positions where the policy's and the start policy's most likely next
    token agree (1 = no drift; NaN without ``rl.track_drift``)."""
    eval_accuracy: float
    """Greedy accuracy on the fixed held-out prompts (``task.eval_every`` steps; NaN on the others)."""
    eval_reward: float
    """Mean reward of one sample per held-out prompt at the rollout temperature (``task.eval_every``; else NaN)."""
    skipped: float
    """1 when the update was skipped because the loss or a gradient was not finite, else 0."""
    rollout_s: float
    """Seconds spent generating (the slowest rank of the replica)."""
    train_s: float
    """Seconds of the optimizer step (forward, backward, update)."""
    refit_s: float
    """Seconds of the refit (training weights into the engine, bucketed: rollout/refit/buckets.py) before the rollouts;
    0 where the engine decodes the training modules themselves."""
    refit_share: float
    """``refit_s`` over ``step_s``: the refit's share of the step."""
    policy_version: float
    """The policy version the step's rollouts were generated with (optimizer steps of its weights; the oldest where
    they differ, ``rl.max_staleness``)."""
    draft_version: float
    """The draft version that proposed (steps that trained it: a frozen draft stays at 0, the warm start; the oldest
    where they differ)."""
    draft_trained: float
    """1 when this step updated the draft (``draft.schedule``), else 0."""
    implied_acceptance: float
    """The current draft's implied acceptance length on the step's rollouts (training/implied.py; NaN when the draft
    did not run)."""
    reference_acceptance: float
    """The A/B's reference draft's implied acceptance length on the same rollouts (NaN without ``draft.reference``)."""
    ab_gain: float
    """``implied_acceptance - reference_acceptance`` on this step (NaN where either is missing)."""
    ab_gain_low: float
    """Lower bound of the 95% confidence interval of the mean A/B gain over the run's steps so far."""
    ab_gain_high: float
    """Upper bound of that interval."""
    step_s: float
    """Seconds of the whole step."""
    tokens_per_s: float
    """Completion tokens per rollout second."""
    staleness: float = 0.0
    """Policy versions between the trainer and the rollouts it trained on, mean over the step's samples
    (``rl.async_level``; 0 when synchronous)."""
    staleness_max: float = 0.0
    """Their largest (at most ``rl.max_staleness``)."""
    draft_lag: float = 0.0
    """Drafter lag: the rollouts' policy version minus the version of the drafter that proposed them, mean over the
    step's samples (a frozen drafter's grows with every step; a drafter co-trained every step stays at 0)."""
    version_span: float = 0.0
    """Policy versions between a rollout's first token and its last, mean over the step's samples (in-flight
    weight updates, ``rl.inflight_updates``; 0 otherwise)."""
    dropped_groups: float = 0.0
    """Prompt groups dropped by the bounded-staleness producer before this step (``rl.drop_uniform_groups`` or too
    stale), each replaced by the next group."""
    trainer_wait_s: float = 0.0
    """Seconds the trainer waited for the step's rollouts (all of the rollout phase when synchronous)."""
    producer_idle: float = math.nan
    """Share of the step's seconds the asynchronous producer spent idle (NaN when synchronous)."""
    is_weight: float = math.nan
    """Token mean of the decoupled objective's off-policy weights (``rl.off_policy``; NaN without it)."""
    is_weight_std: float = math.nan
    """Their standard deviation over the step's completion tokens."""
    is_weight_max: float = math.nan
    """Their largest value (at most ``rl.off_policy.is_cap``)."""
    is_truncated: float = math.nan
    """Share of completion tokens whose weight was truncated at the cap."""
    is_masked: float = math.nan
    """Share of completion tokens out of the loss (rejection or veto)."""
    is_ess: float = math.nan
    """Effective sample size per token of the weights, ``mean^2 / mean of squares`` (1: all equal)."""
    mismatch_kl: float = math.nan
    """k3 estimate of KL(engine || trainer) per completion token: how far the behaviour log-probs are from the
    trainer's current ones (staleness and numerics)."""
    prob_acceptance: float = math.nan
    """DSpark: the probabilistic acceptance ``1 + sum cumprod(1 - TV)`` of the step's training blocks (NaN for other
    drafters)."""
    predicted_acceptance: float = math.nan
    """DSpark: the acceptance its confidence head predicts on the same blocks (its calibration: against
    ``prob_acceptance`` and the measured ``acceptance_length``)."""
    reward_parts: dict[str, float] = field(default_factory=dict)
    """With ``task.rewards``: each reward function's mean score (over the step's scored samples, unweighted), by
    name; logged as the columns ``reward/<name>``."""

    def as_dict(self) -> dict[str, float]:
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "reward_parts"}
        return {**row, **{f"reward/{k}": v for k, v in self.reward_parts.items()}}


COLUMNS = tuple(f.name for f in dataclasses.fields(StepMetrics) if f.name != "reward_parts")
"""Columns of ``metrics.csv``, in order."""
TIME_COLUMNS = (
    "rollout_s",
    "train_s",
    "refit_s",
    "refit_share",
    "step_s",
    "tokens_per_s",
    "trainer_wait_s",
    "producer_idle",
)
"""Columns that depend on wall time (excluded when comparing runs for equality)."""
SCHEDULE_COLUMNS = ("acceptance_length", "acceptance_rate", "mean_k", "tokens_per_round")
"""Columns that follow the adaptive speculation schedule, which follows measured times (with coupled sampling the
rollouts themselves do not): compare them only between runs with ``draft.adaptive=false``."""


def overlap_metrics(step: int, produced, drafts: bool) -> dict[str, float]:
    """The step's staleness (trainer version minus each rollout's policy version: mean and max), drafter lag (each
    rollout's policy version minus its drafter's, where the engine ``drafts``) and waiting / idle figures of a
    :class:`~lightning_codraft.rl.step.Produced`."""
    outs = produced.gen.outs
    stale = [step - o.policy_version for o in outs] or [step - produced.gen.versions["policy"]]
    lag = [o.policy_version - o.draft_version for o in outs] if drafts and outs else [0]
    return {
        "staleness": sum(stale) / len(stale),
        "staleness_max": float(max(stale)),
        "draft_lag": sum(lag) / len(lag),
        "version_span": sum(o.version_span for o in outs) / len(outs) if outs else 0.0,
        "dropped_groups": float(produced.dropped),
        "trainer_wait_s": produced.wait_s,
        "producer_idle": produced.producer_idle,
    }


def idle_share(busy_s: float, since: Optional[float], now: float) -> float:
    """Share of the seconds ``since .. now`` a producer busy for ``busy_s`` of them spent idle (NaN without a
    previous take: ``since`` None)."""
    return math.nan if since is None else max(0.0, 1.0 - busy_s / max(now - since, 1e-9))


def drafter_metrics(m: dict[str, float]) -> dict[str, float]:
    """A drafter's own figures of a step (DSpark's acceptance estimates; absent for the others)."""
    return {k: m[f"draft/{k}"] for k in ("prob_acceptance", "predicted_acceptance") if f"draft/{k}" in m}


def off_policy_metrics(m: dict[str, float]) -> dict[str, float]:
    """The decoupled objective's figures of a step (NaN without it): the weights' token mean, std from the second
    moment, max, truncated and masked shares, effective sample size per token, the engine-trainer KL."""
    if "policy/is_weight" not in m:
        return {}
    mean, second = m["policy/is_weight"], m["policy/is_weight_sq"]
    return {
        "is_weight": mean,
        "is_weight_std": math.sqrt(max(second - mean * mean, 0.0)),
        "is_weight_max": m["policy/is_weight_max"],
        "is_truncated": m["policy/is_truncated"],
        "is_masked": m["policy/is_masked"],
        "is_ess": mean * mean / second if second > 0 else math.nan,
        "mismatch_kl": m["policy/mismatch_kl"],
    }
