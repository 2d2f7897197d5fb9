"""Draft fit settings side by side: fresh drafts fitted for the same wall time on one feature cache, measured on
HELD-OUT prompts.

Takes the feature cache a run of ``benchmarks/draft_warmstart.py`` left (and that run's draft, for its vocabulary
map and taps), re-initialises the draft exactly as the warm start does, and fits it once per arm (the warm start's
:class:`~lightning_codraft.distill.fit.DraftFitConfig` with the arm's changes) for ``--budget-min`` minutes
of fit each. Every arm is then measured the same way: step accuracies at K on the cache's held-out documents (the
acceptance length they imply) and the embedded engine's acceptance length at K, T on the warm-start benchmark's
held-out prompts (coupled sampling: every arm decodes the very same tokens, only the proposals differ), each arm
against the first per prompt (paired, 95% CI).

First, side by side on the same training batches (``--unroll-batches``, alternating): the cost of one fit step
(unroll, loss, backward) when only the rows a loss row can reach are unrolled (what the fit does) against
unrolling every row, prompt rows included; the two losses must agree.

Prints and writes ``draft_fit_ablation.md`` / ``.png`` / ``.json``.

Run: ``python benchmarks/draft_fit_ablation.py`` after ``benchmarks/draft_warmstart.py`` (arms x (budget + ~1.5)
minutes). ``--smoke``: the warm-start benchmark's tiny smoke warm start first, seconds (the test suite runs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import time

import numpy as np
import torch

import draft_warmstart as ws
from lightning_codraft.attention.packing import shift_left_local
from lightning_codraft.distill.cache import compact_vocab, pack_batches
from lightning_codraft.distill.fit import draft_batch_loss, fit_draft
from lightning_codraft.distill.stages import install_vocab
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rl.reports.stats import paired_difference
from lightning_codraft.training.draft_loss import ttt_draft_loss
from pages import command, pyplot, save_figure, write_json

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_ARMS = ("ttt_steps=4", "ttt_steps=3", "ttt_steps=2")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ws.add_cached_run_options(ap)
    ap.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), metavar="KEY=VALUE[,KEY=VALUE]",
                    help="DraftFitConfig changes per arm (the first is the reference), e.g. 'ttt_steps=3,lr=0.003'")
    ap.add_argument("--budget-min", type=float, default=5.0,
                    help="fit wall time of every arm; 0: none, every arm fits its epochs (the same steps)")
    ap.add_argument("--unroll-batches", type=int, default=30, help="batches timed for the suffix-unroll comparison")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    if args.smoke:
        args.budget_min, args.unroll_batches = (0.02 if args.budget_min > 0 else 0.0), 2
        if args.arms == list(DEFAULT_ARMS):
            args.arms = ["ttt_steps=2", "ttt_steps=1"]
    return args


def parse_arm(spec: str, fields: set[str]) -> dict:
    """``"ttt_steps=3,lr=0.003"`` -> ``{"ttt_steps": 3, "lr": 0.003}`` (values as JSON, else strings)."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"arm {spec!r}: {item!r} is not KEY=VALUE of a DraftFitConfig field {sorted(fields)}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _full_unroll_loss(draft, embed, batch, cfg):
    """The fit's loss with every row unrolled (``cu_seqlens_q=None``), as before the suffix unroll."""
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    with torch.no_grad():
        embeds = [embed(shift_left_local(ids, cu, k + 1)).detach() for k in range(cfg.ttt_steps)]
    steps = [lg for lg, _ in draft.ttt_forward(list(batch["taps"]), embeds, cu, batch["position_ids"])]
    return ttt_draft_loss(steps, batch["compact_logits"], cu, batch["loss_mask"], *compact_vocab(steps[0].shape[-1]),
                          decay=cfg.decay)


def unroll_timing(draft, embed, cache, cfg, batches: int, seed: int = 0) -> dict:
    """Seconds per fit step (forward + backward) of the suffix unroll and of the full unroll on the same
    ``batches`` training batches, alternating which runs first; raises if their losses disagree."""
    train, _ = cache.split(cfg.val_docs)
    order = np.random.default_rng(seed).permutation(len(train))
    groups = pack_batches(cache.doc_lengths()[train][order], cfg.batch_tokens)[:batches]
    times, rows, tokens = {"suffix": 0.0, "full": 0.0}, 0, 0
    for i, group in enumerate(groups):
        batch = cache.batch([train[order[j]] for j in group])
        losses = {}
        for arm in (("suffix", "full") if i % 2 == 0 else ("full", "suffix")):
            t0 = time.perf_counter()
            out = (draft_batch_loss(draft, embed, batch, cfg.ttt_steps, cfg.decay) if arm == "suffix"
                   else _full_unroll_loss(draft, embed, batch, cfg))
            out.loss.backward()
            times[arm] += time.perf_counter() - t0
            draft.zero_grad(set_to_none=True)
            losses[arm] = float(out.loss.detach())
        if abs(losses["suffix"] - losses["full"]) > 1e-4 * max(1.0, abs(losses["full"])):
            raise SystemExit(f"suffix and full unroll losses differ: {losses}")
        rows += int(out.total[0])
        tokens += int(batch["input_ids"].shape[0])
    return dict(batches=len(groups), loss_rows=rows, tokens=tokens, suffix_s=times["suffix"], full_s=times["full"],
                speedup=times["full"] / max(times["suffix"], 1e-9))


def main(argv=None) -> None:
    args = parse_args(argv)
    run = ws.cached_run(args)
    out, wsargs, policy, settings, cache = Path(args.out_dir), run.args, run.policy, run.settings, run.cache
    template = Eagle3Draft.from_pretrained(run.draft_dir)
    names = {f.name for f in dataclasses.fields(settings.fit)}
    base = dataclasses.replace(settings.fit, time_budget_s=args.budget_min * 60 if args.budget_min > 0 else None,
                               eval_every=10**9,
                               eval_steps=wsargs.k)
    probe = Eagle3Draft(template.config)
    install_vocab(policy, probe, cache.corpus(), settings)
    timing = unroll_timing(probe, policy.embed, cache, base, args.unroll_batches)
    rates = [timing["loss_rows"] / timing[k] for k in ("suffix_s", "full_s")]
    print(f"suffix unroll: {rates[0]:.0f} rows/s against {rates[1]:.0f} unrolling every row "
          f"({timing['speedup']:.2f}x)", flush=True)
    arms = []
    for spec in args.arms:
        cfg = dataclasses.replace(base, **parse_arm(spec, names))
        draft = Eagle3Draft(template.config)
        install_vocab(policy, draft, cache.corpus(), settings)  # the warm start's initialisation, same seed
        if not torch.equal(draft.d2t, template.d2t):
            raise SystemExit(f"the vocabulary rebuilt from {cache.path} differs from {run.draft_dir}'s: pass the "
                             "matching --draft-dir / --features-dir")
        fit = fit_draft(draft, policy.embed, cache, cfg, log=print)
        stats, outs, dt = ws.engine_acceptance(policy, draft, run.held, wsargs, run.tok)
        last = fit.history[-1]
        arms.append(dict(arm=spec, steps=fit.steps, rows_seen=fit.tokens_seen, fit_seconds=fit.train_seconds,
                         val_accuracy=last["val_accuracy"], implied=last["val_acceptance"],
                         acceptance=stats.acceptance_length, per_position=stats.per_position_rate(),
                         per_prompt=[o.stats.acceptance_length for o in outs],
                         tokens=[list(o.token_ids) for o in outs], engine_seconds=dt))
        print(f"arm {spec}: {fit.steps} steps, {fit.tokens_seen} rows, implied {last['val_acceptance']:.3f}, "
              f"engine acceptance {stats.acceptance_length:.3f}", flush=True)
    if any(a["tokens"] != arms[0]["tokens"] for a in arms):
        raise SystemExit("coupled sampling must decode the same tokens in every arm; it did not")
    res = dict(command=command("draft_fit_ablation.py", args.argv), smoke=args.smoke,
               features_dir=str(cache.path), budget_min=args.budget_min, k=wsargs.k, temperature=wsargs.temperature,
               eval_prompts=len(run.held), eval_max_new_tokens=wsargs.eval_max_new_tokens,
               base=dataclasses.asdict(base), unroll_timing=timing,
               arms=[{k: v for k, v in a.items() if k != "tokens"} for a in arms])
    write_json(out / "draft_fit_ablation.json", res)
    print(write_report(out, res))


def write_report(out: Path, res: dict) -> str:
    """Write ``draft_fit_ablation.md`` and its plot from a run's results."""
    arms, first = res["arms"], res["arms"][0]
    timed = res["budget_min"] > 0
    budget = (f"fitted for {res['budget_min']:g} min (the warm start's fit settings plus the arm's changes; the "
              "schedule decays within the budget)" if timed else
              f"fitted for {res['base']['epochs']:g} epochs unless the arm says otherwise, no wall-time budget (the "
              "warm start's fit settings plus the arm's changes: every arm the same steps)")
    lines = ["# Draft fit settings side by side (SmolLM2-135M / GSM8K): same fit "
             f"{'wall time' if timed else 'steps'}, held-out prompts", "",
             f"Command: `{res['command']}`" + (" (smoke run: tiny random policy)" if res["smoke"] else ""), "",
             f"Feature cache `{Path(res['features_dir']).name}`; every arm a fresh draft initialised as the warm start "
             f"does, {budget}. Held-out step accuracies unroll K={res['k']} steps whatever "
             f"depth is trained. Engine: K={res['k']}, T={res['temperature']}, coupled sampling, "
             f"{res['eval_prompts']} held-out GSM8K prompts, at most {res['eval_max_new_tokens']} new tokens (every "
             "arm decodes the same tokens).", ""]
    t = res.get("unroll_timing")
    if t:
        lines += [f"One fit step (unroll, loss, backward) on the same {t['batches']} training batches ({t['tokens']} "
                  f"tokens, {t['loss_rows']} loss rows), alternating: unrolling only the rows a loss row can reach "
                  f"**{t['loss_rows'] / t['suffix_s']:.0f} rows/s**, every row (prompt rows included) "
                  f"{t['loss_rows'] / t['full_s']:.0f} rows/s: **{t['speedup']:.2f}x**, the same loss.", ""]
    lines += ["| arm | fit steps | rows seen | rows/s | held-out step accuracies | implied acceptance | engine "
             "acceptance | vs first arm, per prompt (95% CI) |", "|---|---|---|---|---|---|---|---|"]
    for a in arms:
        vs = "—" if a is first else str(paired_difference(a["per_prompt"], first["per_prompt"])).replace(
            "steps", "prompts")
        rate = a["rows_seen"] / max(a["fit_seconds"], 1e-9)
        lines.append(f"| `{a['arm']}` | {a['steps']} | {a['rows_seen']} | {rate:.0f} | "
                     f"{', '.join(f'{x:.3f}' for x in a['val_accuracy'])} | {a['implied']:.3f} | "
                     f"**{a['acceptance']:.3f}** | {vs} |")
    text = "\n".join(lines + ["", "![acceptance per arm](draft_fit_ablation.png)", ""])
    (out / "draft_fit_ablation.md").write_text(text)
    _plot(out / "draft_fit_ablation.png", arms, res["k"])
    return text


def _plot(path: Path, arms: list[dict], k: int) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = list(range(len(arms)))
    for shift, key, label in ((-0.2, "implied", "implied (cache held-out)"),
                              (0.2, "acceptance", "engine, held-out prompts")):
        ax.bar([i + shift for i in x], [a[key] for a in arms], 0.4, label=label)
    ax.set(xticks=x, ylim=(1.0, None), ylabel=f"acceptance length, K={k}")
    ax.set_xticklabels([a["arm"] for a in arms], fontsize=8)
    ax.legend()
    save_figure(fig, path)

if __name__ == "__main__":
    main()
