"""Does the main job's RL raise held-out accuracy? The recipe over several seeds, and the settings that decide it.

    python benchmarks/rl_seeds.py [--config recipes/tiny-cpu.yaml] [--seeds 0 1 2] [--out docs/benchmarks]
                                  [--name rl_heldout] [--runs runs/rl-seeds] [--settings NAME,NAME]
                                  [--setting "NAME:key=value,key=value" ...] [--reuse] [key=value ...]

1. **The main job, per seed.** ``codraft fit`` on the recipe (with the ``key=value`` overrides) for every seed of
   ``--seeds`` (``run.seed`` changes the SFT warm-up, the draft's warm-start, the prompts and the sampling), scoring
   the FIXED held-out set (``task.eval_prompts`` prompts) before RL and every ``task.eval_every`` steps: greedy
   accuracy (``eval_accuracy``, what a user of the trained policy gets) and the reward of one sample per prompt at
   the rollout temperature (``eval_reward``, what RL optimises; the step's own reward mixes in which prompts the
   step drew). Reports held-out greedy accuracy before -> after per seed, mean and spread over seeds, and the
   paired per-seed difference after - before with its 95% Student-t confidence interval
   (``lightning_codraft.rl.reports.stats.paired_difference``).
2. **Settings.** Each named setting (overrides of the recipe) runs the RL phase again for every seed from that
   seed's own warmed-up weights (``run.init_from``: same start policy, same held-out score before RL), with the
   draft off and the engine decoding a whole step's batch at once (``draft.mode=none
   parallel.engine_batch_size=null``: RL does not depend on the draft and coupled sampling makes the rollouts a
   function of the seeds, not of the batch, so this is the same RL, several times faster on CPU). The row
   ``recipe`` is the recipe itself under the same conditions, so every row compares like with like.

Writes ``<out>/<name>.md`` (the tables, and the notes of ``--notes`` when that file exists) and
``<out>/<name>.png`` (held-out greedy accuracy and eval reward per RL step, mean over seeds, per setting). Each
run's results are kept in ``<runs>/seed<s>/<setting>/heldout.json``; ``--reuse`` loads a run of the same seed whose
saved config equals the one it would run (output paths aside) instead of running it again, so an interrupted sweep
continues where it stopped and a setting equal to another is run once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_codraft.config import CoDraftConfig, load_config, to_yaml
from lightning_codraft.rl.reports.compare import isolated
from lightning_codraft.rl.reports.run_log import plot_curves
from lightning_codraft.rl.run.loop import CoDraftRun
from lightning_codraft.rl.reports.stats import paired_difference
from pages import command, write_json

REPO = Path(__file__).resolve().parent.parent

SETTINGS = {
    "recipe": [],
    "16 prompts per step": ["rl.prompts_per_step=16"],
    "16 prompts, lr 1e-5": ["rl.prompts_per_step=16", "rl.lr=1e-5"],
    "16 prompts, kl_coef 0.1": ["rl.prompts_per_step=16", "rl.kl_coef=0.1"],
}
"""The investigation's settings: name -> overrides of the recipe (RL keys only: they start from the seed's warm-up)."""
FAST = ["draft.mode=none", "parallel.engine_batch_size=null"]
"""What every setting row adds: no draft, the whole step's batch decoded at once (same RL, faster on CPU)."""
WARMUP_KEYS = ("model.", "sft.", "task.", "draft.warmup", "run.seed", "run.init_from")
"""Override prefixes a setting may not change: its runs start from the recipe run's warm-up and held-out score."""


@dataclass
class HeldOut:
    """One run's held-out scores.

    Attributes:
        seed: ``run.seed``.
        setting: the setting's name (``main`` for the full main job).
        before, after: greedy accuracy on the held-out set before and after RL.
        reward_before: eval reward (one sample per prompt at the rollout temperature) before RL.
        curve: ``{"step", "eval_accuracy", "eval_reward"}`` per scored step (step 0 = before RL).
        kl_last: KL(policy || start policy) on the last step's completions (NaN without a reference).
        agreement_last: greedy agreement with the start policy on the last step's completions.
        reward_mean: mean of the steps' own rewards.
        wall_s: seconds the run took.
        before_scores, after_scores: each held-out prompt's greedy reward before and after RL (in the set's order).
    """

    seed: int
    setting: str
    before: float
    after: float
    reward_before: float
    curve: list[dict[str, float]] = field(default_factory=list)
    kl_last: float = math.nan
    agreement_last: float = math.nan
    reward_mean: float = math.nan
    wall_s: float = math.nan
    before_scores: list[float] = field(default_factory=list)
    after_scores: list[float] = field(default_factory=list)

    @property
    def change(self) -> float:
        return self.after - self.before

    @property
    def reward_after(self) -> float:
        return self.curve[-1]["eval_reward"] if self.curve else math.nan


def _same_run(a: str, b: str) -> bool:
    """Whether two saved configs (YAML) describe the same run, wherever its output went."""
    def strip(text: str) -> str:
        return re.sub(r"(?m)^\s*(out_dir|init_from):.*$", "", text)
    return strip(a) == strip(b)


def run_once(cfg: CoDraftConfig, setting: str, reuse: bool, print_fn=print) -> HeldOut:
    """Run ``cfg`` (or, when ``reuse``, load the saved result of the same run from its directory or a sibling, e.g.
    a setting that equals the recipe): held-out greedy accuracy before / after, the eval reward before RL (scored
    here, at the rollout temperature) and at every ``task.eval_every`` step."""
    out = Path(cfg.run.out_dir)
    saved = out / "heldout.json"
    config_text = to_yaml(cfg)
    if reuse:
        for f in [saved, *sorted(out.parent.glob("*/heldout.json"))]:
            data = json.loads(f.read_text()) if f.is_file() else None
            if data is not None and _same_run(data.pop("config"), config_text):
                print_fn(f"reusing {f}")
                return HeldOut(**{**data, "setting": setting})
    t0 = time.perf_counter()
    run = CoDraftRun(cfg, print_fn=print_fn)
    try:
        start = run.setup()
        if start != 0:
            raise RuntimeError(f"{out} resumed at step {start}; run.resume must be false here")
        reward_before = run.evaluate(cfg.task.eval_prompts, cfg.rl.temperature)
        for step in range(cfg.rl.steps):
            run.end_step(step, run.step(step))
        result = run.finish()
    finally:
        run.close()
    curve = [{"step": 0.0, "eval_accuracy": result.eval_before, "eval_reward": reward_before}]
    curve += [{"step": r["step"], "eval_accuracy": r["eval_accuracy"], "eval_reward": r["eval_reward"]}
              for r in result.rows if not math.isnan(r["eval_accuracy"])]
    rows = result.rows
    res = HeldOut(seed=cfg.run.seed, setting=setting, before=result.eval_before, after=result.eval_after,
                  reward_before=reward_before, curve=curve, kl_last=rows[-1]["kl"],
                  agreement_last=rows[-1]["greedy_agreement"],
                  reward_mean=statistics.fmean(r["reward"] for r in rows), wall_s=time.perf_counter() - t0,
                  before_scores=result.eval_before_scores, after_scores=result.eval_after_scores)
    write_json(saved, {"config": config_text, **dataclasses.asdict(res)})
    return res


def parse_setting(text: str) -> tuple[str, list[str]]:
    """``"NAME:key=value,key=value"`` -> ``(NAME, [overrides])``."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--setting {text!r} must read NAME:key=value[,key=value] (e.g. 'lr 1e-5:rl.lr=1e-5')")
    return name.strip(), [o.strip() for o in rest.split(",") if o.strip()]


def check_setting(name: str, overrides: list[str]) -> None:
    bad = [o for o in overrides if o.startswith(WARMUP_KEYS)]
    if bad:
        raise ValueError(f"setting {name!r} overrides {bad}: settings start from the recipe run's warm-up and "
                         f"held-out score, so they may change RL keys only (not {WARMUP_KEYS}); pass warm-up "
                         f"changes as top-level key=value overrides instead")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_") or "setting"


def spread(xs: list[float]) -> str:
    """``mean ± sd [min, max]`` of ``xs``."""
    sd = statistics.stdev(xs) if len(xs) > 1 else math.nan
    return f"{statistics.fmean(xs):.3f} ± {sd:.3f} [{min(xs):.3f}, {max(xs):.3f}]"


def mean_curve(runs: list[HeldOut]) -> list[dict[str, float]]:
    """The eval curves averaged over seeds (steps every run scored)."""
    steps = sorted(set.intersection(*(set(p["step"] for p in r.curve) for r in runs)))
    return [{"step": s, **{k: statistics.fmean(next(p[k] for p in r.curve if p["step"] == s) for r in runs)
                           for k in ("eval_accuracy", "eval_reward")}} for s in steps]


def seed_table(runs: list[HeldOut]) -> str:
    lines = ["| seed | greedy accuracy before RL | after RL | change | eval reward before RL | after RL | "
             "KL from start, last step | greedy agreement with start, last step | minutes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.seed} | {r.before:.3f} | {r.after:.3f} | {r.change:+.3f} | {r.reward_before:.3f} | "
                     f"{r.reward_after:.3f} | {r.kl_last:.4f} | {r.agreement_last:.3f} | {r.wall_s / 60:.1f} |")
    lines.append(f"| mean ± sd [min, max] | {spread([r.before for r in runs])} | {spread([r.after for r in runs])} "
                 f"| {spread([r.change for r in runs])} | {spread([r.reward_before for r in runs])} | "
                 f"{spread([r.reward_after for r in runs])} | | | |")
    return "\n".join(lines)


def per_prompt(runs: list[HeldOut]):
    """After - before RL, paired per held-out prompt over every seed's set (None without per-prompt scores)."""
    if not all(r.before_scores and len(r.before_scores) == len(r.after_scores) for r in runs):
        return None
    pairs = [(a, b) for r in runs for a, b in zip(r.after_scores, r.before_scores) if math.isfinite(a - b)]
    return paired_difference([a for a, _ in pairs], [b for _, b in pairs])


def paired_lines(runs: list[HeldOut], scored: str = "held-out") -> list[str]:
    acc = paired_difference([r.after for r in runs], [r.before for r in runs])
    rew = paired_difference([r.reward_after for r in runs], [r.reward_before for r in runs])
    prompts = per_prompt(runs)
    by_prompt = [] if prompts is None else [
        f"- {scored} greedy accuracy, after - before RL, paired per prompt over the {len(runs)} seeds' sets "
        f"({prompts.n} prompts): {str(prompts).replace('steps', 'prompts')}"]
    return by_prompt + [f"- {scored} greedy accuracy, after - before RL, paired over {acc.n} seeds: "
            f"{str(acc).replace('steps', 'seeds')}",
            f"- {scored} eval reward (one sample per prompt at the rollout temperature), after - before: "
            f"{str(rew).replace('steps', 'seeds')}"]


def settings_table(settings: dict[str, list[HeldOut]], defs: dict[str, list[str]]) -> str:
    base = settings.get("recipe")
    lines = ["| setting | overrides | greedy accuracy change (mean ± sd over seeds) | per seed | change paired per "
             "prompt over the seeds (95% CI) | vs recipe, paired over seeds (95% CI) | eval reward change | KL from "
             "start, last step (mean) | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in settings.items():
        ch = [r.change for r in runs]
        vs = "-"
        if base is not None and name != "recipe" and len(runs) >= 2:
            d = paired_difference([r.after for r in runs], [b.after for b in base])
            vs = f"{d.mean:+.3f} ({d.low:+.3f} .. {d.high:+.3f})"
        rw = [r.reward_after - r.reward_before for r in runs]
        sd = f"{statistics.stdev(ch):.3f}" if len(ch) > 1 else "-"
        pp = per_prompt(runs)
        pp = "-" if pp is None else f"{pp.mean:+.3f} ({pp.low:+.3f} .. {pp.high:+.3f})"
        lines.append(f"| {name} | `{' '.join(defs[name]) or '(as shipped)'}` | {statistics.fmean(ch):+.3f} ± {sd} | "
                     f"{', '.join(f'{c:+.3f}' for c in ch)} | {pp} | {vs} | {statistics.fmean(rw):+.3f} | "
                     f"{statistics.fmean(r.kl_last for r in runs):.4f} | "
                     f"{statistics.fmean(r.wall_s for r in runs) / 60:.1f} |")
    return "\n".join(lines)


def config_line(cfg: CoDraftConfig) -> str:
    c = cfg
    return (f"Policy {c.model.source} ({c.model.num_hidden_layers} layers, hidden {c.model.hidden_size}), SFT "
            f"{c.sft.steps} steps at lr {c.sft.lr:g}, task `{c.task.name}` ({c.task.min_terms}-{c.task.max_terms} "
            f"terms, operands 0..{c.task.max_operand}); RL: {c.rl.steps} GRPO steps x {c.rl.prompts_per_step} "
            f"prompts x {c.rl.group_size} samples, lr {c.rl.lr:g}, temperature {c.rl.temperature}, kl_coef "
            f"{c.rl.kl_coef}, advantages "
            f"{'scaled by the group std' if c.rl.scale_advantages else 'mean-centred only'}, "
            f"{c.rl.loss_aggregation}-mean loss; draft `{c.draft.mode}`; scored set: {c.task.eval_prompts} fixed "
            f"prompts of the **{c.task.eval_set}** set (`task.eval_set`), every {c.task.eval_every} steps.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "recipes" / "tiny-cpu.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run.seed values (at least 3)")
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--name", default="rl_heldout")
    ap.add_argument("--runs", default="runs/rl-seeds", help="run directories (<runs>/seed<s>/<setting>)")
    ap.add_argument("--eval-every", type=int, default=None,
                    help="task.eval_every of every run (default: the recipe's, or 5 when it has none)")
    ap.add_argument("--settings", default=None,
                    help=f"comma-separated built-in settings to run (default: all of {list(SETTINGS)}; 'none': the "
                         f"main job only)")
    ap.add_argument("--setting", action="append", default=[], metavar="NAME:key=value,...",
                    help="an extra setting (RL overrides), run like the built-in ones")
    ap.add_argument("--notes", default=None, help="markdown appended to the report (default: <out>/<name>_notes.md, "
                    "e.g. docs/benchmarks/rl_heldout_notes.md)")
    ap.add_argument("--reuse", action="store_true", help="load runs whose saved config matches instead of rerunning")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    if len(set(args.seeds)) < 3:
        raise SystemExit(f"--seeds needs at least 3 distinct seeds for a spread and a CI, got {args.seeds}")
    names = list(SETTINGS) if args.settings is None else [n.strip() for n in args.settings.split(",")
                                                          if n.strip() not in ("", "none")]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; built-in ones are {list(SETTINGS)} (add others with --setting)")
    defs = {n: SETTINGS[n] for n in names}
    for text in args.setting:
        name, ovr = parse_setting(text)
        defs[name] = ovr
    for name, ovr in defs.items():
        check_setting(name, ovr)
    base = load_config(args.config, args.overrides)
    every = args.eval_every or base.task.eval_every or 5
    common = [*args.overrides, f"task.eval_every={every}"]
    runs_dir = Path(args.runs)

    main_runs: list[HeldOut] = []
    settings: dict[str, list[HeldOut]] = {n: [] for n in defs}
    for seed in args.seeds:
        out = runs_dir / f"seed{seed}" / "main"
        cfg = isolated(load_config(args.config, [*common, f"run.seed={seed}"]), out, None)
        r = run_once(cfg, "main", args.reuse, print_fn=lambda s, seed=seed: print(f"[seed {seed}] {s}"))
        main_runs.append(r)
        print(f"seed {seed}: held-out greedy accuracy {r.before:.3f} -> {r.after:.3f} ({r.change:+.3f}), eval reward "
              f"{r.reward_before:.3f} -> {r.reward_after:.3f}, {r.wall_s:.0f}s")
        for name, ovr in defs.items():
            scfg = load_config(args.config, [*common, f"run.seed={seed}", *FAST, *ovr])
            scfg = isolated(scfg, runs_dir / f"seed{seed}" / slug(name), str(out / "warm"))
            s = run_once(scfg, name, args.reuse, print_fn=lambda x: None)
            settings[name].append(s)
            print(f"  seed {seed}, {name}: {s.before:.3f} -> {s.after:.3f} ({s.change:+.3f}), eval reward "
                  f"{s.reward_before:.3f} -> {s.reward_after:.3f}, KL {s.kl_last:.4f}, {s.wall_s:.0f}s")

    table = seed_table(main_runs)
    scored = "held-out" if base.task.eval_set == "heldout" else base.task.eval_set
    paired = paired_lines(main_runs, scored)
    print(table)
    print("\n".join(paired))
    stable = settings_table(settings, defs) if defs else ""
    if stable:
        print(stable)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    series = {"main job": mean_curve(main_runs), **{n: mean_curve(r) for n, r in settings.items() if n != "recipe"}}
    png = plot_curves(series, out / f"{args.name}.png", keys=("eval_accuracy", "eval_reward"),
                      title=f"{scored} set, mean over seeds {args.seeds}")
    cmd = command("rl_seeds.py", argv)
    job = " ".join([f"codraft fit --config {Path(args.config).name}", *args.overrides])
    text = [f"# {scored.capitalize()} accuracy of the main job's RL, over seeds", "", config_line(load_config(args.config, common)),
            "", f"## The main job (`{job}`), one full run per seed", "", table, "", *paired, "",
            f"![held-out curves]({png.name})", "",
            f"Eval reward = mean reward of one sample per held-out prompt at the rollout temperature, fixed seeds. "
            f"Held-out greedy accuracy on {base.task.eval_prompts} prompts has a binomial standard error of about "
            f"{math.sqrt(0.25 / max(base.task.eval_prompts, 1)):.3f} for one score. Minutes: wall time of the whole "
            f"run (warm-ups, RL, evaluations, speed-up measurement) on a 2-core machine shared with other jobs.", ""]
    if stable:
        same = "recipe" in settings and all(abs(m.after - r.after) < 1e-9 and m.curve == r.curve
                                            for m, r in zip(main_runs, settings["recipe"]))
        if "recipe" in settings:
            verdict = ("ends with the same held-out scores as the full main job at every scored step of every seed: "
                       "RL does not depend on the draft or on the decode batch" if same else
                       "differs from the full main job (compare the per-seed values)")
            text += [f"The `recipe` row below (draft off, the batch decoded at once) {verdict}.", ""]
        text += ["## Settings", "",
                 f"Every setting reruns the RL phase for each seed from that seed's warm-up above (same start policy, "
                 f"same held-out score before RL), with `{' '.join(FAST)}` (RL does not depend on the draft; the "
                 f"rollouts are a function of the seeds); `recipe` is the shipped RL settings under the same "
                 f"conditions. `vs recipe` is the paired per-seed difference of the held-out accuracy after RL.", "",
                 stable, ""]
    notes = Path(args.notes) if args.notes else out / f"{args.name}_notes.md"
    if notes.is_file():
        text += [notes.read_text().strip(), ""]
    text += [f"Reproduce: `{cmd}` (add `--reuse` to continue an interrupted sweep).", ""]
    path = out / f"{args.name}.md"
    path.write_text("\n".join(text))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
