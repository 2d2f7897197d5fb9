"""Tiny policy + draft + next-token-aligned RL batches shared by the strategy / module / checkpoint tests."""

from __future__ import annotations

import torch

from lightning_codraft.batch import RLBatch
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.dspark import DSparkDraft

VOCAB = 48


def make_models(seed: int = 0, layers: int = 4, draft_vocab: int | None = None, tied: bool = False):
    """A 4-layer, 32-wide policy and its EAGLE-3 draft, identical for a given seed on every process."""
    torch.manual_seed(seed)
    policy = Policy(PolicyConfig.tiny(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, tie_word_embeddings=tied,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2))
    counts = torch.arange(VOCAB, 0, -1).float() if draft_vocab else None
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=draft_vocab, token_counts=counts)
    return policy, draft


def make_dflash_models(seed: int = 0, block_size: int = 4, layers: int = 4, tied: bool = False):
    """The policy of :func:`make_models` and a one-layer DFlash drafter (taps 1, 2, 3) for it."""
    policy, _ = make_models(seed, layers=layers, tied=tied)
    torch.manual_seed(seed + 1)
    drafter = DFlashDraft.from_policy(policy, taps=(1, 2, layers - 1), block_size=block_size, mask_token_id=VOCAB - 1)
    for p in drafter.parameters():  # larger than the default init, so the blocks' logits differ across rows
        p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.fill_(1.0)
    return policy, drafter


def make_dspark_models(seed: int = 0, block_size: int = 4, layers: int = 4, **heads):
    """The policy of :func:`make_models` and a one-layer DSpark drafter (taps 1, 2, 3; Markov rank 8 unless
    ``heads`` say otherwise) for it, every weight drawn larger than the default init (as for DFlash's)."""
    policy, _ = make_models(seed, layers=layers)
    torch.manual_seed(seed + 1)
    heads = {"markov_rank": 8, **heads}
    drafter = DSparkDraft.from_policy(
        policy, taps=(1, 2, layers - 1), block_size=block_size, mask_token_id=VOCAB - 1, **heads
    )
    for p in drafter.parameters():
        p.data.normal_(0, 0.2) if p.dim() > 1 else p.data.fill_(1.0)
    return policy, drafter


def make_batch(seed: int, num_docs: int = 2, multiple_of: int = 12, max_len: int = 14) -> RLBatch:
    """One next-token aligned RL batch (docs/design/interfaces.md) of ``num_docs`` padded documents."""
    g = torch.Generator().manual_seed(seed)
    cols = {k: [] for k in ("input_ids", "target_ids", "position_ids", "valid", "loss_mask", "old_logprobs",
                            "advantages", "ref_logprobs")}
    lengths = []
    for _ in range(num_docs):
        n = int(torch.randint(5, max_len + 1, (1,), generator=g))
        padded = -(-n // multiple_of) * multiple_of
        prompt = int(torch.randint(2, n - 1, (1,), generator=g))
        ids = torch.zeros(padded, dtype=torch.long)
        ids[:n] = torch.randint(1, VOCAB, (n,), generator=g)
        tgt = torch.zeros(padded, dtype=torch.long)
        tgt[:n - 1] = ids[1:n]
        valid = torch.arange(padded) < n
        mask = ((torch.arange(padded) >= prompt - 1) & (torch.arange(padded) < n - 1)).float()
        adv = float(torch.randn(1, generator=g))
        cols["input_ids"].append(ids)
        cols["target_ids"].append(tgt)
        cols["position_ids"].append(torch.arange(padded))
        cols["valid"].append(valid)
        cols["loss_mask"].append(mask)
        cols["old_logprobs"].append((-3.9 - 0.1 * torch.rand(padded, generator=g)) * mask)
        cols["advantages"].append(adv * mask)
        cols["ref_logprobs"].append((-3.9 - 0.1 * torch.rand(padded, generator=g)) * mask)
        lengths.append(padded)
    batch = {k: torch.cat(v) for k, v in cols.items()}
    batch["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch["draft_mask"] = batch["valid"].float()
    return RLBatch.from_dict(batch)


def concat_batches(batches: list[RLBatch]) -> RLBatch:
    """The batches of several dp replicas as one packed batch (what one process trains on)."""
    return RLBatch.concat(batches)


def step_batches(num_steps: int, dp: int, seed: int = 100, num_docs: int = 4) -> list[list[RLBatch]]:
    """``[step][dp_rank]`` batches: what each replica reads at each step."""
    return [[make_batch(seed + 10 * s + r, num_docs=num_docs) for r in range(dp)] for s in range(num_steps)]


def full_state(module) -> dict:
    """``module.state_dict()`` as numpy arrays, FSDP2 shards gathered into full tensors (a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone().numpy()
            for k, v in module.state_dict().items()}


def block_forward_by_hand(module, batch: RLBatch, per_doc: int):
    """Copies of ``module``'s policy and block drafter (gradients cleared), the step's anchors (``per_doc`` a
    document), the policy's forward with taps 1, 2, 3, and the drafter's hidden states ``(N, B, H)`` of the blocks
    anchored there, computed directly from the definitions (no term)."""
    import copy

    from lightning_codraft.training.dflash_loss import context_visibility
    from lightning_codraft.training.dflash_term import draw_anchors

    policy, drafter = copy.deepcopy(module.policy), copy.deepcopy(module.draft)
    drafter.zero_grad(set_to_none=True)
    anchors = torch.nonzero(draw_anchors(batch, per_doc)).flatten()
    with torch.no_grad():
        fw = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids, taps=(1, 2, 3))
        embeds = policy.embed(drafter.block_ids(batch.input_ids[anchors]))
    visible = context_visibility(batch.cu_seqlens, anchors, batch.num_rows)
    pos = batch.position_ids
    hidden = drafter(drafter.context(list(fw.taps)), pos, embeds, pos[anchors], visible)
    return policy, drafter, anchors, fw, hidden
