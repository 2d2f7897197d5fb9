"""Evaluation helpers of the RL loop: greedy task accuracy, and the rollout speed-up of the draft.

Both run the embedded :class:`~lightning_codraft.rollout.embedded.speculative.SpeculativeEngine` on the given modules
(no copies). The speed-up is measured side by side in one call: plain decoding and speculative decoding
on the same prompts, sampling settings and seed, the faster of two repeats of each (interleaved).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_codraft.drafters import drafter_kind
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rl.rollout_worker import rollout_seed
from lightning_codraft.rl.step import weight_versions
from lightning_codraft.rl.tasks.arithmetic import RewardFn, TaskSample
from lightning_codraft.rl.tasks.rewards import RewardSet, as_reward_set
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutOutput


def sample_rewards(
    outputs: Sequence[RolloutOutput],
    tokenizer,
    samples: Sequence[TaskSample],
    reward_fn: RewardFn | RewardSet,
    on_error: str = "raise",
) -> list[float]:
    """``(N,)`` the reward of each completion ``outputs[i]`` of ``samples[i]`` (NaN where it failed under
    ``on_error="skip"``)."""
    if not samples:
        return []
    texts = [tokenizer.decode(o.token_ids) for o in outputs]
    scores = as_reward_set(reward_fn).score([s.prompt for s in samples], texts, samples)
    if scores.failures and on_error == "raise":
        raise scores.failures[0]
    return list(scores.total)


def mean_of(rewards: Sequence[float]) -> float:
    """The mean of the rewards that did not fail (NaN when none is left)."""
    ok = [r for r in rewards if math.isfinite(r)]
    return sum(ok) / len(ok) if ok else float("nan")


def mean_reward(
    outputs: Sequence[RolloutOutput],
    tokenizer,
    samples: Sequence[TaskSample],
    reward_fn: RewardFn | RewardSet,
    on_error: str = "raise",
) -> float:
    """Mean reward of the completions ``outputs`` of ``samples`` (greedy ones: the greedy accuracy; decode them
    with any engine, e.g. ``RolloutWorker.generate(..., temperature=0.0)``). With ``on_error="skip"`` the mean is
    over the samples whose reward did not fail (NaN when all did)."""
    return mean_of(sample_rewards(outputs, tokenizer, samples, reward_fn, on_error))


EVAL_SEED = 10**6
"""Seed offset of the held-out evaluation prompts (the training steps never use it)."""
VALIDATION_OFFSET = 10**5
"""``task.eval_set: validation`` draws its prompts at this offset from the held-out set's seed (no run seed reaches
it, so no seed's validation set is another seed's held-out set)."""


def heldout_samples(task, seed: int, n: int, offset: int = 0) -> list[TaskSample]:
    """``n`` fixed problems no step trains on: the task's reserved rows when it has them (``task.heldout``; at most
    that many), else draws of a generated task under an evaluation seed (``offset`` picks another draw)."""
    if getattr(task, "heldout", 0):
        return task.heldout_samples(min(n, task.heldout))
    return task.sample(n, seed=seed + EVAL_SEED + offset)


def heldout_rewards(
    cfg,
    worker,
    tokenizer,
    task,
    rewards,
    steps_done: int,
    n: int,
    temperature: float = 0.0,
    release: bool = True,
    final: bool = False,
    draft_updates: int | None = None,
) -> list[float]:
    """``(n,)`` the reward of each of the ``n`` fixed held-out prompts (or validation prompts: ``task.eval_set``) at
    ``temperature`` (0: greedy, the accuracy for a 0/1 reward; else one sample per prompt with fixed seeds) with the
    weights after ``steps_done`` optimizer steps, every rank of the world decoding a share through ``worker`` (an
    ``rl.rollout_worker.RolloutWorker``; call on every rank); the same values on every rank. ``release=False`` leaves the engine's weights filled for a measurement that follows; ``final``: the run's
    last refit, fully verified; ``draft_updates``: the steps that trained the draft (the schedule's count)."""
    samples = heldout_samples(task, cfg.run.seed, n, VALIDATION_OFFSET if cfg.task.eval_set == "validation" else 0)
    prompts = [encode_prompt(tokenizer, s.prompt) for s in samples]
    seeds = [rollout_seed(cfg.run.seed, EVAL_SEED, i, 0) for i in range(len(prompts))]
    worker.prepare(weight_versions(cfg, steps_done, draft_updates), full_verify=final)
    worker.policy.eval()
    outs, _, _ = worker.generate(prompts, seeds, temperature=temperature, group="world")
    if release:
        worker.release()
    return sample_rewards(outs, tokenizer, samples, rewards, on_error=cfg.task.on_reward_error)


@dataclass
class SpeedupResult:
    """Plain vs speculative decoding of the same requests.

    Attributes:
        plain_tokens_per_s: generated tokens per second without the draft.
        spec_tokens_per_s: generated tokens per second with the draft (K tokens per round).
        speedup: ``spec_tokens_per_s / plain_tokens_per_s``.
        acceptance_length: mean tokens per verification round of the speculative run.
        plain_s: seconds of the plain run; spec_s: seconds of the speculative run.
        sequences: requests decoded by each run.
    """

    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    acceptance_length: float
    plain_s: float
    spec_s: float
    sequences: int = 0


def _timed(engine, prompts, max_new_tokens, temperature, top_p, seed, stop):
    t0 = time.perf_counter()
    outs = engine.generate(
        prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_token_ids=stop
    )
    dt = time.perf_counter() - t0
    return dt, sum(len(o.token_ids) for o in outs), AcceptanceStats.total(o.stats for o in outs)


def measure_speedup(
    policy,
    draft,
    num_speculative_tokens: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    stop_token_ids: Sequence[int],
    repeats: int = 3,
    max_batch_size: int | None = None,
    adaptive: bool = False,
    sampling: str = "coupled",
    dtype: str | None = None,
) -> SpeedupResult:
    """Tokens/s of plain vs speculative decoding of ``prompts`` (best of ``repeats``, runs interleaved), both
    engines decoding ``max_batch_size`` sequences at a time (None: all together) in ``dtype`` (None: the
    weights')."""
    plain = SpeculativeEngine(policy, None, 0, max_batch_size=max_batch_size, sampling=sampling, dtype=dtype)
    spec = drafter_kind(draft).engine(  # the drafter's own engine (EAGLE-3's, the block engine)
        policy,
        draft,
        num_speculative_tokens,
        max_batch_size=max_batch_size,
        adaptive=adaptive,
        sampling=sampling,
        dtype=dtype,
    )
    best_p = best_s = None
    for _ in range(max(1, repeats)):
        p = _timed(plain, prompts, max_new_tokens, temperature, top_p, seed, stop_token_ids)
        s = _timed(spec, prompts, max_new_tokens, temperature, top_p, seed, stop_token_ids)
        best_p = p if best_p is None or p[1] / p[0] > best_p[1] / best_p[0] else best_p
        best_s = s if best_s is None or s[1] / s[0] > best_s[1] / best_s[0] else best_s
    ptps, stps = best_p[1] / best_p[0], best_s[1] / best_s[0]
    return SpeedupResult(
        plain_tokens_per_s=ptps,
        spec_tokens_per_s=stps,
        speedup=stps / ptps,
        acceptance_length=best_s[2].acceptance_length,
        plain_s=best_p[0],
        spec_s=best_s[0],
        sequences=len(prompts),
    )
