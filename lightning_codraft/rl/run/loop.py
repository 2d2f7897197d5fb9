"""The RL loop: generate (speculative engine) -> reward -> GRPO + draft step (CoDraftModule) -> weight sync.

:func:`fit` runs a whole :class:`~lightning_codraft.config.CoDraftConfig` through a :class:`CoDraftRun`, which
only orchestrates objects with one job each:

- ``rl.run.build``: tokenizer, policy, draft, task, reward and the module's hyper-parameters from the recipe;
- ``rl.run.warm_start.warm_start``: SFT of the policy, the draft fitted to the policy's own samples (or weights
  loaded instead);
- :class:`~lightning_codraft.rl.run.run_dir.RunCheckpoints`: resumable checkpoints and the warmed-up weights;
- :class:`~lightning_codraft.rl.rollout_worker.RolloutWorker`: engine placement, generation, weight sync;
- :class:`~lightning_codraft.rl.step.RLStep`: one RL step, returning named
  :class:`~lightning_codraft.rl.step.StepMetrics`;
- ``rl.reports.run_log.MetricsLogger``: metrics.csv / TensorBoard through Lightning's loggers; ``rl.run.evaluate``: greedy
  accuracy and the final rollout speed-up.

A run: resume from the last checkpoint of ``run.out_dir`` if any, else warm up (or load ``run.init_from``) and save
checkpoint ``step-000000``; then the RL steps, a checkpoint every ``run.checkpoint_every`` steps; then greedy
accuracy before / after, the rollout speed-up of the final draft and PNG plots. Everything a step consumes derives
from the seed, the step index and the checkpointed state, so a killed run resumed from its last checkpoint
reproduces the metrics of the uninterrupted run. On a ``dp x pp x cp`` mesh the warm-ups run on every rank on the
whole modules; greedy evaluation and the speed-up run on global rank 0 (the lead of replica 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.fabric import Fabric

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.fabric import CoDraftStrategy
from lightning_codraft.models.precision import resolve_dtype
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rl.acceptance_watch import AcceptanceWatch
from lightning_codraft.rl.async_rollouts import checkpoint_entry, producer
from lightning_codraft.rl.reports.extra_loggers import build_loggers
from lightning_codraft.rl.reports.run_log import MetricsLogger, StepProgress, plot_run, summarize
from lightning_codraft.rl.rollout_worker import RolloutWorker
from lightning_codraft.rl.run.build import build_module, build_parts, fit_prompts
from lightning_codraft.rl.run.evaluate import (
    EVAL_SEED,
    SpeedupResult,
    heldout_rewards,
    heldout_samples,
    mean_of,
    measure_speedup,
)
from lightning_codraft.rl.run.run_dir import RunCheckpoints, reference_draft, warm_key
from lightning_codraft.rl.run.warm_start import warm_start
from lightning_codraft.rl.step import RLStep, weight_versions
from lightning_codraft.rl.step_metrics import StepMetrics
from lightning_codraft.run_config import config_changes, write_run_config
from lightning_codraft.training.module import CoDraftModule


@dataclass
class FitResult:
    """What a finished (or interrupted) run reports.

    Attributes:
        out_dir: the run directory.
        rows: per-step metrics (as in metrics.csv).
        eval_before, eval_after: greedy mean reward on held-out prompts (NaN when skipped).
        eval_before_scores, eval_after_scores: ``(task.eval_prompts,)`` each held-out prompt's greedy reward (in
            the set's order: pair them per prompt).
        speedup: the final rollout speed-up measurement (None without a draft, and on every rank but 0).
        completed: False when the run stopped early (``stop_after``).
    """

    out_dir: Path
    rows: list[dict[str, float]] = field(default_factory=list)
    eval_before: float = math.nan
    eval_after: float = math.nan
    eval_before_scores: list[float] = field(default_factory=list)
    eval_after_scores: list[float] = field(default_factory=list)
    speedup: Optional[SpeedupResult] = None
    completed: bool = True


class CoDraftRun:
    """One RL run of a config: :meth:`setup`, then :meth:`step` per RL step (or :meth:`run` for all), then
    :meth:`finish`. Built by :func:`fit`.

    Args:
        cfg: the validated config.
        print_fn: where status lines go (rank 0 only).
        task: the task object instead of the recipe's ``task`` section (e.g. a
            :class:`~lightning_codraft.rl.tasks.dataset.DatasetTask` built in Python); it must have ``sample(n, seed)``,
            ``reward(prompt, completion, answer)`` and, for held-out evaluation, ``heldout`` / ``heldout_samples``.
        rewards: reward terms instead of the recipe's (a :class:`~lightning_codraft.rl.tasks.rewards.RewardSet`, a
            list of :class:`~lightning_codraft.rl.tasks.rewards.RewardTerm`, or one ``fn(prompt, completion, answer)``).
    """

    def __init__(self, cfg: CoDraftConfig, print_fn: Callable[[str], None] = print, task=None, rewards=None):
        self.cfg = cfg
        self._given_task = task
        self._given_rewards = rewards
        self.out = Path(cfg.run.out_dir)
        self._print = print_fn
        self.fabric: Optional[Fabric] = None
        self.dims = None
        self.tokenizer = self.task = self.reward_fn = None
        self.context = 0
        self.module: Optional[CoDraftModule] = None
        self.model = self.optimizer = self.scheduler = None
        self.worker: Optional[RolloutWorker] = None
        self.checkpoints: Optional[RunCheckpoints] = None
        self.rl_step: Optional[RLStep] = None
        self.watch = AcceptanceWatch()  # warns when the rollouts' acceptance falls well below its recent level
        self.logger: Optional[MetricsLogger] = None
        self.extra: dict[str, Any] = {}
        self.start_step = self.steps_done = 0
        self.result = FitResult(out_dir=self.out)

    # ------------------------------------------------------------------ building
    def log(self, msg: str) -> None:
        if self.fabric is None or self.fabric.global_rank == 0:
            self._print(msg)

    def launch(self) -> None:
        """Start the processes (Fabric with a ``CoDraftStrategy`` over the recipe's mesh)."""
        p = self.cfg.parallel
        strategy = CoDraftStrategy(
            dp=p.dp, pp=p.pp, cp=p.cp, sharding=p.sharding, timeout=timedelta(seconds=p.timeout_s)
        )
        self.fabric = Fabric(
            accelerator=p.accelerator,
            devices=p.devices,
            num_nodes=p.num_nodes,
            strategy=strategy,
            precision=p.precision,
        )
        self.fabric.launch()
        self.dims = self.fabric.strategy.parallel_dims
        if self.cfg.run.threads:
            torch.set_num_threads(self.cfg.run.threads)
        self.checkpoints = RunCheckpoints(self.out, self.fabric, keep=self.cfg.run.keep_checkpoints)

    def build(self) -> None:
        """Tokenizer, policy, draft, module, task, reward, reference policy and rollout worker of the recipe."""
        cfg = self.cfg
        parts = build_parts(cfg, self._given_task, self._given_rewards)
        self.tokenizer, self.context = parts.tokenizer, parts.context
        self.task, self.reward_fn = parts.task, parts.rewards
        self.module = build_module(cfg, parts)
        self.worker = RolloutWorker(cfg, self.dims, self.fabric.device, eos_token_id=self.tokenizer.eos_token_id)

    def fit_prompts(self, prompts: list[list[int]]) -> list[list[int]]:
        """``prompts`` after checking each leaves room for ``rl.max_new_tokens`` in the context."""
        return fit_prompts(prompts, self.context, self.cfg.rl.max_new_tokens)

    # ------------------------------------------------------------------ the run
    def setup(self) -> int:
        """Launch, build, warm up (or resume); returns the RL step to start from."""
        cfg = self.cfg
        self.launch()
        self.build()
        self.out.mkdir(parents=True, exist_ok=True)
        last = self.checkpoints.last() if cfg.run.resume else None
        written, changed = self.out / "config.yaml", []
        if last is not None and written.is_file():
            changed = config_changes(written, cfg)
            self.log(
                f"resuming {self.out} with {len(changed)} changed setting(s){':' if changed else ''}"
                + "".join(f"\n  {c}" for c in changed)
            )
        if last is None and self.fabric.global_rank == 0:
            write_run_config(self.out, cfg, 0, [])
        if last is None:  # warm-ups on every rank, on the whole modules (before the strategy prunes PP stages)
            self.extra = self._warm_start()
        self.worker.start(self.module)  # before the strategy prunes / shards the module
        if last is None and "eval_before" not in self.extra:
            n_eval = cfg.task.eval_prompts
            self.extra["eval_before_scores"] = self.evaluate(n_eval, per_prompt=True) if n_eval else []
            self.extra["eval_before"] = mean_of(self.extra["eval_before_scores"])
            self.log(f"held-out mean reward before RL (greedy, {n_eval} prompts): {self.extra['eval_before']:.3f}")
        if last is None:
            self.checkpoints.save_warm(self.module.policy, self.module.draft, self.extra, key=warm_key(cfg))
        self.module.set_reference_draft(
            reference_draft(cfg, self.module.draft, self.checkpoints.warm_file if last is not None else None)
        )
        self.model = self.fabric.setup_module(self.module)
        self.optimizer, self.scheduler = self.module.build_optimizer()
        self.optimizer = self.fabric.setup_optimizers(self.optimizer)
        if last is None:
            self.checkpoints.save(0, self._state(self.extra))
        else:
            self.start_step, self.extra = self.checkpoints.load(last[1], self._state())
            self.log(f"resumed from {last[1]} (step {self.start_step})")
        if self.fabric.global_rank == 0 and last is not None:  # once the checkpoint read: a failed resume leaves
            write_run_config(self.out, cfg, self.start_step, changed)  # the record as it was
        self.rl_step = RLStep(
            cfg,
            self.fabric,
            self.dims,
            self.task,
            self.reward_fn,
            self.tokenizer,
            self.context,
            self.worker,
            self.model,
            self.optimizer,
            self.scheduler,
            log=self.log,
        )
        self.rl_step.restore_schedule(self.extra.pop("draft_schedule", []))
        self.rl_step.rollouts = producer(self.rl_step, self.extra.pop("async_rollouts", None))  # None: synchronous
        if self.fabric.global_rank == 0:
            parts = [f"reward/{name}" for name in self.reward_fn.logged_parts]
            self.logger = MetricsLogger(
                self.out,
                tensorboard=cfg.run.tensorboard,
                resume_step=self.start_step,
                extra_columns=parts,
                loggers=build_loggers(cfg.run.loggers, self.out),
                completions=cfg.run.log_completions,
            )
        self.result.eval_before = float(self.extra.get("eval_before", math.nan))
        self.result.eval_before_scores = list(self.extra.get("eval_before_scores", []))
        self.steps_done = self.start_step
        return self.start_step

    def _warm_start(self) -> dict[str, Any]:
        return warm_start(self.cfg, self.module, self.tokenizer, self.task, self.context, log=self.log)

    def _state(self, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return {"module": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler, **(extra or {})}

    def step(self, step: int) -> StepMetrics:
        """Run RL step ``step`` (0-based) on every rank and return its metrics (with the held-out scores every
        ``task.eval_every`` steps)."""
        metrics = self.rl_step(step)
        self.steps_done = step + 1  # the optimizer steps the training state has taken
        t = self.cfg.task
        if t.eval_every and t.eval_prompts and (step + 1) % t.eval_every == 0:
            metrics = dataclasses.replace(
                metrics,
                eval_accuracy=self.evaluate(t.eval_prompts),
                eval_reward=self.evaluate(t.eval_prompts, self.cfg.rl.temperature),
            )
        return metrics

    def end_step(self, step: int, metrics: StepMetrics) -> None:
        """Record a finished step and checkpoint on schedule."""
        if self.cfg.draft.mode != "none":
            warning = self.watch.observe(step + 1, metrics.acceptance_length, metrics.staleness, metrics.draft_version)
            if warning is not None:
                self.log(warning)
        schedule = self.rl_step.schedule.state_dict()
        self.extra["draft_schedule"] = schedule  # a checkpoint entry: a resumed schedule continues this one
        if self.logger is not None:
            self.logger.log(metrics)
            self.logger.log_completions(step + 1, self.rl_step.last_completions)
            (self.out / "draft_schedule.jsonl").write_text("".join(json.dumps(r) + "\n" for r in schedule))
        every = self.cfg.run.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == self.cfg.rl.steps:
            if self.rl_step.rollouts is not None:  # the finished rollouts of the next steps (the one in flight too)
                self.extra["async_rollouts"] = checkpoint_entry(self.rl_step.rollouts, self.dims)
            self.checkpoints.save(step + 1, self._state(self.extra))

    def run(self, stop_after: Optional[int] = None) -> FitResult:
        """Execute the config; ``stop_after`` ends this call after that many RL steps with no final checkpoint
        and no evaluation, as a killed process would (used to test resume)."""
        cfg = self.cfg
        start = self.setup()
        bar_on = cfg.run.progress and self.fabric.global_rank == 0 and sys.stdout.isatty()  # else plain lines
        with StepProgress(cfg.rl.steps, start, enabled=bar_on) as bar:
            for done, step in enumerate(range(start, cfg.rl.steps), start=1):
                metrics = self.step(step)
                if self.fabric.global_rank == 0:
                    bar.update(metrics.as_dict())
                if stop_after is not None and done >= stop_after:
                    if self.logger is not None:
                        self.logger.log(metrics)
                    return self.finish(completed=False)
                self.end_step(step, metrics)
        return self.finish()

    # ------------------------------------------------------------------ evaluation and the summary
    def heldout_samples(self, n: int, offset: int = 0) -> list:
        """:func:`~lightning_codraft.rl.run.evaluate.heldout_samples` of this run's task."""
        return heldout_samples(self.task, self.cfg.run.seed, n, offset)

    def evaluate(
        self, n: int, temperature: float = 0.0, release: bool = True, final: bool = False, per_prompt: bool = False
    ) -> float | list[float]:
        """The mean of :func:`~lightning_codraft.rl.run.evaluate.heldout_rewards` after this run's steps, or with
        ``per_prompt`` the ``(n,)`` rewards themselves (call on every rank)."""
        updates = self.rl_step.schedule.updates if self.rl_step is not None else 0
        rollouts = self.rl_step.rollouts if self.rl_step is not None else None
        with rollouts.paused() if rollouts is not None else contextlib.nullcontext():  # the engine is ours
            scores = heldout_rewards(
                self.cfg,
                self.worker,
                self.tokenizer,
                self.task,
                self.reward_fn,
                self.steps_done,
                n,
                temperature,
                release=release,
                final=final,
                draft_updates=updates,
            )
        return scores if per_prompt else mean_of(scores)

    def finish(self, completed: bool = True) -> FitResult:
        """Close logs; when ``completed``: final evaluation, speed-up, plots and summary."""
        result = self.result
        result.completed = completed
        if self.rl_step is not None and self.rl_step.rollouts is not None:
            self.rl_step.rollouts.close()
        if self.logger is not None:
            self.logger.close()
            result.rows = self.logger.rows
        if completed:
            self._summarize(result)
        return result

    def _summarize(self, result: FitResult) -> None:
        cfg = self.cfg
        measure = cfg.draft.mode != "none" and cfg.run.measure_speedup
        if cfg.task.eval_prompts:  # the speed-up below decodes with the same weights: one refill for both
            result.eval_after_scores = self.evaluate(
                cfg.task.eval_prompts, release=not measure, final=True, per_prompt=True
            )
            result.eval_after = mean_of(result.eval_after_scores)
        if measure:  # every rank refills its copies (a collective); rank 0 measures
            result.speedup = self._measure_speedup()
        if self.fabric.global_rank != 0:
            return
        if cfg.run.plots and result.rows:
            plot_run(result.rows, self.out, cfg.draft.mode, cfg.task.name)
        r0, r1 = summarize(result.rows, "reward")
        a0, a1 = summarize(result.rows, "acceptance_length")
        lines = [
            f"reward (mean of first / last steps): {r0:.3f} -> {r1:.3f}",
            f"held-out mean reward (greedy): {result.eval_before:.3f} -> {result.eval_after:.3f}",
        ]
        if cfg.draft.mode != "none":
            lines.append(f"acceptance length (K={cfg.draft.num_speculative_tokens}): {a0:.2f} -> {a1:.2f}")
        last = result.rows[-1] if result.rows else {}
        if math.isfinite(last.get("ab_gain_low", math.nan)):
            mean = sum(r["ab_gain"] for r in result.rows if math.isfinite(r["ab_gain"])) / max(
                1, sum(math.isfinite(r["ab_gain"]) for r in result.rows)
            )
            lines.append(
                f"live A/B, implied acceptance of the co-trained draft minus the reference's: {mean:+.3f} "
                f"(95% CI {last['ab_gain_low']:+.3f} .. {last['ab_gain_high']:+.3f}; ab.png)"
            )
        if result.speedup is not None:
            s = result.speedup
            batch = cfg.parallel.engine_batch_size or s.sequences
            dtype = resolve_dtype(cfg.parallel.engine_dtype, self.fabric.device)
            lines.append(
                f"rollout speed-up with the {cfg.draft.mode} draft: {s.speedup:.2f}x "
                f"({s.spec_tokens_per_s:.0f} vs {s.plain_tokens_per_s:.0f} tokens/s without a draft, "
                f"acceptance length {s.acceptance_length:.2f}; {s.sequences} held-out sequences, batch "
                f"{min(batch, s.sequences)}, T={cfg.rl.temperature}, K={cfg.draft.num_speculative_tokens}"
                f"{', adaptive' if cfg.draft.adaptive else ''}"
                f"{', ' + dtype if dtype else ''})"
            )
        lines.append(f"outputs: {self.out} (metrics.csv, tb/, curves.png, checkpoints/)")
        summary = "\n".join(lines)
        (self.out / "summary.txt").write_text(summary + "\n")
        self.log(summary)

    def _measure_speedup(self) -> Optional[SpeedupResult]:
        """The final rollout speed-up on held-out prompts (global rank 0's; None elsewhere); every rank refills its
        engine copies first (a collective) unless the final evaluation just did."""
        cfg, tok = self.cfg, self.tokenizer
        speedup = None
        if not cfg.task.eval_prompts:
            self.worker.prepare(weight_versions(cfg, self.steps_done, self.rl_step.schedule.updates), full_verify=True)
        if self.fabric.global_rank == 0:
            samples = self.heldout_samples(cfg.rl.prompts_per_step, offset=1)
            prompts = [encode_prompt(tok, s.prompt) for s in samples for _ in range(cfg.rl.group_size)]
            speedup = measure_speedup(
                self.worker.policy,
                self.worker.draft,
                cfg.draft.num_speculative_tokens,
                prompts,
                cfg.rl.max_new_tokens,
                cfg.rl.temperature,
                cfg.rl.top_p,
                seed=cfg.run.seed + EVAL_SEED,
                stop_token_ids=[tok.eos_token_id],
                max_batch_size=cfg.parallel.engine_batch_size,
                adaptive=cfg.draft.adaptive,
                sampling=cfg.draft.sampling,
                dtype=cfg.parallel.engine_dtype,
            )
        self.fabric.barrier()
        self.worker.release()
        return speedup

    def close(self) -> None:
        """Stop engines that run processes of their own (vLLM)."""
        if self.worker is not None:
            self.worker.close()


def fit(
    cfg: CoDraftConfig,
    stop_after: Optional[int] = None,
    print_fn: Callable[[str], None] = print,
    task=None,
    rewards=None,
) -> FitResult:
    """Run the config end to end (see the module docstring); returns the :class:`FitResult`. ``task`` / ``rewards``:
    Python objects instead of the recipe's (see :class:`CoDraftRun`). A rollout engine that runs its own processes
    (vLLM) is shut down before returning, also when the run fails."""
    run = CoDraftRun(cfg, print_fn=print_fn, task=task, rewards=rewards)
    try:
        return run.run(stop_after=stop_after)
    finally:
        run.close()


def load_for_rollout(cfg: CoDraftConfig, print_fn: Callable[[str], None] = print) -> CoDraftRun:
    """A run whose models hold the last checkpoint of ``run.out_dir`` (or its warm-up weights, or fresh weights
    when neither exists), with its engine ready: for ``codraft rollout``."""
    run = CoDraftRun(cfg, print_fn=print_fn)
    run.launch()
    run.build()
    last = run.checkpoints.last()
    if last is not None:
        run.checkpoints.load(last[1], {"module": run.module}, strict=False)
        run.log(f"loaded {last[1]}")
    elif run.checkpoints.warm_file.is_file():
        RunCheckpoints.load_warm(run.checkpoints.warm_file, run.module.policy, run.module.draft)
        run.log(f"loaded {run.checkpoints.warm_file}")
    else:
        run.log(f"no checkpoint in {run.out}: generating with freshly initialised models")
    run.module.policy.eval()
    run.worker.start(run.module)  # never set up: the modules are whole on every rank
    return run
