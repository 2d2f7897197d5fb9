"""Does a change of the code leave the run as it was? The main job's first steps and the rollout benchmark's tokens,
before and after, side by side.

Two trees: ``--before`` (a git revision, checked out as a worktree in a temporary directory) and ``--after`` (a
revision, or ``.``: this working tree). Each runs, in a process of its own with its tree first on ``PYTHONPATH``:

1. the main job (``recipes/tiny-cpu.yaml``) for ``--steps`` RL steps, with its warm-ups, twice: as the recipe says,
   and pinned (``draft.adaptive=false draft.schedule=every_step``): the adaptive engine and the adaptive draft
   schedule follow measured times, so the recipe's own run differs between two launches of the SAME code in the
   columns that follow them (the engine's log-probs come from verify forwards of other widths: the loss, KL and
   acceptance columns move in the last digits) — the pinned run is the one that must be bit-identical;
2. ``benchmarks/rollout.py``'s tiny grid (batch 1, 4, 16 x T 0, 1, 16 tokens, a short warm-up) and its grid token
   digest (plain decoding's tokens of every cell).

Prints, per run, the metrics.csv columns (wall-time columns aside) that are identical and the ones that differ, a
digest of the policy's and the draft's weights after the last step (the run's last checkpoint), and both token
digests; exits 1 when the pinned run (its columns or its weights) or the token digest differs. Where a key was renamed between the trees,
``--before-overrides`` / ``--before-tiny-overrides`` give the old tree its own (e.g. issue 48's refactor:
``--before 1513d3e --before-tiny-overrides sft.steps=20 draft.warmup_steps=20``). No page: a check, not a figure (the closing note
of a refactor quotes its output). Smoke: ``--steps 1 --overrides sft.steps=2 draft.warm_start.steps=2
rl.prompts_per_step=2 rl.group_size=2 rl.max_new_tokens=8 task.eval_prompts=2 --skip-digest``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from lightning_codraft.rl.step_metrics import TIME_COLUMNS

ROOT = Path(__file__).resolve().parent.parent
PINNED = ["draft.adaptive=false", "draft.schedule=every_step"]


def tree(rev: str, path: Path) -> Path:
    """The code of ``rev`` (``.``: this working tree), checked out at ``path``."""
    if rev == ".":
        return ROOT
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), rev], check=True,
                   capture_output=True)
    return path


def run_job(code: Path, out: Path, steps: int, overrides: list[str]) -> list[dict[str, str]]:
    """The main job's metrics.csv rows after ``steps`` steps, run with ``code``'s library."""
    argv = ["fit", "--config", str(code / "recipes" / "tiny-cpu.yaml"), f"rl.steps={steps}", f"run.out_dir={out}",
            "run.measure_speedup=false", "run.plots=false", "run.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": str(code)}
    script = f"import sys; from lightning_codraft.cli import main; sys.argv = ['codraft'] + {argv!r}; sys.exit(main())"
    res = subprocess.run([sys.executable, "-c", script], cwd=code, env=env, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"the main job failed with {code}'s code:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    with open(out / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def weights_digest(out: Path) -> str:
    """A digest of the policy's and the draft's weights in the run's last checkpoint (``out/checkpoints``): equal
    digests, equal weights bit for bit (read with torch's own DCP reader, whatever tree wrote them)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    last = sorted((out / "checkpoints").glob("step-*"))[-1]
    dcp_to_torch_save(str(last), str(out / "weights.pt"))
    module = torch.load(out / "weights.pt", weights_only=False)["module"]
    h, seen = hashlib.sha256(), 0
    for key in sorted(module):
        if key.startswith(("policy.", "draft.")) and torch.is_tensor(module[key]):
            h.update(key.encode())
            h.update(module[key].contiguous().view(torch.uint8).numpy().tobytes())
            seen += 1
    if not seen:
        raise RuntimeError(f"no policy or draft tensors in {last}")
    return f"{h.hexdigest()[:16]} ({seen} tensors)"


def digest(code: Path, work: Path, overrides: list[str]) -> str:
    """``benchmarks/rollout.py``'s tiny grid token digest with ``code``'s library (and its own benchmark)."""
    cmd = [sys.executable, str(code / "benchmarks" / "rollout.py"), "--models", "tiny", "--batch-sizes", "1,4,16",
           "--temperatures", "0,1", "--max-new-tokens", "16", "--repeats", "1", "--long-tail-batch", "0",
           "--min-cpu-s", "0.01", "--tiny-overrides", *overrides, "--work-dir", str(work / "work"),
           "--out", str(work / "out")]
    res = subprocess.run(cmd, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True)
    found = re.search(r"grid token digest: (\w+)", res.stdout)
    if res.returncode or not found:
        raise RuntimeError(f"the rollout benchmark failed with {code}'s code:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return found.group(1)


def compare(before: list[dict[str, str]], after: list[dict[str, str]]) -> tuple[list[str], list[str]]:
    """``(identical columns, differing columns)`` of two metrics.csv files, wall-time columns aside."""
    if len(before) != len(after):
        raise RuntimeError(f"{len(before)} steps before, {len(after)} after")
    same, diff = [], []
    for key in before[0]:  # the columns of the code before (a column it lacks is new, not a difference)
        if key not in TIME_COLUMNS:
            (same if [r.get(key) for r in before] == [r.get(key) for r in after] else diff).append(key)
    return same, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="a git revision (the code before the change)")
    ap.add_argument("--after", default=".", help="a git revision, or . (this working tree)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--overrides", nargs="*", default=[], help="more key=value overrides of the main job")
    ap.add_argument("--before-overrides", nargs="*", default=None,
                    help="the overrides for the tree before, where its keys differ (default: --overrides)")
    ap.add_argument("--tiny-overrides", nargs="*", default=["sft.steps=20", "draft.warm_start.steps=20"],
                    help="the rollout benchmark's tiny-model overrides (a short warm-up)")
    ap.add_argument("--before-tiny-overrides", nargs="*", default=None,
                    help="the same for the tree before, where its keys differ (default: --tiny-overrides)")
    ap.add_argument("--skip-digest", action="store_true")
    args = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        trees = {"before": tree(args.before, work / "before"), "after": tree(args.after, work / "after")}
        over = {"before": args.overrides if args.before_overrides is None else args.before_overrides,
                "after": args.overrides}
        try:
            for name, extra in (("as the recipe says", []), ("pinned", PINNED)):
                rows = {k: run_job(trees[k], work / f"{k}-{len(extra)}", args.steps, over[k] + extra) for k in trees}
                same, diff = compare(rows["before"], rows["after"])
                weights = {k: weights_digest(work / f"{k}-{len(extra)}") for k in trees}
                print(f"main job, {args.steps} steps, {name}: identical {' '.join(same)}")
                print(f"  different: {' '.join(diff) or 'none'}")
                print(f"  weights after step {args.steps} (policy and draft): before {weights['before']}, after "
                      f"{weights['after']}: {'the same' if weights['before'] == weights['after'] else 'DIFFERENT'}")
                ok &= not ((diff or weights["before"] != weights["after"]) and extra)
            if not args.skip_digest:
                tiny = {"before": args.tiny_overrides if args.before_tiny_overrides is None
                        else args.before_tiny_overrides, "after": args.tiny_overrides}
                d = {k: digest(trees[k], work / f"digest-{k}", tiny[k]) for k in trees}
                print(f"tiny grid token digest: before {d['before']}, after {d['after']}: "
                      f"{'the same' if d['before'] == d['after'] else 'DIFFERENT'}")
                ok &= d["before"] == d["after"]
        finally:
            for k, path in trees.items():
                if path != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                                   capture_output=True)
    print("same run before and after" if ok else "THE RUN CHANGED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
