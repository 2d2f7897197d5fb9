"""Context-parallel attention: per-rank memory saved for backward and wall time, ours vs two baselines.

Methods (all compute the same thing: causal packed attention of the TTT step-K query with the K branch keys
merged in one softmax; forward + backward):

- ``ours``: :func:`lightning_codraft.attention.codraft_attention` (zigzag ring, P2P K/V, branch rank-local,
  one autograd.Function saving only its inputs, the output and the fp32 LSE).
- ``allgather``: llama3-style CP: every rank all-gathers K/V (differentiable all-gather), attends its zigzag
  query rows against the gathered key prefix of each document; branch attention merged with plain autograd.
- ``dupkeys``: SpecForge-style branch attention: the key set is duplicated ``(K+1)`` times (main keys and every
  step's keys, gathered under CP) and an explicit ``(T_local, (K+1) T)`` mask selects the visible ones.

Per rank we sum the bytes of the distinct storages autograd saves for backward
(``torch.autograd.graph.saved_tensors_hooks``) and time forward + backward (max over ranks). Total tokens
are packed into documents of at most ``--doc-tokens`` tokens (unequal lengths, 3:1 split of each block).

Run: ``python benchmarks/cp_attention.py`` (defaults: 4K..64K tokens, cp 1/2/4, K=3). Writes
``docs/benchmarks/cp.md`` and ``docs/benchmarks/cp.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from lightning_codraft.attention import (
    ZigzagLayout,
    codraft_attention,
    merge_attention,
    varlen_attention,
    zigzag_shard,
)
from pages import command, pyplot, save_figure

ROOT = Path(__file__).resolve().parent.parent

METHODS = ("ours", "allgather", "dupkeys")


# ------------------------------------------------------------------------------------------------ layout


def doc_lengths(total: int, doc_tokens: int, multiple: int) -> list[int]:
    """Split ``total`` tokens into documents of <= doc_tokens, each block cut 3:1 (unequal), multiples of ``multiple``."""
    out, left = [], total
    while left > 0:
        block = min(doc_tokens, left)
        a = max(multiple, (block * 3 // 4) // multiple * multiple)
        b = block - a
        out += [a] + ([b] if b > 0 else [])
        left -= block
    assert all(n % multiple == 0 for n in out) and sum(out) == total
    return out


def cu_of(lengths: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu


class SavedBytes:
    """Sums the bytes of distinct storages that autograd saves for backward."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor):
        s = t.untyped_storage()
        self.storages[s.data_ptr()] = s.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


# ------------------------------------------------------------------------------------------------ baselines


def _gather_global(x: torch.Tensor, cu: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather of zigzag shards back into global row order."""
    if group is None:
        return x
    from torch.distributed.nn.functional import all_gather

    parts = all_gather(x, group=group)
    rows = torch.cat([ZigzagLayout.build(cu, r, dist.get_world_size(group)).global_rows
                      for r in range(dist.get_world_size(group))])
    return torch.cat(parts, 0).index_select(0, torch.argsort(rows))


def _branch_dense(q, bk, bv, scale):
    """Differentiable branch attention with plain autograd: (out (T,H,D), lse (T,H))."""
    T, H, D = q.shape
    K, V = torch.stack(bk, 2), torch.stack(bv, 2)                         # (T, Hkv, k, D)
    qg = q.unflatten(1, (K.shape[1], -1))
    s = torch.einsum("tngd,tnkd->tngk", qg, K) * scale
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("tngk,tnkd->tngd", torch.softmax(s, -1), V)
    return out.reshape(T, H, D), lse.reshape(T, H).float()


def allgather_attention(q, k, v, bk, bv, cu, group):
    """llama3-style CP: all-gather K/V, each query chunk against its document's key prefix, branch merged."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    P = dist.get_world_size(group) if group is not None else 1
    r = dist.get_rank(group) if group is not None else 0
    lay = ZigzagLayout.build(cu, r, P)
    kf, vf = _gather_global(k, cu, group), _gather_global(v, cu, group)
    starts, ends = cu[:-1].tolist(), cu[1:].tolist()
    outs, lses, rows = [], [], []
    for half, chunk_of in ((lay.front, lambda c: r), (lay.back, lambda c: 2 * P - 1 - r)):
        key_rows, lk = [], []
        for d, (a, e) in enumerate(zip(starts, ends)):
            c = (e - a) // (2 * P)
            n = (chunk_of(c) + 1) * c
            key_rows.append(torch.arange(a, a + n))
            lk.append(n)
        key_rows = torch.cat(key_rows)
        o, l = varlen_attention(q.index_select(0, half), kf.index_select(0, key_rows),
                                vf.index_select(0, key_rows), lay.cu_half, cu_of(lk), causal=True,
                                softmax_scale=scale)
        outs.append(o), lses.append(l), rows.append(half)
    perm = torch.argsort(torch.cat(rows))
    out, lse = torch.cat(outs).index_select(0, perm), torch.cat(lses).index_select(0, perm)
    if bk:
        b_out, b_lse = _branch_dense(q, bk, bv, scale)
        out, lse = merge_attention(out, lse, b_out, b_lse)
    return out


def dupkeys_attention(q, k, v, bk, bv, cu, group):
    """SpecForge-style: (K+1) duplicated key sets per document and an explicit float mask, SDPA per document."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    P = dist.get_world_size(group) if group is not None else 1
    r = dist.get_rank(group) if group is not None else 0
    lay = ZigzagLayout.build(cu, r, P)
    keys = [_gather_global(t, cu, group) for t in (k, *bk)]
    vals = [_gather_global(t, cu, group) for t in (v, *bv)]
    groups = q.shape[1] // k.shape[1]
    starts, ends = cu[:-1].tolist(), cu[1:].tolist()
    cu_l = lay.cu_local.tolist()
    outs = []
    for d, (a, e) in enumerate(zip(starts, ends)):
        L = e - a
        qpos = lay.global_rows[cu_l[d]:cu_l[d + 1]] - a                                 # (Lq,) positions
        kd = torch.cat([t[a:e] for t in keys], 0).repeat_interleave(groups, 1)           # ((K+1)L, H, D)
        vd = torch.cat([t[a:e] for t in vals], 0).repeat_interleave(groups, 1)
        j = torch.arange(L)
        visible = [j.unsqueeze(0) <= qpos.unsqueeze(1)] + [j.unsqueeze(0) == qpos.unsqueeze(1)] * len(bk)
        mask = torch.zeros(len(qpos), (len(bk) + 1) * L, dtype=q.dtype).masked_fill(
            ~torch.cat(visible, 1), float("-inf"))
        o = F.scaled_dot_product_attention(q[cu_l[d]:cu_l[d + 1]].transpose(0, 1).unsqueeze(0),
                                           kd.transpose(0, 1).unsqueeze(0), vd.transpose(0, 1).unsqueeze(0),
                                           attn_mask=mask, scale=scale)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs, 0)


def dupkeys_mask_bytes(lengths: list[int], P: int, K: int, itemsize: int) -> int:
    return sum((L // P) * (K + 1) * L * itemsize for L in lengths)


# ------------------------------------------------------------------------------------------------ running


def run_one(method, T, args, group):
    """One forward + backward on this rank; returns ({saved, fwd, bwd}, detached output) or (None, None)."""
    P = dist.get_world_size(group) if group is not None else 1
    r = dist.get_rank(group) if group is not None else 0
    lengths = doc_lengths(T, args.doc_tokens, 8)
    cu = cu_of(lengths)
    if method == "dupkeys" and dupkeys_mask_bytes(lengths, P, args.K, 4) > args.dup_mask_budget_gib * 2 ** 30:
        return None, None
    g = torch.Generator().manual_seed(0)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    mk = lambda h: zigzag_shard(torch.randn(T, h, D, generator=g), cu, r, P).requires_grad_()  # noqa: E731
    q, k, v = mk(H), mk(Hkv), mk(Hkv)
    bk, bv = [mk(Hkv) for _ in range(args.K)], [mk(Hkv) for _ in range(args.K)]
    meter = SavedBytes()
    if group is not None:
        dist.barrier(group)
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        if method == "ours":
            out = codraft_attention(q, k, v, cu, branch_k=bk, branch_v=bv, group=group)
        elif method == "allgather":
            out = allgather_attention(q, k, v, bk, bv, cu, group)
        else:
            out = dupkeys_attention(q, k, v, bk, bv, cu, group)
    t1 = time.perf_counter()
    out.float().square().mean().backward()
    t2 = time.perf_counter()
    return {"saved": meter.total, "fwd": t1 - t0, "bwd": t2 - t1}, out.detach()


def worker(rank, P, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn.functional.all_gather
    torch.set_num_threads(max(1, args.threads // P))
    group = None
    if P > 1:
        dist.init_process_group("gloo", rank=rank, world_size=P)
        group = dist.group.WORLD
    try:
        for method in args.methods:  # warm-up (first-call kernel and allocator costs), not recorded
            run_one(method, 64 * P, args, group)
        for T in args.lengths:
            outs = {}
            for method in args.methods:
                res, outs[method] = run_one(method, T, args, group)
                if res is not None and "ours" in outs and outs["ours"] is not None:
                    diff = torch.tensor([(outs[method] - outs["ours"]).abs().max().item()])
                    if group is not None:
                        dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
                    res["diff"] = diff.item()
                if group is not None:
                    vals = torch.tensor([-1.0, -1.0, -1.0] if res is None else [res["saved"], res["fwd"], res["bwd"]])
                    dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=group)
                    res = None if vals[0] < 0 else {"saved": vals[0].item(), "fwd": vals[1].item(),
                                                   "bwd": vals[2].item(), "diff": res["diff"] if res else 0.0}
                if rank == 0:
                    queue.put((P, T, method, res))
                    print(f"  cp={P} T={T} {method}: {fmt(res)}", flush=True)
        if group is not None:  # leave together: a gloo peer torn down while the other still closes aborts it
            dist.barrier(group=group)
    finally:
        if group is not None:
            dist.destroy_process_group()
        if rank == 0:
            queue.put(None)


def worker_main(rank, P, port, args, queue):
    """Run :func:`worker`, then leave through ``os._exit``: after gloo teardown, a native thread still joinable at
    interpreter shutdown aborts the process ("terminate called without an active exception") although every result
    was sent. The results travel on a SimpleQueue, which writes synchronously, so nothing is lost by skipping the
    interpreter's teardown."""
    code = 0
    try:
        worker(rank, P, port, args, queue)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fmt(res):
    if res is None:
        return "skipped (mask over budget)"
    return (f"saved {res['saved'] / 2 ** 20:.1f} MiB, fwd {res['fwd']:.2f}s, bwd {res['bwd']:.2f}s, "
            f"max|out - ours| {res.get('diff', 0.0):.1e}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cp(P, args) -> list:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=worker_main, args=(r, P, port, args, queue)) for r in range(P)]
    for p in procs:
        p.start()
    rows = []
    while True:
        item = queue.get()
        if item is None:
            break
        rows.append(item)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"cp={P} worker exited with code {p.exitcode}")
    return rows


def report(rows, args) -> str:
    res = {(P, T, m): r for P, T, m, r in rows}
    cps = sorted({P for P, _, _, _ in rows})
    lines = ["| tokens | cp | " + " | ".join(f"{m} saved MiB" for m in args.methods) + " | "
             + " | ".join(f"{m} fwd+bwd s" for m in args.methods) + " | ours vs cp=1 | ours vs allgather | "
             "ours vs dupkeys |",
             "|" + "---|" * (5 + 2 * len(args.methods))]
    for T in args.lengths:
        for P in cps:
            cells = [f"{T / 1024:g}K", str(P)]
            cells += ["–" if res.get((P, T, m)) is None else f"{res[(P, T, m)]['saved'] / 2 ** 20:.1f}"
                      for m in args.methods]
            cells += ["–" if res.get((P, T, m)) is None else f"{res[(P, T, m)]['fwd'] + res[(P, T, m)]['bwd']:.2f}"
                      for m in args.methods]
            ours, base = res.get((P, T, "ours")), res.get((1, T, "ours"))
            ratio = lambda a, b: "–" if a is None or b is None else f"{a['saved'] / b['saved']:.3f}x"  # noqa: E731
            cells += [ratio(ours, base), ratio(ours, res.get((P, T, "allgather"))),
                      ratio(ours, res.get((P, T, "dupkeys")))]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows) -> str:
    """Plain-language reading of the memory figures at the largest length measured."""
    res = {(P, T, m): r for P, T, m, r in rows if r is not None}
    cps = sorted({P for P, _, _, _ in rows})
    T = max(T for _, T, _, _ in rows)
    lines = []
    base = res.get((1, T, "ours"))
    for P in cps[1:]:
        ours = res.get((P, T, "ours"))
        if ours and base:
            lines.append(f"- {T / 1024:g}K tokens, cp={P}: ours saves {ours['saved'] / base['saved']:.3f}x of its cp=1 "
                         f"bytes per rank (goal at cp=4: <= 0.3x)")
    for P in cps:
        ours, ag = res.get((P, T, "ours")), res.get((P, T, "allgather"))
        if ours and ag:
            lines.append(f"- {T / 1024:g}K tokens, cp={P}: ours {ours['saved'] / ag['saved']:.3f}x of all-gather CP")
        dup = [T2 for P2, T2, m, _ in rows if P2 == P and m == "dupkeys" and (P2, T2, m) in res]
        if dup:
            T2 = max(dup)
            lines.append(f"- {T2 / 1024:g}K tokens (largest dupkeys run), cp={P}: ours "
                         f"{res[(P, T2, 'ours')]['saved'] / res[(P, T2, 'dupkeys')]['saved']:.3f}x of duplicated keys")
    return "\n".join(lines)


def plot(rows, args, path: Path):
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"ours": "C0", "allgather": "C1", "dupkeys": "C3"}
    dashes = {1: ("-", "o"), 2: ("--", "s"), 4: (":", "^")}
    for P in sorted({P for P, _, _, _ in rows}):
        ls, mk = dashes.get(P, ("-.", "x"))
        for m in args.methods:
            pts = sorted((T, r) for P2, T, m2, r in rows if P2 == P and m2 == m and r is not None)
            if not pts:
                continue
            xs = [T for T, _ in pts]
            style = dict(color=colors[m], linestyle=ls, marker=mk, label=f"{m} cp={P}")
            axes[0].plot(xs, [r["saved"] / 2 ** 20 for _, r in pts], **style)
            axes[1].plot(xs, [r["fwd"] + r["bwd"] for _, r in pts], **style)
    for ax, title in zip(axes, ["per-rank bytes saved for backward (MiB)", "fwd+bwd wall time, max over ranks (s)"]):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("total tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def write_docs(rows, args, cmd: str) -> None:
    """Print the table and summary; write ``cp.md`` and ``cp.png`` under ``args.out``."""
    table = report(rows, args)
    print(table)
    print(summary(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args, args.out / "cp.png")
    (args.out / "cp.md").write_text(
        "# Context-parallel attention: memory and time per rank\n\n"
        f"`{cmd.strip()}` on {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo. fp32, "
        f"H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, K={args.K} branch steps; tokens packed into "
        f"blocks of {args.doc_tokens} split 3:1 into two documents. Saved = distinct storages autograd keeps for "
        "backward on one rank (max over ranks); time = forward + backward, max over ranks, all ranks sharing "
        f"{args.threads} threads (so time shows overhead, not speed-up; load average at the end "
        f"{os.getloadavg()[0]:.1f}). `–` = not run: the dupkeys mask alone "
        f"would exceed {args.dup_mask_budget_gib} GiB.\n\n" + table + "\n\n" + summary(rows)
        + "\n\n![cp](cp.png)\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--K", type=int, default=3, help="TTT branch steps merged into the attention")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--doc-tokens", type=int, default=8192, help="tokens per packed block (split 3:1 into 2 docs)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads shared by the ranks")
    ap.add_argument("--dup-mask-budget-gib", type=float, default=1.0,
                    help="skip dupkeys when its mask alone would exceed this per rank")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args(argv)
    rows = []
    for P in args.cp:
        print(f"cp={P}", flush=True)
        rows += run_cp(P, args)
    write_docs(rows, args, command("cp_attention.py", argv))
    return rows


if __name__ == "__main__":
    main()
