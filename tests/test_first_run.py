"""A user's first run: the one-minute recipe from the command line (plain per-step lines when stdout is a file,
written as each step ends), and Ctrl-C ending with one line that says where the run stopped and how to resume."""

import csv
import json
import os
import signal
import subprocess
import sys
import time

from conftest import REPO

SMOKE = str(REPO / "recipes" / "tiny-smoke.yaml")


def _start(out_file, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "lightning_codraft.cli", "fit", *args], stdout=out_file,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)


def _wait_for(path, text, proc, timeout=600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return True
        if proc.poll() is not None:
            return text in path.read_text()
        time.sleep(0.2)
    return False


def test_the_one_minute_recipe_runs_from_the_command_line_with_a_line_per_step(tmp_path):
    log = tmp_path / "stdout.txt"
    with open(log, "w") as out:
        proc = _start(out, "--config", SMOKE, f"run.out_dir={tmp_path / 'run'}")
        assert _wait_for(log, "step 1:", proc)
        first_seen_while_running = proc.poll() is None  # the line was written when the step ended, not at exit
        _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert first_seen_while_running
    text = log.read_text()
    assert [f"step {i}:" in text for i in range(1, 7)] == [True] * 6 and "\x1b[" not in text  # no redrawn bar
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert len(rows) == 6 and (tmp_path / "run" / "summary.txt").is_file()
    assert "rollout speed-up" not in text  # run.measure_speedup=false: no final measurement


def test_ctrl_c_ends_with_one_line_saying_how_to_resume(tmp_path):
    log = tmp_path / "stdout.txt"
    with open(log, "w") as out:
        proc = _start(out, "--config", SMOKE, f"run.out_dir={tmp_path / 'run'}", "run.checkpoint_every=1",
                      "rl.steps=20")
        assert _wait_for(log, "step 2:", proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]  # Lightning's start-up lines come first
    said = [line for line in lines if "interrupted" in line]
    assert "Traceback" not in err and len(said) == 1 and said[0] == lines[-1], err
    assert "resumes from it" in said[0] and str(tmp_path / "run") in said[0]
    done = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert done and all((d / "codraft.json").is_file() for d in done)  # never a checkpoint cut in the middle


def _bad_inputs(tmp):
    good = tmp / "ok.jsonl"
    good.write_text('{"question": "what is 1 plus 2", "answer": "3"}\n')
    broken = tmp / "broken.jsonl"
    broken.write_text('{"question": "a", "answer": "1"}\n{"question": "b", "answer": \n{"question": "c"}\n')
    data = ["task.name=dataset", "task.prompt_column=question", "sft.steps=0"]
    return [
        ("missing file", [*data, f"task.source={tmp / 'missing.jsonl'}"], "missing.jsonl' does not exist"),
        ("bad JSON line", [*data, f"task.source={broken}"], "broken.jsonl:2: not valid JSON"),
        ("unimportable reward", [*data, f"task.source={good}", "task.rewards=[{fn: 'no_such_pkg.rewards:score'}]"],
         "task.rewards: reward 'no_such_pkg.rewards:score': cannot import module 'no_such_pkg.rewards'"),
        ("wrong signature", [*data, f"task.source={good}", "task.rewards=[{fn: 'rewards_for_tests:two_args_reward'}]"],
         "task.rewards[0] (rewards_for_tests:two_args_reward): a one-sample call failed: raised TypeError"),
        ("negative rate", ["rl.lr=-1"], "rl.lr=-1.0 must be > 0"),
        ("unknown key", ["rl.lrr=1"], "unknown config key 'rl.lrr'"),
        ("temperature 0 with GRPO", ["rl.temperature=0"], "rl.temperature=0.0 makes every sample of a group the same"),
    ]


def test_bad_inputs_are_rejected_by_the_dry_run_before_anything_heavy_loads(tmp_path):
    """Each bad input exits 2 naming the recipe key or the file and line, and the rejection path imports no torch
    (what keeps it to a fraction of a second; the seconds are printed with -s, not asserted)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "rl"), os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, json; from lightning_codraft.cli import main; rc = main(json.loads(sys.argv[1])); "
            "print(json.dumps([rc, 'torch' in sys.modules]))")
    for name, overrides, expected in _bad_inputs(tmp_path):
        t0 = time.monotonic()
        argv = ["fit", "--config", SMOKE, "--dry-run", *overrides]
        r = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=120)
        rc, torch_loaded = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"{name}: exit {rc} in {time.monotonic() - t0:.2f} s")
        assert rc == 2 and expected in r.stderr, (name, r.stderr)
        assert not torch_loaded, name


def test_version_answers_without_importing_torch():
    code = "import sys; from lightning_codraft.cli import main; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_every_problem_is_reported_together(tmp_path):
    """A missing data file does not hide the other problems found before it (a greedy temperature, a logger)."""
    from lightning_codraft.config import load_config
    from lightning_codraft.rl.run.preflight import preflight

    cfg = load_config(SMOKE, ["task.name=dataset", "task.prompt_column=question", "sft.steps=0", "rl.temperature=0",
                              "run.loggers=[tensorbored]", f"task.source={tmp_path / 'missing.jsonl'}"])
    problems = preflight(cfg)
    assert len(problems) == 3 and "rl.temperature=0.0" in problems[0] and "run.loggers[0]" in problems[1]
    assert "missing.jsonl' does not exist" in problems[2]
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "b", "answer": \n')
    cfg = load_config(SMOKE, ["task.name=dataset", "task.prompt_column=question", "sft.steps=0", "rl.temperature=0",
                              f"task.source={broken}"])
    problems = preflight(cfg)
    assert len(problems) == 2 and "broken.jsonl:1: not valid JSON" in problems[1]


def test_a_missing_reference_draft_is_found_before_launch(tmp_path):
    from lightning_codraft.config import load_config
    from lightning_codraft.rl.run.preflight import preflight

    cfg = load_config(SMOKE, [f"draft.reference={tmp_path / 'nowhere'}"])
    assert any("draft.reference=" in p and "weights.pt" in p for p in preflight(cfg))
    assert not any("draft.reference" in p for p in preflight(load_config(SMOKE, ["draft.reference=start"])))
