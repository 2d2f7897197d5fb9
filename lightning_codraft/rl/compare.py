"""The headline comparison: no draft vs a frozen draft vs the co-trained draft, same seeds, one process.

All arms start from the same warmed-up policy and draft (the SFT warm-up and the draft's offline warm-start
run once, in the first arm set up) and see the same prompts and sampling seeds. Their RL steps run
interleaved (step s of every arm, then step s+1), so machine load affects every arm alike and the speed-up
ratios are measured side by side:

* rollout speed-up = (completion tokens / rollout seconds) of the arm over that of the no-draft arm;
* end-to-end speed-up = (completion tokens / whole-step seconds: rollout + train + sync) likewise.

Speculative decoding is lossless, so the reward curves differ only by sampling noise.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.rl.logs import plot_curves
from lightning_codraft.rl.loop import CoDraftRun, FitResult

ARMS = ("none", "frozen", "cotrain")
LABELS = {"none": "no draft", "frozen": "frozen draft", "cotrain": "co-trained draft"}


@dataclass
class CompareResult:
    """Per-arm results of :func:`compare_arms`.

    Attributes:
        cfg: the base config (its ``draft.mode`` is overridden per arm).
        results: arm -> :class:`FitResult` (per-step rows, greedy accuracy before / after).
    """

    cfg: CoDraftConfig
    results: dict[str, FitResult] = field(default_factory=dict)

    def totals(self, arm: str) -> dict[str, float]:
        rows = self.results[arm].rows
        tok = sum(r["completion_tokens"] for r in rows)
        roll = sum(r["rollout_s"] for r in rows)
        step = sum(r["step_s"] for r in rows)
        rewards = [r["reward"] for r in rows]
        n = len(rewards)
        half = rewards[n // 2:] or rewards
        return {
            "tokens": tok, "rollout_s": roll, "step_s": step, "rollout_tps": tok / roll, "e2e_tps": tok / step,
            "reward_mean": sum(rewards) / n, "reward_last_half": sum(half) / len(half),
            "acceptance_last": rows[-1]["acceptance_length"],
            "acceptance_mean": sum(r["acceptance_length"] for r in rows) / n,
            "eval_before": self.results[arm].eval_before, "eval_after": self.results[arm].eval_after,
        }

    def speedups(self, arm: str) -> tuple[float, float]:
        """(rollout, end-to-end) speed-up of ``arm`` over the no-draft arm."""
        base, t = self.totals("none"), self.totals(arm)
        return t["rollout_tps"] / base["rollout_tps"], t["e2e_tps"] / base["e2e_tps"]

    def reward_noise(self) -> float:
        """Standard error of a per-step mean reward (binomial, from the pooled mean): the noise scale."""
        c = self.cfg.rl
        n = c.prompts_per_step * c.group_size
        p = sum(self.totals(a)["reward_mean"] for a in self.results) / len(self.results)
        return math.sqrt(max(p * (1 - p), 1e-12) / n)

    def table(self) -> str:
        """A markdown table: one row per arm."""
        k = self.cfg.draft.num_speculative_tokens
        lines = [f"| arm | mean reward | reward, last half | greedy acc. before -> after | acceptance length "
                 f"(K={k}), last step | mean | rollout tok/s | rollout speed-up | end-to-end tok/s | "
                 f"end-to-end speed-up |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for arm in self.results:
            t = self.totals(arm)
            ro, e2e = self.speedups(arm) if "none" in self.results else (math.nan, math.nan)
            lines.append(f"| {LABELS[arm]} | {t['reward_mean']:.3f} | {t['reward_last_half']:.3f} | "
                         f"{t['eval_before']:.3f} -> {t['eval_after']:.3f} | {t['acceptance_last']:.2f} | "
                         f"{t['acceptance_mean']:.2f} | {t['rollout_tps']:.1f} | {ro:.2f}x | {t['e2e_tps']:.1f} | "
                         f"{e2e:.2f}x |")
        return "\n".join(lines)


def arm_config(cfg: CoDraftConfig, arm: str, out: Path, init_from: str | None) -> CoDraftConfig:
    """``cfg`` with ``draft.mode = arm``, its own output directory, no resume, checkpoint only at the end."""
    return dataclasses.replace(
        cfg, draft=dataclasses.replace(cfg.draft, mode=arm),
        run=dataclasses.replace(cfg.run, out_dir=str(out / arm), resume=False, init_from=init_from,
                                checkpoint_every=0, progress=False))


def compare_arms(cfg: CoDraftConfig, arms: Sequence[str] = ARMS,
                 print_fn: Callable[[str], None] = print) -> CompareResult:
    """Run the arms on ``cfg`` (outputs under ``run.out_dir/bench/<arm>``) and return their results."""
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; arms are {ARMS}")
    out = Path(cfg.run.out_dir) / "bench"
    if out.exists():
        shutil.rmtree(out)
    # the arm that warms up must train the draft offline (mode != none): it is set up first
    first = "cotrain" if "cotrain" in arms else arms[0]
    order = [first] + [a for a in arms if a != first]
    runs: dict[str, CoDraftRun] = {}
    for a in order:
        # the first arm warms up (or starts from run.init_from when given); the others from its weights
        init = cfg.run.init_from if a == first else str(out / first / "warm")
        runs[a] = CoDraftRun(arm_config(cfg, a, out, init), print_fn=lambda s, a=a: print_fn(f"[{a}] {s}"))
        runs[a].setup()
    for step in range(cfg.rl.steps):
        line = [f"step {step + 1}/{cfg.rl.steps}:"]
        for a in arms:
            m = runs[a].step(step)
            runs[a].end_step(step, m)
            line.append(f"{a} reward {m.reward:.3f} accept {m.acceptance_length:.2f} rollout {m.rollout_s:.1f}s")
        print_fn("  ".join(line))
    res = CompareResult(cfg=cfg)
    for a in arms:
        res.results[a] = runs[a].finish()
    return res


def write_report(res: CompareResult, out_dir: str | Path, name: str = "rl") -> Path:
    """``<out_dir>/<name>.md`` with the table, the per-step curves and the goals; PNG plots beside it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = {LABELS[a]: r.rows for a, r in res.results.items()}
    png = plot_curves(series, out / f"{name}_curves.png", keys=("reward", "acceptance_length", "rollout_s"),
                      title="no draft vs frozen vs co-trained draft (same seeds)")
    c = res.cfg
    lines = [f"# RL with an online co-trained draft vs a frozen draft vs no draft", "",
             f"Task `{c.task.name}`, policy `{c.model.source}` "
             f"({c.model.num_hidden_layers} layers, hidden {c.model.hidden_size}), {c.rl.steps} GRPO steps x "
             f"{c.rl.prompts_per_step} prompts x {c.rl.group_size} samples, temperature {c.rl.temperature}, "
             f"K = {c.draft.num_speculative_tokens}, embedded engine, {c.parallel.accelerator}. Same seeds in every "
             f"arm; steps interleaved across arms; ratios measured side by side in this one run.", "",
             res.table(), "", f"![curves]({png.name})", ""]
    if "none" in res.results:
        noise = res.reward_noise()
        lines.append(f"Reward noise scale (binomial standard error of one step's mean reward): {noise:.3f}.")
        for a in res.results:
            if a != "none":
                d = res.totals(a)["reward_mean"] - res.totals("none")["reward_mean"]
                se = noise * math.sqrt(2.0 / len(res.results[a].rows))  # SE of a difference of two run means
                lines.append(f"- {LABELS[a]}: mean reward differs from no draft by {d:+.3f} = {abs(d) / se:.1f} "
                             f"standard errors of the difference of two {len(res.results[a].rows)}-step means.")
        lines.append("")
    lines += [f"Conditions: the embedded engine decodes `parallel.engine_batch_size = {c.parallel.engine_batch_size}` "
              "sequence(s) at a time. On CPU a large decode batch is compute-bound, so verifying K+1 tokens costs "
              "about K+1 single-token steps and speculation stops paying; small batches keep decoding "
              "latency-bound, the regime of GPU decoding. Wall times come from one shared machine and are "
              "noisy step to step; the ratios are over all steps of arms run interleaved.",
              "", "Reproduce: `python benchmarks/codraft_vs_frozen.py` (or `codraft bench --config "
              "recipes/tiny-cpu.yaml --out docs/benchmarks`).", ""]
    lines.append("Per step (reward / acceptance length):")
    lines.append("")
    arms = list(res.results)
    lines.append("| step | " + " | ".join(LABELS[a] for a in arms) + " |")
    lines.append("|---|" + "---|" * len(arms))
    for i in range(len(res.results[arms[0]].rows)):
        cells = [f"{res.results[a].rows[i]['reward']:.3f} / {res.results[a].rows[i]['acceptance_length']:.2f}"
                 for a in arms]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
