"""No draft vs frozen draft vs co-trained draft over N GRPO steps, same seeds, one run.

    python benchmarks/codraft_vs_frozen.py [--config recipes/tiny-cpu.yaml] [--out docs/benchmarks] [key=value ...]

Prints the table (reward, acceptance length, rollout and end-to-end tokens/s and their speed-ups over no
draft) and writes ``<out>/codraft_vs_frozen.md`` with per-step curves (``codraft_vs_frozen_curves.png``). Same as
``codraft bench``. docs/benchmarks/rl.md summarises this and the drift runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_codraft.config import load_config
from lightning_codraft.rl.compare import compare_arms, write_report

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "recipes" / "tiny-cpu.yaml"))
    ap.add_argument("--out", default=str(REPO / "docs" / "benchmarks"))
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args()
    cfg = load_config(args.config, ["run.out_dir=runs/bench-codraft-vs-frozen", *args.overrides])
    res = compare_arms(cfg)
    print(res.table())
    print(f"wrote {write_report(res, args.out)}")


if __name__ == "__main__":
    main()
