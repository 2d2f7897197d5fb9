"""RL post-training with an online co-trained draft.

The tree says what it owns: the step at the top (``step``: one RL step; ``experience``: advantages and packing;
``rollout_worker``: the engines and their refit; ``draft_schedule``: when the draft trains), ``tasks/`` (prompts
and rewards), ``run/`` (the two front ends, Fabric and Trainer, and what they share) and ``reports/`` (what a run
logs, and how runs compare).

Public names (imported lazily so ``import lightning_codraft.rl`` stays light)::

    ArithmeticTask, TaskSample, arithmetic_reward                     # rl.tasks.arithmetic
    GSM8KTask, load_gsm8k, extract_answer, gsm8k_reward                # rl.tasks.gsm8k
    resolve_reward, score_completions, RewardError                     # rl.tasks.rewards
    Rollout, group_advantages, build_rl_batch                          # rl.experience
    fit, CoDraftRun, FitResult                                         # rl.run.loop
    compare_arms, write_report                                         # rl.reports.compare
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.rl.experience import Rollout, build_rl_batch, group_advantages
    from lightning_codraft.rl.reports.compare import compare_arms, write_report
    from lightning_codraft.rl.run.loop import CoDraftRun, FitResult, fit
    from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask, TaskSample, arithmetic_reward
    from lightning_codraft.rl.tasks.gsm8k import GSM8KTask, extract_answer, gsm8k_reward, load_gsm8k
    from lightning_codraft.rl.tasks.rewards import RewardError, resolve_reward, score_completions

_LAZY = {
    "ArithmeticTask": "lightning_codraft.rl.tasks.arithmetic",
    "TaskSample": "lightning_codraft.rl.tasks.arithmetic",
    "arithmetic_reward": "lightning_codraft.rl.tasks.arithmetic",
    "GSM8KTask": "lightning_codraft.rl.tasks.gsm8k",
    "load_gsm8k": "lightning_codraft.rl.tasks.gsm8k",
    "extract_answer": "lightning_codraft.rl.tasks.gsm8k",
    "gsm8k_reward": "lightning_codraft.rl.tasks.gsm8k",
    "resolve_reward": "lightning_codraft.rl.tasks.rewards",
    "score_completions": "lightning_codraft.rl.tasks.rewards",
    "RewardError": "lightning_codraft.rl.tasks.rewards",
    "Rollout": "lightning_codraft.rl.experience",
    "group_advantages": "lightning_codraft.rl.experience",
    "build_rl_batch": "lightning_codraft.rl.experience",
    "fit": "lightning_codraft.rl.run.loop",
    "CoDraftRun": "lightning_codraft.rl.run.loop",
    "FitResult": "lightning_codraft.rl.run.loop",
    "compare_arms": "lightning_codraft.rl.reports.compare",
    "write_report": "lightning_codraft.rl.reports.compare",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
