import random

import pytest

from lightning_codraft.models.tokenizer import CharTokenizer
from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask, arithmetic_reward


def test_arithmetic_solutions_are_correct_and_deterministic():
    task = ArithmeticTask(min_terms=2, max_terms=4, max_operand=9)
    a, b = task.sample(50, seed=3), task.sample(50, seed=3)
    assert a == b
    assert a != task.sample(50, seed=4)
    for s in a:
        expr = s.prompt.rstrip("=")
        assert str(eval(expr)) == s.answer  # noqa: S307 - the expression is digits and +/- only
        assert task.reward(s.prompt, s.solution, s.answer) == 1.0
        # every worked step is a true equation
        for step in s.solution.split("#")[0].split(","):
            lhs, rhs = step.split("=")
            assert eval(lhs) == int(rhs)  # noqa: S307


def test_arithmetic_reward_is_exact():
    assert arithmetic_reward("1+2=", "1+2=3#3", "3") == 1.0
    assert arithmetic_reward("1+2=", "1+2=3#33", "3") == 0.0
    assert arithmetic_reward("1-5=", "1-5=-4#-4", "-4") == 1.0
    assert arithmetic_reward("1-5=", "1-5=-4#4", "-4") == 0.0
    assert arithmetic_reward("1+2=", "1+2=3", "3") == 0.0  # no '#': no answer


def test_task_rejects_bad_config():
    with pytest.raises(ValueError, match="min_terms"):
        ArithmeticTask(min_terms=1)
    with pytest.raises(ValueError, match="max_operand"):
        ArithmeticTask(max_operand=0)


def test_char_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    task = ArithmeticTask(max_terms=4, max_operand=20)
    for s in task.sample(20, seed=0):
        text = s.prompt + s.solution
        ids = tok.encode(text)
        assert min(ids) >= 3 and max(ids) < tok.vocab_size
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.eos_token_id] + tok.encode("99")) == text
    with pytest.raises(ValueError, match="'~'"):
        tok.encode("1~2")
    rng = random.Random(0)
    assert tok.decode([tok.pad_token_id, tok.bos_token_id] + tok.encode("12")) == "12"
    assert len({tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}) == 3 and rng is not None


def test_solution_styles_mix_and_the_reward_can_require_one():
    from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask, solution_style

    task = ArithmeticTask(styles=("symbols", "words"), style_weights=(0.75, 0.25), required_style="words")
    samples = task.sample(400, seed=3)
    styles = [solution_style(s.solution) for s in samples]
    assert set(styles) == {"symbols", "words"} and 0.18 < styles.count("words") / 400 < 0.32
    for s, st in zip(samples, styles):  # every solution is correct; only the required style scores
        assert task.reward(s.prompt, s.solution, s.answer) == (1.0 if st == "words" else 0.0)
    w = next(s for s, st in zip(samples, styles) if st == "words")
    assert " is " in w.solution and ("plus" in w.solution or "minus" in w.solution)
    assert task.reward(w.prompt, w.solution.replace(f"#{w.answer}", "#999"), w.answer) == 0.0  # wrong answer
    assert solution_style("3+4=7 and 7#7") is None and solution_style("3 plus 4 is 7#7") == "words"
    # one style: the prompts, answers and solutions of the plain task (same random stream)
    plain, one = ArithmeticTask().sample(20, seed=1), ArithmeticTask(styles=("symbols",)).sample(20, seed=1)
    assert plain == one
    with pytest.raises(ValueError, match="one of"):
        ArithmeticTask(styles=("prose",))
    with pytest.raises(ValueError, match="one weight >= 0 per style"):
        ArithmeticTask(styles=("symbols", "words"), style_weights=(1.0,))


def test_style_config_errors_name_the_key():
    from lightning_codraft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="task.styles / required_style: 'prose' is not one of"):
        load_config(None, ["task.required_style=prose"])
    with pytest.raises(ConfigError, match="task.style_weights"):
        load_config(None, ["task.styles=[symbols,words]", "task.style_weights=[1.0]"])
