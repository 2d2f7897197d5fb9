"""Asynchronous RL against synchronous on this machine: the main job with ``rl.async_level`` k in {0, 1, 2}.

Arms (the tiny-cpu recipe, the main job: 128 prompts x 8 samples a step, 40 new tokens, T=1; ``--steps`` RL steps; every
arm from the same warm-ups, ``run.init_from`` the first arm's ``warm/weights.pt``, and the same seeds):

- ``k=0``: synchronous (rollouts, then training, then the refit), the co-trained draft;
- ``k=1``, ``k=2``: deterministic k-step-off (rl/async_rollouts.py: step t trains on the rollouts of version t - k,
  generated on a producer thread while step t - 1 trains), the decoupled objective's defaults (truncation at 2);
- ``k=1 frozen``: k=1 with the draft frozen after its warm start (``draft.mode=frozen``): its drafter lag (policy
  version minus drafter version) grows by one a step;
- ``eta=1``, ``eta=2``: bounded staleness (rl/bounded_rollouts.py: a free-running producer that refits to the newest
  weights before each batch of groups and runs at most eta + 1 steps of work ahead; which version generates which
  group follows timing, so these arms do not repeat exactly);
- ``eta=2 in-flight``: eta=2 with in-flight weight updates (``rl.inflight_updates``: the producer's engine takes the
  weights each step publishes between decoding rounds, mid-sequence).

Each arm runs whole with ``run.threads=1`` (synchronous: one core busy; asynchronous: the producer's thread and the
trainer's, one core each), the arms one after another in the order given, then again in reverse order for
``--repeats 2``. Reported per arm: end-to-end completion tokens per second (the steps' completion tokens over the
steps' wall seconds), its ratio to ``k=0`` (goal >= 1.3x) and the per-step throughput against ``k=0`` (paired over
steps after the first, 95% CI), the trainer's and the producer's idle shares, reward per step against ``k=0``
(paired over steps, 95% CI), the held-out greedy reward after RL (``task.eval_prompts`` prompts, paired over prompts
against ``k=0``), acceptance length by staleness and by drafter lag, and the off-policy weights' figures.
``--arms`` runs a subset (``k=0`` always).

``--pinned`` runs every arm with a fixed speculation length and the draft trained every step
(``draft.adaptive=false draft.schedule=every_step``; a frozen arm stays frozen): the main job's adaptive draft
schedule pays for draft updates only out of the decode time speculation saved, and on this CPU the adaptive engine
barely drafts, so as the recipe says no arm updates its draft (every arm drafts with the warm-start drafter); the
pinned run is the one that compares a co-trained drafter with a frozen one, with acceptance measured every round.

Writes ``<out>/<name>.md``, ``.json``, ``.png`` (``--name``, default ``async_rl``; ``async_rl_pinned`` for the pinned
run). Smoke: ``--steps 2 --prompts-per-step 2 --overrides sft.steps=2
draft.warm_start.steps=2 task.eval_prompts=4 --out TMP --work-dir TMP``.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
from pathlib import Path

import torch

from lightning_codraft.config import load_config
from lightning_codraft.rl.reports.stats import paired_difference
from lightning_codraft.rl.run.loop import fit
from pages import command, md_table, pyplot, save_figure, write_json, write_page

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "k=0": ["rl.async_level=0"],
    "k=1": ["rl.async_level=1"],
    "k=2": ["rl.async_level=2"],
    "k=1 frozen": ["rl.async_level=1", "draft.mode=frozen"],
    "eta=1": ["rl.async_level=1", "rl.max_staleness=1"],
    "eta=2": ["rl.async_level=1", "rl.max_staleness=2"],
    "eta=2 in-flight": ["rl.async_level=1", "rl.max_staleness=2", "rl.inflight_updates=true"],
}


def run_arm(name: str, args, warm: Path | None, repeat: int) -> dict:
    """One whole run of an arm; its rows and held-out scores."""
    out = Path(args.work_dir) / f"{name.replace(' ', '_').replace('=', '')}-r{repeat}"
    overrides = ["run.threads=1", "run.resume=false", "run.progress=false", "run.plots=false", "task.eval_every=0",
                 "run.checkpoint_every=0", f"run.out_dir={out}", f"rl.steps={args.steps}",
                 f"rl.prompts_per_step={args.prompts_per_step}", *args.overrides, *ARMS[name]]
    if args.pinned:
        overrides += ["draft.adaptive=false", "draft.schedule=every_step"]
    if warm is not None:
        overrides.append(f"run.init_from={warm}")
    cfg = load_config(ROOT / "recipes" / "tiny-cpu.yaml", overrides)
    res = fit(cfg, print_fn=lambda m: None)
    rows = res.rows
    tokens, seconds = sum(r["completion_tokens"] for r in rows), sum(r["step_s"] for r in rows)
    print(f"{name} (repeat {repeat + 1}): {tokens / seconds:.0f} completion tokens/s over {len(rows)} steps, "
          f"held-out reward {res.eval_after:.3f}", flush=True)
    return {"rows": rows, "tokens_per_s": tokens / seconds, "eval_after": res.eval_after,
            "eval_scores": list(res.eval_after_scores), "out": str(out)}


def summarize(runs: dict[str, list[dict]]) -> tuple[list[list], list[str], dict]:
    """The table's rows, the findings' lines and the JSON summary."""
    base = runs["k=0"]
    body, lines, summary = [], [], {}
    for name, reps in runs.items():
        ratio = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(reps, base)]
        rows = [row for r in reps for row in r["rows"]]
        mean = lambda key, rs=rows: statistics.fmean(x[key] for x in rs if not math.isnan(x[key]))  # noqa: E731
        late = [x for x in rows if x["step"] > 1]
        idle_p = [x["producer_idle"] for x in late if not math.isnan(x["producer_idle"])]
        wait = sum(x["trainer_wait_s"] for x in rows) / max(sum(x["step_s"] for x in rows), 1e-9)
        by_stale = {}
        for x in rows:
            by_stale.setdefault(int(x["staleness"]), []).append(x["acceptance_length"])
        acc = ", ".join(f"{s}: {statistics.fmean(v):.2f}" for s, v in sorted(by_stale.items()))
        by_lag = {}
        for x in rows:
            by_lag.setdefault(round(x["draft_lag"]), []).append(x["acceptance_length"])
        lag = ", ".join(f"{s}: {statistics.fmean(v):.2f}" for s, v in sorted(by_lag.items()))
        if name == "k=0":
            reward_cmp = heldout_cmp = speed_cmp = "-"
        else:
            per_step = lambda rs: [x["completion_tokens"] / x["step_s"] for x in rs if x["step"] > 1]  # noqa: E731
            mine, theirs = per_step(rows), per_step([x for b in base for x in b["rows"]])
            speed_cmp = "-"
            if len(mine) >= 2:
                v = paired_difference(mine, theirs)
                speed_cmp = f"{v.mean:+.0f} ({v.low:+.0f} .. {v.high:+.0f})"
            d = paired_difference([x["reward"] for x in rows], [x["reward"] for b in base for x in b["rows"]])
            reward_cmp = f"{d.mean:+.4f} ({d.low:+.4f} .. {d.high:+.4f})"
            e = paired_difference([s for r in reps for s in r["eval_scores"]],
                                  [s for b in base for s in b["eval_scores"]])
            heldout_cmp = f"{e.mean:+.4f} ({e.low:+.4f} .. {e.high:+.4f})"
        is_w = [x["is_weight"] for x in late if not math.isnan(x["is_weight"])]
        summary[name] = {"tokens_per_s": [r["tokens_per_s"] for r in reps], "speedup": ratio,
                         "trainer_wait_share": wait, "producer_idle": statistics.fmean(idle_p) if idle_p else None,
                         "eval_after": [r["eval_after"] for r in reps], "acceptance_by_drafter_lag":
                             {k: statistics.fmean(v) for k, v in by_lag.items()}}
        body.append([name, f"{statistics.fmean(r['tokens_per_s'] for r in reps):.0f}",
                     f"{statistics.fmean(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})", speed_cmp, f"{wait:.0%}",
                     f"{statistics.fmean(idle_p):.0%}" if idle_p else "-", f"{mean('reward'):.4f}", reward_cmp,
                     f"{statistics.fmean(r['eval_after'] for r in reps):.3f}", heldout_cmp, acc, lag,
                     f"{statistics.fmean(is_w):.3f}" if is_w else "-",
                     f"{max(x['is_weight_max'] for x in late):.2f}" if is_w else "-"])
        if name != "k=0":
            goal = statistics.fmean(ratio) >= 1.3
            lines.append(f"{name}: end-to-end {statistics.fmean(ratio):.2f}x synchronous (goal >= 1.3x: "
                         f"{'met' if goal else '**not met**'})")
    return body, lines, summary


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for name, reps in runs.items():
        rows = reps[0]["rows"]
        axes[0].plot([r["step"] for r in rows], [r["reward"] for r in rows], label=name)
        axes[1].plot([r["step"] for r in rows], [r["acceptance_length"] for r in rows], label=name)
    axes[0].set_title("reward per step")
    axes[1].set_title("acceptance length per step")
    axes[0].legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts-per-step", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--overrides", nargs="*", default=[])
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS), help="the arms (k=0 always runs)")
    ap.add_argument("--work-dir", default="/tmp/codraft_async_rl")
    ap.add_argument("--pinned", action="store_true", help="fixed K, the draft trained every step (module docstring)")
    ap.add_argument("--name", default=None, help="the page's name (default async_rl, or async_rl_pinned)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = ["k=0", *[a for a in ARMS if a in args.arms and a != "k=0"]]
    runs: dict[str, list[dict]] = {name: [] for name in arms}
    warm = None
    for repeat in range(args.repeats):
        order = arms if repeat % 2 == 0 else list(reversed(arms))
        for name in order:
            runs[name].append(run_arm(name, args, warm, repeat))
            if warm is None:
                warm = Path(runs[name][-1]["out"]) / "warm" / "weights.pt"
    body, lines, summary = summarize(runs)
    header = ["arm", "completion tok/s", "vs k=0 (range over repeats)", "tok/s - k=0 per step (95% CI)",
              "trainer waiting", "producer idle", "reward", "reward - k=0 per step (95% CI)", "held-out reward",
              "held-out - k=0 per prompt (95% CI)", "acceptance by staleness", "acceptance by drafter lag",
              "IS weight mean", "IS weight max"]
    name = args.name or ("async_rl_pinned" if args.pinned else "async_rl")
    trained = {k: sum(x["draft_trained"] for r in v for x in r["rows"]) for k, v in runs.items()}
    pin_note = [
        "Pinned: fixed K (`draft.adaptive=false`), the draft trained every step (`draft.schedule=every_step`); "
        "draft updates per arm: " + ", ".join(f"{k} {v:.0f}" for k, v in trained.items()) + "."
        if args.pinned else
        "As the recipe says (adaptive speculation length, adaptive draft schedule). Draft updates per arm: "
        + ", ".join(f"{k} {v:.0f}" for k, v in trained.items())
        + " (the schedule pays for an update only out of decode time speculation saved; where it saved none, every "
        "arm drafts with its warm-start drafter and the drafter lag is the policy version: the co-trained and frozen "
        "drafters are compared in async_rl_pinned.md)."]
    page = ["# Asynchronous RL against synchronous (k-step-off, bounded staleness)", "",
            f"`{command('async_rl.py', argv)}`", "", *pin_note, "",
            f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread per "
            f"thread of work, torch {torch.__version__}. Recipe tiny-cpu (the main job), {args.steps} RL steps x "
            f"{args.prompts_per_step} prompts x 8 samples, T=1, 40 new tokens, {args.repeats} repeat(s) of every "
            f"arm (orders alternating); held-out: the recipe's greedy evaluation after RL.", "",
            *md_table(header, body), "", *[f"- {x}" for x in lines], "", f"![curves]({name}.png)", ""]
    plot(runs, out / f"{name}.png")
    write_json(out / f"{name}.json", {"summary": summary, "argv": sys.argv[1:] if argv is None else argv,
                                       "rows": {k: [r["rows"] for r in v] for k, v in runs.items()}})
    print(write_page(out / f"{name}.md", page))
    return 0


if __name__ == "__main__":
    sys.exit(main())
