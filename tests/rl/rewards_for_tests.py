"""Reward callables addressed by dotted path from the loop / CLI tests."""

from lightning_codraft.rl.tasks import arithmetic_reward


def flaky_reward(prompt: str, completion: str, answer: str) -> float:
    """The arithmetic reward, except that it raises on prompts whose first operand is 7."""
    if prompt.startswith("7"):
        raise ZeroDivisionError(f"cannot score {prompt}")
    return arithmetic_reward(prompt, completion, answer)
