"""What speculation could at best gain on a narrowing batch: plain decoding's time by batch width, bounded by the
best speed-up measured at each width.

The long-tail case of ``benchmarks/rollout.py`` (B requests whose answers end at very different lengths, so the
batch narrows as it runs) is decoded plainly, and every round's time is booked to the number of rows it decoded.
Each width's time is then divided by the best speed-up any arm (fixed K=4 or adaptive; 1.0 for plain decoding)
reached at that batch size in a ``rollout.json`` of the same model and temperature, log-interpolated between the
measured batch sizes and held constant beyond them. Prefill and the rest of the call keep their time. The bound is

    total / (rest + sum_B time(B) / best_speedup(B))

It is an upper bound for one-k-per-batch speculation with that draft on that machine. No arm beats its own
best cell, and the narrowing batch's rows are no easier than the grid's prompts (an assumption: the long tail's
prompts are the grid's held-out pool).

It also times the engine's round blocks at the batch's full width for a few fixed k (policy verify, proposals,
draft catch-up, the rest). A round of k=1 yields B plain tokens plus the accepted proposals, so it pays only if
the rows' mean first-proposal acceptance exceeds ``T(k=1) / T(k=0) - 1``. A per-row (ragged) verify could keep
only the rows above that rate; this is the figure to weigh it by.

Run (SmolLM2 about 3 minutes; reads docs/benchmarks/rollout.json): ``python benchmarks/long_tail_bound.py``.
Writes ``<out>/long_tail_bound.md``, ``long_tail_bound.png``, ``long_tail_bound.json``. Smoke: ``--model tiny
--speedups TMP/rollout.json --long-tail-batch 4 --repeats 1 --ks 1 --out TMP --work-dir TMP --tiny-overrides
sft.steps=2 draft.warm_start.steps=2``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import rollout as rb  # benchmarks/rollout.py: the same models, prompts and long-tail settings
from lightning_codraft.rollout import SpeculativeEngine
from lightning_codraft.rollout.embedded.adaptive import SpeculationController
from pages import md_table, pyplot, save_figure, write_json, write_page

ROOT = rb.ROOT


class FixedK(SpeculationController):
    """A controller that verifies the same k every round and books every round's timed blocks (its public
    hooks: ``record_round``, ``record_catch_up``)."""

    def __init__(self, k: int, max_k: int):
        super().__init__(max_k)
        self.k, self.rounds, self.catch_ups = k, [], []

    def choose(self, estimates, remaining, catch_up_span=0) -> int:
        return self.k

    def needs_calibration(self, batch_size: int) -> bool:
        return False

    def record_round(self, batch_size, k, policy_s, draft_s, rest_s, drafted=None) -> None:
        self.rounds.append((batch_size, policy_s, draft_s, rest_s))
        super().record_round(batch_size, k, policy_s, draft_s, rest_s, drafted)

    def record_catch_up(self, batch_size: int, span: int, seconds: float) -> None:
        self.catch_ups.append((batch_size, seconds))
        super().record_catch_up(batch_size, span, seconds)


def best_speedups(rows: list[dict], model: str, T: float) -> dict[int, float]:
    """``{B: best speed-up over plain decoding}`` of a rollout.json's grid cells of ``model`` at temperature T."""
    out = {}
    for r in rows:
        if r["model"] == model and r["case"] == "grid" and abs(r["T"] - T) < 1e-9:
            out[int(r["B"])] = max(1.0, r["fixed"]["speedup_cpu"], r["adaptive"]["speedup_cpu"])
    if not out:
        raise ValueError(f"the speed-up file has no grid cells of {model!r} at T={T:g}; run benchmarks/rollout.py "
                         f"for that model and temperature (or pass --speedups)")
    return out


def interpolate(best: dict[int, float], B: int) -> float:
    """The best speed-up at width B: log-log interpolation between measured batch sizes, constant beyond them."""
    sizes = sorted(best)
    if B <= sizes[0]:
        return best[sizes[0]]
    if B >= sizes[-1]:
        return best[sizes[-1]]
    hi = next(s for s in sizes if s >= B)
    lo = max(s for s in sizes if s <= B)
    if lo == hi:
        return best[lo]
    f = (math.log(B) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp((1 - f) * math.log(best[lo]) + f * math.log(best[hi]))


def profile(model, prompts, T: float, max_new: int, repeats: int) -> dict:
    """Plain decoding's CPU time by width (medians over repeats), with the call's total and its lengths."""
    ctl = FixedK(0, rb.K)
    eng = SpeculativeEngine(model.policy, model.draft, rb.K, adaptive=ctl, dtype=model.dtype)
    kw = dict(temperature=T, stop_token_ids=model.stop, request_seeds=list(range(len(prompts))))
    eng.generate(prompts, 4, **kw)  # warm-up
    runs = []
    for _ in range(repeats):
        ctl.rounds.clear()
        t0 = time.process_time()
        outs = eng.generate(prompts, max_new, **kw)
        total = time.process_time() - t0
        by = {}
        for B, p, d, r in ctl.rounds:
            by[B] = by.get(B, 0.0) + p + d + r
        runs.append((total, by))
    total = statistics.median(t for t, _ in runs)
    widths = sorted({B for _, run_by in runs for B in run_by})
    by_width = {B: statistics.median(run_by.get(B, 0.0) for _, run_by in runs) for B in widths}
    return {"total_s": total, "by_width_s": by_width, "lengths": sorted(len(o.token_ids) for o in outs)}


def round_blocks(model, prompts, T: float, ks: list[int], rounds: int) -> list[dict]:
    """Median block times of rounds at the prompts' full width for k = 0 and each of ``ks`` (fixed)."""
    kw = dict(temperature=T, stop_token_ids=model.stop, request_seeds=list(range(len(prompts))))
    B, out = len(prompts), []
    for k in [0, *ks]:
        ctl = FixedK(k, rb.K)
        eng = SpeculativeEngine(model.policy, model.draft, rb.K, adaptive=ctl, dtype=model.dtype)
        eng.generate(prompts, 4, **kw)
        ctl.rounds.clear()
        ctl.catch_ups.clear()
        eng.generate(prompts, 1 + (k + 1) * rounds, **kw)
        full = [x for x in ctl.rounds if x[0] == B][1:]  # the first round pays the prompts' catch-up
        if not full:
            raise ValueError(f"no round at the full width {B} after the first (k={k}): rows ended too soon; "
                             f"raise --block-rounds")
        med = lambda i: statistics.median(x[i] for x in full)  # noqa: E731
        catch = [t for b, t in ctl.catch_ups if b == B][1:]
        out.append({"k": k, "rounds": len(full), "policy_s": med(1), "draft_s": med(2), "rest_s": med(3),
                    "catch_up_s": statistics.median(catch) if catch else 0.0})
        out[-1]["round_s"] = out[-1]["policy_s"] + out[-1]["draft_s"] + out[-1]["rest_s"] + out[-1]["catch_up_s"]
    return out


def bound(prof: dict, best: dict[int, float]) -> float:
    decode = sum(prof["by_width_s"].values())
    ideal = prof["total_s"] - decode + sum(t / interpolate(best, B) for B, t in prof["by_width_s"].items())
    return prof["total_s"] / ideal


BANDS = ((33, 10 ** 9), (17, 32), (9, 16), (5, 8), (2, 4), (1, 1))


def report(res: dict, out: Path) -> Path:
    prof, best, blocks = res["profile"], res["best"], res["blocks"]
    total = prof["total_s"]
    lines = [f"# The long tail's bound: {res['model']}, B={res['B']}, T={res['T']:g}", "",
             f"Command: `python {' '.join(res['argv'])}` ({res['elapsed_s'] / 60:.1f} min; one torch thread, CPU "
             f"time). Speed-ups per batch size from `{res['speedups']}`.", "",
             f"Plain decoding of the long-tail prompts ({res['max_new_tokens']} tokens at most): requests ended "
             f"after {prof['lengths'][0]} / {statistics.median(prof['lengths']):g} / {prof['lengths'][-1]} tokens "
             f"(min / median / max), {total:.2f} s of CPU a call (median of {res['repeats']}).", "",
             "| rows in the round | CPU s | share | best measured speed-up there |", "|---|---|---|---|"]
    for lo, hi in BANDS:
        t = sum(v for B, v in prof["by_width_s"].items() if lo <= B <= hi)
        if t > 0:
            s = [interpolate(best, B) for B in prof["by_width_s"] if lo <= B <= hi]
            lines.append(f"| {lo}-{hi if hi < 10 ** 9 else ''} | {t:.2f} | {t / total:.0%} | "
                         f"{min(s):.2f}-{max(s):.2f}x |")
    rest = total - sum(prof["by_width_s"].values())
    lines += [f"| prefill and the rest of the call | {rest:.2f} | {rest / total:.0%} | 1.00x |", "",
              "Best speed-up over plain decoding per batch size (grid cells, best of fixed K=4 and adaptive, 1.0 "
              "where plain decoding wins): " + ", ".join(f"B={B}: {s:.2f}x" for B, s in sorted(best.items())), "",
              f"**Bound on the whole batch: {res['bound']:.2f}x plain decoding.**", "",
              f"## A round's blocks at the full width (B={res['B']}, fixed k, medians over rounds)", ""]
    t0, ms = blocks[0]["round_s"], lambda s: f"{s * 1e3:.1f} ms"
    lines += md_table(["k", "rounds", "verify (policy + sampling)", "proposals", "draft catch-up", "rest", "round",
                       "vs k=0"],
                      [(b["k"], b["rounds"], ms(b["policy_s"]), ms(b["draft_s"]), ms(b["catch_up_s"]), ms(b["rest_s"]),
                        ms(b["round_s"]), f"{b['round_s'] / t0:.2f}x") for b in blocks])
    k1 = next((b for b in blocks if b["k"] == 1), None)
    if k1 is not None:
        lines += ["", f"A k=1 round pays only if the rows' mean first-proposal acceptance exceeds "
                      f"{k1['round_s'] / t0 - 1:.2f} (= T(k=1) / T(k=0) - 1)."]
    lines += ["", "![time by width](long_tail_bound.png)", ""]
    md = out / "long_tail_bound.md"
    write_page(md, lines)
    return md


def plot(res: dict, path: Path) -> None:
    plt = pyplot()

    by = res["profile"]["by_width_s"]
    widths = sorted(by)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([str(B) for B in widths], [by[B] for B in widths], color="tab:blue", label="plain decoding")
    ax.bar([str(B) for B in widths], [by[B] / interpolate(res["best"], B) for B in widths], color="tab:orange",
           label="at the best measured speed-up")
    ax.set_xlabel("rows in the round")
    ax.set_ylabel("CPU s")
    ax.set_title(f"{res['model']} long tail: time by width (bound {res['bound']:.2f}x)")
    ax.legend()
    save_figure(fig, path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["tiny", "smollm2"])
    ap.add_argument("--speedups", default=str(ROOT / "docs" / "benchmarks" / "rollout.json"),
                    help="a rollout.json of benchmarks/rollout.py with grid cells of this model at the long tail's T")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="the engine's decode dtype, as the speed-up file's cells were run (default: SmolLM2 "
                         "bfloat16, tiny float32)")
    ap.add_argument("--repeats", type=int, default=3, help="plain passes over the long tail (medians)")
    ap.add_argument("--ks", default="1,2,4", help="fixed k whose round blocks are timed at the full width")
    ap.add_argument("--block-rounds", type=int, default=8, help="rounds of each fixed k timed")
    ap.add_argument("--long-tail-batch", type=int, default=16)
    ap.add_argument("--long-tail-tokens", type=int, default=300)
    ap.add_argument("--long-tail-temperature", type=float, default=0.0, help="SmolLM2's (tiny's is 1)")
    ap.add_argument("--smollm2-draft", default=None, help="as in benchmarks/rollout.py (default: the newest cached)")
    ap.add_argument("--heldout", type=int, default=500)
    ap.add_argument("--gsm8k", default=str(rb.GSM8K))
    ap.add_argument("--tiny-overrides", nargs="*", default=[], metavar="key=value")
    ap.add_argument("--work-dir", default="/work/runs/rollout_bench")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    args.batch_sizes = [args.long_tail_batch]
    if args.model == "smollm2" and args.smollm2_draft is None:
        found = rb.newest_cached_draft()
        if found is None:
            ap.error("no SmolLM2 draft in the warm-start cache; run `python benchmarks/draft_warmstart.py` first")
        args.smollm2_draft = str(found)
    saved = Path(args.speedups)
    if not saved.is_file():
        ap.error(f"--speedups {saved} does not exist: run benchmarks/rollout.py first")
    model = (rb.tiny_model if args.model == "tiny" else rb.smollm2_model)(args)
    args.dtype = args.dtype or ("float32" if args.model == "tiny" else "bfloat16")
    if not rb.exact_dtype(args.dtype):
        model.dtype, model.name = args.dtype, f"{model.name} {args.dtype}"
    T = model.long_temperature
    best = best_speedups(json.loads(saved.read_text())["rows"], model.name, T)
    prompts = model.long_prompts
    room = int(model.policy.config.max_position_embeddings) - max(map(len, prompts))
    max_new = min(args.long_tail_tokens, room) if args.model == "smollm2" else room
    prof = profile(model, prompts, T, max_new, args.repeats)
    ks = [int(k) for k in args.ks.split(",") if k]
    if any(not 1 <= k <= rb.K for k in ks):
        ap.error(f"--ks {args.ks}: each k must be in 1..{rb.K}")
    blocks = round_blocks(model, prompts, T, ks, args.block_rounds)
    res = {"model": model.name, "B": len(prompts), "T": T, "max_new_tokens": max_new, "repeats": args.repeats,
           "profile": prof, "best": best, "blocks": blocks, "bound": bound(prof, best), "speedups": str(saved),
           "argv": sys.argv, "elapsed_s": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "long_tail_bound.json", res)
    md = report(res, out)
    plot(res, out / "long_tail_bound.png")
    print(md.read_text())
    print(f"wrote {md}, {out / 'long_tail_bound.png'}, {out / 'long_tail_bound.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
