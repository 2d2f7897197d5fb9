import json
import math

import pytest
import torch
from safetensors.torch import load_file

from lightning_codraft.models.config import PolicyConfig
from lightning_codraft.models.eagle3 import Eagle3Config, Eagle3Draft
from lightning_codraft.models.policy import Policy


def _policy(**kw):
    torch.manual_seed(0)
    return Policy(PolicyConfig.tiny(**kw))


def _draft(Vd=None, seed=1, **kw):
    policy = _policy(**kw)
    counts = torch.randint(0, 100, (policy.config.vocab_size,), generator=torch.Generator().manual_seed(seed))
    torch.manual_seed(seed)
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=Vd, token_counts=counts if Vd else None)
    with torch.no_grad():  # non-trivial norms so the reference checks every weight
        for n, p in draft.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return policy, draft


# ---------------------------------------------------------------- dense reference from the definition


def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _reference_ttt(p, cfg, taps, embeds, doc_lengths, positions):
    """Every step attends over the full (k+1)*T key set [K0 | K1 | ... | Kk] with an explicit boolean mask."""
    T = taps[0].shape[0]
    doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths))
    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    h = torch.cat(taps, -1) @ p["fc.weight"].T
    keys, values, outs = [], [], []
    for k, e in enumerate(embeds):
        x = torch.cat([_rms(e, p["midlayer.input_layernorm.weight"], cfg.rms_norm_eps),
                       _rms(h, p["midlayer.hidden_norm.weight"], cfg.rms_norm_eps)], -1)
        q = (x @ p["midlayer.self_attn.q_proj.weight"].T).view(T, Hq, D)
        kk = (x @ p["midlayer.self_attn.k_proj.weight"].T).view(T, Hkv, D)
        vv = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(T, Hkv, D)
        q, kk = _rope(q, positions + k, cfg.rope_theta), _rope(kk, positions + k, cfg.rope_theta)
        keys.append(kk)
        values.append(vv)
        K_all = torch.cat(keys, 0).repeat_interleave(Hq // Hkv, 1)  # ((k+1)T, Hq, D)
        V_all = torch.cat(values, 0).repeat_interleave(Hq // Hkv, 1)
        i = torch.arange(T)[:, None]
        mask = torch.zeros(T, (k + 1) * T, dtype=torch.bool)
        mask[:, :T] = (doc[:, None] == doc[None, :]) & (torch.arange(T)[None, :] <= i)
        for m in range(1, k + 1):
            mask[:, m * T:(m + 1) * T] = torch.arange(T)[None, :] == i
        s = torch.einsum("thd,shd->hts", q, K_all) / math.sqrt(D)
        s = s.masked_fill(~mask[None], float("-inf"))
        a = torch.einsum("hts,shd->thd", torch.softmax(s, -1), V_all).reshape(T, Hq * D)
        a = a @ p["midlayer.self_attn.o_proj.weight"].T + h
        y = _rms(a, p["midlayer.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        mlp = (torch.nn.functional.silu(y @ p["midlayer.mlp.gate_proj.weight"].T)
               * (y @ p["midlayer.mlp.up_proj.weight"].T)) @ p["midlayer.mlp.down_proj.weight"].T
        h = mlp + a
        outs.append((_rms(h, p["norm.weight"], cfg.rms_norm_eps) @ p["lm_head.weight"].T, h))
    return outs


@pytest.mark.parametrize("K", [1, 2, 4])
def test_ttt_forward_matches_dense_reference(K):
    _, draft = _draft(Vd=40, seed=K)
    cfg = draft.config
    lengths = [5, 1, 9, 3]
    T, H = sum(lengths), cfg.hidden_size
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    g = torch.Generator().manual_seed(10 + K)
    taps = [torch.randn(T, H, generator=g).requires_grad_() for _ in range(3)]
    embeds = [torch.randn(T, H, generator=g).requires_grad_() for _ in range(K)]
    outs = draft.ttt_forward(taps, embeds, cu, pos)

    params = {n: p.detach().clone().requires_grad_() for n, p in draft.named_parameters()}
    r_taps = [t.detach().clone().requires_grad_() for t in taps]
    r_embeds = [e.detach().clone().requires_grad_() for e in embeds]
    ref = _reference_ttt(params, cfg, r_taps, r_embeds, lengths, pos)

    assert len(outs) == K
    weights = [(torch.randn(T, cfg.draft_vocab_size, generator=g), torch.randn(T, H, generator=g)) for _ in range(K)]
    loss, ref_loss = 0.0, 0.0
    for (lg, hd), (rlg, rhd), (wl, wh) in zip(outs, ref, weights):
        torch.testing.assert_close(lg, rlg, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hd, rhd, atol=1e-5, rtol=1e-5)
        loss = loss + (lg * wl).sum() + (hd * wh).sum()
        ref_loss = ref_loss + (rlg * wl).sum() + (rhd * wh).sum()
    loss.backward()
    ref_loss.backward()
    for n, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, params[n].grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    for a, b in zip(taps + embeds, r_taps + r_embeds):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("K", [1, 3])
def test_ttt_forward_on_a_suffix_of_each_document_equals_the_full_unroll_there(K):
    """``cu_seqlens_q``: only the last rows of each document are unrolled (the prompt rows before give their step-0
    keys): outputs, and gradients of a loss on those rows, equal the dense reference's at those rows."""
    _, draft = _draft(Vd=40, seed=K)
    cfg = draft.config
    lengths, suffix = [9, 4, 12, 5], [3, 0, 12, 1]  # a document left out entirely, one unrolled whole
    T, H = sum(lengths), cfg.hidden_size
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_q = torch.tensor([0, *torch.tensor(suffix).cumsum(0).tolist()], dtype=torch.int32)
    rows = torch.cat([torch.arange(int(cu[d + 1]) - n, int(cu[d + 1])) for d, n in enumerate(suffix)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    g = torch.Generator().manual_seed(20 + K)
    taps = [torch.randn(T, H, generator=g).requires_grad_() for _ in range(3)]
    embeds = [torch.randn(T, H, generator=g).requires_grad_() for _ in range(K)]
    outs = draft.ttt_forward(taps, embeds, cu, pos, cu_seqlens_q=cu_q)
    params = {n: p.detach().clone().requires_grad_() for n, p in draft.named_parameters()}
    r_taps = [t.detach().clone().requires_grad_() for t in taps]
    r_embeds = [e.detach().clone().requires_grad_() for e in embeds]
    ref = _reference_ttt(params, cfg, r_taps, r_embeds, lengths, pos)
    loss, ref_loss = 0.0, 0.0
    for (lg, hd), (rlg, rhd) in zip(outs, ref):
        assert lg.shape == (len(rows), cfg.draft_vocab_size)
        torch.testing.assert_close(lg, rlg[rows], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hd, rhd[rows], atol=1e-5, rtol=1e-5)
        wl, wh = torch.randn(lg.shape, generator=g), torch.randn(hd.shape, generator=g)
        loss = loss + (lg * wl).sum() + (hd * wh).sum()
        ref_loss = ref_loss + (rlg[rows] * wl).sum() + (rhd[rows] * wh).sum()
    loss.backward()
    ref_loss.backward()
    for n, p in draft.named_parameters():
        torch.testing.assert_close(p.grad, params[n].grad, atol=1e-4, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    for a, b in zip(taps + embeds, r_taps + r_embeds):  # prompt rows still get gradients through their keys
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)
    assert float(taps[0].grad[:6].abs().sum()) > 0  # rows 0..5 of document 0 are keys only
    with pytest.raises(ValueError, match="suffix length"):
        draft.ttt_forward(taps, embeds, cu, pos, cu_seqlens_q=torch.tensor([0, 10, 10, 22, 23], dtype=torch.int32))


def test_step_with_cache_matches_ttt_step0_and_chunked_decode():
    _, draft = _draft(Vd=None)
    H, T = draft.config.hidden_size, 7
    g = torch.Generator().manual_seed(3)
    taps = [torch.randn(2, T, H, generator=g) for _ in range(3)]
    embeds = torch.randn(2, T, H, generator=g)
    with torch.no_grad():
        cache = draft.allocate_kv_cache(2, 16)
        h_full, lg_full = draft.step(draft.fuse(taps), embeds, cache)
        assert cache.lengths.tolist() == [T, T]
        for b in range(2):  # one document per row -> TTT step 0 on that document
            (lg0, h0), = draft.ttt_forward([t[b] for t in taps], [embeds[b]], torch.tensor([0, T], dtype=torch.int32),
                                           torch.arange(T))
            torch.testing.assert_close(lg_full[b], lg0, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(h_full[b], h0, atol=1e-5, rtol=1e-5)
        cache2 = draft.allocate_kv_cache(2, 16)
        h_a, _ = draft.step(draft.fuse([t[:, :4] for t in taps]), embeds[:, :4], cache2)
        h_b, lg_b = draft.step(draft.fuse([t[:, 4:] for t in taps]), embeds[:, 4:], cache2,
                               num_new=torch.tensor([3, 1]))
    torch.testing.assert_close(torch.cat([h_a, h_b], 1), h_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lg_b, lg_full[:, 4:], atol=1e-5, rtol=1e-5)
    assert cache2.lengths.tolist() == [7, 5]


def test_from_policy_vocab_and_init():
    policy, draft = _draft(Vd=None)
    c = draft.config
    assert c.draft_vocab_size == c.vocab_size == policy.config.vocab_size
    assert c.taps == (1, 2, 3)  # 4-layer policy: the default (2, 2, 1) repeats a layer
    assert bool(draft.t2d.all()) and not bool(draft.d2t.any())
    torch.testing.assert_close(draft.lm_head.weight, policy.lm_head.weight)
    policy, draft = _draft(Vd=40)
    ids = draft.draft_to_target(torch.arange(40))
    assert ids.unique().numel() == 40 and bool(draft.t2d[ids].all()) and int(draft.t2d.sum()) == 40
    torch.testing.assert_close(draft.lm_head.weight, policy.lm_head.weight[ids])
    big = _policy(num_hidden_layers=8)
    assert Eagle3Draft.from_policy(big).config.taps == (2, 4, 5)
    draft.check_policy(_policy())


def test_save_load_round_trip(tmp_path):
    for Vd in (None, 40):
        _, draft = _draft(Vd=Vd)
        out = tmp_path / f"d{Vd}"
        draft.save_pretrained(out)
        back = Eagle3Draft.from_pretrained(out)
        assert back.config == draft.config
        sd, sb = draft.state_dict(), back.state_dict()
        assert sd.keys() == sb.keys()
        for k in sd:
            assert torch.equal(sd[k], sb[k]), k
        T, H = 6, draft.config.hidden_size
        taps, emb = [torch.randn(T, H) for _ in range(3)], [torch.randn(T, H) for _ in range(2)]
        cu, pos = torch.tensor([0, T], dtype=torch.int32), torch.arange(T)
        with torch.no_grad():
            for (a, _), (b, _) in zip(draft.ttt_forward(taps, emb, cu, pos), back.ttt_forward(taps, emb, cu, pos)):
                assert torch.equal(a, b)


def _vllm_expected(H, I, Hq, Hkv, D, V, Vd):
    """Names and shapes vLLM's llama_eagle3 (Eagle3LlamaForCausalLM.load_weights) consumes.

    Written from vllm/model_executor/models/llama_eagle3.py: `midlayer.` is renamed to `layers.0.`, q/k/v are
    stacked into qkv_proj whose input is 2*hidden (embeds ++ hidden), gate/up into gate_up_proj; fc takes
    3*target_hidden; lm_head has draft_vocab_size rows; `d2t` becomes draft_id_to_target_id (Vd,) and `t2d` is
    skipped. No embed_tokens (shared with the target).
    """
    table = {
        "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (Hq * D, 2 * H),
        "midlayer.self_attn.k_proj.weight": (Hkv * D, 2 * H),
        "midlayer.self_attn.v_proj.weight": (Hkv * D, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, Hq * D),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (I, H),
        "midlayer.mlp.up_proj.weight": (I, H),
        "midlayer.mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (Vd, H),
        "t2d": (V,),
    }
    if Vd != V:
        table["d2t"] = (Vd,)
    return table


@pytest.mark.parametrize("Vd,arch", [(None, "LlamaForCausalLM"), (40, "Qwen3ForCausalLM")])
def test_export_has_exactly_vllm_names_and_shapes(tmp_path, Vd, arch):
    policy, draft = _draft(Vd=Vd, architecture=arch)
    draft.save_pretrained(tmp_path)
    pc = policy.config
    V = pc.vocab_size
    want = _vllm_expected(pc.hidden_size, pc.intermediate_size, pc.num_attention_heads, pc.num_key_value_heads,
                          pc.head_dim, V, Vd or V)
    got = {k: tuple(v.shape) for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    assert got == want
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors["t2d"].dtype == torch.bool
    if Vd:
        assert tensors["d2t"].dtype == torch.int64
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == (Vd or V) and cfg["vocab_size"] == V
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(draft.config.taps)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(draft.config.taps)
    assert cfg["head_dim"] == pc.head_dim and cfg["norm_before_residual"] is False
    assert len(set(cfg["eagle_aux_hidden_state_layer_ids"])) == 3


def test_errors_are_clear(tmp_path):
    policy, draft = _draft(Vd=None)
    H, T = draft.config.hidden_size, 4
    taps, emb = [torch.randn(T, H) for _ in range(3)], [torch.randn(T, H)]
    cu, pos = torch.tensor([0, T], dtype=torch.int32), torch.arange(T)
    with pytest.raises(ValueError, match="tap id 9 out of range"):
        Eagle3Draft.from_policy(policy, taps=(1, 2, 9))
    with pytest.raises(ValueError, match="distinct"):
        Eagle3Draft.from_policy(policy, taps=(1, 2, 2))
    with pytest.raises(ValueError, match=r"must be increasing, e.g. \(0, 1, 3\)"):
        Eagle3Draft.from_policy(policy, taps=(3, 0, 1))
    with pytest.raises(ValueError, match="token_counts has 7 entries but the policy's vocab_size is 128"):
        Eagle3Draft.from_policy(policy, draft_vocab_size=4, token_counts=torch.ones(7))
    with pytest.raises(ValueError, match="needs token_counts"):
        Eagle3Draft.from_policy(policy, draft_vocab_size=4)
    with pytest.raises(ValueError, match="vocab mismatch"):
        draft.check_policy(_policy(vocab_size=96))
    with pytest.raises(ValueError, match="K >= 1"):
        draft.ttt_forward(taps, [], cu, pos)
    with pytest.raises(ValueError, match="strictly increasing"):
        draft.ttt_forward(taps, emb, torch.tensor([0, 3, 2, 4], dtype=torch.int32), pos)
    with pytest.raises(ValueError, match="does not cover the batch of 4 tokens"):
        draft.ttt_forward(taps, emb, torch.tensor([0, 3], dtype=torch.int32), pos)
    with pytest.raises(ValueError, match=r"token_embeds\[0\] has shape \(4, 3\)"):
        draft.ttt_forward(taps, [torch.randn(4, 3)], cu, pos)
    draft.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported architectures \['MistralForCausalLM'\]"):
        Eagle3Draft.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft_vocab_size=200 exceeds"):
        Eagle3Config(hidden_size=8, intermediate_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                    vocab_size=100, draft_vocab_size=200, taps=(0, 1, 2))


def _cp_worker(rank, world_size):
    import torch.distributed as dist

    from lightning_codraft.attention import zigzag_shard
    from lightning_codraft.training.draft_loss import ttt_draft_loss

    _, draft = _draft(Vd=40)
    K, lengths = 3, [8, 4, 12]
    T, H = sum(lengths), draft.config.hidden_size
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    g = torch.Generator().manual_seed(7)
    taps = [torch.randn(T, H, generator=g) for _ in range(3)]
    embeds = [torch.randn(T, H, generator=g) for _ in range(K)]
    policy_logits = torch.randn(T, draft.config.vocab_size, generator=g)
    mask = torch.ones(T)

    def run(shard, group):
        draft.zero_grad()
        outs = draft.ttt_forward([shard(t) for t in taps], [shard(e) for e in embeds], cu, shard(pos),
                                 cp_group=group)
        loss = ttt_draft_loss([lg for lg, _ in outs], shard(policy_logits), cu, shard(mask), draft.d2t, draft.t2d,
                              group=group).loss
        loss.backward()
        return [lg.detach() for lg, _ in outs], loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()}

    ref_logits, ref_loss, ref_grads = run(lambda x: x, None)
    shard = lambda x: zigzag_shard(x, cu, rank, world_size)  # noqa: E731
    logits, loss, grads = run(shard, dist.group.WORLD)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, shard(b), rtol=1e-5, atol=1e-5)
    for n, gr in grads.items():  # gradients of replicated draft weights are summed over the CP group
        dist.all_reduce(gr)
        torch.testing.assert_close(gr, ref_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    return float(loss)


def test_ttt_and_loss_under_context_parallelism_equal_single_process():
    from distributed import run_distributed

    losses = run_distributed(_cp_worker, world_size=2, timeout=180)
    assert losses[0] == losses[1]


def test_loads_a_vllm_style_checkpoint_without_t2d(tmp_path):
    from safetensors.torch import save_file

    _, draft = _draft(Vd=40)
    draft.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["t2d"]  # vLLM ignores t2d; third-party checkpoints may lack it
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
    del cfg["eagle_aux_hidden_state_layer_ids"]  # ids only under eagle_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = Eagle3Draft.from_pretrained(tmp_path)
    assert torch.equal(back.t2d, draft.t2d) and torch.equal(back.d2t, draft.d2t)
    assert back.config.taps == draft.config.taps
    del cfg["eagle_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no eagle_aux_hidden_state_layer_ids"):
        Eagle3Draft.from_pretrained(tmp_path)
