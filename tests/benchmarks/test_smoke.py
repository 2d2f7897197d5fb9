"""Every benchmark script runs end to end with tiny arguments and writes its table, so none can rot unnoticed."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO


# what an in-process Fabric run of an earlier test may leave in this process's environment (its rendezvous port is
# still bound here): a benchmark started as a fresh process must pick its own
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "GROUP_RANK")


def _run(script, *args, timeout=600):
    """Run ``benchmarks/<script>`` (or, for ``-m module``, that module) with ``args``; return its stdout."""
    target = script.split() if script.startswith("-m ") else [str(REPO / "benchmarks" / script)]
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    out = subprocess.run([sys.executable, *target, *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def test_gpu_check_smoke(tmp_path):
    text = _run("gpu_check.py", "--smoke", "--out", tmp_path)
    assert "| self, packed | cpu |" in text and "bf16-mixed co-training step" in text
    md = (tmp_path / "gpu.md").read_text()
    assert "CPU (smoke run: no GPU)" in md and "| True |" in md


def test_pp_tapchannel_smoke(tmp_path):
    text = _run("pp_tapchannel.py", "--stages", 2, "--layers", 4, "--hidden", 64, "--vocab", 128, "--tokens", 32,
                "--microbatches", 2, "--rounds", 1, "--out", tmp_path)
    assert "| tapchannel |" in text and (tmp_path / "pp.md").is_file()


@pytest.mark.parametrize("script, args", [
    ("codraft_step.py", ["--layers", 4, "--hidden", 32, "--vocab", 128, "--docs", 2, "--length", 16, "--rounds", 1,
                         "--threads", 1]),
])
def test_benchmark_smoke(tmp_path, script, args):
    _run(script, *args, "--out", tmp_path)
    assert list(tmp_path.glob("*.md"))


def test_rollout_scale_smoke(tmp_path):
    text = _run("rollout_scale.py", "--worlds", "1,2", "--prompts", 2, "--group-size", 2, "--max-new-tokens", 8,
                "--rounds", 1, "--out", tmp_path, "--recipe-overrides", "sft.steps=2", "draft.warm_start.steps=2")
    assert "| 2 | pp=2 | every rank |" in text and "[2, 2]" in text  # both ranks decoded a share
    assert "token for token" in (tmp_path / "rollout_scale.md").read_text()


_TINY_RL = ["sft.steps=2", "draft.warm_start.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8",
            "task.eval_prompts=2", "task.eval_every=2"]


def test_drift_smoke(tmp_path):
    text = _run("drift.py", "--out", tmp_path, "--name", "d", f"run.out_dir={tmp_path / 'run'}", "rl.steps=4", *_TINY_RL)
    assert "frozen draft's acceptance falls" in text and "co-trained draft |" in text
    md = (tmp_path / "d.md").read_text()
    assert "Goals (issue #15)" in md and "| step |" in md and (tmp_path / "d_curves.png").is_file()


def test_drift_dflash_smoke(tmp_path):
    text = _run("drift.py", "--dflash", 4, "--out", tmp_path, "--name", "f", f"run.out_dir={tmp_path / 'run'}",
                "rl.steps=4", *_TINY_RL)
    assert "co-trained DFlash (B=4) |" in text and "frozen EAGLE-3 |" in text
    md = (tmp_path / "f.md").read_text()
    assert "paired co-trained - frozen DFlash acceptance" in md and (tmp_path / "f_curves.png").is_file()


def test_drift_dspark_smoke(tmp_path):
    text = _run("drift.py", "--dspark", 3, "--out", tmp_path, "--name", "s", f"run.out_dir={tmp_path / 'run'}",
                "rl.steps=4", *_TINY_RL)
    assert "co-trained DSpark (B=3) |" in text and "frozen DSpark (B=3) |" in text
    md = (tmp_path / "s.md").read_text()
    assert "paired co-trained - frozen DSpark acceptance" in md and "Calibration per step" in md
    assert "predicted - measured acceptance" in md and (tmp_path / "s_curves.png").is_file()


def test_drift_ablation_smoke(tmp_path):
    text = _run("drift.py", "--ablation", "--out", tmp_path, "--name", "a", f"run.out_dir={tmp_path / 'run'}",
                "rl.steps=4", *_TINY_RL)
    assert "| every 4 steps |" in text and "| lambda = 10 |" in text and "| draft lr / 3 |" in text
    assert (tmp_path / "a.md").is_file()


def test_rollout_smoke(tmp_path):
    text = _run("rollout.py", "--models", "tiny", "--batch-sizes", "1,2", "--temperatures", 1, "--max-new-tokens", 8,
                "--repeats", 1, "--min-cpu-s", 0, "--long-tail-batch", 2, "--out", tmp_path,
                "--work-dir", tmp_path / "work",
                "--tiny-overrides", "sft.steps=2", "draft.warm_start.steps=2")
    assert "adaptive / max(no draft, fixed K=4)" in text and "LOSSLESSNESS" not in text
    md = (tmp_path / "rollout.md").read_text()
    assert "identical in every cell" in md and "## Goals (issue #14)" in md and "| tiny | 2 | 1 |" in md
    assert "## Long tail" in md and (tmp_path / "rollout.png").is_file()
    findings = tmp_path / "findings.md"                 # the report rebuilt from its JSON, with findings
    findings.write_text("- a finding")
    _run("rollout.py", "--report-only", tmp_path / "rollout.json", "--findings", findings, "--out", tmp_path / "again")
    again = (tmp_path / "again" / "rollout.md").read_text()
    assert "each run's `--min-cpu-s`" in again and "## Findings\n\n- a finding" in again
    assert "| tiny | 2 | 1 |" in again and "Command: `python " in again
    # the long tail's bound from the same run's speed-ups (and the same warm weights)
    text = _run("long_tail_bound.py", "--model", "tiny", "--speedups", tmp_path / "rollout.json", "--long-tail-batch",
                2, "--repeats", 1, "--ks", "1,2", "--block-rounds", 2, "--out", tmp_path / "bound",
                "--work-dir", tmp_path / "work", "--tiny-overrides", "sft.steps=2", "draft.warm_start.steps=2")
    assert "Bound on the whole batch" in text and "blocks at the full width (B=2, fixed k" in text
    res = json.loads((tmp_path / "bound" / "long_tail_bound.json").read_text())
    best = res["best"].values()
    assert min(best) >= 1.0 and 1.0 <= res["bound"] <= max(best) + 1e-9   # no width gains more than its best cell
    assert 0 < sum(res["profile"]["by_width_s"].values()) <= res["profile"]["total_s"]
    assert [b["k"] for b in res["blocks"]] == [0, 1, 2] and (tmp_path / "bound" / "long_tail_bound.png").is_file()


def test_rollout_smoke_in_bfloat16(tmp_path):
    """--dtype bfloat16: every arm decodes a bf16 copy; sequences that diverge from plain bf16 decoding at a near-tie
    are counted in the report, not failed."""
    text = _run("rollout.py", "--models", "tiny", "--batch-sizes", "2", "--temperatures", 0, "--max-new-tokens", 8,
                "--repeats", 1, "--min-cpu-s", 0, "--long-tail-batch", 0, "--out", tmp_path, "--dtype", "bfloat16",
                "--work-dir", tmp_path / "work", "--tiny-overrides", "sft.steps=2", "draft.warm_start.steps=2")
    assert "tiny bfloat16" in text and "LOSSLESSNESS" not in text
    md = (tmp_path / "rollout.md").read_text()
    assert "decoding in bfloat16" in md and "| tiny bfloat16 | 2 | 0 |" in md
    assert "compared sequences continue differently from plain decoding" in md


def test_rl_seeds_smoke(tmp_path):
    text = _run("rl_seeds.py", "--seeds", 0, 1, 2, "--out", tmp_path, "--runs", tmp_path / "runs", "--eval-every", 1,
                "--settings", "recipe", "--setting", "lr x2:rl.lr=1e-4", "model.num_hidden_layers=4", "sft.steps=2",
                "draft.warm_start.steps=2", "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2",
                "rl.max_new_tokens=8", "task.eval_prompts=4")
    assert "paired over 3 seeds" in text and "| lr x2 | `rl.lr=1e-4` |" in text
    md = (tmp_path / "rl_heldout.md").read_text()
    assert "| mean ± sd [min, max] |" in md and "| recipe | `(as shipped)` |" in md
    assert (tmp_path / "rl_heldout.png").is_file()
    assert len(list((tmp_path / "runs").glob("seed*/*/heldout.json"))) == 9  # 3 seeds x (main job + 2 settings)


def test_codraft_bench_smoke(tmp_path):
    """``codraft bench`` (no draft vs frozen vs co-trained, same seeds) writes the page docs/benchmarks/rl.md cites."""
    text = _run("-m lightning_codraft.cli", "bench", "--config", REPO / "recipes" / "tiny-cpu.yaml", "--out", tmp_path,
                f"run.out_dir={tmp_path / 'run'}", "rl.steps=2", "model.num_hidden_layers=4", *_TINY_RL)
    assert "| no draft |" in text and "| frozen draft |" in text and "| co-trained draft |" in text
    assert "| co-trained draft |" in (tmp_path / "codraft_vs_frozen.md").read_text()
    assert (tmp_path / "codraft_vs_frozen_curves.png").is_file()


def test_cp_attention_smoke(tmp_path):
    text = _run("cp_attention.py", "--lengths", 64, "--cp", 1, 2, "--K", 2, "--heads", 2, "--kv-heads", 1,
                "--head-dim", 8, "--doc-tokens", 32, "--threads", 1, "--out", tmp_path)
    assert "cp=2" in text
    md = (tmp_path / "cp.md").read_text()
    assert "| 0.0625K | 1 |" in md and "| 0.0625K | 2 |" in md and "ours vs dupkeys" in md
    assert (tmp_path / "cp.png").is_file()


def test_draft_warmstart_smoke(tmp_path):
    text = _run("draft_warmstart.py", "--smoke", "--out-dir", tmp_path, "--cache-dir", tmp_path / "cache")
    assert "acceptance length" in text and "cache hit" in text
    res = (tmp_path / "draft_warmstart.json").read_text()
    assert '"cache_hit_same": true' in res and (tmp_path / "draft_warmstart.md").is_file()
    assert "## Against the goal: acceptance >= 2.0" in (tmp_path / "draft_warmstart.md").read_text()
    assert "| proposal temperature calibration | scale" in (tmp_path / "draft_warmstart.md").read_text()
    assert "with rejection sampling (per position" in (tmp_path / "draft_warmstart.md").read_text()
    assert '"final_acceptance_rejection"' in res
    again = tmp_path / "again"                   # the page rebuilt from the JSON, an earlier run beside it
    _run("draft_warmstart.py", "--report-only", tmp_path / "draft_warmstart.json", "--previous",
         tmp_path / "draft_warmstart.json", "--out-dir", again)
    md = (again / "draft_warmstart.md").read_text()
    assert "| this run |" in md and "| draft_warmstart |" in md and (again / "draft_warmstart.png").is_file()


def test_draft_calibration_smoke(tmp_path):
    text = _run("draft_calibration.py", "--smoke", "--out-dir", tmp_path, "--cache-dir", tmp_path / "cache")
    assert "| 1" in text and "engine acceptance length" in text and "Chosen scale" in text
    res = json.loads((tmp_path / "draft_calibration.json").read_text())
    assert res["arms"][0]["scale"] == 1.0 and {a["scale"] for a in res["arms"]} >= {1.0, 0.5}
    assert len(res["calibration"]["acceptance"]) == len(res["calibration"]["scales"]) >= 7
    assert (tmp_path / "draft_calibration.md").is_file() and (tmp_path / "draft_calibration.png").is_file()



def test_draft_fit_ablation_smoke(tmp_path):
    text = _run("draft_fit_ablation.py", "--smoke", "--out-dir", tmp_path, "--cache-dir", tmp_path / "cache")
    assert "| `ttt_steps=2` |" in text and "| `ttt_steps=1` |" in text and "engine acceptance" in text
    res = json.loads((tmp_path / "draft_fit_ablation.json").read_text())
    assert [a["arm"] for a in res["arms"]] == ["ttt_steps=2", "ttt_steps=1"]
    assert all(len(a["val_accuracy"]) == res["k"] and a["steps"] >= 1 for a in res["arms"])  # reports unroll K
    assert res["unroll_timing"]["batches"] == 2 and "every row (prompt rows included)" in text
    assert (tmp_path / "draft_fit_ablation.md").is_file() and (tmp_path / "draft_fit_ablation.png").is_file()


def test_draft_fit_ablation_of_the_losses_at_the_same_steps_smoke(tmp_path):
    """The SmolLM2 loss comparison's form: loss arms, no wall-time budget (every arm the same epochs)."""
    text = _run("draft_fit_ablation.py", "--smoke", "--out-dir", tmp_path, "--cache-dir", tmp_path / "cache",
                "--budget-min", 0, "--arms", "loss_type=ce,epochs=1", "loss_type=tv,epochs=1")
    res = json.loads((tmp_path / "draft_fit_ablation.json").read_text())
    assert [a["arm"] for a in res["arms"]] == ["loss_type=ce,epochs=1", "loss_type=tv,epochs=1"]
    assert res["arms"][0]["steps"] == res["arms"][1]["steps"] >= 1 and "same fit steps" in text

def test_recipe_run_smoke(tmp_path):
    text = _run("recipe_run.py", "--config", "recipes/tiny-cpu.yaml", "--name", "page", "--out", tmp_path,
                f"run.out_dir={tmp_path / 'run'}", "model.num_hidden_layers=4", "sft.steps=2", "draft.warm_start.steps=2",
                "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8",
                "task.eval_prompts=2", "run.checkpoint_every=0", "run.progress=false")
    assert "rollout speed-up with the cotrain draft" in text and "held-out sequences, batch" in text
    md = (tmp_path / "page.md").read_text()
    assert "| step | reward | acceptance_length |" in md and "\n| 2 | " in md and "best of 3 interleaved" in md
    assert (tmp_path / "page_curves.png").is_file() and (tmp_path / "page.json").is_file()


def test_refit_smoke(tmp_path):
    """benchmarks/refit.py: the bytes path against the bucketed refit, side by side (embedded engine here; the vLLM
    arm runs in the vLLM environment)."""
    import json

    text = _run("refit.py", "--models", "tiny", "--engines", "embedded", "--repeats", 1, "--bucket-mb", "1,4",
                "--out", tmp_path, "--work-dir", tmp_path / "work")
    assert "| tiny | embedded | 1 |" in text and "| tiny | embedded | 2 |" in text and (tmp_path / "refit.md").is_file()
    rows = json.loads((tmp_path / "refit.json").read_text())["rows"]
    assert [(r["processes"], r["bucket_mb"]) for r in rows] == [(1, 1), (1, 4), (2, 1)]
    assert all(r["before_s"] > 0 and r["after_s"] > 0 and r["weights_mb"] > 1 for r in rows)


@pytest.mark.parametrize("mode", ["schedule", "losses"])
def test_cotrain_schedule_smoke(tmp_path, mode):
    flags = ["--losses"] if mode == "losses" else []
    text = _run("cotrain_schedule.py", *flags, "--out", tmp_path, "--name", "c", f"run.out_dir={tmp_path / 'run'}",
                "rl.steps=4", *_TINY_RL)
    md = (tmp_path / "c.md").read_text()
    if mode == "losses":
        assert "| lk_lambda |" in text and "| ce, acceptance weights |" in md
    else:
        assert "| adaptive |" in text and "implied vs measured acceptance" in md and "within 0.1" in md
    assert (tmp_path / "c.png").is_file() and (tmp_path / "c.json").is_file()
    again = _run("cotrain_schedule.py", *flags, "--report-only", "--out", tmp_path / "again", "--name", "c",
                 f"run.out_dir={tmp_path / 'run'}", "rl.steps=4", *_TINY_RL)  # the page from the arms' CSVs
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert table and table == [line for line in again.splitlines() if line.startswith("|")]
    assert "rebuilt with `--report-only`" in (tmp_path / "again" / "c.md").read_text()


def test_cotrain_schedule_over_seeds_smoke(tmp_path):
    arms = [x for a in ("none", "frozen", "adaptive, 1/4 of samples") for x in ("--arm", a)]
    text = _run("cotrain_schedule.py", "--seeds", 0, 1, *arms, "--out", tmp_path, "--name", "s",
                f"run.out_dir={tmp_path / 'run'}", "rl.steps=4", *_TINY_RL)
    md = (tmp_path / "s.md").read_text()
    assert "| adaptive, 1/4 of samples | " in md and "seed 1: e2e speed-up" in md and "Seed 1:" in md
    assert "adaptive, 1/4 of samples - frozen end-to-end speed-up over 2 seeds (paired)" in text
    assert (tmp_path / "run" / "seed0" / "arms" / "frozen" / "metrics.csv").is_file()
    assert (tmp_path / "run" / "seed1" / "arms" / "none" / "metrics.csv").is_file()


def _trl_python():
    """A Python that has TRL: this one, or the benchmark's own environment (``.venv-trl``, see vs_trl.py)."""
    import importlib.util

    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    venv = REPO / ".venv-trl" / "bin" / "python"
    return str(venv) if venv.is_file() else None


def test_vs_trl_smoke(tmp_path):
    python = _trl_python()
    if python is None:
        pytest.skip("TRL is not installed (benchmarks/vs_trl.py runs in an environment of its own)")
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    tiny = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
            "sft.steps=2", "draft.warm_start.steps=2"]
    out = subprocess.run([python, str(REPO / "benchmarks" / "vs_trl.py"), "--seeds", "0", "1", "--steps", "2",
                          "--batches", "all", "1", "--prompts", "2", "--group", "2", "--max-new-tokens", "8",
                          "--work", str(tmp_path / "work"), "--out", str(tmp_path), *tiny],
                         capture_output=True, text=True, timeout=900, cwd=REPO, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    md = (tmp_path / "vs_trl.md").read_text()
    assert "| TRL GRPOTrainer |" in md and "| co-trained draft (the default: adaptive schedule), batch 1 |" in md
    data = json.loads((tmp_path / "vs_trl.json").read_text())
    assert len(data["repeats"]) == 2 and all(len(rep["TRL GRPOTrainer"]) == 2 for rep in data["repeats"])
    assert {t["arm"] for t in data["table"]} >= {"no draft, batch all", "frozen draft, batch 1"}
    assert "Goals at the full batch" in md and "the no-draft arm's -> <= 1.05x" in md
    again = subprocess.run([python, str(REPO / "benchmarks" / "vs_trl.py"), "--report-only", str(tmp_path / "vs_trl.json"),
                            "--out", str(tmp_path / "again")], capture_output=True, text=True, timeout=300, cwd=REPO,
                           env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "vs_trl.md").read_text().split("\n")[4:] == md.split("\n")[4:]  # but the command


def test_long_tail_main_smoke(tmp_path):
    """The main job's long tail: both runs emit the same tokens (the script checks it), every band's rounds add up
    to the call's, and the completions' lengths stay within the budget."""
    tiny = ["model.hidden_size=32", "model.num_hidden_layers=4", "model.num_attention_heads=2",
            "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
            "sft.steps=2", "draft.warm_start.steps=2"]
    text = _run("long_tail_main.py", "--prompts", 2, "--group", 2, "--max-new-tokens", 8, "--repeats", 2,
                "--work", tmp_path / "work", "--out", tmp_path, *tiny)
    assert "| rows still decoding |" in text and "Whole call, wall time" in text
    res = json.loads((tmp_path / "long_tail_main.json").read_text())
    assert len(res["lengths"]) == 8 and all(1 <= n <= 8 for n in res["lengths"])
    assert sum(b["plain_share"] for b in res["bands"]) == pytest.approx(1.0)
    assert sum(b["adaptive_share"] for b in res["bands"]) == pytest.approx(1.0)
    assert all(0 <= b["mean_k"] <= 4 for b in res["bands"]) and (tmp_path / "long_tail_main.png").is_file()


def test_same_steps_smoke():
    """Two launches of the same revision: the pinned run (no adaptive timing in it) is bit-identical, so the check
    can tell a change of the code from the noise of measured times."""
    text = _run("same_steps.py", "--before", "HEAD", "--after", "HEAD", "--steps", 1, "--skip-digest", "--overrides",
                "model.num_hidden_layers=4", "sft.steps=2", "draft.warm_start.steps=2", "rl.prompts_per_step=2",
                "rl.group_size=2", "rl.max_new_tokens=8", "task.eval_prompts=2", "task.eval_every=0",
                "run.checkpoint_every=0")
    assert "pinned: identical step reward" in text and "  different: none" in text
    assert text.rstrip().endswith("same run before and after")


def test_dflash_tiny_smoke(tmp_path):
    text = _run("dflash_tiny.py", "--steps", 2, "--prompts", 2, "--max-new-tokens", 6, "--repeats", 1,
                "--batch-sizes", "1,3", "--recipe-overrides", "sft.steps=2", "draft.warm_start.steps=2", "--out", tmp_path,
                "--work-dir", tmp_path / "work")
    assert "lossless True" in text and "| dflash |" not in text  # the table is on the page
    page = (tmp_path / "dflash_tiny.md").read_text()
    assert "| 1 | 0 | dflash |" in page and "| 3 | 1 | dflash-adaptive |" in page
    assert "| 1 | 1 | dspark-confidence |" in page and "| 3 | 0 | dspark-adaptive |" in page
    assert (tmp_path / "dflash_tiny.png").is_file()


def test_async_rl_smoke(tmp_path):
    text = _run("async_rl.py", "--steps", 2, "--prompts-per-step", 2, "--repeats", 1, "--overrides", "sft.steps=2",
                "draft.warm_start.steps=2", "task.eval_prompts=4", "--out", tmp_path, "--work-dir", tmp_path / "w")
    assert "| k=1 | " in text and "| k=1 frozen | " in text and "| eta=2 | " in text and (tmp_path / "async_rl.png").is_file()
    assert "acceptance by drafter lag" in (tmp_path / "async_rl.md").read_text()
