"""Policy vs ``transformers`` (fp32): logits, taps and gradients for Llama / Llama-3 RoPE / Qwen2 / Qwen3 / tied
configs, padded (left and right) and packed input; KV-cache decode vs the full forward; error messages."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lightning_codraft.models import KVCache, Policy, PolicyConfig
from lightning_codraft.models.rope import RotaryEmbedding

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": dict(),
    "llama3_rope": dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "llama_bias": dict(attention_bias=True, o_proj_bias=True, mlp_bias=True),
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM"),
    "tied": dict(tie_word_embeddings=True),
}
TOL = 1e-4


def hf_and_ours(family: str):
    """A randomly initialised HF model (every parameter perturbed) and our Policy holding the same weights."""
    cfg = PolicyConfig.tiny(**FAMILIES[family])
    d = cfg.to_hf_dict()
    hf_cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = Policy(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True)
    if cfg.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    return hf, ours.eval()


def hf_forward(hf, ids, mask=None, positions=None):
    out = hf(ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    hs = list(out.hidden_states)
    return out.logits, hs  # hs[L] is after the final norm in transformers


def check_taps(ours, our_taps, tap_ids, hf_hs, select=lambda t: t):
    for tid, t in zip(tap_ids, our_taps):
        mine = ours.model.norm(t) if tid == ours.num_layers else t   # HF's last hidden state is normed
        assert (select(mine) - select(hf_hs[tid])).abs().max() <= TOL, f"tap {tid}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_logits_and_taps_match_transformers(family):
    hf, ours = hf_and_ours(family)
    B, T = 3, 11
    ids = torch.randint(0, 128, (B, T))
    ar = torch.arange(T)
    for padding, lengths in (("right", [T, 7, 4]), ("left", [5, T, 1]), ("none", [T, T, T])):
        lengths = torch.tensor(lengths)
        if padding == "left":
            mask = (ar[None] >= (T - lengths)[:, None]).long()
        else:
            mask = (ar[None] < lengths[:, None]).long()
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        taps = (0, 2, 1, 4)
        with torch.no_grad():
            ref_logits, ref_hs = hf_forward(hf, ids, mask, positions)
            out = ours(ids, attention_mask=None if padding == "none" else mask, taps=taps)
        valid = mask.bool()
        assert out.logits.shape == (B, T, 128)
        assert (out.logits[valid] - ref_logits[valid]).abs().max() <= TOL, padding
        assert (out.logits[~valid] == 0).all()
        check_taps(ours, out.taps, taps, ref_hs, select=lambda t: t[valid])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logits_and_taps_match_transformers_per_document(family):
    hf, ours = hf_and_ours(family)
    lengths = [5, 9, 3]
    docs = [torch.randint(0, 128, (n,)) for n in lengths]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    taps = tuple(range(ours.num_layers + 1))
    with torch.no_grad():
        out = ours(torch.cat(docs), cu_seqlens=cu, taps=taps)
        for i, doc in enumerate(docs):
            ref_logits, ref_hs = hf_forward(hf, doc[None])
            rows = slice(int(cu[i]), int(cu[i + 1]))
            assert (out.logits[rows] - ref_logits[0]).abs().max() <= TOL
            check_taps(ours, [t[rows] for t in out.taps], taps, [h[0] for h in ref_hs])


def test_padded_row_without_tokens_gets_zeros_and_others_are_unaffected():
    _, ours = hf_and_ours("llama")
    ids = torch.randint(0, 128, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        out = ours(ids, attention_mask=mask, taps=(3,))
        alone = ours(ids[:1, :4]).logits
    assert torch.equal(out.logits[0, :4], alone[0]) and (out.logits[1] == 0).all() and (out.taps[0][1] == 0).all()


def test_packed_with_explicit_restarting_positions_equals_default():
    _, ours = hf_and_ours("llama")
    ids = torch.randint(0, 128, (12,))
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(7), torch.arange(5)])
    with torch.no_grad():
        assert torch.equal(ours(ids, cu_seqlens=cu).logits, ours(ids, cu_seqlens=cu, position_ids=pos).logits)


def test_packed_gradients_match_transformers():
    hf, ours = hf_and_ours("qwen3")
    docs = [torch.randint(0, 128, (n,)) for n in (6, 4)]
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    w = torch.randn(10, 128)
    (ours(torch.cat(docs), cu_seqlens=cu).logits * w).sum().backward()
    ref = sum((hf(d[None]).logits[0] * w[int(cu[i]):int(cu[i + 1])]).sum() for i, d in enumerate(docs))
    ref.backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - hf_params[name].grad).abs().max() <= TOL, name


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kv_cache_decode_matches_full_forward(family):
    """Right-padded ragged prefill (num_new), then steps of 1 and 3 tokens, then a truncate + re-decode."""
    _, ours = hf_and_ours(family)
    full = [torch.randint(0, 128, (n,)) for n in (14, 10, 12)]
    prompt_lens = torch.tensor([5, 2, 4])
    B = len(full)

    with torch.no_grad():
        full_logits = [ours(f[None]).logits[0] for f in full]     # causal: prefix logits are a prefix

    def reference(row, upto):
        return full_logits[row][:upto]

    cache = ours.allocate_kv_cache(B, capacity=32)
    P = int(prompt_lens.max())
    prefill = torch.zeros(B, P, dtype=torch.int64)
    for b in range(B):
        prefill[b, :prompt_lens[b]] = full[b][:prompt_lens[b]]
    with torch.no_grad():
        out = ours(prefill, kv_cache=cache, num_new=prompt_lens, taps=(1, 4))
    assert torch.equal(cache.lengths, prompt_lens)
    for b in range(B):
        n = int(prompt_lens[b])
        assert (out.logits[b, :n] - reference(b, n)).abs().max() <= TOL
    for S in (1, 3, 1):
        cur = cache.lengths.clone()
        step = torch.stack([full[b][cur[b]:cur[b] + S] for b in range(B)])
        with torch.no_grad():
            out = ours(step, kv_cache=cache)
        for b in range(B):
            end = int(cur[b]) + S
            assert (out.logits[b] - reference(b, end)[-S:]).abs().max() <= TOL
    cache.truncate(cache.lengths - torch.tensor([2, 0, 1]))       # reject some speculative tokens
    cur = cache.lengths.clone()
    step = torch.stack([full[b][cur[b]:cur[b] + 2] for b in range(B)])
    with torch.no_grad():
        out = ours(step, kv_cache=cache, taps=(0,))
    for b in range(B):
        assert (out.logits[b] - reference(b, int(cur[b]) + 2)[-2:]).abs().max() <= TOL
    assert out.taps[0].shape == (B, 2, 64)


def test_llama3_rope_tables_equal_transformers():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                         max_position_embeddings=256)
    hf = LlamaRotaryEmbedding(hf_cfg)
    pos = torch.arange(200)[None]
    cos, sin = hf(torch.zeros(1), pos)
    ours = RotaryEmbedding(16, 500000.0, LLAMA3_ROPE)
    ocos, osin = ours(pos)
    assert torch.equal(ocos, cos) and torch.equal(osin, sin)


def test_default_taps_and_pipeline_pieces():
    ours = Policy(PolicyConfig.tiny(num_hidden_layers=8))
    assert ours.default_taps == (2, 4, 5)
    ids = torch.randint(0, 128, (9,))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    pos = torch.cat([torch.arange(4), torch.arange(5)])
    with torch.no_grad():
        x = ours.embed(ids)
        cos, sin = ours.rotary(pos)
        for layer in ours.model.layers:
            x = layer(x, cos, sin, cu)
        assert torch.equal(ours.head(x), ours(ids, cu_seqlens=cu).logits)


def test_errors_are_clear():
    ours = Policy(PolicyConfig.tiny())
    ids = torch.randint(0, 128, (8,))
    with pytest.raises(ValueError, match=r"tap id 5 out of range.*\[0, 4\]"):
        ours(ids, taps=(1, 5))
    with pytest.raises(ValueError, match="tap id -1"):
        ours(ids, taps=(-1,))
    with pytest.raises(ValueError, match="strictly increasing"):
        ours(ids, cu_seqlens=torch.tensor([0, 5, 5, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="does not cover the batch of 8"):
        ours(ids, cu_seqlens=torch.tensor([0, 5, 7], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"must be \(T,\) packed or \(B, T\)"):
        ours(ids.view(2, 2, 2))
    with pytest.raises(ValueError, match="not left- or right-padded"):
        ours(ids.view(2, 4), attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]))
    with pytest.raises(ValueError, match="position_ids shape"):
        ours(ids, position_ids=torch.arange(7))
    with pytest.raises(ValueError, match="KVCache overflow"):
        ours(ids.view(1, 8), kv_cache=ours.allocate_kv_cache(1, capacity=6))
    with pytest.raises(ValueError, match="num_new"):
        ours(ids.view(2, 4), kv_cache=ours.allocate_kv_cache(2, capacity=8), num_new=torch.tensor([5, 1]))
    with pytest.raises(ValueError, match="kv_cache has batch 3"):
        ours(ids.view(2, 4), kv_cache=ours.allocate_kv_cache(3, capacity=8))
    with pytest.raises(ValueError, match="integer tensor"):
        ours.embed(torch.zeros(3))
    with pytest.raises(ValueError, match="L >= 3|out of range"):
        Policy(PolicyConfig.tiny(num_hidden_layers=2)).default_taps
    assert isinstance(ours.allocate_kv_cache(1, 4), KVCache)
