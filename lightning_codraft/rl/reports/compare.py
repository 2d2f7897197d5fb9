"""Arms run side by side from the same seeds: no draft vs a frozen draft vs the co-trained draft (and variants).

All arms start from the same warmed-up policy and draft (the SFT warm-up and the draft's offline warm-start run
once, in the first arm set up) and see the same prompts and sampling seeds. Their RL steps run interleaved (step s
of every arm, then step s+1), so machine load affects every arm alike and the speed-up ratios are measured side by
side:

* rollout speed-up = (completion tokens / rollout seconds) of the arm over that of the no-draft arm;
* end-to-end speed-up = (completion tokens / whole-step seconds: rollout + train + sync) likewise.

Speculative decoding is lossless (with coupled sampling the arms' rollouts are the same tokens until their policies
differ by round-off of the draft's share of the step), so reward curves differ only by noise. Arms are judged by
paired per-step differences (``rl.reports.stats.paired_difference``), never by one step.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from lightning_codraft.config import CoDraftConfig
from lightning_codraft.rl.reports.run_log import plot_curves
from lightning_codraft.rl.reports.stats import PairedDifference, paired_difference
from lightning_codraft.rl.run.loop import CoDraftRun, FitResult

ARMS = ("none", "frozen", "cotrain")
LABELS = {"none": "no draft", "frozen": "frozen draft", "cotrain": "co-trained draft"}


@dataclass
class CompareResult:
    """Per-arm results of :func:`compare_arms` / :func:`run_side_by_side`.

    Attributes:
        cfg: the base config.
        results: arm name -> :class:`FitResult` (per-step rows, greedy accuracy before / after).
        labels: arm name -> label in tables (default: :data:`LABELS`, else the name).
    """

    cfg: CoDraftConfig
    results: dict[str, FitResult] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def label(self, arm: str) -> str:
        return self.labels.get(arm, LABELS.get(arm, arm))

    def series(self, arm: str, key: str) -> list[float]:
        return [r[key] for r in self.results[arm].rows]

    def totals(self, arm: str) -> dict[str, float]:
        rows = self.results[arm].rows
        tok = sum(r["completion_tokens"] for r in rows)
        roll = sum(r["rollout_s"] for r in rows)
        step = sum(r["step_s"] for r in rows)
        rewards = [r["reward"] for r in rows]
        n = len(rewards)
        half = rewards[n // 2 :] or rewards
        return {
            "tokens": tok,
            "rollout_s": roll,
            "step_s": step,
            "rollout_tps": tok / roll,
            "e2e_tps": tok / step,
            "reward_mean": sum(rewards) / n,
            "reward_last_half": sum(half) / len(half),
            "acceptance_last": rows[-1]["acceptance_length"],
            "acceptance_mean": sum(r["acceptance_length"] for r in rows) / n,
            "eval_before": self.results[arm].eval_before,
            "eval_after": self.results[arm].eval_after,
        }

    def speedups(self, arm: str, base: str = "none") -> tuple[float, float]:
        """(rollout, end-to-end) speed-up of ``arm`` over ``base`` (token throughput ratios)."""
        b, t = self.totals(base), self.totals(arm)
        return t["rollout_tps"] / b["rollout_tps"], t["e2e_tps"] / b["e2e_tps"]

    def paired(self, a: str, b: str, key: str, last_half: bool = True) -> PairedDifference:
        """Per-step ``a - b`` of ``key`` (over the last half of the steps by default) with its 95% CI."""
        x, y = self.series(a, key), self.series(b, key)
        start = len(x) // 2 if last_half else 0
        return paired_difference(x[start:], y[start:])

    def table(self, base: Optional[str] = "none") -> str:
        """A markdown table: one row per arm (speed-ups over ``base`` when it ran)."""
        k = self.cfg.draft.num_speculative_tokens
        lines = [
            f"| arm | mean reward | reward, last half | greedy acc. before -> after | acceptance length "
            f"(K={k}), last step | mean | rollout tok/s | rollout speed-up | end-to-end tok/s | "
            f"end-to-end speed-up |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for arm in self.results:
            t = self.totals(arm)
            ro, e2e = self.speedups(arm, base) if base in self.results else (math.nan, math.nan)
            lines.append(
                f"| {self.label(arm)} | {t['reward_mean']:.3f} | {t['reward_last_half']:.3f} | "
                f"{t['eval_before']:.3f} -> {t['eval_after']:.3f} | {t['acceptance_last']:.2f} | "
                f"{t['acceptance_mean']:.2f} | {t['rollout_tps']:.1f} | {ro:.2f}x | {t['e2e_tps']:.1f} | "
                f"{e2e:.2f}x |"
            )
        return "\n".join(lines)


def isolated(cfg: CoDraftConfig, out: Path, init_from: str | None) -> CoDraftConfig:
    """``cfg`` writing to ``out``, starting from ``init_from`` (or warming up), no resume, no periodic checkpoint."""
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(
            cfg.run, out_dir=str(out), resume=False, init_from=init_from, checkpoint_every=0, progress=False
        ),
    )


def run_side_by_side(
    configs: Mapping[str, CoDraftConfig], out: str | Path, base: CoDraftConfig, print_fn: Callable[[str], None] = print
) -> CompareResult:
    """Run every ``name -> config`` arm interleaved, step by step, from one warm start.

    For each drafter type (``draft.type``) the first arm whose draft trains offline (``draft.mode != "none"``) is set
    up first and warms up (or starts from its ``run.init_from``); the type's other arms start from its warmed-up
    weights (an arm without a draft from the first type's). The SFT warm-up is seeded, so every type's arms start
    from the same policy. Outputs go under ``out/<name>``. All arms must run the same number of RL steps.
    """
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    steps = {c.rl.steps for c in configs.values()}
    if len(steps) != 1:
        raise ValueError(f"arms must run the same number of RL steps, got {sorted(steps)}")
    names = list(configs)
    firsts = _warm_sources(configs)
    runs: dict[str, CoDraftRun] = {}
    for name in list(dict.fromkeys(firsts.values())) + [n for n in names if n not in firsts.values()]:
        first = firsts[name]
        init = configs[name].run.init_from if name == first else str(out / first / "warm")
        runs[name] = CoDraftRun(
            isolated(configs[name], out / name, init), print_fn=lambda s, n=name: print_fn(f"[{n}] {s}")
        )
        runs[name].setup()
    for step in range(steps.pop()):
        line = [f"step {step + 1}:"]
        for name in names:
            m = runs[name].step(step)
            runs[name].end_step(step, m)
            line.append(f"{name} reward {m.reward:.3f} accept {m.acceptance_length:.2f} rollout {m.rollout_s:.1f}s")
        print_fn("  ".join(line))
    res = CompareResult(cfg=base)
    for name in names:
        res.results[name] = runs[name].finish()
    return res


def _warm_sources(configs: Mapping[str, CoDraftConfig]) -> dict[str, str]:
    """arm -> the arm whose warm-up it starts from: per drafter type (``draft.type``), its first co-trained arm (the
    general case), else its first arm with a draft; an arm without a draft starts from the first such source."""
    by_type: dict[str, str] = {}
    for mode in ("cotrain", "frozen"):
        for name, c in configs.items():
            if c.draft.mode == mode:
                by_type.setdefault(c.draft.type, name)
    fallback = next(iter(by_type.values()), next(iter(configs)))
    return {n: by_type.get(c.draft.type, fallback) if c.draft.mode != "none" else fallback for n, c in configs.items()}


def compare_arms(
    cfg: CoDraftConfig, arms: Sequence[str] = ARMS, print_fn: Callable[[str], None] = print
) -> CompareResult:
    """Run the arms (``draft.mode`` values) on ``cfg`` (outputs under ``run.out_dir/bench/<arm>``)."""
    for a in arms:
        if a not in ARMS:
            raise ValueError(f"unknown arm {a!r}; arms are {ARMS}")
    configs = {a: dataclasses.replace(cfg, draft=dataclasses.replace(cfg.draft, mode=a)) for a in arms}
    return run_side_by_side(configs, Path(cfg.run.out_dir) / "bench", cfg, print_fn)


def paired_lines(res: CompareResult) -> list[str]:
    """Markdown lines: per-step paired differences (last half of the run) between the arms that ran."""
    lines = []
    if "cotrain" in res.results and "frozen" in res.results:
        lines.append(
            f"- acceptance length, co-trained - frozen, last half: "
            f"{res.paired('cotrain', 'frozen', 'acceptance_length')}"
        )
        lines.append(
            f"- reward, co-trained - frozen, whole run: {res.paired('cotrain', 'frozen', 'reward', last_half=False)}"
        )
    if "none" in res.results:
        for a in res.results:
            if a != "none":
                lines.append(
                    f"- reward, {res.label(a)} - no draft, whole run: "
                    f"{res.paired(a, 'none', 'reward', last_half=False)}"
                )
    return lines


def write_report(res: CompareResult, out_dir: str | Path, name: str = "codraft_vs_frozen") -> Path:
    """``<out_dir>/<name>.md`` with the table, the paired statistics and the per-step curves (PNG beside it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    series = {res.label(a): r.rows for a, r in res.results.items()}
    png = plot_curves(
        series,
        out / f"{name}_curves.png",
        keys=("reward", "acceptance_length", "kl", "rollout_s"),
        title="arms from the same seeds",
    )
    c = res.cfg
    lines = [
        "# RL with an online co-trained draft vs a frozen draft vs no draft",
        "",
        f"Task `{c.task.name}`, policy `{c.model.source}` "
        f"({c.model.num_hidden_layers} layers, hidden {c.model.hidden_size}), {c.rl.steps} GRPO steps x "
        f"{c.rl.prompts_per_step} prompts x {c.rl.group_size} samples, temperature {c.rl.temperature}, "
        f"K = {c.draft.num_speculative_tokens} ({'adaptive' if c.draft.adaptive else 'fixed'}), embedded "
        f"engine decoding {c.parallel.engine_batch_size or 'all'} sequence(s) at a time, "
        f"{c.parallel.accelerator}. Same seeds in every arm; steps interleaved across arms; ratios measured "
        f"side by side in this one run.",
        "",
        res.table(),
        "",
        f"![curves]({png.name})",
        "",
    ]
    counts = {len(r.rows) for r in res.results.values()}
    if len(counts) == 1 and counts.pop() >= 4:
        lines += [
            "Paired per-step differences (mean, 95% confidence interval, steps where the first arm is higher):",
            "",
            *paired_lines(res),
            "",
        ]
    lines += [
        "Reproduce: `codraft bench --config recipes/tiny-cpu.yaml --out docs/benchmarks`.",
        "",
        "Per step (reward / acceptance length):",
        "",
    ]
    arms = list(res.results)
    lines.append("| step | " + " | ".join(res.label(a) for a in arms) + " |")
    lines.append("|---|" + "---|" * len(arms))
    for i in range(len(res.results[arms[0]].rows)):
        cells = [
            f"{res.results[a].rows[i]['reward']:.3f} / {res.results[a].rows[i]['acceptance_length']:.2f}" for a in arms
        ]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    path = out / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path
