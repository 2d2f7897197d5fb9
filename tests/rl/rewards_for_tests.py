"""Reward callables addressed by dotted path from the loop / CLI tests."""

from lightning_codraft.rl.tasks.arithmetic import arithmetic_reward


def flaky_reward(prompt: str, completion: str, answer: str) -> float:
    """The arithmetic reward, except that it raises on prompts whose first operand is 7."""
    if prompt.startswith("7"):
        raise ZeroDivisionError(f"cannot score {prompt}")
    return arithmetic_reward(prompt, completion, answer)


def digit_share_reward(prompt: str, completion: str, answer: str) -> float:
    """The share of digits among the completion's characters: a reward in [0, 1] that differs between the
    samples of an untrained policy, so group advantages (and policy gradients) are not all zero."""
    return sum(c.isdigit() for c in completion) / max(1, len(completion))


def batched_reward(prompts, completions, answer):
    """A TRL-style batched reward (lists in, a list out) plugged in where a per-sample reward is expected."""
    return [float(c == a) for c, a in zip(completions, answer)]


def nan_reward(prompt: str, completion: str, answer: str) -> float:
    """A reward that returns NaN (e.g. 0 / 0 in a user's shaping term)."""
    return float("nan")


def two_args_reward(text, other):
    """A reward with a signature the loop cannot call (neither TRL's nor per-sample)."""
    return 1.0


def scaled_length(prompts, completions, scale: float = 1.0, **columns):
    """A batched reward with one option (``scale``)."""
    return [scale * len(c) for c in completions]


def digit_share_batched(prompts, completions, **columns):
    """:func:`digit_share_reward` with TRL's batched signature."""
    return [digit_share_reward(p, c, "") for p, c in zip(prompts, completions)]


def batch_only_reward(prompts, completions, **columns):
    """Scores one sample at a time, raises on a batch (an API limit, a batch normalisation bug)."""
    if len(completions) > 1:
        raise RuntimeError(f"rate limit: {len(completions)} requests in one call")
    return [digit_share_reward(p, c, "") for p, c in zip(prompts, completions)]


def never_applies(prompts, completions, **columns):
    """TRL's "does not apply" for every sample."""
    return [None] * len(completions)


def conversational_only(prompts, completions, answer, **columns):
    """Scores as TRL's conversational rewards do, and refuses anything else: the prompts are message lists and each
    completion is ``[{"role": "assistant", "content": text}]``."""
    for p, c in zip(prompts, completions):
        if not (isinstance(p, list) and isinstance(c, list) and c[0]["role"] == "assistant"):
            raise TypeError(f"not TRL's conversational form: prompt {p!r}, completion {c!r}")
    return [float(answer[i] in c[0]["content"]) for i, c in enumerate(completions)]
