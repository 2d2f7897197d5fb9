"""A DSpark checkpoint in DeepSpec's released layout (models/dspark_io.py): files written with exactly DeepSpec's
tensor names (its own copies of the target's ``embed_tokens`` / ``lm_head`` included) and config keys load into a
``DSparkDraft`` whose block logits and confidence equal the writer's; copies of another target's tensors, and a
checkpoint loaded without its policy, are refused by name."""

import json

import pytest
import torch
from safetensors.torch import save_file

from lightning_codraft.models import Policy, PolicyConfig
from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.models.dspark_io import load_deepspec_dspark


def _write(tmp_path, policy, draft, head=None):
    """The directory DeepSpec's trainer saves: a Qwen3 config.json with its drafter keys, one safetensors file."""
    c = draft.config
    config = {
        "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
        "num_hidden_layers": c.num_hidden_layers, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings, "attention_bias": False,
        "target_layer_ids": [t - 1 for t in c.taps], "mask_token_id": c.mask_token_id, "block_size": c.block_size,
        "num_anchors": 512, "markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
        "enable_confidence_head": c.confidence_head, "confidence_head_with_markov": c.confidence_with_markov,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {k: v.contiguous() for k, v in draft.state_dict().items()}
    tensors["embed_tokens.weight"] = policy.model.embed_tokens.weight.detach().clone()
    tensors["lm_head.weight"] = (policy.lm_head.weight if head is None else head).detach().clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_a_deepspec_checkpoint_loads_with_equal_logits(tmp_path, kind):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=40, num_hidden_layers=4))
    draft = DSparkDraft.from_policy(policy, markov_rank=8, markov_head_type=kind, confidence_with_markov=True,
                                    block_size=4, mask_token_id=3)
    for p in draft.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    loaded = load_deepspec_dspark(_write(tmp_path, policy, draft), policy)
    assert loaded.config.taps == draft.config.taps and loaded.config.markov_head_type == kind
    # DeepSpec's next-token layout (slot j supervised on x_{anchor+j+1}): every one of the block's rows proposes
    assert loaded.first_slot == 0 and loaded.num_proposals == 4
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in loaded.state_dict().items())  # the backbone too
    hidden, prev = torch.randn(2, 4, policy.config.hidden_size), torch.tensor([[5, 6, 7, 8], [9, 1, 2, 3]])
    head = policy.lm_head.weight
    assert torch.equal(loaded.block_logits(hidden, head, prev), draft.block_logits(hidden, head, prev))
    assert torch.equal(loaded.confidence_logits(hidden, prev), draft.confidence_logits(hidden, prev))


def test_copies_of_another_target_and_a_missing_policy_are_refused(tmp_path):
    torch.manual_seed(1)
    policy = Policy(PolicyConfig.tiny(vocab_size=40, num_hidden_layers=4))
    draft = DSparkDraft.from_policy(policy, markov_rank=8, block_size=4, mask_token_id=3)
    path = _write(tmp_path, policy, draft, head=torch.randn_like(policy.lm_head.weight))
    with pytest.raises(ValueError, match="lm_head.weight is not the policy's"):
        load_deepspec_dspark(path, policy)
    with pytest.raises(ValueError, match="pass the policy"):
        load_deepspec_dspark(path)
