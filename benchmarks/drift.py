"""What co-training is for: a policy that drifts, a frozen draft that decays, a co-trained draft that holds.

    python benchmarks/drift.py [--config recipes/tiny-drift.yaml] [--name drift] [--out docs/benchmarks] [key=value ...]
    python benchmarks/drift.py --ablation [...]        # co-train every N steps, draft loss weight lambda
    python benchmarks/drift.py --dflash 8 [...]        # plus frozen and co-trained DFlash arms, block 8
    python benchmarks/drift.py --dspark 7 [...]        # no draft, frozen and co-trained DSpark, block 7

Main mode: arms no draft / frozen draft / co-trained draft from the same seeds and the same warm start, steps
interleaved (lightning_codraft.rl.reports.compare), on a recipe whose RL really moves the policy (recipes/tiny-drift.yaml:
SFT on mostly `symbols` solutions, RL rewarding `words` solutions). Reports per step reward, KL from the start
policy, greedy agreement with it, acceptance length, rollout and step time; per arm the speed-ups over no draft;
and judges co-trained against frozen by paired per-step differences over the last half of the run (mean, 95% CI).

With ``--dflash B``: two more arms, a frozen and a co-trained DFlash block drafter (``draft.type=dflash``, block B,
B - 1 proposals a round, one draft layer), warm-started by the same warm-start budget (``draft.warm_start``) on the
same SFT'd policy, on the same prompts and seeds, interleaved with the others; their acceptance is judged the same
way (paired co-trained - frozen over the last half).

With ``--dspark B``: the arms no draft, frozen DSpark and co-trained DSpark (``draft.type=dspark``, block B in
DeepSpec's next-token layout: B proposals a round, fixed K = B, full verify; both scored every step,
``draft.score_frozen``), the same seeds, prompts and warm-start budget; co-trained against frozen by the paired
per-step difference of the measured acceptance, and the confidence head's calibration per step: the acceptance it
predicts on the step's rollouts (``predicted_acceptance``) against the engine's measured acceptance of the same
rollouts, and DeepSpec's probabilistic acceptance (``prob_acceptance``).

Ablation mode: co-trained arms that update the draft every 1 / 2 / 4 steps, with lambda in {0.1, 1, 10}, and at a
third of the draft learning rate, next to
the frozen draft (lambda = 0), against acceptance length and step time.

Writes ``<out>/<name>.md`` (+ ``<name>_curves.png``); prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from lightning_codraft.config import load_config
from lightning_codraft.rl.reports.compare import CompareResult, compare_arms, paired_difference, run_side_by_side
from lightning_codraft.rl.reports.run_log import plot_curves

REPO = Path(__file__).resolve().parent.parent


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else math.nan


def acceptance_drift(res: CompareResult, arm: str) -> tuple[float, float, float]:
    """(start, end, relative change) of an arm's acceptance length: step 1 vs the mean of the last quarter."""
    acc = res.series(arm, "acceptance_length")
    end = _mean(acc[-max(1, len(acc) // 4):])
    return acc[0], end, end / acc[0] - 1.0


def drift_table(res: CompareResult) -> str:
    rows = ["| arm | acceptance at step 1 | last quarter | change | KL from start, last step | greedy agreement, "
            "last step | rollout speed-up | end-to-end speed-up |", "|---|---|---|---|---|---|---|---|"]
    for arm in res.results:
        last = res.results[arm].rows[-1]
        ro, e2e = res.speedups(arm) if "none" in res.results else (math.nan, math.nan)
        if arm == "none":
            acc = "- | - | -"
        else:
            s, e, ch = acceptance_drift(res, arm)
            acc = f"{s:.2f} | {e:.2f} | {100 * ch:+.1f}%"
        rows.append(f"| {res.label(arm)} | {acc} | {last['kl']:.3f} | "
                    f"{last['greedy_agreement']:.3f} | {ro:.2f}x | {e2e:.2f}x |")
    return "\n".join(rows)


def goals(res: CompareResult) -> list[str]:
    """The issue's goals, each with its measured value and whether it holds."""
    out = []
    kl = res.series("cotrain", "kl")
    q = max(1, len(kl) // 4)
    out.append(f"KL from the start policy rises: first quarter {_mean(kl[:q]):.3f} -> last quarter "
               f"{_mean(kl[-q:]):.3f} ({'yes' if _mean(kl[-q:]) > _mean(kl[:q]) else 'NO'})")
    _, _, fch = acceptance_drift(res, "frozen")
    out.append(f"frozen draft's acceptance falls by >= 25% of its start: {100 * -fch:.1f}% "
               f"({'yes' if -fch >= 0.25 else 'NO'})")
    _, _, cch = acceptance_drift(res, "cotrain")
    out.append(f"co-trained draft stays within 10% of its start: {100 * cch:+.1f}% "
               f"({'yes' if abs(cch) <= 0.10 else 'NO'})")
    d = res.paired("cotrain", "frozen", "acceptance_length")
    out.append(f"paired co-trained - frozen acceptance, last half >= +0.5 with its 95% CI above 0: {d} "
               f"({'yes' if d.mean >= 0.5 and d.low > 0 else 'NO'})")
    if "none" in res.results:
        rc, rf = res.speedups("cotrain")[0], res.speedups("frozen")[0]
        out.append(f"co-trained rollout speed-up above frozen: {rc:.2f}x vs {rf:.2f}x ({'yes' if rc > rf else 'NO'})")
        for a in ("frozen", "cotrain"):
            r = res.paired(a, "none", "reward", last_half=False)
            same = res.series(a, "reward") == res.series("none", "reward")
            how = ("identical at every step: coupled sampling makes the rollouts independent of the draft"
                   if same else "agreement = the 95% CI contains 0")
            out.append(f"reward agrees with no draft ({res.label(a)} - no draft, whole run; {how}): {r} "
                       f"({'yes' if same or r.low <= 0 <= r.high else 'NO'})")
    return out


def per_step_table(res: CompareResult) -> str:
    arms = list(res.results)
    head = "| step | " + " | ".join(f"{res.label(a)}: reward / KL / acceptance" for a in arms) + " |"
    lines = [head, "|---|" + "---|" * len(arms)]
    for i in range(len(res.results[arms[0]].rows)):
        cells = []
        for a in arms:
            r = res.results[a].rows[i]
            cells.append(f"{r['reward']:.3f} / {r['kl']:.3f} / {r['acceptance_length']:.2f}")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shown(path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(path)


def setup_line(cfg, args) -> str:
    c = cfg
    styles = (f" (SFT styles {list(c.task.styles)} weights {c.task.style_weights}, RL reward requires "
              f"`{c.task.required_style}`)" if c.task.required_style else "")
    shape = (f" ({c.model.num_hidden_layers} layers, hidden {c.model.hidden_size})" if c.model.source == "tiny"
             else "")
    return (f"Recipe `{Path(args.config).name}` ({' '.join(args.overrides) or 'as shipped'}): task `{c.task.name}`"
            f"{styles}, policy {c.model.source}{shape}, {c.rl.steps} GRPO steps x {c.rl.prompts_per_step} prompts x "
            f"{c.rl.group_size} samples, lr {c.rl.lr}, temperature {c.rl.temperature}, K = "
            f"{c.draft.num_speculative_tokens} ({'adaptive' if c.draft.adaptive else 'fixed'}), the embedded engine "
            f"decoding {c.parallel.engine_batch_size or 'all'} sequence(s) at a time, draft lr {c.draft.lr}, "
            f"{c.parallel.accelerator}, seed {c.run.seed}.")


NEAR_TIES = ("The arms' rollouts are the same samples (coupled sampling: a token is a function of the request's seed "
             "and position, docs/design/sampling.md), so the reward curves agree by construction, except where two "
             "tokens' noised logits tie within float rounding: the speculative arms score a position inside a K+1 "
             "verify forward, the plain arm in a one-token forward, and a last-bit difference can flip such a "
             "near tie; from then on that arm's policy takes slightly different updates (a small KL gap by the end).")


def dflash_arms(args, kind: str = "dflash") -> dict:
    """The frozen and co-trained block drafter arms' configs (``--dflash B`` / ``--dspark B``), the recipe's settings
    otherwise (DSpark: every proposal verified, both arms scored every step)."""
    B = getattr(args, kind)
    extra = [f"draft.type={kind}", f"draft.block_size={B}", "draft.adaptive=false",
             f"draft.num_speculative_tokens={B if kind == 'dspark' else B - 1}"]
    if kind == "dspark":
        extra.append("draft.score_frozen=true")
    cfg = load_config(args.config, [f"run.out_dir=runs/bench-{args.name}", *args.overrides, *extra])
    return {f"{kind}-{mode}": dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, mode=mode))
            for mode in ("frozen", "cotrain")}


def dspark_goals(res: CompareResult) -> list[str]:
    """The DSpark arms' lines: co-trained against frozen, and the confidence head's calibration."""
    d = res.paired("dspark-cotrain", "dspark-frozen", "acceptance_length")
    lines = [f"frozen DSpark's acceptance change, step 1 -> last quarter: "
             f"{100 * acceptance_drift(res, 'dspark-frozen')[2]:+.1f}%",
             f"co-trained DSpark's: {100 * acceptance_drift(res, 'dspark-cotrain')[2]:+.1f}%",
             f"paired co-trained - frozen DSpark acceptance, last half: {d} "
             f"({'above 0' if d.low > 0 else 'CI holds 0'})"]
    for arm in ("dspark-frozen", "dspark-cotrain"):
        err = [p - m for p, m in zip(res.series(arm, "predicted_acceptance"), res.series(arm, "acceptance_length"))]
        q = max(1, len(err) // 4)
        lines.append(f"{res.label(arm)}: predicted - measured acceptance, mean over steps {_mean(err):+.2f} "
                     f"(mean |error| {_mean(abs(e) for e in err):.2f}; first quarter {_mean(err[:q]):+.2f}, last "
                     f"quarter {_mean(err[-q:]):+.2f}); paired over the whole run: "
                     f"{paired_difference(res.series(arm, 'predicted_acceptance'), res.series(arm, 'acceptance_length'))}")
    return lines


def calibration_table(res: CompareResult) -> str:
    """Per step: each DSpark arm's measured acceptance, the confidence head's prediction and DeepSpec's
    probabilistic acceptance on the same rollouts."""
    arms = [a for a in ("dspark-frozen", "dspark-cotrain") if a in res.results]
    head = "| step | KL from start | " + " | ".join(
        f"{res.label(a)}: measured | predicted | prob." for a in arms) + " |"
    lines = [head, "|---|---|" + "---|---|---|" * len(arms)]
    kl = res.series(arms[-1], "kl")
    for i in range(len(kl)):
        cells = [f"{res.series(a, 'acceptance_length')[i]:.2f} | {res.series(a, 'predicted_acceptance')[i]:.2f} | "
                 f"{res.series(a, 'prob_acceptance')[i]:.2f}" for a in arms]
        lines.append(f"| {i + 1} | {kl[i]:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def dflash_goals(res: CompareResult) -> list[str]:
    """The DFlash arms' lines: co-trained against frozen (the issue's figure), and against EAGLE-3's co-trained."""
    d = res.paired("dflash-cotrain", "dflash-frozen", "acceptance_length")
    e = res.paired("dflash-cotrain", "cotrain", "acceptance_length")
    _, _, ch = acceptance_drift(res, "dflash-frozen")
    return [f"frozen DFlash's acceptance change, step 1 -> last quarter: {100 * ch:+.1f}%",
            f"paired co-trained - frozen DFlash acceptance, last half: {d} ({'above 0' if d.low > 0 else 'CI holds 0'})",
            f"paired co-trained DFlash - co-trained EAGLE-3 acceptance, last half (different proposals per round: "
            f"B - 1 against K): {e}"]


def run_dspark(cfg, args) -> str:
    arms = dflash_arms(args, "dspark")
    base = arms["dspark-frozen"]  # the recipe with the DSpark drafter: every arm's warm start is DSpark's
    configs = {"none": dataclasses.replace(base, draft=dataclasses.replace(base.draft, mode="none")), **arms}
    res = run_side_by_side(configs, Path(cfg.run.out_dir) / "bench", base)
    res.labels.update({"dspark-frozen": f"frozen DSpark (B={args.dspark})",
                       "dspark-cotrain": f"co-trained DSpark (B={args.dspark})"})
    out = Path(args.out)
    png = plot_curves({res.label(a): r.rows for a, r in res.results.items()}, out / f"{args.name}_curves.png",
                      keys=("reward", "kl", "acceptance_length", "predicted_acceptance", "rollout_s"),
                      title="drift: frozen vs co-trained DSpark (same seeds)")
    g = dspark_goals(res)
    d = configs["dspark-cotrain"].draft
    text = "\n".join([
        f"# Drift with DSpark: frozen against co-trained, and how well its confidence head predicts ({args.name})",
        "", setup_line(base, args), "",
        f"DSpark arms: block {args.dspark} in DeepSpec's next-token layout ({args.dspark} proposals a round, every one "
        f"verified: fixed K = {d.num_speculative_tokens}), one draft layer, Markov rank min(256, hidden), a confidence "
        f"head, DeepSpec's loss (CE {d.dspark_ce_weight:g}, L1 {d.dspark_l1_weight:g}, confidence "
        f"{d.dspark_confidence_weight:g}); the same warm-start budget on the same SFT'd policy, the same prompts and "
        "seeds as the EAGLE-3 and DFlash arms of drift.md / drift_dflash.md. Both DSpark arms are scored on every "
        "step's rollouts (`draft.score_frozen`): *predicted* is the acceptance length its confidence head predicts "
        "(`1 + sum cumprod(sigmoid(c))` over the step's training blocks), *prob.* DeepSpec's probabilistic acceptance "
        "(`1 + sum cumprod(1 - TV)` against the live policy), *measured* the engine's tokens per round on the same "
        "rollouts.", "",
        res.table(), "", drift_table(res), "", "Findings:", "", *[f"- {x}" for x in g], "", NEAR_TIES, "",
        f"![curves]({png.name})", "", "Calibration per step:", "", calibration_table(res), "",
        f"Reproduce: `python benchmarks/drift.py --dspark {args.dspark} --config {_shown(args.config)} --name "
        f"{args.name}{' ' + ' '.join(args.overrides) if args.overrides else ''}`.", ""])
    print(res.table())
    print("\n".join(g))
    return text


def run_main(cfg, args) -> str:
    if args.dflash:
        configs = {a: dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, mode=a))
                   for a in ("none", "frozen", "cotrain")}
        configs.update(dflash_arms(args))
        res = run_side_by_side(configs, Path(cfg.run.out_dir) / "bench", cfg)
        res.labels.update({"frozen": "frozen EAGLE-3", "cotrain": "co-trained EAGLE-3",
                           "dflash-frozen": f"frozen DFlash (B={args.dflash})",
                           "dflash-cotrain": f"co-trained DFlash (B={args.dflash})"})
    else:
        res = compare_arms(cfg)
    out = Path(args.out)
    png = plot_curves({res.label(a): r.rows for a, r in res.results.items()}, out / f"{args.name}_curves.png",
                      keys=("reward", "kl", "greedy_agreement", "acceptance_length", "rollout_s"),
                      title="drift: no draft vs frozen vs co-trained draft (same seeds)")
    g = goals(res) + (dflash_goals(res) if args.dflash else [])
    text = "\n".join([
        f"# Drift: a frozen draft decays, a co-trained draft holds ({args.name})", "", setup_line(cfg, args), "",
        "Arms from the same warm start and seeds, steps interleaved, ratios measured side by side in one run. "
        "Acceptance length = tokens per verification round of the rollouts (fixed K: comparable across arms). "
        "KL = k3 estimate of KL(policy || start policy) on the step's completions; greedy agreement = share of "
        "completion positions where the policy's and the start policy's argmax agree.", "",
        *([f"DFlash arms: block {args.dflash} ({args.dflash - 1} proposals a round against EAGLE-3's K = "
            f"{cfg.draft.num_speculative_tokens}: the drafters' acceptance lengths are not on one scale), the same "
            f"warm-start budget on the same SFT'd policy.", ""] if args.dflash else []),
        res.table(), "", drift_table(res), "", "Goals (issue #15):", "", *[f"- {x}" for x in g], "", NEAR_TIES, "",
        f"![curves]({png.name})", "", "Per step:", "", per_step_table(res), "",
        f"Reproduce: `python benchmarks/drift.py --config {_shown(args.config)} --name {args.name}"
        f"{' ' + ' '.join(args.overrides) if args.overrides else ''}`.", ""])
    print(res.table())
    print(drift_table(res))
    print("\n".join(g))
    return text


ABLATION = {
    "frozen (lambda = 0)": {"mode": "frozen"},
    "every step, lambda = 1": {"mode": "cotrain"},
    "every 2 steps": {"mode": "cotrain", "schedule": "every_n", "train_every": 2},
    "every 4 steps": {"mode": "cotrain", "schedule": "every_n", "train_every": 4},
    "lambda = 0.1": {"mode": "cotrain", "loss_weight": 0.1},
    "lambda = 10": {"mode": "cotrain", "loss_weight": 10.0},
    "draft lr / 3": {"mode": "cotrain", "lr_scale": 1 / 3},
}


def run_ablation(cfg, args) -> str:
    configs = {}
    for name, kw in ABLATION.items():
        kw = dict(kw)
        if "lr_scale" in kw:
            kw["lr"] = cfg.draft.lr * kw.pop("lr_scale")
        configs[name] = dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, **kw))
    res = run_side_by_side(configs, Path(cfg.run.out_dir) / "ablation", cfg)
    base = "every step, lambda = 1"
    lines = ["| arm | acceptance, last half | vs every step (paired, last half) | vs frozen (paired, last half) | "
             "rollout s per step | train s per step | step s per step |", "|---|---|---|---|---|---|---|"]
    for name in res.results:
        acc = res.series(name, "acceptance_length")
        half = acc[len(acc) // 2:]
        vs = "-" if name == base else str(res.paired(name, base, "acceptance_length"))
        vf = "-" if name.startswith("frozen") else str(res.paired(name, "frozen (lambda = 0)", "acceptance_length"))
        lines.append(f"| {name} | {_mean(half):.2f} | {vs} | {vf} | {_mean(res.series(name, 'rollout_s')):.2f} | "
                     f"{_mean(res.series(name, 'train_s')):.2f} | "
                     f"{_mean(res.series(name, 'step_s')):.2f} |")
    table = "\n".join(lines)
    png = plot_curves({n: r.rows for n, r in res.results.items()}, Path(args.out) / f"{args.name}_curves.png",
                      keys=("acceptance_length", "train_s"), title="ablation: how often and how strongly to co-train")
    print(table)
    return "\n".join([f"# Co-training ablation ({args.name})", "", setup_line(cfg, args), "",
                      "All arms from the same warm start and seeds, interleaved. `every N steps` updates the draft on "
                      "every N-th RL step only (`draft.train_every`; its backward still runs, the update is skipped); "
                      "lambda is `draft.loss_weight`; `draft lr / 3` co-trains every step at a third of the recipe's "
                      f"draft learning rate ({cfg.draft.lr:g}). The draft's parameters are its own, so lambda only "
                      "scales the draft's gradients, which AdamW normalises away (up to its epsilon and the gradient "
                      "clip): the learning rate, not lambda, sets how fast the draft follows.", "", table, "", f"![curves]({png.name})", "",
                      f"Reproduce: `python benchmarks/drift.py --ablation --config {_shown(args.config)}"
                      f"{' ' + ' '.join(args.overrides) if args.overrides else ''}`.", ""])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "recipes" / "tiny-drift.yaml"))
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("--name", default=None, help="report name (default: drift, or drift_ablation)")
    ap.add_argument("--ablation", action="store_true")
    ap.add_argument("--dflash", type=int, default=0, metavar="B",
                    help="also run frozen and co-trained DFlash arms of block size B (0: none)")
    ap.add_argument("--dspark", type=int, default=0, metavar="B",
                    help="run no draft, frozen and co-trained DSpark of block size B instead (0: not this mode)")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    args.name = args.name or ("drift_ablation" if args.ablation else "drift_dflash" if args.dflash
                              else "drift_dspark" if args.dspark else "drift")
    cfg = load_config(args.config, [f"run.out_dir=runs/bench-{args.name}", *args.overrides])
    if cfg.rl.steps < 4:
        ap.error(f"rl.steps={cfg.rl.steps}: the paired statistics over the last half need rl.steps >= 4")
    text = run_ablation(cfg, args) if args.ablation else run_dspark(cfg, args) if args.dspark else run_main(cfg, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(text)
    print(f"wrote {out / f'{args.name}.md'}")


if __name__ == "__main__":
    main()
