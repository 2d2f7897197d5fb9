"""One RL step: prompts -> rollouts -> rewards -> group advantages -> RLBatch -> optimizer step -> weight sync.

:class:`RLStep` holds what a step needs (task, reward, tokenizer, the rollout worker, the Fabric-wrapped module
and its optimizer) and returns the step's :class:`StepMetrics`. Everything a step consumes is a function of the
seed, the step index and the checkpointed state: prompts come from ``task.sample(n, step_seed(seed, step))`` and
the replica's sampling seed from ``(seed, step, dp_rank)``, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.parallel.checkpoint import unwrap_module
from lightning_codraft.rl.draft_schedule import Decision, DraftSchedule, ab_difference
from lightning_codraft.rl.experience import Rollout, build_rl_batch, group_advantages
from lightning_codraft.rl.rollout_worker import rollout_seed
from lightning_codraft.rl.run.build import fit_prompts
from lightning_codraft.rl.step_metrics import StepMetrics, drafter_metrics, off_policy_metrics, overlap_metrics
from lightning_codraft.rl.tasks.rewards import RewardScores, as_reward_set, check_failure_budget
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutError
from lightning_codraft.training.step import optimizer_step


def step_seed(seed: int, step: int) -> int:
    """The seed of RL step ``step``'s prompts and sampling."""
    return seed * 100_003 + step + 1


@dataclass
class Generation:
    """One replica's rollouts of a step (:meth:`RLStep._generate`)."""

    requests: list[list[int]]
    """Prompt ids of every request (each prompt ``rl.group_size`` times)."""
    outs: list
    """The engine's outputs, one per request."""
    acc: AcceptanceStats
    """The engine's speculation figures over the requests."""
    rollout_s: float
    """Seconds generating."""
    refit_s: float
    """Seconds refitting the engine before."""
    versions: dict[str, int]
    """The policy and draft versions the rollouts were generated with."""

    @property
    def tokens(self) -> int:
        """Completion tokens of the replica's rollouts."""
        return sum(len(o.token_ids) for o in self.outs)


@dataclass
class Produced:
    """The produce stage's result for one step: what the consume stages read."""

    step: int
    """The RL step the rollouts are for."""
    prompts: list
    """This replica's prompts of the step."""
    gen: Generation
    """Their rollouts."""
    wait_s: float = 0.0
    """Seconds the trainer waited for them (all of the rollout phase when synchronous)."""
    producer_idle: float = math.nan
    """Share of the trainer's previous step the asynchronous producer spent idle (NaN when synchronous)."""
    scores: Optional[RewardScores] = None
    """The rollouts' rewards where they were computed already (the bounded producer's group filter,
    rl/bounded_rollouts.py), else None."""
    dropped: int = 0
    """Prompt groups the producer dropped (and replaced) before these."""


def step_prompts(task, cfg: CoDraftConfig, step: int) -> list:
    """The prompts of RL step ``step`` (0-based): a pure function of the run's seed and the step."""
    return task.sample(cfg.rl.prompts_per_step, seed=step_seed(cfg.run.seed, step))


def weight_versions(cfg: CoDraftConfig, step: int, draft_updates: Optional[int] = None) -> dict[str, int]:
    """The versions of the training state after ``step`` optimizer steps: the policy's is ``step``; the draft's
    counts the steps that trained it (``draft_updates``: the schedule's count; without it, every step, or every
    ``train_every``-th from the first under ``every_n``), 0 for a frozen or absent draft (the warm start)."""
    d = cfg.draft
    if not (d.mode == "cotrain" and d.loss_weight > 0):
        return {"policy": int(step), "draft": 0}
    if draft_updates is None and d.schedule == "adaptive":
        raise ValueError("under draft.schedule=adaptive the draft's version is its update count: pass draft_updates")
    every = d.train_every if d.schedule == "every_n" else 1
    return {"policy": int(step), "draft": -(-int(step) // every) if draft_updates is None else int(draft_updates)}


def check_versions(outputs, versions: dict[str, int], drafts: bool) -> None:
    """Raise :class:`~lightning_codraft.rollout.engine.RolloutError` unless every output was generated with the
    expected policy version (and draft version, where the engine drafts): a synchronous loop trains on rollouts of
    the current weights only."""
    for i, o in enumerate(outputs):
        if o.policy_version != versions["policy"] or (drafts and o.draft_version != versions["draft"]):
            raise RolloutError(
                f"rollout {i} was generated with policy version {o.policy_version} and draft version "
                f"{o.draft_version}; the training state is policy {versions['policy']}, draft "
                f"{versions['draft']}: the engine was not refitted (a stale engine)"
            )


def draft_schedule(cfg: CoDraftConfig) -> DraftSchedule:
    """The run's draft update schedule from ``cfg.draft``."""
    d = cfg.draft
    return DraftSchedule(
        d.schedule, cfg.rl.steps, d.train_every, d.schedule_horizon, trains=d.mode == "cotrain" and d.loss_weight > 0
    )


class RLStep:
    """The RL step of a run.

    Args:
        cfg: the run's config.
        fabric: the launched ``Fabric``.
        dims: this process' (dp, pp, cp) layout.
        task, reward_fn, tokenizer, context: the task, its rewards (a
            :class:`~lightning_codraft.rl.tasks.rewards.RewardSet`, or one ``fn(prompt, completion, answer)``), the
            tokenizer and the usable context length.
        worker: the :class:`~lightning_codraft.rl.rollout_worker.RolloutWorker`.
        model: the Fabric-wrapped ``CoDraftModule`` (its reference policy, if any, scores the KL term);
            optimizer / scheduler: its optimizer and LR schedule.
        log: where status lines go.
        schedule: the draft's :class:`~lightning_codraft.rl.draft_schedule.DraftSchedule` (kept across steps by a
            front end that builds a step object per step); default: a new one from ``cfg.draft``.
    """

    def __init__(
        self,
        cfg: CoDraftConfig,
        fabric,
        dims,
        task,
        reward_fn,
        tokenizer,
        context: int,
        worker,
        model,
        optimizer,
        scheduler,
        log: Callable[[str], None] = print,
        schedule: Optional[DraftSchedule] = None,
    ):
        self.cfg, self.fabric, self.dims = cfg, fabric, dims
        self.task, self.rewards, self.tokenizer, self.context = task, as_reward_set(reward_fn), tokenizer, context
        self.worker, self.model, self.optimizer, self.scheduler = worker, model, optimizer, scheduler
        self.log = log
        self.schedule = schedule if schedule is not None else draft_schedule(cfg)
        """The draft's update schedule; its history is the run's ``draft_schedule.jsonl`` and a checkpoint entry."""
        self.rollouts = None
        """The asynchronous producer (rl/async_rollouts.py) the step takes its rollouts from; None: produced in the
        step (synchronous)."""
        self.last_rollouts: list[Rollout] = []
        self.last_completions: list[dict] = []
        """This replica's samples of the last step: prompt text, completion text, reward (and each reward's)."""

    def restore_schedule(self, rows) -> None:
        """Resume the draft's schedule from its saved history (and the draft's live per-position rates with it)."""
        self.schedule.load_state_dict(rows)
        unwrap_module(self.model).set_live_position_rates(self.schedule.last_rates)

    def _summed(self, **values: float) -> dict[str, float]:
        """``values`` summed over every rank (one all-reduce), by name."""
        out = self.fabric.all_reduce(torch.tensor(list(values.values()), dtype=torch.float64), reduce_op="sum")
        return dict(zip(values, out.tolist()))

    def _decide_draft(self, step: int, acc: AcceptanceStats, rollout_s: float, n_tok: int, module) -> Decision:
        """The draft schedule's decision for ``step`` from the whole world's rollout figures, set on ``module``'s
        flags (train, run, score the reference) and logged under the adaptive schedule."""
        dims, K = self.dims, self.worker.num_speculative_tokens
        seen = self._summed(
            accepted=float(acc.accepted),
            draft_steps=float(acc.draft_steps),
            rollout_s=rollout_s,
            tokens=float(n_tok),
            drafted=float(acc.drafted),
            forwards=float(acc.policy_forwards),
            saved_s=acc.plain_s - acc.round_s,
            timed=float(acc.plain_s > 0),
        )
        decision = self.schedule.decide(
            step,
            1.0 + seen["accepted"] / seen["draft_steps"] if seen["draft_steps"] else 1.0,
            seen["rollout_s"] / dims.world_size,
            seen["tokens"] * dims.dp / dims.world_size,  # a replica's ranks hold the same rollouts
            seen["drafted"] / (seen["forwards"] * K) if seen["forwards"] and K else 1.0,
            seen["saved_s"] / dims.world_size if seen["timed"] == dims.world_size else math.nan,
        )
        if self.schedule.skips_draft:
            self.log(f"step {step + 1}: draft update {'taken' if decision.train else 'skipped'}: {decision.reason}")
        module.train_draft_this_step = decision.train
        frozen_unscored = self.cfg.draft.mode == "frozen" and not self.cfg.draft.score_frozen
        module.run_draft_this_step = decision.train or not (self.schedule.skips_draft or frozen_unscored)
        module.score_reference_this_step = not decision.idle
        return decision

    def __call__(self, step: int, samples=None) -> StepMetrics:
        """Run RL step ``step`` (0-based) on every rank; ``samples``: the step's prompts (every rank the same list
        of ``rl.prompts_per_step``), default ``task.sample(rl.prompts_per_step, step_seed(run.seed, step))``.

        The stages: produce (the rollouts: now, or taken from the asynchronous producer), score, batch, decide the
        draft's update, train, record."""
        t_start = time.perf_counter()
        produced = self.produce(step, samples) if self.rollouts is None else self.rollouts.take(step, samples)
        scores, r, scored = self._score(step, produced.prompts, produced.gen.outs, produced.scores)
        batch = self._batch(produced.gen, scores.total, r, scored)
        self.model.train()
        module = unwrap_module(self.model)
        decision = self._decide_draft(step, produced.gen.acc, produced.gen.rollout_s, produced.gen.tokens, module)
        m, train_s = self._train(module, batch)
        implied, reference = m.get("draft/implied_acceptance", math.nan), m.get("draft/reference_acceptance", math.nan)
        K = module.draft_term.num_positions(module)  # the drafter's positions (EAGLE-3's unroll, a block's)
        rates = [m[f"draft/implied_rate{k}"] for k in range(K) if f"draft/implied_rate{k}" in m]
        self.schedule.record(decision, train_s, implied - reference, rates, reference)
        return self._metrics(step, t_start, produced, scores, r, scored, decision, m, train_s)

    def produce(self, step: int, samples=None) -> Produced:
        """The produce stage: this replica's prompts of ``step`` and their rollouts, with the engine refitted to the
        training state after ``step`` updates."""
        mine = self._replica_prompts(step, samples)
        t0 = time.perf_counter()
        gen = self._generate(step, mine)
        return Produced(step, mine, gen, wait_s=time.perf_counter() - t0)

    def _train(self, module, batch) -> tuple[dict[str, float], float]:
        """The optimizer step on ``batch``: its figures and the slowest rank's seconds (every rank's schedule must
        see the same figures to decide alike)."""
        t0 = time.perf_counter()
        m = {
            k: float(v)
            for k, v in optimizer_step(
                self.model, module, batch, self.optimizer, self.scheduler, self.fabric.backward
            ).items()
        }
        seconds = time.perf_counter() - t0
        return m, self.fabric.all_reduce(torch.tensor(seconds, dtype=torch.float64), reduce_op="max").item()

    def _replica_prompts(self, step: int, samples) -> list:
        """This replica's share of the step's prompts (``samples``, default :func:`step_prompts`)."""
        cfg, dims = self.cfg, self.dims
        if samples is None:
            samples = step_prompts(self.task, cfg, step)
        if len(samples) != cfg.rl.prompts_per_step:
            raise ValueError(
                f"step {step + 1} got {len(samples)} prompts; rl.prompts_per_step={cfg.rl.prompts_per_step}"
            )
        per_rank = cfg.rl.prompts_per_step // dims.dp
        return samples[dims.dp_rank * per_rank : (dims.dp_rank + 1) * per_rank]

    def _generate(self, step: int, mine: list) -> Generation:
        """Refit the engine to the training state, then sample ``rl.group_size`` completions of each prompt."""
        versions = weight_versions(self.cfg, step, self.schedule.updates)  # the training state after `step` updates
        refit_s = self.worker.prepare(versions)
        return self.generate_prepared(step, mine, versions, refit_s)

    def generate_prepared(
        self,
        step: int,
        mine: list,
        versions: dict[str, int],
        refit_s: float,
        places: Optional[list] = None,
        group="replica",
    ) -> Generation:
        """Sample ``rl.group_size`` completions of each of ``mine`` (step ``step``'s prompts of this replica) with
        the engine already refitted to ``versions`` (in ``refit_s`` seconds); the engine's copies are released
        after (a thread of its own may call this: rl/async_rollouts.py). ``places``: each prompt's ``(step,
        index in the step)``, the seeds' (default: this replica's share of ``step``); ``group``: the ranks that
        share the decoding and gather the outputs (``RolloutWorker.generate``; a producer thread uses its own)."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        prompts = fit_prompts(
            [encode_prompt(self.tokenizer, s.prompt) for s in mine], self.context, cfg.rl.max_new_tokens
        )
        requests = [p for p in prompts for _ in range(G)]
        first = self.dims.dp_rank * len(mine)  # the step's index of this replica's first prompt
        places = places or [(step, first + i) for i in range(len(mine))]
        seeds = [rollout_seed(cfg.run.seed, *places[i // G], i % G) for i in range(len(requests))]
        outs, acc, rollout_s = self.worker.generate(requests, seeds, group=group)
        check_versions(outs, versions, drafts=self.worker.num_speculative_tokens > 0)
        self.worker.release()
        return Generation(requests, outs, acc, rollout_s, refit_s, versions)

    def _score(self, step: int, mine: list, outs, scores: Optional[RewardScores] = None) -> tuple:
        """The rewards of the replica's completions: ``(scores, (P, G) float64 rewards, (P, G) bool scored)``
        (``scores``: computed already, by the group filter).

        Every rank scores in the tolerant mode and the budget (0 for ``on_reward_error=raise``) is checked on the
        step's global count, so all ranks stop together (a rank that raised alone would leave the others waiting).
        """
        cfg, G = self.cfg, self.cfg.rl.group_size
        texts, per_sample = [self.tokenizer.decode(o.token_ids) for o in outs], [s for s in mine for _ in range(G)]
        if scores is None:
            scores = self.rewards.score([s.prompt for s in per_sample], texts, per_sample)
        self.last_completions = [
            {
                "prompt": s.prompt,
                "completion": text,
                "reward": scores.total[i],
                **{f"reward/{k}": scores.parts[k][i] for k in self.rewards.logged_parts},
            }
            for i, (s, text) in enumerate(zip(per_sample, texts))
        ]
        failures = scores.failures
        for name in scores.not_applied:  # TRL's None for every sample: legal, but never silent
            self.log(f"step {step + 1}: reward {name!r} returned None (does not apply) for every sample of the step")
        skip = cfg.task.on_reward_error == "skip"
        for f in failures if skip else ():  # every skipped sample is reported
            self.log(
                f"step {step + 1}: skipped sample {f.index} (prompt {f.prompt!r}): reward function {f.function} "
                f"{f.reason}"
            )
        counts = self.fabric.all_reduce(
            torch.tensor([float(len(failures)), float(len(failures) == len(scores.total))]), reduce_op="sum"
        ).tolist()
        check_failure_budget(
            failures,
            int(counts[0]),
            cfg.rl.prompts_per_step * G,
            cfg.task.reward_failure_budget if skip else 0.0,
            empty_replicas=int(counts[1]),
        )
        r = torch.tensor(scores.total, dtype=torch.float64).view(len(mine), G)
        return scores, r, torch.isfinite(r)  # a skipped sample's reward is NaN: out of its group and the loss

    def _batch(self, gen: Generation, rewards: list, r: torch.Tensor, scored: torch.Tensor):
        """Group advantages and the packed :class:`~lightning_codraft.batch.RLBatch` of the scored samples (the
        loss aggregation, token / sequence / constant, is the module's: ``CoDraftModule.normalize``)."""
        cfg, G = self.cfg, self.cfg.rl.group_size
        adv = group_advantages(r, scale=cfg.rl.scale_advantages, std=cfg.rl.std, valid=scored).view(-1).tolist()
        rollouts = [
            Rollout(req, o.token_ids, o.logprobs, group=i // G, reward=rw)
            for i, (req, o, rw) in enumerate(zip(gen.requests, gen.outs, rewards))
        ]
        self.last_rollouts = rollouts
        rollouts, adv = zip(*[(ro, a) for ro, a, keep in zip(rollouts, adv, scored.view(-1).tolist()) if keep])
        return build_rl_batch(rollouts, adv, cp=self.dims.cp, pad_id=self.tokenizer.pad_token_id)

    def _metrics(
        self,
        step: int,
        t_start: float,
        produced: Produced,
        scores,
        r,
        scored,
        decision: Decision,
        m: dict[str, float],
        train_s: float,
    ) -> StepMetrics:
        """The step's :class:`StepMetrics`: replica means of the rollout figures, the module's loss figures."""
        _, ab_low, ab_high = ab_difference([d.ab_gain for d in self.schedule.history])
        gen = produced.gen
        ok, acc = r[scored].tolist(), gen.acc
        local = {
            "reward": sum(ok) / len(ok),
            "reward_std": torch.tensor(ok).std(unbiased=False).item(),
            "accuracy": sum(x >= 1.0 for x in ok) / len(ok),
            "reward_failures": float(len(scores.failures)),
            "completion_tokens": float(gen.tokens),
            "accepted": float(acc.accepted),
            "draft_steps": float(acc.draft_steps),
            "drafted": float(acc.drafted),
            "policy_forwards": float(acc.policy_forwards),
        }
        parts = self.rewards.logged_parts
        for name in parts:
            kept = [v for v, keep in zip(scores.parts[name], scored.view(-1).tolist()) if keep and not math.isnan(v)]
            local[f"reward/{name}"] = sum(kept) / len(kept) if kept else math.nan
        means = self.fabric.all_reduce(torch.tensor(list(local.values()), dtype=torch.float64), reduce_op="mean")
        g = dict(zip(local, means.tolist()))  # replica means, by name
        step_s = time.perf_counter() - t_start
        mean_acc = AcceptanceStats(
            draft_steps=g["draft_steps"],
            drafted=g["drafted"],
            accepted=g["accepted"],
            policy_forwards=g["policy_forwards"],
        )
        implied, reference = m.get("draft/implied_acceptance", math.nan), m.get("draft/reference_acceptance", math.nan)
        return StepMetrics(
            step=step + 1,
            reward=g["reward"],
            reward_std=g["reward_std"],
            accuracy=g["accuracy"],
            reward_failures=g["reward_failures"],
            completion_tokens=g["completion_tokens"],
            acceptance_length=mean_acc.acceptance_length,
            acceptance_rate=mean_acc.acceptance_rate,
            mean_k=mean_acc.mean_k,
            tokens_per_round=mean_acc.tokens_per_round,
            draft_loss=m.get("draft/loss", math.nan),
            draft_acc0=m.get("draft/acc_step0", math.nan),
            draft_oov_share=m.get("draft/oov_share", math.nan),
            policy_loss=m.get("policy/pg_loss", math.nan),
            clip_frac=m.get("policy/clip_frac", math.nan),
            kl=m.get("policy/kl", math.nan) if self.model.reference is not None else math.nan,
            greedy_agreement=m.get("drift/greedy_agreement", math.nan),
            eval_accuracy=math.nan,
            eval_reward=math.nan,
            skipped=m.get("skipped", 0.0),
            rollout_s=gen.rollout_s,
            train_s=train_s,
            refit_s=gen.refit_s,
            refit_share=gen.refit_s / step_s,
            policy_version=float(gen.versions["policy"]),
            draft_version=float(gen.versions["draft"]),
            draft_trained=float(decision.train),
            implied_acceptance=implied,
            reference_acceptance=reference,
            ab_gain=implied - reference,
            ab_gain_low=ab_low,
            ab_gain_high=ab_high,
            step_s=step_s,
            tokens_per_s=float(gen.tokens) / max(gen.rollout_s, 1e-9),
            **overlap_metrics(step, produced, self.worker.num_speculative_tokens > 0),
            **off_policy_metrics(m) | drafter_metrics(m),
            reward_parts={name: g[f"reward/{name}"] for name in parts},
        )
