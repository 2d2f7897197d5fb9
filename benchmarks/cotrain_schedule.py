"""Does co-training pay for itself? The live A/B, the adaptive schedule and the acceptance-optimal losses, measured.

    python benchmarks/cotrain_schedule.py [--config recipes/tiny-drift.yaml] [--name cotrain_schedule] [key=value ...]
    python benchmarks/cotrain_schedule.py --losses [--name cotrain_losses] [...]

Schedule mode: arms no draft / frozen draft / co-trained every step / co-trained adaptively (``draft.schedule``),
from one warm start and the same seeds, steps interleaved (rl/reports/compare.py). Reports per arm the acceptance over the
last half, the training step's seconds (and its ratio to the frozen arm's), the draft updates taken, the speed-ups
over no draft; the paired adaptive - every-step acceptance over the last half (95% CI); and how well the implied
acceptance (training/implied.py, one draft forward on the step's taps) tracks the acceptance the engine measured
when decoding with that draft: the current draft against its own arm's rollouts, the reference (the draft as RL
began) against the frozen arm's, which decodes with it (coupled sampling: the same rollouts, docs/design/sampling.md).

Loss mode: co-trained every step with each draft loss (``ce``, ``tv``, ``lk_alpha``, ``lk_lambda``) and, for ``ce``,
uniform and acceptance-derived position weights; paired against ``ce`` with decaying weights.

Writes ``<out>/<name>.md`` and ``<name>.png``; prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

from lightning_codraft.config import load_config
from lightning_codraft.rl.reports.compare import CompareResult, run_side_by_side
from lightning_codraft.rl.reports.run_log import plot_curves, read_metrics
from lightning_codraft.rl.run.loop import FitResult
from lightning_codraft.rl.reports.stats import paired_difference
from pages import command, write_json, write_page

REPO = Path(__file__).resolve().parent.parent

SCHEDULE_ARMS = {"none": {"mode": "none"}, "frozen": {"mode": "frozen", "score_frozen": True},  # its implied acceptance
                 "every_step": {"mode": "cotrain", "schedule": "every_step"},
                 "adaptive": {"mode": "cotrain", "schedule": "adaptive"},
                 "every_step, 1/4 of samples": {"mode": "cotrain", "schedule": "every_step", "sample_every": 4},
                 "adaptive, 1/4 of samples": {"mode": "cotrain", "schedule": "adaptive", "sample_every": 4}}
LOSS_ARMS = {"ce": {}, "tv": {"loss_type": "tv"}, "lk_alpha": {"loss_type": "lk_alpha"},
             "lk_lambda": {"loss_type": "lk_lambda"}, "ce, uniform weights": {"position_weights": "uniform"},
             "ce, acceptance weights": {"position_weights": "acceptance"}}


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def _last_half(xs):
    return xs[len(xs) // 2:]


def correlation(x, y) -> float:
    """Pearson correlation of the finite pairs (NaN with fewer than 3 or no spread)."""
    pairs = [(a, b) for a, b in zip(x, y) if math.isfinite(a) and math.isfinite(b)]
    if len(pairs) < 3:
        return math.nan
    mx, my = _mean([a for a, _ in pairs]), _mean([b for _, b in pairs])
    sxy = sum((a - mx) * (b - my) for a, b in pairs)
    sx, sy = math.sqrt(sum((a - mx) ** 2 for a, _ in pairs)), math.sqrt(sum((b - my) ** 2 for _, b in pairs))
    return sxy / (sx * sy) if sx > 0 and sy > 0 else math.nan


def tracking(implied, measured) -> tuple[float, float, int]:
    """(correlation, mean absolute difference, steps) of implied vs measured acceptance over the finite steps."""
    pairs = [(a, b) for a, b in zip(implied, measured) if math.isfinite(a) and math.isfinite(b)]
    mad = _mean([abs(a - b) for a, b in pairs])
    return correlation(implied, measured), mad, len(pairs)


def configs_for(cfg, arms: dict) -> dict:
    return {name: dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, **kw)) for name, kw in arms.items()}


def from_runs(arms: dict, root: Path, cfg) -> CompareResult:
    """The arms' results from their ``metrics.csv`` (each arm writes one row per finished step), cut to the steps
    every arm finished: a run stopped early still gives its page."""
    rows = {name: read_metrics(root / name / "metrics.csv") for name in arms}
    n = min(len(r) for r in rows.values())
    if n < 4:
        raise SystemExit(f"only {n} steps finished in every arm under {root}; the paired statistics need 4")
    return CompareResult(cfg=cfg, results={name: FitResult(out_dir=root / name, rows=r[:n], completed=False)
                                           for name, r in rows.items()})


def schedule_report(res: CompareResult, args) -> tuple[str, list[str]]:
    frozen_train = _mean(res.series("frozen", "train_s")) if "frozen" in res.results else math.nan
    lines = ["| arm | acceptance, last half | train s per step | train s vs frozen | draft updates | rollout "
             "speed-up | end-to-end speed-up |", "|---|---|---|---|---|---|---|"]
    for arm in res.results:
        acc = _mean(_last_half(res.series(arm, "acceptance_length")))
        train = _mean(res.series(arm, "train_s"))
        updates = int(sum(res.series(arm, "draft_trained")))
        ro, e2e = (f"{x:.2f}x" for x in res.speedups(arm)) if "none" in res.results else ("- (no arm none)",) * 2
        lines.append(f"| {arm} | {acc:.2f} | {train:.2f} | {train / frozen_train:.3f}x | {updates} | {ro} | {e2e} |")
    goals = []
    for arm in [a for a in res.results if a.startswith("adaptive")]:
        if "every_step" in res.results:
            d = res.paired(arm, "every_step", "acceptance_length")
            goals.append(f"{arm} - every-step acceptance, last half (paired): {d} -> within 0.1: "
                         f"{'yes' if d.low >= -0.1 else 'NO'}")
        ratio = _mean(res.series(arm, "train_s")) / frozen_train
        goals.append(f"{arm}: training step vs frozen, mean over the run: {ratio:.3f}x -> <= 1.15x: "
                     f"{'yes' if ratio <= 1.15 else 'NO'}")
        if "frozen" in res.results and "none" in res.results:
            e2e, e2e_frozen = res.speedups(arm)[1], res.speedups("frozen")[1]
            goals.append(f"{arm}: end-to-end speed-up over no draft {e2e:.3f}x vs frozen {e2e_frozen:.3f}x -> "
                         f"{'at least' if e2e >= e2e_frozen else 'BELOW'} the frozen arm's")
    if res.cfg.draft.adaptive:
        goals.append("adaptive speculation (draft.adaptive): the engine's acceptance counts rounds of the length it "
                     "chose (0..K), the implied figure rounds of K proposals, so the two are not the same quantity "
                     "and the tracking below is not a test of the implied figure (docs/cotraining.md)")
    for arm in [a for a in res.results if a not in ("none",)]:
        c, mad, n = tracking(res.series(arm, "implied_acceptance"), res.series(arm, "acceptance_length"))
        goals.append(f"{arm}: the current draft's implied vs measured acceptance over {n} steps: correlation "
                     f"{c:.3f}, mean |difference| {mad:.3f} -> {'yes' if c >= 0.9 and mad <= 0.15 else 'NO'}")
    for arm in [a for a in res.results if a not in ("none", "frozen") and "frozen" in res.results]:
        c, mad, n = tracking(res.series(arm, "reference_acceptance"), res.series("frozen", "acceptance_length"))
        goals.append(f"{arm}: the reference draft's implied acceptance vs the frozen arm's measured one over {n} "
                     f"steps: correlation {c:.3f}, mean |difference| {mad:.3f} -> "
                     f"{'yes' if c >= 0.9 and mad <= 0.15 else 'NO'}")
        last = res.results[arm].rows[-1]
        goals.append(f"{arm}: the live A/B at the last step, current - reference implied acceptance, mean over the run "
                     f"{_mean(res.series(arm, 'ab_gain')):+.3f} (95% CI {last['ab_gain_low']:+.3f} .. "
                     f"{last['ab_gain_high']:+.3f})")
    return "\n".join(lines), goals


def loss_report(res: CompareResult) -> tuple[str, list[str]]:
    lines = ["| draft loss | acceptance, last half | vs ce (paired, last half) | implied acceptance, last half | "
             "train s per step |", "|---|---|---|---|---|"]
    for arm in res.results:
        acc = res.series(arm, "acceptance_length")
        vs = "-" if arm == "ce" else str(res.paired(arm, "ce", "acceptance_length"))
        lines.append(f"| {arm} | {_mean(_last_half(acc)):.3f} | {vs} | "
                     f"{_mean(_last_half(res.series(arm, 'implied_acceptance'))):.3f} | "
                     f"{_mean(res.series(arm, 'train_s')):.2f} |")
    return "\n".join(lines), []


def setup_line(cfg, args) -> str:
    c = cfg
    return (f"Recipe `{Path(args.config).name}` ({' '.join(args.overrides) or 'as shipped'}): task `{c.task.name}`, "
            f"policy {c.model.source} ({c.model.num_hidden_layers} layers, hidden {c.model.hidden_size}), "
            f"{c.rl.steps} GRPO steps x {c.rl.prompts_per_step} prompts x {c.rl.group_size} samples, temperature "
            f"{c.rl.temperature}, K = {c.draft.num_speculative_tokens} "
            f"({'adaptive' if c.draft.adaptive else 'fixed'}), draft lr {c.draft.lr}, {c.draft.sampling} sampling, "
            f"rollouts on prompts the draft never trained on (fresh prompts every step), {c.parallel.accelerator}, "
            + (f"seed {c.run.seed}." if args.seeds is None else
               f"seeds {', '.join(map(str, args.seeds))} (each a whole side-by-side run with its own SFT and draft "
               "warm-up; arms paired over seeds)."))


def seeds_report(results: dict[int, CompareResult]) -> tuple[str, list[str]]:
    """Across seeds (each a whole side-by-side run): every arm's end-to-end speed-up over no draft per seed, and
    each co-trained arm against the frozen one, paired over seeds."""
    arms = [a for a in next(iter(results.values())).results if a != "none"]
    seeds = list(results)
    lines = ["| arm | " + " | ".join(f"seed {s}: e2e speed-up / acceptance, last half" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    e2e = {a: [results[s].speedups(a)[1] for s in seeds] for a in arms}
    acc = {a: [_mean(_last_half(results[s].series(a, "acceptance_length"))) for s in seeds] for a in arms}
    for a in arms:
        lines.append(f"| {a} | " + " | ".join(f"{x:.3f}x / {y:.2f}" for x, y in zip(e2e[a], acc[a])) + " |")
    goals = []
    for a in [a for a in arms if a != "frozen" and "frozen" in arms]:
        d = paired_difference(e2e[a], e2e["frozen"])
        goals.append(f"{a} - frozen end-to-end speed-up over {len(seeds)} seeds (paired): {d.mean:+.3f} (95% CI "
                     f"{d.low:+.3f} .. {d.high:+.3f}; {d.wins}/{d.n} seeds higher) -> "
                     f"{'at least the frozen arm' if d.mean >= 0 else 'BELOW the frozen arm'} on average")
        d = paired_difference(acc[a], acc["frozen"])
        goals.append(f"{a} - frozen acceptance over the last half, over seeds (paired): {d.mean:+.3f} (95% CI "
                     f"{d.low:+.3f} .. {d.high:+.3f})")
    return "\n".join(lines), goals


def run_arms(args, cfg, arms) -> CompareResult:
    root = Path(cfg.run.out_dir) / "arms"
    return from_runs(arms, root, cfg) if args.report_only else run_side_by_side(arms, root, cfg)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "recipes" / "tiny-drift.yaml"))
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--name", default=None)
    ap.add_argument("--losses", action="store_true", help="compare the draft losses instead of the schedules")
    ap.add_argument("--report-only", action="store_true",
                    help="rebuild the page from the arms' metrics.csv under run.out_dir (the steps every arm finished)")
    ap.add_argument("--arm", action="append", dest="arms", default=None,
                    help="an arm to run, by name (repeat it; default: every arm of the mode)")
    ap.add_argument("--seeds", type=int, nargs="+", default=None,
                    help="run the arms once per seed (run.seed) and pair the arms over seeds (needs none and frozen)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    args.name = args.name or ("cotrain_losses" if args.losses else "cotrain_schedule")
    cfg = load_config(args.config, [f"run.out_dir=runs/bench-{args.name}", *args.overrides])
    if cfg.rl.steps < 4:
        ap.error(f"rl.steps={cfg.rl.steps}: the paired statistics over the last half need rl.steps >= 4")
    catalogue = LOSS_ARMS if args.losses else SCHEDULE_ARMS
    chosen = catalogue if args.arms is None else {n: catalogue.get(n) for n in args.arms}
    if unknown := [n for n, kw in chosen.items() if kw is None]:
        ap.error(f"--arm: unknown arm(s) {unknown}; arms are {list(catalogue)}")
    if args.seeds is not None and (args.losses or len(args.seeds) < 2 or not {"none", "frozen"} <= set(chosen)):
        ap.error("--seeds compares schedules over >= 2 seeds and needs the arms none and frozen")
    if args.seeds is None:
        res = run_arms(args, cfg, configs_for(cfg, chosen))
        table, goals = loss_report(res) if args.losses else schedule_report(res, args)
    else:
        per_seed, reports = {}, {}
        for seed in args.seeds:
            c = load_config(args.config, [*args.overrides, f"run.seed={seed}",
                                          f"run.out_dir={Path(cfg.run.out_dir) / f'seed{seed}'}"])
            per_seed[seed] = run_arms(args, c, configs_for(c, chosen))
            reports[seed] = schedule_report(per_seed[seed], args)
            print(f"seed {seed}:\n" + reports[seed][0])
        res = per_seed[args.seeds[0]]
        table, goals = seeds_report(per_seed)
        table += "".join(f"\n\nSeed {s}:\n\n" + seed_table for s, (seed_table, _) in reports.items())
        goals += [f"seed {s}: {g}" for s, (_, seed_goals) in reports.items() for g in seed_goals]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = ("acceptance_length", "implied_acceptance", "train_s") if args.losses else (
        "acceptance_length", "implied_acceptance", "reference_acceptance", "train_s", "draft_trained")
    png = plot_curves({a: r.rows for a, r in res.results.items()}, out / f"{args.name}.png", keys=keys,
                      title="co-training: " + ("draft losses" if args.losses else "schedules") + " (same seeds)")
    what = ("Draft losses, each co-trained every step" if args.losses else
            "Co-training schedules and the live A/B")
    text = "\n".join([f"# {what} ({args.name})", "", setup_line(cfg, args), "",
                      "Arms from the same warm start and seeds, steps interleaved, ratios measured side by side in "
                      "this one run. Acceptance length = tokens per verification round the engine measured on the "
                      "step's rollouts; implied acceptance = the same figure computed from one draft forward on the "
                      "step's taps (training/implied.py).", "", table, "",
                      *([f"- {g}" for g in goals] + [""] if goals else []), f"![curves]({png.name})", "",
                      f"Reproduce: `{command('cotrain_schedule.py', [a for a in argv if a != '--report-only'])}`"
                      + (" (this page was rebuilt with `--report-only` from the arms' metrics.csv: the run's final "
                         "held-out evaluation and speed-up measurement per arm were cut short)." if args.report_only
                         else ".")])
    write_page(out / f"{args.name}.md", text)
    write_json(out / f"{args.name}.json", {a: r.rows for a, r in res.results.items()} if args.seeds is None else
               {f"seed {s}": {a: r.rows for a, r in pr.results.items()} for s, pr in per_seed.items()})
    print(table)
    print("\n".join(goals))
    print(f"wrote {out / f'{args.name}.md'}")


if __name__ == "__main__":
    main()
