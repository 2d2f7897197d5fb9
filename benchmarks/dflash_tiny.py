"""DSpark and DFlash against EAGLE-3 after the same warm-start budget: acceptance and rollout speed at batch B
(``--batch-sizes``, default 1), T=0 and T=1, on prompts no draft trained on.

Models (``--recipe``): the tiny-cpu recipe's SFT'd arithmetic policy (the default), or SmolLM2-135M-Instruct on GSM8K
(``--recipe smollm2-135m-cpu``: its pool warm start, ``draft.warm_start.corpus=null``, so both drafters fit on the
same pool for the same steps; the recipe's 58-minute corpus warm start is EAGLE-3's alone). The EAGLE-3 draft after
the recipe's warm start (``CoDraftRun(...).setup()``; ``--init-from`` reuses a run's ``warm/weights.pt``), and a DFlash
drafter (``DFlashDraft.from_policy``: one draft layer, block ``--block``) and a DSpark drafter (``DSparkDraft``: the
same backbone, block ``--block - 1`` in DeepSpec's next-token layout, so both propose ``--block - 1`` tokens a round;
Markov rank ``--markov-rank``, a confidence head; DeepSpec's three-term loss) each fitted for ``--steps`` steps
(default: the recipe's EAGLE-3 warm-start steps) at ``--lr``
(``distill.pool.fit_on_pool`` through DFlash's term: the one fit loop, cosine to 10%) on
the SAME pool of the policy's own samples the EAGLE-3 warm start uses (``distill.pool.sample_pool``: the recipe's
``draft.warm_start.batch_size`` x ``min(steps, 8)`` problems at the rollout temperature), with ``--anchors``
anchors per document.

Arms, on ``max(B, --prompts)`` problems drawn with a benchmark seed minus every pool problem, B requests decoded
together, ``--max-new-tokens`` tokens, coupled sampling with one seed per request: plain decoding, EAGLE-3 (fixed K =
the recipe's, the embedded engine), DFlash (``block - 1`` proposals a round, one drafter forward: the block engine,
rollout/embedded/block.py), DSpark (the same engine, proposals drawn through its Markov head), DSpark with the
confidence-chosen verify length (``verify_length="confidence"``, threshold 0.5), and the three adaptive (k in 0..K
chosen each round by the engine's cost model from earlier rounds; DSpark's then shortened by its confidence head and
the cost model; one engine per drafter, its controller kept across cells as in a run). Every arm emits the same tokens
(checked: lossless). Time: ``time.process_time()`` of this process with one torch thread, the arms alternating within each of
``--repeats`` repeats; speed-ups are medians of the per-repeat ratios against plain decoding of the same repeat.

Writes ``<out>/dflash_tiny.md``, ``.json``, ``.png`` (``dflash_smollm2.*`` for SmolLM2). Smoke: ``--steps 2 --prompts 2
--max-new-tokens 6 --repeats 1 --recipe-overrides sft.steps=2 draft.warm_start.steps=2 --out TMP``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from lightning_codraft.config import load_config
from lightning_codraft.distill.pool import POOL_SEED, fit_on_pool, pool_prompts, sample_pool
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.models.tokenizer import encode_prompt
from lightning_codraft.rollout import AcceptanceStats, SpeculativeEngine
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine
from lightning_codraft.training.module import CoDraftModule
from pages import command, md_table, pyplot, save_figure, write_json, write_page

ROOT = Path(__file__).resolve().parent.parent
PROMPT_SEED = 7_000_003  # the rollout benchmark's draw (disjoint from the warm-up seeds)
ARMS = ("plain", "eagle3", "dflash", "dspark", "dspark-confidence", "eagle3-adaptive", "dflash-adaptive",
        "dspark-adaptive")


PAGES = {"tiny-cpu": "dflash_tiny", "smollm2-135m-cpu": "dflash_smollm2"}
RECIPE_OVERRIDES = {"smollm2-135m-cpu": ["draft.warm_start.corpus=null", "parallel.engine_dtype=null"]}
"""The pool warm start (the same budget for both drafters) and fp32 decoding (the block engine's dtype) for SmolLM2."""


def build(args):
    """The recipe's policy and EAGLE-3 draft after its warm-ups, the run's config and task."""
    from lightning_codraft.rl.run.loop import CoDraftRun

    base = ["run.threads=1", "run.resume=false", "run.progress=false", "run.plots=false", "task.eval_prompts=0",
            f"run.out_dir={Path(args.work_dir) / args.recipe}", *RECIPE_OVERRIDES.get(args.recipe, []),
            *args.recipe_overrides]
    if args.init_from:
        base.append(f"run.init_from={args.init_from}")
    cfg = load_config(ROOT / "recipes" / f"{args.recipe}.yaml", base)
    run = CoDraftRun(cfg, print_fn=lambda m: print("   " + m, flush=True))
    run.setup()
    policy, draft, tok, task = run.module.policy.eval(), run.module.draft.eval(), run.tokenizer, run.task
    run.close()
    return cfg, policy, draft, tok, task


def fit_dflash(cfg, policy, tok, task, args, kind="dflash") -> tuple[DFlashDraft, list[float], list[float], set[str]]:
    """A block drafter (``kind``: dflash or dspark) fitted on the EAGLE-3 warm start's pool; its losses, its last
    step's top-1 accuracy per block position (on the pool), the pool's problems."""
    ws = cfg.draft.warm_start
    samples = task.sample(pool_prompts(ws), seed=cfg.run.seed + POOL_SEED)
    torch.manual_seed(cfg.run.seed)
    if kind == "dspark":
        drafter = DSparkDraft.from_policy(policy, markov_rank=args.markov_rank, block_size=args.block - 1,
                                          mask_token_id=int(tok.pad_token_id))
    else:
        drafter = DFlashDraft.from_policy(policy, block_size=args.block, mask_token_id=int(tok.pad_token_id))
    prompts = [encode_prompt(tok, s.prompt) for s in samples]
    batches = sample_pool(policy, drafter, prompts, ws, max_new_tokens=cfg.rl.max_new_tokens,
                          temperature=cfg.rl.temperature, top_p=cfg.rl.top_p, seed=cfg.run.seed + POOL_SEED,
                          stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    last = []

    def on_step(i, loss, accuracy):
        last[:] = [round(a, 2) for a in accuracy]
        if (i + 1) % max(1, args.steps // 5) == 0:
            print(f"  {kind} fit step {i + 1}/{args.steps}: loss {loss:.3f}, position accuracy {last}", flush=True)

    module = CoDraftModule(policy, drafter, block_anchors=args.anchors, block_gamma=args.gamma)
    losses = fit_on_pool(module, batches, args.steps, args.lr, on_step=on_step)
    accuracy = last
    return drafter.eval(), losses, accuracy, {s.prompt for s in samples}


def measure(engines: dict, prompts: list[list[int]], B: int, T: float, args, stop: list[int]) -> dict:
    """Every arm on ``prompts``, ``B`` requests decoded together, the arms alternating; a row of the table."""
    seeds = list(range(len(prompts)))
    for engine in engines.values():  # the adaptive engines keep their controllers across cells, as in a run
        engine.max_batch_size = B
    for arm in ARMS:  # untimed: first-call paths, and the adaptive engines' cost models calibrate at this width
        engines[arm].generate(prompts[:B], 4, temperature=T, request_seeds=seeds[:B], stop_token_ids=stop)
    cpu = {a: [] for a in ARMS}
    outs = {}
    for r in range(args.repeats):
        for arm in ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]:
            c0 = time.process_time()
            outs[arm] = engines[arm].generate(prompts, args.max_new_tokens, temperature=T, request_seeds=seeds,
                                              stop_token_ids=stop)
            cpu[arm].append(time.process_time() - c0)
    same = {arm: [o.token_ids for o in outs[arm]] == [o.token_ids for o in outs["plain"]] for arm in ARMS}
    row = {"B": B, "T": T, "prompts": len(prompts), "tokens": sum(len(o.token_ids) for o in outs["plain"]),
           "lossless": all(same.values())}
    for arm in ARMS:
        st = AcceptanceStats.total(o.stats for o in outs[arm])
        row[arm] = {"acceptance": st.acceptance_length, "mean_k": st.mean_k, "cpu_s": statistics.median(cpu[arm]),
                    "speedup": statistics.median(p / c for p, c in zip(cpu["plain"], cpu[arm])),
                    "range": [min(p / c for p, c in zip(cpu["plain"], cpu[arm])),
                              max(p / c for p, c in zip(cpu["plain"], cpu[arm]))]}
    return row


def report(rows: list[dict], args, notes: list[str], out: Path) -> str:
    header = ["B", "T", "arm", "acceptance length", "mean k", "speed-up vs plain (range)", "CPU s",
              "same tokens as plain"]
    body = [[r["B"], f"{r['T']:g}", arm, "-" if arm == "plain" else f"{r[arm]['acceptance']:.2f}",
             "-" if arm == "plain" else f"{r[arm]['mean_k']:.2f}",
             f"{r[arm]['speedup']:.2f}x ({r[arm]['range'][0]:.2f}-{r[arm]['range'][1]:.2f})",
             f"{r[arm]['cpu_s']:.2f}", "yes" if r["lossless"] else "**NO**"] for r in rows for arm in ARMS]
    goal = [f"B=1 T={r['T']:g}: acceptance DSpark {r['dspark']['acceptance']:.2f}, DFlash "
            f"{r['dflash']['acceptance']:.2f}, EAGLE-3 {r['eagle3']['acceptance']:.2f}; speed-up DSpark "
            f"{r['dspark']['speedup']:.2f}x, with the confidence prefix {r['dspark-confidence']['speedup']:.2f}x"
            for r in rows if r["B"] == 1]
    page = PAGES.get(args.recipe, f"dflash_{args.recipe}")
    lines = [f"# DSpark and DFlash against EAGLE-3 on {args.recipe}, after the same warm-start budget", "",
             f"`{command('dflash_tiny.py')}`", "",
             f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread.", "",
             *[f"- {n}" for n in notes], "", *md_table(header, body), "", *[f"- {g}" for g in goal], "",
             f"![acceptance and speed-up]({page}.png)", ""]
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in ((axes[0], "acceptance", "acceptance length"), (axes[1], "speedup", "speed-up vs plain")):
        for i, arm in enumerate(ARMS[1:]):
            ax.bar([j + 0.11 * i for j in range(len(rows))], [r[arm][key] for r in rows], width=0.11, label=arm)
        ax.set_xticks([j + 0.35 for j in range(len(rows))], [f"B={r['B']} T={r['T']:g}" for r in rows], fontsize=7)
        ax.set_title(title)
    axes[0].legend(fontsize=6)
    save_figure(fig, out / f"{page}.png")
    return write_page(out / f"{page}.md", lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--block", type=int, default=8, help="DFlash block size B (B - 1 proposals a round)")
    ap.add_argument("--recipe", default="tiny-cpu", choices=sorted(PAGES), help="the policy and its EAGLE-3 warm start")
    ap.add_argument("--steps", type=int, default=None, help="DFlash fit steps (default: the recipe's EAGLE-3 warm start)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--markov-rank", type=int, default=None, help="DSpark's Markov rank (default min(256, hidden))")
    ap.add_argument("--gamma", type=float, default=5.0, help="position k weighs exp(-(k-1)/gamma)")
    ap.add_argument("--anchors", type=int, default=8, help="anchors per document and step")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--batch-sizes", default="1", help="requests decoded together (a cell decodes max(B, --prompts))")
    ap.add_argument("--init-from", default=None, help="a run's warm/weights.pt of this recipe (skips the warm-ups)")
    ap.add_argument("--recipe-overrides", nargs="*", default=[])
    ap.add_argument("--work-dir", default="/tmp/codraft_dflash_tiny")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, policy, draft, tok, task = build(args)
    args.steps = cfg.draft.warm_start.steps if args.steps is None else args.steps
    t0 = time.perf_counter()
    drafter, losses, accuracy, pool = fit_dflash(cfg, policy, tok, task, args)
    fit_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    spark, spark_losses, spark_accuracy, _ = fit_dflash(cfg, policy, tok, task, args, kind="dspark")
    spark_s = time.perf_counter() - t0
    drawn = task.sample(20 * max(args.prompts, 64) + 200, seed=PROMPT_SEED)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    prompts = [encode_prompt(tok, s.prompt) for s in drawn if s.prompt not in pool][: max(args.prompts, *sizes)]
    K = cfg.draft.num_speculative_tokens
    engines = {"plain": SpeculativeEngine(policy, None, 0), "eagle3": SpeculativeEngine(policy, draft, K),
               "dflash": BlockSpeculativeEngine(policy, drafter),
               "dspark": BlockSpeculativeEngine(policy, spark),
               "dspark-confidence": BlockSpeculativeEngine(policy, spark, verify_length="confidence"),
               "eagle3-adaptive": SpeculativeEngine(policy, draft, K, adaptive=True),
               "dflash-adaptive": BlockSpeculativeEngine(policy, drafter, adaptive=True),
               "dspark-adaptive": BlockSpeculativeEngine(policy, spark, adaptive=True, verify_length="confidence")}
    rows = []
    for B in (int(b) for b in args.batch_sizes.split(",")):
        for T in (float(t) for t in args.temperatures.split(",")):
            cell = prompts[: max(args.prompts, B)]
            rows.append(measure(engines, cell, B, T, args, [tok.eos_token_id]))
            r = rows[-1]
            print(f"B={B} T={T:g}: " + "; ".join(f"{a} acceptance {r[a]['acceptance']:.2f}, {r[a]['speedup']:.2f}x"
                                                for a in ARMS[1:]) + f"; lossless {r['lossless']}", flush=True)
    notes = [f"policy: {args.recipe} recipe ({policy.config.num_hidden_layers} layers, hidden "
             f"{policy.config.hidden_size}, fp32); "
             f"EAGLE-3: the recipe's warm start ({cfg.draft.warm_start.steps} steps), K={K} fixed",
             f"DFlash: 1 layer, block {args.block} ({args.block - 1} proposals a round), {args.steps} steps at lr "
             f"{args.lr} on the same pool ({len(pool)} problems), {args.anchors} anchors per document, gamma "
             f"{args.gamma}; loss {losses[0]:.2f} -> {losses[-1]:.2f} in {fit_s:.0f} s; top-1 accuracy per block "
             f"position on the pool at the end {accuracy}, against its acceptance on fresh prompts below (DFlash's "
             f"published drafters train on hundreds of thousands of samples, this one on {len(pool)} problems)",
             f"DSpark: the same backbone, block {args.block - 1} in DeepSpec's next-token layout ({args.block - 1} "
             f"proposals a round), Markov rank {spark.config.markov_rank}, a confidence head, DeepSpec's loss "
             f"(CE 0.1, L1 0.9, confidence 1.0); the same steps, pool and anchors; loss {spark_losses[0]:.2f} -> "
             f"{spark_losses[-1]:.2f} in {spark_s:.0f} s; top-1 accuracy per position on the pool {spark_accuracy}; "
             "`dspark-confidence` verifies the prefix its confidence head chooses (threshold 0.5, from the hidden "
             "states before any proposal is drawn)",
             "adaptive arms: each round's k in 0..K chosen by the engine's cost model from earlier rounds (a prefix "
             "of the block for the block drafters; DSpark's then shortened by its confidence head and the cost "
             "model); their acceptance counts drafting rounds only",
             f"prompts: `task.sample(.., seed={PROMPT_SEED})` outside the pool, max(B, {args.prompts}) a cell, B decoded "
             f"together; "
             f"{args.max_new_tokens} new tokens; coupled sampling; {args.repeats} repeats"]
    page = PAGES.get(args.recipe, f"dflash_{args.recipe}")
    write_json(out / f"{page}.json", {"rows": rows, "notes": notes, "argv": sys.argv[1:]})
    report(rows, args, notes, out)
    print(f"wrote {out / (page + '.md')}")
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
