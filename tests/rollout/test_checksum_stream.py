"""The streamed verification of a refit (rollout/vllm/weights.py ``ChecksumStream``): checksums reduced from the
buckets as they pass equal those of the whole pushed state, in any order (a bias in a later bucket than its weight,
vLLM's fused q/k/v parts adding up), and what the stream holds is the probes' outputs and the biases, never a
weight (a run's first and last refits no longer hold the pushed state on the host)."""

import pytest
import torch

from lightning_codraft.rollout.vllm.weights import PROBE_ROWS, ChecksumStream, canonical_name, expected_checksums


def _state():
    g = torch.Generator().manual_seed(0)
    names = {"model.layers.0.self_attn.q_proj.weight": (8, 16), "model.layers.0.self_attn.k_proj.weight": (4, 16),
             "model.layers.0.self_attn.v_proj.weight": (4, 16), "model.layers.0.self_attn.q_proj.bias": (8,),
             "model.layers.0.self_attn.k_proj.bias": (4,), "model.layers.0.self_attn.v_proj.bias": (4,),
             "model.layers.0.mlp.down_proj.weight": (16, 32), "model.norm.weight": (16,),
             "model.embed_tokens.weight": (50, 16)}
    return {n: torch.randn(*shape, generator=g) for n, shape in names.items()}


def test_streamed_checksums_equal_the_whole_states_in_any_order():
    state = _state()
    kinds = {canonical_name(n, False): ("probe" if "proj" in n else "param") for n in state}
    whole = expected_checksums(state, False, kinds)
    assert len(whole) == 4  # qkv fused, down_proj, norm, embed_tokens
    stream = ChecksumStream(False, kinds)
    for name in reversed(list(state)):  # biases before their weights, parts of one fused key apart
        stream.add(name, state[name])
    held = list(stream._probed.values()) + list(stream._biases.values())
    assert held and all(t.numel() <= PROBE_ROWS * 32 for t in held)  # probe outputs and biases, never a weight
    streamed = stream.result()
    assert streamed.keys() == whole.keys()
    for key, (s, q) in whole.items():
        assert streamed[key] == pytest.approx((s, q), rel=1e-12), key  # the parts add in another order
    changed = dict(state)
    changed["model.layers.0.self_attn.k_proj.bias"] = state["model.layers.0.self_attn.k_proj.bias"] + 1e-3
    assert expected_checksums(changed, False, kinds)["layers.0.self_attn.qkv_proj.weight"] != whole[
        "layers.0.self_attn.qkv_proj.weight"]
