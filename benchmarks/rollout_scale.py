"""Rollouts at scale: the RL loop's rollout phase on 1, 2 and 4 processes, every rank generating vs one lead.

Each world size runs the recipe's rollout phase (``RolloutWorker.prepare`` + ``generate``: the same requests, the same
per-request seeds, warmed-up weights loaded from the 1-process run's warm-up) in two modes, alternated round by
round:

- ``every rank``: the library's placement (issue #13): each replica's requests split over its ``pp x cp`` ranks,
  every rank decoding its share with its own engine, outputs all-gathered;
- ``lead only``: what the loop did before: the replica's lead decodes every request and broadcasts the outputs
  while the other ranks wait.

It checks the rollouts of every mode and world size are the 1-process rollouts token for token (coupled sampling:
placement-invariant) and reports the slowest rank's wall seconds per rollout phase (median over rounds), the
weight refill's share of it, requests and tokens per rank, and each mode's speed-up over the lead-only phase.

On this 2-core CPU machine 4 processes share 2 cores, so the 4-process figure is bounded by 2x; on a GPU cluster
each rank has its own device. Layouts: 1 = one process, 2 = pp 2 (each rank holds one stage; the engines decode
with released-and-refilled whole copies), 4 = pp 2 x cp 2 (FSDP2 over cp).

Usage::

    python benchmarks/rollout_scale.py                         # writes docs/benchmarks/rollout_scale.md
    python benchmarks/rollout_scale.py --worlds 1,2 --prompts 2 --group-size 2 --max-new-tokens 8 --rounds 1 \
        --out /tmp/x --recipe-overrides sft.steps=2 draft.warm_start.steps=2    # the smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {1: [], 2: ["parallel.pp=2"], 4: ["parallel.pp=2", "parallel.cp=2"]}
MODES = ("every rank", "lead only")


def _config(args, out: Path, world: int, init_from: Path | None):
    from lightning_codraft.config import load_config

    overrides = [f"run.out_dir={out}", "run.progress=false", "run.plots=false", "run.tensorboard=false",
                 "run.threads=1", "task.eval_prompts=0", "run.resume=false", "draft.adaptive=false",
                 f"rl.prompts_per_step={args.prompts}", f"rl.group_size={args.group_size}",
                 f"rl.max_new_tokens={args.max_new_tokens}", f"parallel.devices={world}", *LAYOUTS[world],
                 *args.recipe_overrides]
    if init_from is not None:
        overrides.append(f"run.init_from={init_from}")
    return load_config(ROOT / "recipes" / f"{args.recipe}.yaml", overrides)


def _lead_only(worker, requests, seeds):
    """Before issue #13: the replica's lead decodes everything and broadcasts the outputs."""
    dims = worker.dims
    t0 = time.perf_counter()
    box = [None]
    if dims.is_replica_lead:
        box = [worker.generate(requests, seeds, group=None)]
    if dims.replica_group is not None:
        dist.broadcast_object_list(box, src=dims.replica_ranks()[0], group=dims.replica_group)
    return box[0][0], time.perf_counter() - t0


def _worker(rank: int, world: int, port: int, args, out: str, init_from, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        from lightning_codraft.models.tokenizer import encode_prompt
        from lightning_codraft.rl.run.loop import CoDraftRun
        from lightning_codraft.rl.rollout_worker import rollout_seed

        cfg = _config(args, Path(out), world, init_from)
        run = CoDraftRun(cfg, print_fn=lambda s: None)
        run.setup()
        worker = run.worker
        samples = run.task.sample(args.prompts, seed=cfg.run.seed + 999)
        prompts = run.fit_prompts([encode_prompt(run.tokenizer, s.prompt) for s in samples])
        G = args.group_size
        requests = [p for p in prompts for _ in range(G)]
        seeds = [rollout_seed(cfg.run.seed, 0, i // G, i % G) for i in range(len(requests))]
        times = {m: [] for m in MODES}
        sync, digests, tokens, counts = [], {m: set() for m in MODES}, {}, {}
        for r in range(args.rounds + 1):  # round 0 warms up
            for mode in (MODES if r % 2 else MODES[::-1]):
                dist.barrier()
                before = worker.requests_generated
                t0 = time.perf_counter()
                sync_s = worker.prepare()
                if mode == "every rank":
                    outs, _, _ = worker.generate(requests, seeds)
                else:
                    outs, _ = _lead_only(worker, requests, seeds)
                wall = torch.tensor([time.perf_counter() - t0, sync_s], dtype=torch.float64)
                worker.release()
                dist.all_reduce(wall, op=dist.ReduceOp.MAX)
                if r:
                    times[mode].append(float(wall[0]))
                    if mode == "every rank":
                        sync.append(float(wall[1]))
                digests[mode].add(hashlib.sha256(repr([o.token_ids for o in outs]).encode()).hexdigest())
                counts[mode] = worker.requests_generated - before
                tokens[mode] = sum(len(o.token_ids) for o in outs)
        queue.put((rank, "ok", {"times": times, "sync": sync, "digests": digests, "counts": counts,
                                "tokens": tokens, "requests": len(requests)}))
        run.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback

        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(world: int, args, out: Path, init_from) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, str(out), init_from, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + args.timeout
    while len(results) < world:
        if not queue.empty():
            rank, status, value = queue.get()
            if status != "ok":
                for p in procs:
                    p.kill()
                raise RuntimeError(f"rank {rank} of {world} failed:\n{value}")
            results[rank] = value
        elif any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise RuntimeError(f"a rank of {world} died or timed out: exit codes {[p.exitcode for p in procs]}")
        else:
            time.sleep(0.05)
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny-cpu")
    ap.add_argument("--worlds", default="1,2,4", help="process counts, among 1, 2, 4")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    ap.add_argument("--recipe-overrides", nargs="*", default=[], help="key=value overrides of the recipe")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    if worlds[0] != 1 or any(w not in LAYOUTS for w in worlds):
        ap.error(f"--worlds must start with 1 and use sizes among {sorted(LAYOUTS)}; got {args.worlds}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, reference = [], None
    with tempfile.TemporaryDirectory() as tmp:
        init_from = None
        for world in worlds:
            print(f"rollout phase on {world} process(es) ...", file=sys.stderr, flush=True)
            res = _spawn(world, args, Path(tmp) / f"w{world}", init_from)
            if init_from is None:  # later worlds start from the 1-process run's warm-up
                init_from = Path(tmp) / "w1" / "warm" / "weights.pt"
            digests = set().union(*(r["digests"][m] for r in res for m in MODES))
            reference = reference or digests
            if len(digests) != 1 or digests != reference:
                raise RuntimeError(f"{world} processes generated other rollouts than 1 process: {digests}")
            lead = statistics.median(res[0]["times"]["lead only"])
            for mode in MODES:
                wall = statistics.median(res[0]["times"][mode])
                per_rank = [r["counts"][mode] for r in res]
                rows.append({"world": world, "layout": " x ".join(LAYOUTS[world]).replace("parallel.", "") or "1",
                             "mode": mode, "wall_s": wall, "speedup": lead / wall,
                             "sync_s": statistics.median(res[0]["sync"]) if mode == "every rank" else float("nan"),
                             "requests_per_rank": per_rank, "tokens": res[0]["tokens"][mode],
                             "tokens_per_s": res[0]["tokens"][mode] / wall})
    header = ("processes", "layout", "mode", "rollout phase s (median)", "weight refill s", "vs lead only",
              "requests per rank", "tokens", "tokens/s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['world']} | {r['layout']} | {r['mode']} | {r['wall_s']:.3f} | "
                     f"{'-' if r['sync_s'] != r['sync_s'] else format(r['sync_s'], '.3f')} | {r['speedup']:.2f}x | "
                     f"{r['requests_per_rank']} | {r['tokens']} | {r['tokens_per_s']:.1f} |")
    cores = os.cpu_count()
    setup = (f"recipe {args.recipe} ({' '.join(args.recipe_overrides) or 'as shipped'}), {args.prompts} prompts x "
             f"{args.group_size} samples, max_new_tokens {args.max_new_tokens}, temperature from the recipe, fixed K "
             f"(draft.adaptive=false), {args.rounds} rounds per mode (alternating), one torch thread per rank, "
             f"{cores} CPU cores")
    table = "\n".join(lines)
    print(table)
    text = (f"# Rollouts at scale: every rank generates\n\nCommand: `python benchmarks/rollout_scale.py"
            f"{' ' + ' '.join(argv) if argv else ''}`\n\nSetup: {setup}.\n\n{table}\n\n"
            "Every mode and process count generated the 1-process rollouts token for token (checked by the script: "
            "coupled sampling with per-request seeds makes them placement-invariant). `rollout phase s` is the "
            "slowest rank's wall time of one rollout phase (weight refill + decoding + gathering the outputs), "
            "median over rounds; `vs lead only` divides the lead-only phase of the same process count by it. "
            f"With {cores} cores, more processes than cores share them: the speed-up of a real cluster, where each "
            "rank decodes on its own GPU, approaches the number of ranks per replica for decode-bound phases.\n")
    (out_dir / "rollout_scale.md").write_text(text)
    return {"rows": rows}


if __name__ == "__main__":
    main()
