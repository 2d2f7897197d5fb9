"""Test helpers (unique module name: tests/ dirs share sys.path): a dense top-k/top-p reference, tiny policies with peaked (decisive) distributions and a draft fitted to one.

``fit_draft`` trains an EAGLE-3 draft by the TTT unroll on the policy's own greedy continuations, with a
plain cross-entropy against the policy's argmax at row ``i + 1 + k`` (written densely here; the
production loss lives in ``training/draft_loss.py`` and is not used, so these tests stand alone).
"""

from __future__ import annotations

import math

import torch

from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine
from lightning_codraft.training.dflash_loss import context_visibility, dflash_draft_loss, sample_anchors


def make_policy(seed: int = 0, std: float = 0.2, **overrides) -> Policy:
    """A tiny Llama whose logits are far from uniform (so greedy argmax has no near-ties)."""
    torch.manual_seed(seed)
    policy = Policy(PolicyConfig.tiny(**overrides))
    policy.reset_parameters(std=std)
    return policy.eval()


def random_prompts(n: int, vocab: int, lo: int = 1, hi: int = 20, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g).tolist() for L in lengths]


def fit_prompts(num_seqs: int, vocab: int, prompt_len: int = 4, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num_seqs, prompt_len), generator=g).tolist()


def fit_draft(policy: Policy, draft: Eagle3Draft, prompts: list[list[int]], *, gen_len: int = 28, unroll: int = 4,
              steps: int = 100, lr: float = 3e-3) -> Eagle3Draft:
    """Train ``draft`` (in place) to predict the policy's greedy continuations of ``prompts`` (all the same
    length); returns it in eval mode. A tiny random policy is chaotic, so the fit is to these trajectories."""
    outs = SpeculativeEngine(policy, None, 0).generate(prompts, gen_len, temperature=0.0)
    ids = torch.tensor([p + o.token_ids for p, o in zip(prompts, outs)])  # (N, T) all the same length
    N, T = ids.shape
    flat = ids.reshape(-1)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    pos = torch.arange(T).repeat(N)
    with torch.no_grad():
        out = policy(flat, cu_seqlens=cu, position_ids=pos, taps=draft.config.taps)
        taps = [t.detach() for t in out.taps]
        greedy = out.logits.argmax(-1).reshape(N, T)      # greedy[i] = policy's choice for x_{i+1}
    t2d = draft.t2d
    target_to_draft = torch.cumsum(t2d.long(), 0) - 1     # valid where t2d (d2t maps increasing ids)
    embeds, targets, masks = [], [], []
    for k in range(unroll):
        shifted = torch.zeros_like(ids)
        shifted[:, : T - k - 1] = ids[:, k + 1:]
        embeds.append(policy.embed(shifted.reshape(-1)).detach())
        tgt = torch.zeros_like(ids)
        tgt[:, : T - k - 1] = greedy[:, k + 1:]           # row i, step k predicts x_{i+2+k}
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, : T - k - 1] = True
        tgt, mask = tgt.reshape(-1), mask.reshape(-1)
        mask &= t2d[tgt]
        targets.append(target_to_draft[tgt].clamp_min(0))
        masks.append(mask)
    draft.train()
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    for _ in range(steps):
        outs = draft.ttt_forward(taps, embeds, cu, pos)
        loss = sum(0.8 ** k * torch.nn.functional.cross_entropy(lg[m], tg[m])
                   for k, ((lg, _), tg, m) in enumerate(zip(outs, targets, masks)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval()


def reference_filter(logits: list[float], top_k: int, top_p: float) -> list[bool]:
    """Kept tokens, from the definitions: top-k by rank, then the smallest top-p nucleus."""
    v = len(logits)
    keep = [True] * v
    if 0 < top_k < v:
        kth = sorted(logits, reverse=True)[top_k - 1]
        keep = [x >= kth for x in logits]
    if top_p < 1.0:
        kept = [x if k else -math.inf for x, k in zip(logits, keep)]
        z = sum(math.exp(x) for x in kept if x > -math.inf)
        order = sorted(range(v), key=lambda i: -kept[i])
        mass, nucleus = 0.0, set()
        for i in order:
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += math.exp(kept[i]) / z if kept[i] > -math.inf else 0.0
        keep = [k and (i in nucleus) for i, k in enumerate(keep)]
    return keep


def fit_dflash(policy, drafter, prompts, steps=250):
    """A DFlash drafter fitted briefly (in place) to the policy's greedy continuations of ``prompts``; returned in
    eval mode."""
    outs = SpeculativeEngine(policy, None, 0).generate(prompts, 24, temperature=0.0)
    docs = [p + o.token_ids for p, o in zip(prompts, outs)]
    ids = torch.tensor([t for d in docs for t in d])
    cu = torch.tensor([0, *torch.tensor([len(d) for d in docs]).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(len(d)) for d in docs])
    with torch.no_grad():
        out = policy(ids, cu_seqlens=cu, position_ids=pos, taps=tuple(drafter.config.taps))
    mask, g = torch.ones_like(ids, dtype=torch.float32), torch.Generator().manual_seed(5)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        anchors = sample_anchors(cu, mask, 6, g)
        emb = policy.embed(drafter.block_ids(ids[anchors])).detach()
        hidden = drafter(drafter.context(list(out.taps)), pos, emb, pos[anchors],
                         context_visibility(cu, anchors, ids.shape[0]))
        loss = dflash_draft_loss(drafter.logits(hidden, policy.lm_head.weight), out.logits, anchors, cu, mask).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()
