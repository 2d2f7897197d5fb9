"""Cost of co-training the draft inside the RL step: one optimizer step of CoDraftModule, three ways.

Same policy, same packed GRPO batch, same optimizer; three variants measured side by side in one run
(interleaved rounds in rotating order, median per variant):

- ``rl_only``: ``draft_loss_weight=0, score_draft=False``: the policy update alone (the no-draft baseline).
- ``frozen``: the draft is run without gradient to log its accuracy (the frozen-draft baseline).
- ``cotrain``: ``L_rl + lambda L_draft`` in one backward, the draft's K=3 TTT steps trained (this library).

The ratio cotrain / rl_only is the price of keeping the draft aligned with the policy, paid in the training
step; what it buys is paid back in rollout speed (benchmarks/rollout.py, `codraft bench`).

On a tiny policy the draft (one layer, K=3 unrolled steps, lm_head over V/4) is large relative to the
policy (8 layers), so these ratios overstate the cost for real models, whose policy has tens of layers.

Run: ``python benchmarks/codraft_step.py --rounds 9 --threads 1`` (defaults: 8 layers, hidden 256, vocab 8192,
draft vocabulary 2048, 16 documents of ~128 tokens). Writes ``docs/benchmarks/codraft_step.md`` and ``docs/benchmarks/codraft_step.png``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.rl.experience import Rollout, build_rl_batch
from lightning_codraft.training.module import CoDraftModule
from pages import pyplot, save_figure

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "rl_only": dict(draft_loss_weight=0.0, score_draft=False),
    "frozen": dict(freeze_draft=True),
    "cotrain": dict(draft_loss_weight=1.0),
}


def make_batch(vocab: int, docs: int, length: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rollouts = []
    for i in range(docs):
        n = int(length * (0.75 + 0.5 * torch.rand(1, generator=g)))
        prompt = torch.randint(1, vocab, (n // 4,), generator=g).tolist()
        completion = torch.randint(1, vocab, (n - n // 4,), generator=g).tolist()
        rollouts.append(Rollout(prompt, completion, [-9.0] * len(completion), group=i // 4))
    return build_rl_batch(rollouts, torch.randn(docs, generator=g).tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    config = PolicyConfig.tiny(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                               max_position_embeddings=4096)
    batch = make_batch(args.vocab, args.docs, args.length)
    modules = {}
    for name, kwargs in VARIANTS.items():
        torch.manual_seed(0)
        policy = Policy(config)
        counts = torch.arange(args.vocab, 0, -1).float()  # Zipf-like frequencies pick the draft vocabulary
        draft = Eagle3Draft.from_policy(policy, draft_vocab_size=args.vocab // 4, token_counts=counts)
        module = CoDraftModule(policy, draft, policy_lr=1e-5, draft_lr=1e-4, **kwargs)
        modules[name] = (module, *module.build_optimizer())

    def step(name: str) -> float:
        module, optimizer, scheduler = modules[name]
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        out = module(batch)
        out.loss.backward()
        module.after_backward()
        optimizer.step()
        scheduler.step()
        return time.perf_counter() - t0

    names = list(VARIANTS)
    for name in names:  # warm-up
        step(name)
    times = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(step(name))
    med = {n: statistics.median(t) for n, t in times.items()}
    tokens = batch.num_tokens

    rows = [(n, med[n], med[n] / med["rl_only"], tokens / med[n]) for n in names]
    header = f"{'variant':<10} {'step s':>9} {'x rl_only':>10} {'tokens/s':>10}"
    print(header)
    for n, t, ratio, tps in rows:
        print(f"{n:<10} {t:>9.3f} {ratio:>10.2f} {tps:>10.0f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Co-training cost inside the RL step", "",
             f"`python benchmarks/codraft_step.py` — one process, {args.threads} threads, policy {args.layers} layers x "
             f"{args.hidden} (vocab {args.vocab}), draft vocabulary {args.vocab // 4} (V/4 as in EAGLE-3), K=3 TTT steps, packed batch of {args.docs} documents "
             f"({tokens} tokens); median of {args.rounds} interleaved rounds after one warm-up.", "",
             "| variant | step (s) | x rl_only | tokens/s |", "|---|---:|---:|---:|"]
    lines += [f"| {n} | {t:.3f} | {ratio:.2f} | {tps:.0f} |" for n, t, ratio, tps in rows]
    lines += ["", "`rl_only`: policy update alone; `frozen`: draft scored without gradient; `cotrain`: "
              "L_rl + lambda L_draft in one backward. All three in the same run on the same batch."]
    (out / "codraft_step.md").write_text("\n".join(lines) + "\n")

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, [med[n] / med["rl_only"] for n in names], color=["#999999", "#6699cc", "#cc6633"])
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_ylabel("step time / rl_only")
    ax.set_title("Co-training cost per RL step")
    save_figure(fig, out / "codraft_step.png", dpi=120)
    print(f"wrote {out / 'codraft_step.md'} and {out / 'codraft_step.png'}")


if __name__ == "__main__":
    main()
