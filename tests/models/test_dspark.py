"""The DSpark drafter (models/dspark.py): its backbone is DFlash's (the same weights give the same hidden states),
its block logits are DFlash's plus the Markov bias of the previous token, its confidence reads the hidden state (and
the Markov embedding with ``confidence_with_markov``), and its config refuses inconsistent heads."""

import pytest
import torch

from lightning_codraft.models import Policy, PolicyConfig
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.dspark import DSparkConfig, DSparkDraft


def _models(**heads):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=40, num_hidden_layers=4))
    dspark = DSparkDraft.from_policy(policy, block_size=4, mask_token_id=3, **heads)
    for p in dspark.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    dflash = DFlashDraft.from_policy(policy, block_size=4, mask_token_id=3)
    dflash.load_state_dict({k: v for k, v in dspark.state_dict().items() if k in dflash.state_dict()})
    return policy, dspark, dflash


def _forward(draft, policy):
    g = torch.Generator().manual_seed(1)
    T, N, H = 7, 2, policy.config.hidden_size
    ctx = draft.context([torch.randn(T, H, generator=g) for _ in draft.config.taps])
    block = policy.embed(draft.block_ids(torch.tensor([5, 9]))).detach()
    visible = torch.tensor([[True] * 3 + [False] * 4, [True] * 6 + [False]])
    return draft(ctx, torch.arange(T), block, torch.tensor([3, 6]), visible)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_block_logits_are_dflash_logits_plus_the_markov_bias(kind):
    policy, dspark, dflash = _models(markov_head_type=kind, markov_rank=8)
    hidden = _forward(dspark, policy)
    torch.testing.assert_close(hidden, _forward(dflash, policy))  # the same backbone
    prev = torch.tensor([[5, 11, 12, 13], [9, 20, 21, 22]])
    head = policy.lm_head.weight
    got = dspark.block_logits(hidden, head, prev)
    want = hidden @ head.T + dspark.markov_head.bias(prev, hidden)
    torch.testing.assert_close(got, want)
    assert set(dspark.state_dict()) - set(dflash.state_dict()) >= {"markov_head.markov_w1.weight",
                                                                  "confidence_head.proj.weight"}


def test_confidence_reads_the_hidden_state_and_optionally_the_markov_embedding():
    policy, dspark, _ = _models(markov_rank=8, confidence_with_markov=True)
    hidden, prev = _forward(dspark, policy), torch.tensor([[5, 1, 2, 3], [9, 4, 5, 6]])
    w, b = dspark.confidence_head.proj.weight[0], dspark.confidence_head.proj.bias[0]
    features = torch.cat([hidden, dspark.markov_head.markov_w1.weight[prev]], -1)
    torch.testing.assert_close(dspark.confidence_logits(hidden, prev), features @ w + b)
    plain = DSparkDraft.from_policy(policy, block_size=4, mask_token_id=3, markov_rank=0, confidence_head=False)
    assert plain.markov_head is None and plain.confidence_logits(hidden, prev) is None
    torch.testing.assert_close(plain.block_logits(hidden, policy.lm_head.weight, prev),
                               hidden @ policy.lm_head.weight.T)


def test_the_default_rank_fits_the_width_and_bad_heads_are_refused():
    policy, dspark, _ = _models()
    assert dspark.config.markov_rank == min(256, policy.config.hidden_size)
    base = {k: getattr(dspark.config, k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim", "vocab_size", "taps")}
    with pytest.raises(ValueError, match="markov_rank"):
        DSparkConfig(**base, markov_rank=-1)
    with pytest.raises(ValueError, match="markov_head_type"):
        DSparkConfig(**base, markov_head_type="rnn")
    with pytest.raises(ValueError, match="confidence_with_markov"):
        DSparkConfig(**base, markov_rank=0, confidence_with_markov=True)
