import subprocess
import sys

import pytest

from conftest import REPO
from lightning_codraft.cli import main

MICRO = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
         "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
         "sft.steps=2", "sft.batch_size=4", "draft.warmup_steps=2", "draft.warmup_batch_size=4", "rl.steps=2",
         "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=10", "task.eval_prompts=2",
         "run.progress=false", "run.tensorboard=false"]
TINY = str(REPO / "recipes" / "tiny-cpu.yaml")


@pytest.mark.parametrize("recipe", ["tiny-cpu", "smollm2-135m-cpu", "qwen3-8b-cluster"])
def test_dry_run_validates_every_recipe(recipe, capsys):
    assert main(["fit", "--config", str(REPO / "recipes" / f"{recipe}.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "config OK" in out and "mesh: world" in out


def test_dry_run_reports_the_cluster_mesh(capsys):
    assert main(["fit", "-c", str(REPO / "recipes" / "qwen3-8b-cluster.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world 16 = dp 2 x pp 2 x cp 4" in out
    assert "rollouts: 2 vllm engine(s), one per data-parallel replica on its lead" in out
    assert "global ranks 0, 8" in out and "a whole copy of policy + draft, gathered from the 2 stages" in out


@pytest.mark.parametrize("override, match", [
    ("rl.stepz=3", "unknown config key 'rl.stepz'; valid keys under 'rl'"),
    ("draft.num_speculative_tokens=-1", "draft.num_speculative_tokens=-1 must be >= 0"),
])
def test_bad_config_exits_2_with_the_key(override, match, capsys):
    assert main(["fit", "--config", TINY, override, "--dry-run"]) == 2
    assert match in capsys.readouterr().err


def test_missing_config_file(capsys, tmp_path):
    assert main(["fit", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_fit_then_rollout_micro_recipe(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["fit", "--config", TINY, *MICRO, f"run.out_dir={out}"]) == 0
    text = capsys.readouterr().out
    assert "acceptance length (K=4)" in text and "rollout speed-up" in text
    assert (out / "metrics.csv").is_file() and (out / "curves.png").is_file()
    assert main(["rollout", "--config", TINY, *MICRO, f"run.out_dir={out}", "--prompt", "1+2=",
                 "--prompt", "3-1="]) == 0
    text = capsys.readouterr().out
    assert "'1+2=' ->" in text and "K=4: acceptance length" in text
    # clear errors: an empty prompt, a prompt longer than the context
    assert main(["rollout", "--config", TINY, *MICRO, f"run.out_dir={out}", "--prompt", ""]) == 2
    assert "--prompt #0 is empty" in capsys.readouterr().err
    assert main(["rollout", "--config", TINY, *MICRO, f"run.out_dir={out}", "--prompt", "1+" * 40 + "1="]) == 2
    assert "prompt 0 has 82 tokens but the context 64" in capsys.readouterr().err


def test_console_entry_point_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "lightning_codraft.cli", "fit", "--config", TINY, "--dry-run",
                        "rl.steps=7"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "GRPO: 7 steps" in r.stdout


def test_version_and_only_config_errors_say_config_error(monkeypatch, capsys):
    from lightning_codraft import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and __version__ in capsys.readouterr().out
    assert main(["fit", "--config", TINY, "rl.stepz=3"]) == 2
    assert "config error: unknown config key" in capsys.readouterr().err

    def deep_failure(cfg):
        raise ValueError("a shape mismatch deep inside training")

    monkeypatch.setattr("lightning_codraft.cli.fit", deep_failure)
    assert main(["fit", "--config", TINY]) == 1
    err = capsys.readouterr().err
    assert "config error" not in err and "ValueError: a shape mismatch deep inside training" in err
    assert "test_cli.py" in err and "--debug" in err and "Traceback" not in err
    assert main(["--debug", "fit", "--config", TINY]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "deep_failure" in err
