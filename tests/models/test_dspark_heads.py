"""DSpark's heads (models/dspark_heads.py) against their definitions by hand: the vanilla and gated Markov biases,
semi-autoregressive drafting (each position biased by the token drawn before it), the confidence head, and the
parameter names of DeepSpec's released checkpoints."""

import pytest
import torch

from lightning_codraft.models.dspark_heads import ConfidenceHead, MarkovHead

V, R, H = 13, 4, 6


def test_the_vanilla_bias_is_w2_of_w1_of_the_previous_token():
    torch.manual_seed(0)
    head = MarkovHead(V, R, H)
    prev = torch.tensor([3, 7, 0])
    want = torch.stack([head.markov_w2.weight @ head.markov_w1.weight[i] for i in prev.tolist()])
    torch.testing.assert_close(head.bias(prev), want)
    assert sorted(n for n, _ in head.named_parameters()) == ["markov_w1.weight", "markov_w2.weight"]


def test_the_gated_bias_scales_the_embedding_by_its_gate():
    torch.manual_seed(1)
    head = MarkovHead(V, R, H, kind="gated")
    prev, hidden = torch.tensor([2, 5]), torch.randn(2, H)
    rows = []
    for i, h in zip(prev.tolist(), hidden):
        e = head.markov_w1.weight[i]
        gate = torch.sigmoid(head.gate_proj.weight @ torch.cat([h, e]) + head.gate_proj.bias)
        rows.append(head.markov_w2.weight @ (gate * e))
    torch.testing.assert_close(head.bias(prev, hidden), torch.stack(rows))
    with pytest.raises(ValueError, match="hidden"):
        head.bias(prev)
    assert {n for n, _ in head.named_parameters()} >= {"gate_proj.weight", "gate_proj.bias"}


def test_drafting_biases_each_position_by_the_token_drawn_before_it():
    torch.manual_seed(2)
    head = MarkovHead(V, R, H)
    base, first = torch.randn(2, 3, V), torch.tensor([1, 4])
    tokens, logits = head.draw(base, first, lambda step, k: step.argmax(-1))
    prev = first
    for k in range(3):
        step = base[:, k] + head.bias(prev)
        torch.testing.assert_close(logits[:, k], step)
        assert torch.equal(tokens[:, k], step.argmax(-1))
        prev = tokens[:, k]


def test_the_confidence_head_is_a_linear_logit_per_position():
    torch.manual_seed(3)
    head = ConfidenceHead(H)
    f = torch.randn(2, 5, H)
    torch.testing.assert_close(head(f), f @ head.proj.weight[0] + head.proj.bias[0])
    assert sorted(n for n, _ in head.named_parameters()) == ["proj.bias", "proj.weight"]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rank"):
        MarkovHead(V, 0, H)
    with pytest.raises(ValueError, match="kind"):
        MarkovHead(V, R, H, kind="rnn")
