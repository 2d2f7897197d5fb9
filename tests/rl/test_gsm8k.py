import json

import pytest

from lightning_codraft.rl.tasks.gsm8k import EXCERPT_PATH, GSM8KTask, extract_answer, gsm8k_reward, load_gsm8k


def test_extract_answer_forms():
    assert extract_answer("so 48+24 = 72\n#### 72") == "72"
    assert extract_answer("#### 1,200") == "1200"
    assert extract_answer("The answer is $18.00.") == "18"
    assert extract_answer("it is -3 then 0.5") == "0.5"
    assert extract_answer("no number here") is None


def test_reward_on_excerpt_reference_solutions():
    samples = load_gsm8k(EXCERPT_PATH)
    assert len(samples) == 200
    for s in samples:
        assert s.prompt.startswith("Question: ") and s.prompt.endswith("Answer:")
        assert gsm8k_reward(s.prompt, s.solution, s.answer) == 1.0
    s = samples[0]
    assert gsm8k_reward(s.prompt, "I think #### 71", s.answer) == 0.0
    assert gsm8k_reward(s.prompt, "They sold 72 clips.", s.answer) == 1.0


def test_local_jsonl_and_errors(tmp_path):
    p = tmp_path / "mini.jsonl"
    p.write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    (s,) = load_gsm8k(p)
    assert s.answer == "2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "x"}) + "\n")
    with pytest.raises(ValueError, match="row 0 has no column 'question'.*its columns are \\['q'\\]"):
        load_gsm8k(bad)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_gsm8k(tmp_path / "missing.jsonl")


def test_task_sampling_is_a_function_of_the_seed():
    t = GSM8KTask(source="excerpt", limit=10)
    a = t.sample(25, seed=1)
    assert a == t.sample(25, seed=1) and a != t.sample(25, seed=2)
    assert len({x.prompt for x in a[:10]}) == 10  # a full pass before any repeat


def test_heldout_problems_are_never_drawn_for_training_and_are_a_fixed_set():
    t = GSM8KTask(source="excerpt", limit=10, heldout=3)
    tail = t.samples[7:]
    drawn = [s for seed in range(20) for s in t.sample(12, seed=seed)]
    assert {s.prompt for s in drawn} == {s.prompt for s in t.samples[:7]}  # every training problem, no held-out one
    assert t.heldout_samples(2) == tail[:2] == t.heldout_samples(2)
    with pytest.raises(ValueError, match="raise task.heldout"):
        t.heldout_samples(4)
    with pytest.raises(ValueError, match="at least one to train on"):
        GSM8KTask(source="excerpt", limit=10, heldout=10)


def test_recipe_task_holds_out_its_evaluation_prompts():
    from lightning_codraft.config import load_config
    from lightning_codraft.rl.run.build import build_task

    cfg = load_config(None, ["task.name=gsm8k", "task.eval_prompts=16"])
    assert build_task(cfg.task).heldout == 16  # null: the evaluation prompts are the held-out set
    assert build_task(load_config(None, ["task.name=gsm8k", "task.heldout=40"]).task).heldout == 40
