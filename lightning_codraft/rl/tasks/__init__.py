"""Tasks and rewards: where a run's prompts come from and how its completions are scored.

- ``arithmetic``: the built-in multi-step arithmetic task (generated on the fly) and the character tokenizer;
- ``dataset``: prompts from any data set (local files or the hub); ``gsm8k``: one configuration of it;
- ``rewards``: a recipe's rewards resolved and scored so that a failing reward is never silent;
- ``reward_funcs``: the built-in rewards, with TRL's batched signature; ``data/``: the bundled GSM8K excerpt.
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask, TaskSample, arithmetic_reward
    from lightning_codraft.rl.tasks.dataset import DatasetTask
    from lightning_codraft.rl.tasks.gsm8k import GSM8KTask, extract_answer, gsm8k_reward, load_gsm8k
    from lightning_codraft.rl.tasks.rewards import RewardError, RewardSet, resolve_reward, score_completions

_LAZY = {
    "ArithmeticTask": "lightning_codraft.rl.tasks.arithmetic",
    "TaskSample": "lightning_codraft.rl.tasks.arithmetic",
    "arithmetic_reward": "lightning_codraft.rl.tasks.arithmetic",
    "DatasetTask": "lightning_codraft.rl.tasks.dataset",
    "GSM8KTask": "lightning_codraft.rl.tasks.gsm8k",
    "load_gsm8k": "lightning_codraft.rl.tasks.gsm8k",
    "extract_answer": "lightning_codraft.rl.tasks.gsm8k",
    "gsm8k_reward": "lightning_codraft.rl.tasks.gsm8k",
    "RewardSet": "lightning_codraft.rl.tasks.rewards",
    "resolve_reward": "lightning_codraft.rl.tasks.rewards",
    "score_completions": "lightning_codraft.rl.tasks.rewards",
    "RewardError": "lightning_codraft.rl.tasks.rewards",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
