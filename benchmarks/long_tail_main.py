"""The main job's long tail: where in a step the adaptive engine drafts, and what it gains there.

One RL step's rollouts of the main job (recipes/tiny-cpu.yaml after its SFT and draft warm start, the warm-ups of
benchmarks/vs_trl.py: ``--prompts`` x ``--group`` samples, the recipe's ``max_new_tokens``, T=1, coupled sampling)
decoded as ONE batch, as the main job decodes them, twice per repeat: by the adaptive engine, and plainly (the same
engine told to verify nothing: the same rounds' bookkeeping, no draft). Coupled sampling makes both runs emit the
same tokens. As sequences finish the batch narrows; every round is booked to its width (the rows still decoding).

Per width band it reports the rounds, the CPU seconds of the rounds (one thread: the engine's own clock, calibration
excluded) and their share of the call, the mean speculation length the engine chose, the tokens a row emitted per
round, and the seconds speculation saved there: the band's tokens at the plain run's measured seconds per row-token
in the same band, less the adaptive run's seconds. It also prints the completions' length distribution and both
calls' whole wall time (prefill and the engine's first calibration included). The prompts are the steps' own (a
pure function of the seed and the step; the draft was warmed up on other draws).

Run: ``python benchmarks/long_tail_main.py`` (about 5 minutes, warm-ups included; they are cached under ``--work``).
Writes ``<out>/long_tail_main.md``, ``.json``, ``.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_codraft.config import load_config
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rl.run.build import build_draft, build_policy, build_task, fit_prompts
from lightning_codraft.rl.run.run_dir import warm_state
from lightning_codraft.rl.step import step_prompts
from lightning_codraft.rollout import SpeculativeEngine
from lightning_codraft.rollout.embedded.adaptive import SpeculationController
from pages import command, md_table, pyplot, save_figure, write_json, write_page
from vs_trl import RECIPE, ROOT, warm_start

def width_bands(batch: int) -> list[tuple[int, int]]:
    """Octaves of rows still decoding, widest first: ``(2^(i-1) + 1, 2^i)`` down to ``(5, 8)``, then 2-4 and 1."""
    top = 1 << max(batch - 1, 1).bit_length()
    bands, hi = [], top
    while hi > 4:
        bands.append((hi // 2 + 1, hi))
        hi //= 2
    return bands + [(2, 4), (1, 1)]


class TracingController(SpeculationController):
    """The engine's controller, unchanged, that also books every round: ``(rows, k, seconds, tokens)``; with
    ``plain`` it verifies nothing (k = 0 every round)."""

    def __init__(self, max_k: int, plain: bool = False):
        super().__init__(max_k)
        self.plain, self.rounds, self._catch_up, self._tokens = plain, [], 0.0, 0

    def choose(self, estimates, remaining, catch_up_span=0):
        k = super().choose(estimates, remaining, catch_up_span)
        return 0 if self.plain else k

    def observe(self, estimates, k, accepted, confidences=None):
        self._tokens = sum(min(a, k) + 1 for a in accepted)
        super().observe(estimates, k, accepted, confidences)

    def record_catch_up(self, batch_size, span, seconds):
        self._catch_up += seconds
        super().record_catch_up(batch_size, span, seconds)

    def record_round(self, batch_size, k, policy_s, draft_s, rest_s, drafted=None):
        self.rounds.append((batch_size, k, policy_s + draft_s + rest_s + self._catch_up, self._tokens))
        self._catch_up = 0.0
        super().record_round(batch_size, k, policy_s, draft_s, rest_s, drafted)


def by_band(rounds, bands) -> dict[tuple[int, int], dict[str, float]]:
    out: dict = {}
    for rows, k, s, tok in rounds:
        b = out.setdefault(next(b for b in bands if b[0] <= rows <= b[1]), {"rounds": 0, "seconds": 0.0, "k": 0, "tokens": 0, "row_rounds": 0})
        b["rounds"] += 1
        b["seconds"] += s
        b["k"] += k
        b["tokens"] += tok
        b["row_rounds"] += rows
    return out


def decode(engine: SpeculativeEngine, prompts, args, seed: int) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, args.max_new_tokens, temperature=1.0, seed=seed)
    return outs, time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the recipe's)")
    ap.add_argument("--group", type=int, default=None, help="samples per prompt (default: the recipe's)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="(default: the recipe's)")
    ap.add_argument("--repeats", type=int, default=3, help="steps decoded (each one a repeat: its own prompts)")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "vs_trl", help="the warm-ups (shared with vs_trl)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("overrides", nargs="*", help="recipe overrides (smoke tests)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rl = load_config(RECIPE, args.overrides).rl
    args.prompts, args.group = args.prompts or rl.prompts_per_step, args.group or rl.group_size
    args.max_new_tokens = args.max_new_tokens or rl.max_new_tokens
    args.steps, args.threads = 1, 1
    warm = warm_start(args)
    cfg = load_config(RECIPE, [*args.overrides, f"rl.prompts_per_step={args.prompts}",
                               f"rl.group_size={args.group}", f"rl.max_new_tokens={args.max_new_tokens}"])
    tok, policy, _ = build_policy(cfg.model)
    draft = build_draft(cfg, policy)
    state = warm_state(warm)
    policy.load_state_dict(state["policy"])
    draft.load_state_dict(state["draft"])
    policy.eval(), draft.eval()
    task = build_task(cfg.task)
    K = cfg.draft.num_speculative_tokens
    arms = {"adaptive": TracingController(K), "plain": TracingController(K, plain=True)}
    engines = {name: SpeculativeEngine(policy, draft, K, adaptive=ctl) for name, ctl in arms.items()}
    context = cfg.model.max_position_embeddings
    lengths, walls, bands = [], {n: [] for n in arms}, {n: [] for n in arms}
    BANDS = width_bands(args.prompts * args.group)  # noqa: N806
    for rep in range(args.repeats + 1):  # the first call of each engine calibrates its cost model: not measured
        samples = step_prompts(task, cfg, rep)
        prompts = fit_prompts([encode_prompt(tok, s.prompt) for s in samples], context, args.max_new_tokens)
        prompts = [p for p in prompts for _ in range(args.group)]
        tokens = None
        for name in (("adaptive", "plain") if rep % 2 else ("plain", "adaptive")):
            arms[name].rounds = []
            outs, wall = decode(engines[name], prompts, args, seed=1000 + rep)
            ids = [o.token_ids for o in outs]
            if tokens is not None and ids != tokens:
                raise RuntimeError("the adaptive and plain runs emitted different tokens: coupled sampling broke")
            tokens = ids
            if rep:
                walls[name].append(wall)
                bands[name].append(by_band(arms[name].rounds, BANDS))
        if rep:
            lengths += [len(t) for t in tokens]
    rows, table, n = [], [], args.repeats
    tot = lambda xs, key: sum(x[key] for x in xs)  # noqa: E731
    total = {name: sum(sum(x["seconds"] for x in b.values()) for b in bands[name]) for name in arms}
    price = {band: tot(p, "seconds") / tot(p, "tokens") for band in BANDS
             if (p := [b[band] for b in bands["plain"] if band in b]) and tot(p, "tokens")}
    for i, band in enumerate(BANDS):
        a = [b[band] for b in bands["adaptive"] if band in b]
        p = [b[band] for b in bands["plain"] if band in b]
        if not a and not p:
            continue
        # seconds per row-token of plain decoding at this width (the nearest measured width where plain has none)
        per_row_token = price[min(price, key=lambda b: abs(BANDS.index(b) - i))]
        saved = tot(a, "tokens") * per_row_token - tot(a, "seconds")
        row = {"rows": f"{band[0]}-{band[1]}" if band[0] < band[1] else str(band[0]),
               "adaptive_rounds": tot(a, "rounds") / n, "plain_rounds": tot(p, "rounds") / n,
               "adaptive_s": tot(a, "seconds") / n, "plain_s": tot(p, "seconds") / n,
               "adaptive_share": tot(a, "seconds") / total["adaptive"], "plain_share": tot(p, "seconds") / total["plain"],
               "mean_k": tot(a, "k") / tot(a, "rounds") if a else 0.0,
               "tokens_per_row_round": tot(a, "tokens") / tot(a, "row_rounds") if a else 0.0,
               "saved_s": saved / n, "priced_here": bool(p),
               "saved_share": saved / (tot(a, "tokens") * per_row_token) if a else 0.0}
        rows.append(row)
        table.append([row["rows"], f"{row['plain_rounds']:.1f}", f"{row['adaptive_rounds']:.1f}",
                      f"{row['plain_s']:.3f} ({row['plain_share']:.0%})",
                      f"{row['adaptive_s']:.3f} ({row['adaptive_share']:.0%})", f"{row['mean_k']:.2f}",
                      f"{row['tokens_per_row_round']:.2f}",
                      f"{row['saved_s']:+.3f}" + (f" ({row['saved_share']:+.0%})" if p else " (priced at another width)")])
    q = statistics.quantiles(lengths, n=10)
    at_budget = sum(n >= args.max_new_tokens for n in lengths) / len(lengths)
    wall_p, wall_a = statistics.median(walls["plain"]), statistics.median(walls["adaptive"])
    dist = (f"Completion lengths ({len(lengths)} completions, {args.repeats} steps): min {min(lengths)}, 10% {q[0]:.0f}, "
            f"median {statistics.median(lengths):.0f}, 90% {q[8]:.0f}, max {max(lengths)} tokens; "
            f"{at_budget:.0%} stop at the {args.max_new_tokens}-token budget.")
    whole = (f"Whole call, wall time (median of {args.repeats}): plain {wall_p:.2f} s, adaptive {wall_a:.2f} s "
             f"({wall_p / wall_a:.2f}x).")
    header = ["rows still decoding", "plain rounds", "adaptive rounds", "plain CPU s (share)", "adaptive CPU s (share)",
              "mean k chosen", "tokens per row per round", "saved by speculation, s (share of plain)"]
    lines = ["# The main job's long tail: where the adaptive engine drafts, and what it gains", "",
             f"`{command('long_tail_main.py', argv)}` (one thread; {torch.backends.cpu.get_cpu_capability()}).", "",
             f"One step's rollouts of the main job ({args.prompts} prompts x {args.group} samples, up to "
             f"{args.max_new_tokens} new tokens, T=1, K={K}; the policy and draft after recipes/tiny-cpu.yaml's "
             f"warm-ups) decoded as one batch of {args.prompts * args.group}, by the adaptive engine and plainly, "
             f"{args.repeats} steps (each its own prompts, never trained on); means per step. Both runs emit the same "
             "tokens (coupled sampling). Seconds are the engine's per-round CPU time; `saved` prices the adaptive "
             "run's tokens in a band at the plain run's seconds per row-token in the same band (the nearest band "
             "where plain decoding has none: the adaptive run's rows finish at other rounds).", "",
             dist, "", *md_table(header, table), "", whole, "", "![long tail](long_tail_main.png)"]
    args.out.mkdir(parents=True, exist_ok=True)
    text = write_page(args.out / "long_tail_main.md", lines)
    write_json(args.out / "long_tail_main.json", {"lengths": lengths, "bands": rows, "wall_plain": walls["plain"],
                                                  "wall_adaptive": walls["adaptive"]})
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["plain_s"] for r in rows], 0.4, label="plain")
    ax1.bar([i + 0.2 for i in x], [r["adaptive_s"] for r in rows], 0.4, label="adaptive")
    ax1.set_xticks(list(x), [r["rows"] for r in rows])
    ax1.set_xlabel("rows still decoding")
    ax1.set_ylabel("CPU s per step")
    ax1.legend()
    ax2.plot(list(x), [r["mean_k"] for r in rows], marker="o")
    ax2.set_xticks(list(x), [r["rows"] for r in rows])
    ax2.set_xlabel("rows still decoding")
    ax2.set_ylabel("mean k the engine chose")
    save_figure(fig, args.out / "long_tail_main.png")
    print(text)


if __name__ == "__main__":
    main()
