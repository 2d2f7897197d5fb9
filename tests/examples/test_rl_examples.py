"""The RL examples a user copies run at tiny size: a custom JSONL task with two weighted rewards under Trainer.fit
(each reward's mean in the logger's metrics), and GSM8K through datasets with the math reward (slow: SmolLM2)."""

import csv
import importlib.util
import json

import pytest

from conftest import REPO

TINY = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
        "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
        "draft.warm_start.steps=2", "draft.warm_start.batch_size=4", "rl.steps=2", "rl.prompts_per_step=2",
        "rl.group_size=2", "rl.max_new_tokens=8", "task.eval_prompts=0", "run.progress=false"]


def _example(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_custom_jsonl_task_with_two_weighted_rewards_in_trainer_fit(tmp_path):
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {a} plus {b}", "answer": str(a + b)}) + "\n"
                            for a in range(5) for b in range(4)))
    trainer = _example("custom_task").main(str(data), *TINY, f"run.out_dir={tmp_path / 'run'}")
    assert trainer.global_step == 2
    rows = [r for r in _rows(tmp_path / "run" / "lightning_logs" / "version_0" / "metrics.csv") if r["reward"]]
    assert len(rows) == 2
    for r in rows:
        correct, brevity = float(r["reward/correct"]), float(r["reward/brevity"])
        assert 0 <= correct <= 1 and 0 <= brevity <= 1
        assert float(r["reward"]) == pytest.approx(correct + 0.2 * brevity, abs=1e-6)


@pytest.mark.slow
def test_gsm8k_with_the_math_reward_in_trainer_fit(tmp_path):
    module = _example("grpo_trainer").main([
        "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8", "draft.warm_start.corpus=null",
        "draft.warm_start.steps=0", "task.eval_prompts=2", "task.eval_every=1", f"run.out_dir={tmp_path}"])
    rows = _rows(tmp_path / "version_0" / "metrics.csv")
    assert any(r.get("reward/correct") for r in rows) and any(r.get("eval_accuracy") for r in rows)
    assert module.cfg.task.name == "gsm8k" and (tmp_path / "checkpoints" / "last.ckpt").is_dir()
