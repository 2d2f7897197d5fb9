"""Proposal temperature calibration of a warm-started draft: engine acceptance on HELD-OUT prompts, side by side.

Takes the draft a run of ``benchmarks/draft_warmstart.py`` left in its cache (and that run's feature cache),
undoes the calibration the warm start folded in (if any), and measures, with the embedded engine at K and T as
the warm-start benchmark (coupled sampling: every arm decodes the very same tokens, only the proposals differ),
the acceptance length of the fitted draft as it is (scale 1), calibrated by
:func:`~lightning_codraft.distill.calibration.calibrate_draft_temperature` (scale chosen on the feature
cache's held-out documents), and at each ``--engine-scales``. Arms are compared per prompt (paired, 95% CI).

Prints and writes ``draft_calibration.md`` / ``.png`` / ``.json``.

Run: ``python benchmarks/draft_calibration.py`` after ``benchmarks/draft_warmstart.py`` (a few minutes).
``--smoke``: the warm-start benchmark's tiny smoke warm start first, seconds (the test suite runs it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import draft_warmstart as ws
from lightning_codraft.distill.calibration import calibrate_draft_temperature
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rl.reports.stats import paired_difference
from pages import command, pyplot, save_figure, write_json

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ws.add_cached_run_options(ap)
    ap.add_argument("--engine-scales", default="0.5", help="extra scales to measure in the engine (comma list)")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    return args


def _arm(policy, draft, held, wsargs, tok, scale: float) -> dict:
    stats, outs, dt = ws.engine_acceptance(policy, draft, held, wsargs, tok)
    return dict(scale=scale, acceptance=stats.acceptance_length, per_position=stats.per_position_rate(),
                per_prompt=[o.stats.acceptance_length for o in outs], tokens=[list(o.token_ids) for o in outs],
                seconds=dt)


def main(argv=None) -> None:
    args = parse_args(argv)
    out, run = Path(args.out_dir), ws.cached_run(args)
    wsargs, tok, policy, held, ddir, cache = run.args, run.tok, run.policy, run.held, run.draft_dir, run.cache
    settings = run.settings
    saved = json.loads((ddir / "report.json").read_text())
    draft = Eagle3Draft.from_pretrained(ddir).eval()
    folded = float(saved.get("calibration", {}).get("scale", 1.0))
    with torch.no_grad():
        draft.lm_head.weight.mul_(folded)  # back to the fit's own logits
    fit = settings.fit  # the warm-start benchmark's: its held-out documents, unroll length and precision
    T = wsargs.temperature
    fitted = draft.lm_head.weight.detach().clone()

    base = _arm(policy, draft, held, wsargs, tok, 1.0)
    t0 = time.perf_counter()
    cal = calibrate_draft_temperature(draft, policy.embed, cache, cache.split(fit.val_docs)[1], fit, T)
    cal_s = time.perf_counter() - t0
    arms = [base] + ([_arm(policy, draft, held, wsargs, tok, cal.scale)] if cal.scale != 1.0 else [])
    for s in sorted({float(x) for x in args.engine_scales.split(",") if x.strip()} - {1.0, cal.scale}):
        with torch.no_grad():
            draft.lm_head.weight.copy_(fitted / s)
        arms.append(_arm(policy, draft, held, wsargs, tok, s))
    if any(a["tokens"] != base["tokens"] for a in arms):
        raise SystemExit("coupled sampling must decode the same tokens in every arm; it did not")
    res = dict(command=command("draft_calibration.py", args.argv), smoke=args.smoke,
               draft_dir=str(ddir), folded_scale=folded, k=wsargs.k, temperature=T, eval_prompts=len(held),
               eval_max_new_tokens=wsargs.eval_max_new_tokens, calibration=dict(
                   scale=cal.scale, scales=cal.scales, acceptance=cal.acceptance, rows=cal.rows, seconds=cal_s),
               arms=[{k: v for k, v in a.items() if k != "tokens"} for a in arms])
    write_json(out / "draft_calibration.json", res)
    text = write_report(out, res)
    print(text)


def write_report(out: Path, res: dict) -> str:
    """Write ``draft_calibration.md`` and its plot from a run's results."""
    cal, arms = res["calibration"], res["arms"]
    implied = dict(zip(cal["scales"], cal["acceptance"]))
    base = arms[0]
    lines = ["# Proposal temperature calibration of the warm-started draft (SmolLM2-135M / GSM8K)", "",
             f"Command: `{res['command']}`" + (" (smoke run: tiny random policy)" if res["smoke"] else ""), "",
             f"Draft: `{Path(res['draft_dir']).name}` (its folded scale {res['folded_scale']:g} undone first). "
             f"Embedded engine, K={res['k']}, T={res['temperature']}, coupled sampling, {res['eval_prompts']} "
             f"held-out GSM8K prompts, at most {res['eval_max_new_tokens']} new tokens: every arm decodes the same "
             f"tokens; only the draft's proposals differ. Chosen scale: **{cal['scale']:g}** (by implied acceptance "
             f"on {cal['rows']} held-out cache rows, {cal['seconds']:.0f} s).",
             "", "| scale | implied acceptance (overlap, cache held-out) | engine acceptance length | per-position "
             "acceptance | vs scale 1, per prompt (95% CI) |", "|---|---|---|---|---|"]
    for a in arms:
        vs = "—" if a is base or len(a["per_prompt"]) < 2 else str(paired_difference(a["per_prompt"],
                                                                                     base["per_prompt"]))
        imp = f"{implied[a['scale']]:.3f}" if a["scale"] in implied else "—"
        chosen = " (chosen)" if a["scale"] == cal["scale"] else ""
        lines.append(f"| {a['scale']:g}{chosen} | {imp} | **{a['acceptance']:.3f}** | "
                     f"{', '.join(f'{r:.2f}' for r in a['per_position'])} | {vs.replace('steps', 'prompts')} |")
    lines += ["", "Implied acceptance of every candidate scale: " + ", ".join(
        f"{s:g}: {v:.3f}" for s, v in zip(cal["scales"], cal["acceptance"])), "",
        "![implied and engine acceptance against the scale](draft_calibration.png)", ""]
    text = "\n".join(lines)
    (out / "draft_calibration.md").write_text(text)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    order = sorted(range(len(cal["scales"])), key=lambda i: cal["scales"][i])
    ax.plot([cal["scales"][i] for i in order], [cal["acceptance"][i] for i in order], "o-",
            label="implied (overlap), cache held-out")
    e = sorted(arms, key=lambda a: a["scale"])
    ax.plot([a["scale"] for a in e], [a["acceptance"] for a in e], "s--", label="engine, held-out prompts")
    ax.set_xlabel("proposal temperature scale (logits / scale)")
    ax.set_ylabel("acceptance length")
    ax.legend()
    save_figure(fig, out / "draft_calibration.png")
    return text


if __name__ == "__main__":
    main()
