import json
import subprocess
import sys

import pytest

from conftest import REPO
from lightning_codraft.cli import main

MICRO = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
         "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
         "sft.steps=2", "sft.batch_size=4", "draft.warm_start.steps=2", "draft.warm_start.batch_size=4", "rl.steps=2",
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
    assert "rollouts: 16 vllm engine(s), one on every rank; each of the 2 data-parallel replica(s) splits its " \
        "requests over its 8 rank(s)" in out
    assert "vLLM holds its own weights" in out


def test_dry_run_places_released_copies_under_fsdp(capsys):
    assert main(["fit", "-c", TINY, "parallel.devices=2", "parallel.cp=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollouts: 2 embedded engine(s), one on every rank" in out and "released while training" in out
    assert main(["fit", "-c", TINY, "parallel.devices=2", "parallel.cp=2", "parallel.sharding=ddp", "--dry-run"]) == 0
    assert "released while training" not in capsys.readouterr().out


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

    monkeypatch.setattr("lightning_codraft.rl.run.loop.fit", deep_failure)  # the CLI imports it when fit runs
    assert main(["fit", "--config", TINY]) == 1
    err = capsys.readouterr().err
    assert "config error" not in err and "ValueError: a shape mismatch deep inside training" in err
    assert "test_cli.py" in err and "--debug" in err and "Traceback" not in err
    assert main(["--debug", "fit", "--config", TINY]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "deep_failure" in err


CLUSTER = str(REPO / "recipes" / "qwen3-8b-cluster.yaml")


def _qwen3_stage0_parameter_bytes() -> int:
    """fp32 bytes of Qwen3-8B's embeddings + layers 0-17 over 8 FSDP2 ranks, from the HF config.json numbers."""
    V, H, I, q, kv, D = 151936, 4096, 12288, 32 * 128, 8 * 128, 128
    layer = H * q + 2 * H * kv + q * H + 3 * H * I + 2 * H + 2 * D  # q/k/v/o, MLP, two norms, q/k norms
    return 4 * (V * H + 18 * layer) // 8  # every dim divides by 8: no FSDP2 padding


def test_plan_prints_every_rank_kind_and_fits_the_cluster_recipe(capsys):
    assert main(["plan", "--config", CLUSTER]) == 0
    out = capsys.readouterr().out
    assert "world 16 = dp 2 x pp 2 x cp 4; FSDP2 over 8 ranks; precision bf16-mixed" in out
    for row in ("stage 0 (first)", "stage 1 (last)", "parameters", "AdamW state", "activations (saved for backward)",
                "engine weights (policy + draft)", "engine KV cache (16 sequences)", "TRAINING phase", "ROLLOUT phase"):
        assert row in out, row
    assert "FITS (headroom" in out and "of 80 GiB" in out


def test_plan_json_matches_the_architecture_and_its_totals(capsys):
    assert main(["plan", "--config", CLUSTER, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["device_memory"] == 80 * 2**30
    first, last = plan["ranks"]
    assert first["stages"] == [0] and last["stages"] == [1]
    assert first["bytes"]["parameters"] == _qwen3_stage0_parameter_bytes()
    assert first["in_flight"] == 2 and last["in_flight"] == 1  # 1F1B: pp - stage microbatches
    assert first["tokens_per_microbatch"] == 8704 // 4  # one document of the context per microbatch, over cp = 4
    for rank in plan["ranks"]:
        b, phase = rank["bytes"], rank["phase"]
        resident = sum(v for k, v in b.items() if phase[k] == "both")
        step = sum(v for k, v in b.items() if phase[k] == "training")
        assert rank["training_total"] == resident + max(step, b["reference_forward"], b["optimizer_step"])
        assert rank["rollout_total"] == resident + sum(v for k, v in b.items() if phase[k] == "rollout")
        assert phase["engine_weights"] == "rollout"  # vLLM sleeps during training on cuda
    assert plan["worst"]["training"] == max(r["training_total"] for r in plan["ranks"]) <= 80 * 2**30


def test_plan_against_a_smaller_device_does_not_fit_but_exits_0(capsys):
    assert main(["plan", "--config", CLUSTER, "--device-memory", "40GiB"]) == 0
    assert "DOES NOT FIT: training needs" in capsys.readouterr().out
    assert main(["plan", "--config", CLUSTER, "--json", "--device-memory", "141GB"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"] == 141 * 10**9


@pytest.mark.parametrize("value", ["80XB", "GiB", "-4GiB", "0"])
def test_plan_rejects_a_bad_device_memory(value, capsys):
    assert main(["plan", "--config", CLUSTER, f"--device-memory={value}"]) == 2
    err = capsys.readouterr().err
    assert "--device-memory" in err and repr(value) in err


@pytest.mark.parametrize("override, match", [
    ("model.config=qwen3-9b", "model.config='qwen3-9b': 'qwen3-9b' is neither a built-in architecture (qwen3-8b, "),
    ("model.config=null", "model.source='/checkpoints/Qwen3-8B' is not 'tiny'"),
    ("parallel.layers_per_stage=[30,30]", "layers_per_stage=[30, 30] must be >= 1 each and sum to the 36 layers"),
])
def test_plan_bad_config_exits_2(override, match, capsys):
    assert main(["plan", "--config", CLUSTER, override]) == 2
    assert match in capsys.readouterr().err


def test_dry_run_shows_the_memory_of_both_phases(capsys):
    assert main(["fit", "--config", CLUSTER, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank (`codraft plan` lists every term) against 80 GiB:" in out
    assert "stage 1 (last): training phase" in out and "rollout phase" in out and "  fits: worst rank needs" in out
    assert main(["fit", "--config", CLUSTER, "--dry-run", "model.config=null"]) == 0  # no config.json here
    assert "memory per rank: not planned (model.source='/checkpoints/Qwen3-8B'" in capsys.readouterr().out


def test_the_smollm2_dry_run_works_from_anywhere_without_files_outside_the_repository(tmp_path, monkeypatch, capsys):
    """The README's SmolLM2 --dry-run from a fresh clone: its GSM8K training split ships with the package."""
    from lightning_codraft.rl.tasks.gsm8k import GSM8KTask

    monkeypatch.chdir(tmp_path)  # no ../shared next to this directory
    assert main(["fit", "--config", str(REPO / "recipes" / "smollm2-135m-cpu.yaml"), "--dry-run"]) == 0, \
        capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out
    task = GSM8KTask("train", heldout=500)
    assert len(task.samples) == 7473 and task.num_train == 6973
    assert task.samples[0].answer == "72" and task.samples[0].prompt.startswith("Question: Natalia sold clips")
