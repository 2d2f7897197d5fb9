"""RL post-training with an online co-trained draft: tasks and rewards, experience packing, the loop.

Public names (imported lazily so ``import lightning_codraft.rl`` stays light)::

    ArithmeticTask, TaskSample, arithmetic_reward                     # rl.tasks
    GSM8KTask, load_gsm8k, extract_answer, gsm8k_reward                # rl.gsm8k
    resolve_reward, score_completions, RewardError                     # rl.rewards
    Rollout, group_advantages, build_rl_batch                          # rl.experience
    fit, CoDraftRun, FitResult                                         # rl.loop
    compare_arms, write_report                                         # rl.compare
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.rl.compare import compare_arms, write_report
    from lightning_codraft.rl.experience import Rollout, build_rl_batch, group_advantages
    from lightning_codraft.rl.gsm8k import GSM8KTask, extract_answer, gsm8k_reward, load_gsm8k
    from lightning_codraft.rl.loop import CoDraftRun, FitResult, fit
    from lightning_codraft.rl.rewards import RewardError, resolve_reward, score_completions
    from lightning_codraft.rl.tasks import ArithmeticTask, TaskSample, arithmetic_reward

_LAZY = {
    "ArithmeticTask": "lightning_codraft.rl.tasks",
    "TaskSample": "lightning_codraft.rl.tasks",
    "arithmetic_reward": "lightning_codraft.rl.tasks",
    "GSM8KTask": "lightning_codraft.rl.gsm8k",
    "load_gsm8k": "lightning_codraft.rl.gsm8k",
    "extract_answer": "lightning_codraft.rl.gsm8k",
    "gsm8k_reward": "lightning_codraft.rl.gsm8k",
    "resolve_reward": "lightning_codraft.rl.rewards",
    "score_completions": "lightning_codraft.rl.rewards",
    "RewardError": "lightning_codraft.rl.rewards",
    "Rollout": "lightning_codraft.rl.experience",
    "group_advantages": "lightning_codraft.rl.experience",
    "build_rl_batch": "lightning_codraft.rl.experience",
    "fit": "lightning_codraft.rl.loop",
    "CoDraftRun": "lightning_codraft.rl.loop",
    "FitResult": "lightning_codraft.rl.loop",
    "compare_arms": "lightning_codraft.rl.compare",
    "write_report": "lightning_codraft.rl.compare",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
