"""Policy + EAGLE-3 draft end to end under context parallelism (cp = 2, 4) equal the single-process run.

Policy logits and taps, the draft TTT loss, and the gradients of every policy and draft weight (summed over
the CP group, as data-parallel reduction would) match cp = 1. The draft's token embeddings are built the way
training does it: ids shifted left by k+1 under CP (``shift_left``, halo exchange, several hops where a
zigzag chunk is shorter than the shift), embedded by the policy, detached.
"""

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_codraft.attention import position_ids_from_cu_seqlens, shift_left, zigzag_shard
from lightning_codraft.models.config import PolicyConfig
from lightning_codraft.models.eagle3 import Eagle3Draft
from lightning_codraft.models.policy import Policy
from lightning_codraft.training.draft_loss import ttt_draft_loss

K = 3
LENGTHS = [8, 24, 16]  # multiples of 2 * cp for cp in {1, 2, 4}; 8 / (2*4) = 1-row chunks force multi-hop shifts


def _models(arch):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(architecture=arch))
    counts = torch.randint(0, 100, (policy.config.vocab_size,), generator=torch.Generator().manual_seed(1))
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=48, token_counts=counts)
    return policy, draft


def _step(policy, draft, ids, pos, cu, rl_grad, shard, group):
    """One co-training step on this rank's rows: (logits, taps, draft loss, grads by name)."""
    policy.zero_grad()
    draft.zero_grad()
    out = policy(shard(ids), cu_seqlens=cu, position_ids=shard(pos), taps=draft.config.taps, cp_group=group)
    rl_loss = (out.logits * shard(rl_grad)).sum()        # stands in for the RL loss: any row-local function
    local_ids = shard(ids)
    embeds = [policy.embed(shift_left(local_ids, cu, k + 1, group=group)).detach() for k in range(K)]
    steps = draft.ttt_forward([t.detach() for t in out.taps], embeds, cu, shard(pos), cp_group=group)
    dl = ttt_draft_loss([lg for lg, _ in steps], out.logits.detach(), cu, torch.ones(local_ids.shape[0]),
                        draft.d2t, draft.t2d, group=group)
    (rl_loss + dl.loss).backward()
    grads = {f"policy.{n}": p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    grads.update({f"draft.{n}": p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None})
    return out.logits.detach(), [t.detach() for t in out.taps], dl.loss.detach(), grads


def _worker(rank, world_size):
    group = dist.group.WORLD
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    T = int(cu[-1])
    report = {}
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
        policy, draft = _models(arch)
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(0, policy.config.vocab_size, (T,), generator=g)
        rl_grad = torch.randn(T, policy.config.vocab_size, generator=g)
        pos = position_ids_from_cu_seqlens(cu)
        ref = _step(policy, draft, ids, pos, cu, rl_grad, lambda x: x, None)
        shard = lambda x: zigzag_shard(x, cu, rank, world_size)  # noqa: E731
        got = _step(policy, draft, ids, pos, cu, rl_grad, shard, group)
        errs = {"logits": float((got[0] - shard(ref[0])).abs().max() / ref[0].abs().max())}
        errs["taps"] = max(float((a - shard(b)).abs().max() / b.abs().max()) for a, b in zip(got[1], ref[1]))
        errs["draft_loss"] = float((got[2] - ref[2]).abs() / ref[2].abs())
        zero = [n for n, gr in ref[3].items() if not gr.abs().sum() > 0]
        assert not zero, f"{arch}: single-process gradients are zero for {zero}; the test would be vacuous"
        missing = sorted(set(ref[3]) ^ set(got[3]))
        assert not missing, f"gradients present in one run only: {missing}"
        for name, gr in got[3].items():
            dist.all_reduce(gr, group=group)
            errs[name] = float((gr - ref[3][name]).abs().max() / ref[3][name].abs().max().clamp_min(1e-12))
        report[arch] = errs
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_policy_and_draft_under_cp_equal_single_process(world_size):
    for rank, report in enumerate(run_distributed(_worker, world_size=world_size, timeout=300)):
        for arch, errs in report.items():
            bad = {k: v for k, v in errs.items() if not v <= 1e-5}
            assert not bad, f"rank {rank} {arch}: relative errors above 1e-5: {bad}"
            assert any(k.startswith("draft.") for k in errs) and any(k.startswith("policy.") for k in errs)
