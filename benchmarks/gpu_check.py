"""One script that checks and times what only a GPU can show, for the short windows a GPU is at hand.

    python benchmarks/gpu_check.py                  # on a CUDA machine: writes docs/benchmarks/gpu.md
    python benchmarks/gpu_check.py --smoke --out /tmp/x   # anywhere: the same code paths on CPU, tiny sizes

1. **Attention kernels**: every CUDA backend of ``lightning_codraft.attention.varlen_attention`` that can run
   (``torch_flash``: PyTorch's varlen flash ops; ``flash_attn``: the optional package) against a dense fp32
   reference in bf16: packed documents of several lengths, GQA, causal, plus a ring-style block (Lq != Lk);
   forward output and lse, and the gradients of q, k, v. (On the GPU also run
   ``pytest tests/attention/test_local_cuda.py``: its real-kernel tests run only where CUDA is present.)
2. **A bf16-mixed co-training step** of SmolLM2-135M (or the tiny policy with ``--smoke``) and its EAGLE-3 draft
   through ``CoDraftModule`` under Fabric ``precision="bf16-mixed"``: step time and training tokens/s.
3. **Rollouts**: the embedded engine's plain and speculative (K=4) decoding tokens/s at batch 8.

Every number is printed as a table and written to ``<out>/gpu.md`` with the device name. Errors are reported
relative to the reference's largest entry.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from lightning_codraft.attention import BACKENDS, varlen_attention
from lightning_codraft.attention.local_cuda import available_cuda_backend, input_problem
from lightning_codraft.batch import RLBatch
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.rollout import SpeculativeEngine
from lightning_codraft.training.module import CoDraftModule

ROOT = Path(__file__).resolve().parent.parent


def dense_reference(q, k, v, cu_q, cu_k):
    """fp32 softmax attention per document, causal mask aligned bottom-right: (out (T,H,D), lse (T,H))."""
    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t.float() for t in (q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]))
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
        lq, lk = qs.shape[0], ks.shape[0]
        visible = torch.arange(lk, device=q.device)[None] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        s = s.masked_fill(~visible, float("-inf"))
        lses.append(torch.logsumexp(s, -1).transpose(0, 1))
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).nan_to_num(0.0), vs))
    return torch.cat(outs), torch.cat(lses)


def _rel(a, b):
    finite = torch.isfinite(b)
    return float((a.float() - b.float())[finite].abs().max() / b.float()[finite].abs().max().clamp_min(1e-12))


def check_attention(device, dtype, backends, lengths=(37, 128, 211), lq_short=64):
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    H, Hkv, D = 8, 2, 64
    packed = [0] + torch.tensor(lengths).cumsum(0).tolist()
    for name, cu_q_list, cu_k_list in (("self, packed", packed, packed),
                                       ("ring block Lq<Lk", [0, lq_short], [0, lengths[1]])):
        Tq, Tk = cu_q_list[-1], cu_k_list[-1]
        q = torch.randn(Tq, H, D, generator=gen).to(device, dtype).requires_grad_()
        k = torch.randn(Tk, Hkv, D, generator=gen).to(device, dtype).requires_grad_()
        v = torch.randn(Tk, Hkv, D, generator=gen).to(device, dtype).requires_grad_()
        cu_q = torch.tensor(cu_q_list, dtype=torch.int32, device=device)
        cu_k = torch.tensor(cu_k_list, dtype=torch.int32, device=device)
        ref_out, ref_lse = dense_reference(q, k, v, cu_q_list, cu_k_list)
        dout = torch.randn_like(ref_out)
        ref_grads = torch.autograd.grad((ref_out * dout).sum(), (q, k, v))
        for backend in backends:
            problem = input_problem(backend, q, k, v) if backend in ("torch_flash", "flash_attn") else None
            if problem:
                rows.append((name, backend, "skipped: " + problem, "", "", ""))
                continue
            t0 = time.perf_counter()
            out, lse = varlen_attention(q, k, v, cu_q, cu_k, causal=True, backend=backend)
            grads = torch.autograd.grad((out.float() * dout).sum(), (q, k, v))
            if device.type == "cuda":
                torch.cuda.synchronize()
            ms = 1000 * (time.perf_counter() - t0)
            rows.append((name, backend, f"{_rel(out, ref_out):.2e}", f"{_rel(lse, ref_lse):.2e}",
                         " / ".join(f"{_rel(g, r):.2e}" for g, r in zip(grads, ref_grads)), f"{ms:.2f}"))
    return rows


def _models(smoke, device):
    if smoke:
        torch.manual_seed(0)
        policy = Policy(PolicyConfig.tiny(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    else:
        from lightning_codraft.models.hf_io import smollm2_135m_path

        policy = Policy.from_pretrained(smollm2_135m_path())
    return policy.to(device), Eagle3Draft.from_policy(policy).to(device)


def co_training_step(device, smoke, steps, docs, length):
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step

    fabric = Fabric(accelerator=device.type, devices=1, strategy=CoDraftStrategy(), precision="bf16-mixed")
    fabric.launch()
    policy, draft = _models(smoke, device)
    model = fabric.setup_module(CoDraftModule(policy, draft, policy_lr=1e-6, draft_lr=1e-4, ttt_steps=4))
    optimizer, scheduler = model.build_optimizer()
    optimizer = fabric.setup_optimizers(optimizer)
    V = policy.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, V, (length // 4,), generator=gen).tolist() for _ in range(docs)]
    completions = [torch.randint(1, V, (length - length // 4,), generator=gen).tolist() for _ in range(docs)]
    batch = RLBatch.pack(prompts, completions, [[-1.0] * len(c) for c in completions],
                         [float(i % 2) - 0.5 for i in range(docs)]).to(device)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        t0 = time.perf_counter()
        metrics = fabric_training_step(fabric, model, batch, optimizer, scheduler)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times[1:])[len(times[1:]) // 2]
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"step_s": step_s, "tokens_per_s": batch.num_tokens / step_s, "loss": metrics["loss"],
            "finite": math.isfinite(metrics["loss"]), "tokens": batch.num_tokens, "peak_gib": peak}, policy, draft


def rollouts(policy, draft, batch_size, new_tokens):
    prompts = [[1 + (7 * i + j) % 200 for j in range(16)] for i in range(batch_size)]
    out = {}
    for name, k in (("plain", 0), ("K=4", 4)):
        engine = SpeculativeEngine(policy, draft if k else None, k)
        engine.generate(prompts, max_new_tokens=4, temperature=0.0)  # warm up
        t0 = time.perf_counter()
        outs = engine.generate(prompts, max_new_tokens=new_tokens, temperature=0.0)
        if policy.lm_head.weight.device.type == "cuda":
            torch.cuda.synchronize()
        out[name] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)
    return out


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; runs on CPU too")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run with --smoke for the CPU check of the same code paths")
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name() if cuda else "CPU (smoke run: no GPU)"
    backends = [b for b in ("torch_flash", "flash_attn") if cuda] or ["cpu"]
    if cuda and available_cuda_backend(torch.empty(1, 1, 64, device=device, dtype=torch.bfloat16)) is None:
        backends.append("torch")
    attn = check_attention(device, torch.bfloat16 if cuda else torch.float32, backends,
                           lengths=(9, 16, 23) if args.smoke else (37, 128, 211), lq_short=8 if args.smoke else 64)
    docs, length = (16, 256) if not args.smoke else (4, 32)
    step, policy, draft = co_training_step(device, args.smoke, args.steps if not args.smoke else 1, docs, length)
    roll = rollouts(policy.to(torch.bfloat16 if cuda else torch.float32),
                    draft.to(torch.bfloat16 if cuda else torch.float32), 8, 64 if not args.smoke else 8)
    lines = [f"# GPU check: {name}", "", f"torch {torch.__version__}; backends tried: {', '.join(backends)} "
             f"(of {', '.join(BACKENDS)}). Command: `python benchmarks/gpu_check.py{' --smoke' if args.smoke else ''}`",
             "", "## Attention kernels against a dense fp32 reference (relative to the reference's largest entry)", "",
             "| case | backend | out | lse | grad q / k / v | ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {' | '.join(map(str, r))} |" for r in attn]
    lines += ["", f"## One bf16-mixed co-training step ({'tiny policy' if args.smoke else 'SmolLM2-135M'} + EAGLE-3 "
              f"draft, {docs} documents x {length} tokens, K=4 TTT)", "",
              "| step s | training tokens/s | loss finite | peak GiB |", "|---|---|---|---|",
              f"| {step['step_s']:.3f} | {step['tokens_per_s']:.0f} | {step['finite']} | {step['peak_gib']:.2f} |",
              "", "## Embedded engine, batch 8, greedy (random prompts; the draft is untrained)", "",
              "| plain tok/s | K=4 tok/s |", "|---|---|", f"| {roll['plain']:.0f} | {roll['K=4']:.0f} |", ""]
    text = "\n".join(lines)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(text)
    return out / "gpu.md"


if __name__ == "__main__":
    main()
