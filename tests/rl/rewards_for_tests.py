"""Reward callables addressed by dotted path from the loop / CLI tests."""

from lightning_codraft.rl.tasks import arithmetic_reward


def flaky_reward(prompt: str, completion: str, answer: str) -> float:
    """The arithmetic reward, except that it raises on prompts whose first operand is 7."""
    if prompt.startswith("7"):
        raise ZeroDivisionError(f"cannot score {prompt}")
    return arithmetic_reward(prompt, completion, answer)


def digit_share_reward(prompt: str, completion: str, answer: str) -> float:
    """The share of digits among the completion's characters: a reward in [0, 1] that differs between the
    samples of an untrained policy, so group advantages (and policy gradients) are not all zero."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))
