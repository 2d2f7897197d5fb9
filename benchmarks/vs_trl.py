"""The same GRPO job in TRL's ``GRPOTrainer`` and in the library's arms, side by side on this machine.

The job (issue "faster than TRL"): the main job's policy after its SFT and draft warm start (recipes/tiny-cpu.yaml's
warm-ups, run once and reused), the same prompts in the same order (the library's step prompts, fed to TRL as an
unshuffled data set), one shared batched reward (the exact final answer), ``--prompts`` x ``--group`` samples per
step, ``--max-new-tokens`` new tokens, T=1 (top-k and top-p off), GRPO's per-sequence aggregation (TRL
``loss_type="grpo"``), no KL (TRL ``beta=0``; the library's drift tracking, a reference forward TRL does not run, is
off), a constant learning rate, one thread, fp32 everywhere (TRL 1.16 defaults to bf16 autocast: on a CPU without
AVX-512 bf16 is emulated and made TRL's step 8x slower, an unfair arm). TRL decodes with ``transformers``'
``generate`` over the whole batch.

Arms are run one after another within a repeat (one repeat per seed, the arms' order rotated between repeats); a
step's time is the median over its measured steps (the first step of every arm is a warm-up and is dropped), and
each library arm's ratio to TRL is taken within its repeat, then summarised as the median over repeats with its
range. Every arm is shown, also the ones that lose.

TRL is not a dependency of the library: install it in an environment of its own and run this script there::

    python -m venv --system-site-packages .venv-trl && .venv-trl/bin/pip install --no-deps trl==1.16.0 accelerate
    .venv-trl/bin/python benchmarks/vs_trl.py

Writes docs/benchmarks/vs_trl.md (+ .json, .png).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_codraft.config import load_config
from lightning_codraft.rl.run.build import build_policy, build_task
from lightning_codraft.rl.run.loop import CoDraftRun
from lightning_codraft.rl.tasks.rewards import RewardTerm
from lightning_codraft.rl.step import step_prompts
from lightning_codraft.rl.tasks.arithmetic import arithmetic_reward
from pages import command, md_table, pyplot, save_figure, write_json, write_page

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
ARMS = {  # name -> library overrides (None: TRL)
    "TRL GRPOTrainer": None,
    "no draft": ["draft.mode=none"],
    "frozen draft": ["draft.mode=frozen"],
    "co-trained draft (the default: adaptive schedule)": ["draft.mode=cotrain"],
    "co-trained draft, every step": ["draft.mode=cotrain", "draft.schedule=every_step"],
}


def correct(prompts, completions, answer, **_):
    """The shared batched reward: 1.0 where the completion's final ``#answer`` is the reference, else 0.0."""
    return [arithmetic_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]


def job(args, seed: int, out: Path, extra=()) -> list[str]:
    return [f"rl.steps={args.steps}", f"rl.prompts_per_step={args.prompts}", f"rl.group_size={args.group}",
            f"rl.max_new_tokens={args.max_new_tokens}", "rl.temperature=1.0", "rl.top_p=1.0",
            "rl.loss_aggregation=sequence", "rl.kl_coef=0", "rl.track_drift=false", "task.eval_prompts=0",
            "run.measure_speedup=false", "run.plots=false", "run.tensorboard=false", "run.checkpoint_every=0",
            "run.progress=false", f"run.threads={args.threads}", f"run.seed={seed}", f"run.out_dir={out}",
            *args.overrides, *extra]


def warm_start(args) -> Path:
    """The main job's warm-ups (SFT, the draft's warm start) once, kept in ``args.work/warm``."""
    out = args.work / "warm_run"
    if not (out / "warm" / "weights.pt").is_file():
        run = CoDraftRun(load_config(RECIPE, job(args, 0, out)), print_fn=print)
        try:
            run.setup()
        finally:
            run.close()
    return out / "warm"


def library_arm(args, overrides, warm: Path, seed: int, batch, tmp: Path) -> list[dict]:
    cfg = load_config(RECIPE, job(args, seed, tmp, [f"run.init_from={warm}",
                                                     f"parallel.engine_batch_size={batch or 'null'}", *overrides]))
    run = CoDraftRun(cfg, print_fn=lambda s: None, rewards=[RewardTerm("correct", correct, 1.0)])
    try:
        run.setup()
        rows = []
        for step in range(args.steps):
            m = run.step(step)
            rows.append({"step_s": m.step_s, "generation_s": m.rollout_s, "training_s": m.train_s,
                         "tokens": m.completion_tokens, "acceptance": m.acceptance_length, "reward": m.reward,
                         "draft_trained": m.draft_trained})
        return rows
    finally:
        run.close()


def export_policy(args, warm: Path, work: Path) -> Path:
    """The warm policy as a Hugging Face directory with its tokenizer (what TRL loads)."""
    from lightning_codraft.rl.run.run_dir import warm_state

    target = work / "policy_hf"
    if not (target / "config.json").is_file():
        tok, policy, _ = build_policy(load_config(RECIPE, args.overrides).model)
        policy.load_state_dict(warm_state(warm)["policy"])
        policy.save_pretrained(target)
        tok.to_transformers().save_pretrained(target)
    return target


def trl_arm(args, policy_dir: Path, seed: int, tmp: Path) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(RECIPE, job(args, seed, tmp))
    task = build_task(cfg.task)  # the library's prompts, step by step, in order
    rows = [{"prompt": s.prompt, "answer": s.answer} for step in range(args.steps)
            for s in step_prompts(task, cfg, step)]
    model = AutoModelForCausalLM.from_pretrained(policy_dir, attn_implementation="sdpa")
    tok = AutoTokenizer.from_pretrained(policy_dir)
    tok.padding_side = "left"
    seconds = {"generation": 0.0}
    generate = model.generate

    def timed_generate(*a, **k):
        t0 = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            seconds["generation"] += time.perf_counter() - t0

    model.generate = timed_generate
    out: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            seconds["start"], seconds["generation"] = time.perf_counter(), 0.0

        def on_step_end(self, *a, **k):
            step_s = time.perf_counter() - seconds["start"]
            out.append({"step_s": step_s, "generation_s": seconds["generation"],
                        "training_s": step_s - seconds["generation"]})

    config = GRPOConfig(output_dir=str(tmp / "trl"), per_device_train_batch_size=args.prompts * args.group,
                        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=1.0,
                        top_p=1.0, top_k=0, beta=0.0, loss_type="grpo", learning_rate=cfg.rl.lr,
                        lr_scheduler_type="constant", max_steps=args.steps, logging_steps=1, report_to=[],
                        use_cpu=True, save_strategy="no", shuffle_dataset=False, seed=seed, disable_dropout=True,
                        dataloader_num_workers=0, bf16=False, fp16=False)  # fp32, as the library arms
    trainer = GRPOTrainer(model=model, reward_funcs=[correct], args=config, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), callbacks=[Timer()])
    trainer.train()
    return out


def summarise(repeats: list[dict[str, list[dict]]]) -> list[dict]:
    """Per arm: median step / generation / training seconds (measured steps: all but the first) over repeats, and
    the within-repeat ratio of step times to TRL's (median over repeats, with its range)."""
    table = []
    for arm in repeats[0]:
        med = {k: [statistics.median(r[k] for r in rep[arm][1:]) for rep in repeats]
               for k in ("step_s", "generation_s", "training_s")}
        trl = [statistics.median(r["step_s"] for r in rep["TRL GRPOTrainer"][1:]) for rep in repeats]
        nod = [statistics.median(r["step_s"] for r in rep["no draft, batch all"][1:]) for rep in repeats] \
            if "no draft, batch all" in repeats[0] else [math.nan] * len(repeats)
        ratio = [a / b for a, b in zip(med["step_s"], trl)]
        vs_none = [a / b for a, b in zip(med["step_s"], nod)]
        measured = [r for rep in repeats for r in rep[arm][1:]]
        lib = [r for r in measured if "tokens" in r]
        table.append({"arm": arm, **{k: statistics.median(v) for k, v in med.items()},
                      "vs_trl": statistics.median(ratio), "vs_trl_range": (min(ratio), max(ratio)),
                      "vs_no_draft": statistics.median(vs_none), "vs_no_draft_range": (min(vs_none), max(vs_none)),
                      "acceptance": statistics.median([r["acceptance"] for r in lib]) if lib else math.nan,
                      "updates": sum(r["draft_trained"] for r in lib) / len(repeats) if lib else math.nan,
                      "tokens_per_s": sum(r["tokens"] for r in lib) / sum(r["generation_s"] for r in lib)
                      if lib else math.nan})
    return table


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=6, help="steps per arm and repeat (the first is a warm-up)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=40)
    ap.add_argument("--batches", nargs="+", default=["all", "8", "1"], help="the library's engine batch sizes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "vs_trl", help="warm start and exported policy")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--name", default="vs_trl")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every arm and the warm-ups (smoke tests)")
    ap.add_argument("--report-only", type=Path, default=None, metavar="JSON",
                    help="rebuild the page from a saved <name>.json (its repeats and arguments) without running")
    args = ap.parse_args(argv)
    if args.report_only is not None:
        saved = json.loads(args.report_only.read_text())
        for k, v in saved["args"].items():
            if k not in ("out", "report_only", "name"):
                setattr(args, k, Path(v) if k == "work" else v)
        args.out.mkdir(parents=True, exist_ok=True)
        table = summarise(saved["repeats"])
        report(args, table, saved["repeats"])
        return table
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    warm = warm_start(args)
    policy_dir = export_policy(args, warm, args.work)
    arms = [("TRL GRPOTrainer", None, None)] + [(f"{name}, batch {b}", ov, None if b == "all" else int(b))
                                               for b in args.batches for name, ov in ARMS.items() if ov is not None]
    repeats = []
    for i, seed in enumerate(args.seeds):
        order = arms[i % len(arms):] + arms[:i % len(arms)]
        rep = {}
        for name, overrides, batch in order:
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                rows = trl_arm(args, policy_dir, seed, Path(tmp)) if overrides is None else \
                    library_arm(args, overrides, warm, seed, batch, Path(tmp))
                print(f"seed {seed} {name}: median step {statistics.median(r['step_s'] for r in rows[1:]):.2f} s "
                      f"({time.perf_counter() - t0:.0f} s in all)", flush=True)
            rep[name] = rows
        repeats.append({name: rep[name] for name, _, _ in arms})
        write_json(args.out / f"{args.name}.partial.json", repeats)  # what is measured so far, if the run is cut
    (args.out / f"{args.name}.partial.json").unlink()
    table = summarise(repeats)
    report(args, table, repeats)
    return table


def report(args, table: list[dict], repeats) -> None:
    fmt = lambda x, r: f"{x:.2f}x ({r[0]:.2f}-{r[1]:.2f})" if x == x else "-"  # noqa: E731
    rows = [(t["arm"], f"{t['step_s']:.2f}", f"{t['generation_s']:.2f}", f"{t['training_s']:.2f}",
             f"{t['tokens_per_s']:.0f}" if t["tokens_per_s"] == t["tokens_per_s"] else "-",
             f"{t['acceptance']:.2f}" if t["acceptance"] == t["acceptance"] else "-",
             f"{t['updates']:.1f}" if t["updates"] == t["updates"] else "-",
             fmt(t["vs_trl"], t["vs_trl_range"]), fmt(t["vs_no_draft"], t["vs_no_draft_range"]))
            for t in table]
    header = ["arm", "step s", "generation s", "training s", "tokens/s", "acceptance", "draft updates (measured steps)",
              "step vs TRL (range)", "step vs no draft, batch all (range)"]
    lines = ["# The same GRPO job in TRL's GRPOTrainer and in the library", "",
             f"`{command('vs_trl.py')}` (TRL {_trl_version()} in its own environment; {_cpu()}, "
             f"{args.threads} thread(s)).", "",
             f"Job: the main job's policy after its SFT and draft warm start (recipes/tiny-cpu.yaml's warm-ups), "
             f"{args.prompts} prompts x {args.group} samples per step, {args.max_new_tokens} new tokens, T=1 (no "
             f"top-k / top-p), GRPO's per-sequence aggregation, no KL, a constant learning rate; the same prompts "
             f"in the same order (the library's step prompts, drawn fresh every step: no draft trained on them); "
             f"one shared batched reward (the exact final answer). {len(args.seeds)} repeats (seeds "
             f"{', '.join(map(str, args.seeds))}), {args.steps} steps per arm and repeat, the first dropped; medians "
             f"over the measured steps, then over repeats; ratios within each repeat (median and range over "
             f"repeats). `batch` is the library engine's batch (`parallel.engine_batch_size`; `all`: the step's "
             f"{args.prompts * args.group} sequences at once); TRL generates the whole batch with `generate`. "
             f"Acceptance: tokens per verification round (1 without a draft).", "",
             *md_table(header, rows), "", *goals(table), ""]
    write_page(args.out / f"{args.name}.md", lines)
    write_json(args.out / f"{args.name}.json", {"table": table, "repeats": repeats, "args": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(table) + 1.5))
    ax.barh([t["arm"] for t in table][::-1], [t["step_s"] for t in table][::-1], color="tab:blue")
    ax.set_xlabel("median step seconds")
    save_figure(fig, args.out / f"{args.name}.png")
    print("\n".join(md_table(header, rows)))


def goals(table: list[dict]) -> list[str]:
    """The issue's goals at the full batch, each with its verdict: every library arm's step at most 0.8x TRL's, and
    the co-trained default's at most 1.05x the no-draft arm's (medians within repeats; the range says how sure)."""
    full = [t for t in table if t["arm"].endswith(", batch all")]
    default = next((t for t in full if t["arm"].startswith("co-trained draft (the default")), None)
    fmt = lambda t, k: f"{t[k]:.2f}x ({t[k + '_range'][0]:.2f}-{t[k + '_range'][1]:.2f})"  # noqa: E731
    out = ["Goals at the full batch:", ""]
    for t in full:
        verdict = "met" if t["vs_trl"] <= 0.8 else "not met"
        out.append(f"- {t['arm']}: step {fmt(t, 'vs_trl')} TRL's -> <= 0.8x: **{verdict}**"
                   + ("" if t["vs_trl_range"][1] <= 0.8 or verdict == "not met" else " (median; not in every repeat)"))
    if default is not None:
        verdict = "met" if default["vs_no_draft"] <= 1.05 else "not met"
        out.append(f"- {default['arm']}: step {fmt(default, 'vs_no_draft')} the no-draft arm's -> <= 1.05x: "
                   f"**{verdict}**")
    return out


def _cpu() -> str:
    """The CPU the figures are from (its model and the kernels torch dispatches to)."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "an unknown CPU"
    return f"{model}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def _trl_version() -> str:
    import trl

    return trl.__version__


if __name__ == "__main__":
    main()
