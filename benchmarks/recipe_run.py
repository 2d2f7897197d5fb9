"""One recipe end to end, reported: ``codraft fit --config RECIPE`` and what it printed, as a markdown page.

The run is exactly the CLI's (:func:`lightning_codraft.rl.run.loop.fit` on ``load_config(RECIPE, overrides)``); this
script adds the page: conditions (machine, threads, load), the run's summary (reward, greedy accuracy on the task's
held-out problems before / after RL, acceptance length, and the rollout speed-up over plain decoding that the run
measures at its end on held-out problems, with its batch size, temperature and K), the draft warm start's lines,
the per-step table and the curves.

Run: ``python benchmarks/recipe_run.py --config recipes/smollm2-135m-cpu.yaml --name smollm2_gsm8k`` (writes
``docs/benchmarks/smollm2_gsm8k.md``, ``smollm2_gsm8k_curves.png``, ``smollm2_gsm8k.json``; the first run of that
recipe spends about an hour on the draft warm start unless ``python benchmarks/draft_warmstart.py`` filled its cache).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from pathlib import Path

import torch

from lightning_codraft.config import load_config
from lightning_codraft.rl.run.loop import fit
from pages import command, write_json

ROOT = Path(__file__).resolve().parent.parent

TABLE = (("step", "{:.0f}"), ("reward", "{:.3f}"), ("acceptance_length", "{:.2f}"), ("mean_k", "{:.2f}"),
         ("draft_loss", "{:.3f}"), ("draft_acc0", "{:.3f}"), ("kl", "{:.4f}"), ("completion_tokens", "{:.0f}"),
         ("tokens_per_s", "{:.1f}"), ("step_s", "{:.0f}"))
"""Columns of the per-step table (``metrics.csv`` names) and their formats."""


def _cell(fmt: str, v) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else fmt.format(float(v))


def write_page(out: Path, name: str, res: dict) -> str:
    """``<out>/<name>.md`` from the run's record ``res``; returns the text."""
    lines = [f"# `{res['recipe']}` end to end", "",
             f"Command: `{res['command']}` (the run itself is `codraft fit --config {res['recipe']}"
             f"{' ' + ' '.join(res['overrides']) if res['overrides'] else ''}`).", "",
             f"Conditions: {res['machine']}; {res['threads']} torch thread(s); load average at start / end "
             f"{res['load_start']} / {res['load_end']}; {res['wall_s'] / 60:.1f} minutes in all.", "",
             "## What the run printed", "", "Draft warm start:", "", "```", *res["warm_start_lines"], "```", "",
             "Summary:", "", "```", *res["summary"].splitlines(), "```", ""]
    if res["speedup"]:
        s = res["speedup"]
        lines += [f"The speed-up is measured by the run at its end (`rl.run.evaluate.measure_speedup`): the final policy "
                  f"and draft decode the same {s['sequences']} requests (held-out problems x samples) with and "
                  f"without the draft, best of 3 interleaved runs each, wall time: plain {s['plain_s']:.1f} s, "
                  f"speculative {s['spec_s']:.1f} s.", ""]
    lines += ["## Per step", "", "| " + " | ".join(c for c, _ in TABLE) + " |", "|" + "---|" * len(TABLE)]
    for row in res["rows"]:
        lines.append("| " + " | ".join(_cell(f, row.get(c)) for c, f in TABLE) + " |")
    lines += ["", f"![curves]({name}_curves.png)", ""]
    text = "\n".join(lines)
    (out / f"{name}.md").write_text(text)
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a recipe YAML")
    ap.add_argument("--name", required=True, help="page name: <out>/<name>.md")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, as for codraft fit")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    printed: list[str] = []

    def log(s: str) -> None:
        printed.append(s)
        print(s, flush=True)

    load_start, t0 = "%.1f" % os.getloadavg()[0], time.perf_counter()
    result = fit(cfg, print_fn=log)
    if not result.completed:
        raise SystemExit("the run did not complete")
    summary = (Path(cfg.run.out_dir) / "summary.txt").read_text()
    warm = [line for text in printed for line in text.splitlines() if "warm start" in line or "warm-start" in line]
    res = dict(command=command("recipe_run.py", argv),
               recipe=args.config, overrides=list(args.overrides), machine=f"{os.cpu_count()} CPU cores, torch "
               f"{torch.__version__}", threads=cfg.run.threads, load_start=load_start,
               load_end="%.1f" % os.getloadavg()[0], wall_s=time.perf_counter() - t0,
               warm_start_lines=warm[-12:], summary=summary, rows=result.rows,
               eval_before=result.eval_before, eval_after=result.eval_after,
               speedup=None if result.speedup is None else vars(result.speedup))
    curves = Path(cfg.run.out_dir) / "curves.png"
    if curves.is_file():
        shutil.copyfile(curves, out / f"{args.name}_curves.png")
    write_json(out / f"{args.name}.json", res)
    print(write_page(out, args.name, res))


if __name__ == "__main__":
    main()
