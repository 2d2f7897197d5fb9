"""The DFlash block drafter against a dense reference written here from the definitions (docs/design/drafters.md),
its masks, and its loss; the draft term never reaches the policy's gradients."""

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_codraft.models import Policy, PolicyConfig
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.training.dflash_loss import context_visibility, dflash_draft_loss, sample_anchors

torch.set_default_dtype(torch.float32)


def _models(seed=0, block=4, layers=2):
    torch.manual_seed(seed)
    policy = Policy(PolicyConfig.tiny(vocab_size=40, num_hidden_layers=4))
    draft = DFlashDraft.from_policy(policy, num_hidden_layers=layers, block_size=block, mask_token_id=3)
    for p in draft.parameters():  # away from the initial ones, so every term matters
        p.data.add_(0.05 * torch.randn_like(p))
    return policy, draft


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = [9, 6, 11]
    ids = torch.randint(4, 40, (sum(lengths),), generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, cu, pos


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """x (S, h, D) at positions pos (S,), rotate-half convention."""
    D = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _reference_block(draft, ctx_feat, ctx_pos, emb, anchor_pos, ctx_rows):
    """One block, densely: its keys are the visible context rows in order, then its own B rows; one softmax."""
    c = draft.config
    x = emb
    B = x.shape[0]
    bpos = anchor_pos + torch.arange(B)
    for layer in draft.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight, c.rms_norm_eps)
        q = _rope(_rms(a.q_proj(h).view(B, c.num_attention_heads, c.head_dim), a.q_norm.weight, c.rms_norm_eps), bpos,
                  c.rope_theta)
        src = torch.cat([ctx_feat[ctx_rows], h])
        spos = torch.cat([ctx_pos[ctx_rows], bpos])
        S = src.shape[0]
        k = _rope(_rms(a.k_proj(src).view(S, c.num_key_value_heads, c.head_dim), a.k_norm.weight, c.rms_norm_eps),
                  spos, c.rope_theta)
        v = a.v_proj(src).view(S, c.num_key_value_heads, c.head_dim)
        rep = c.num_attention_heads // c.num_key_value_heads
        outs = []
        for head in range(c.num_attention_heads):
            kh, vh = k[:, head // rep], v[:, head // rep]
            w = torch.softmax(q[:, head] @ kh.T / math.sqrt(c.head_dim), dim=-1)
            outs.append(w @ vh)
        x = x + a.o_proj(torch.cat(outs, -1))
        h = _rms(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
        x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
    return _rms(x, draft.norm.weight, c.rms_norm_eps)


def _forward(policy, draft, ids, cu, pos, anchors):
    out = policy(ids, cu_seqlens=cu, position_ids=pos, taps=tuple(draft.config.taps))
    ctx = draft.context([t.detach() for t in out.taps])
    emb = policy.embed(draft.block_ids(ids[anchors])).detach()
    visible = context_visibility(cu, anchors, ids.shape[0])
    hidden = draft(ctx, pos, emb, pos[anchors], visible)
    return out, ctx, emb, hidden


def test_blocks_equal_the_dense_reference_in_values_and_gradients():
    policy, draft = _models()
    ids, cu, pos = _batch()
    anchors = torch.tensor([0, 3, 8, 9, 13, 15, 25])  # first rows of documents, a last row, mid rows
    out, ctx, emb, hidden = _forward(policy, draft, ids, cu, pos, anchors)
    ref = []
    for n, a in enumerate(anchors.tolist()):
        doc = int((cu[1:] <= a).sum())
        rows = torch.arange(int(cu[doc]), a)
        ref.append(_reference_block(draft, ctx, pos, emb[n], int(pos[a]), rows))
    ref = torch.stack(ref)
    torch.testing.assert_close(hidden, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn_like(hidden)
    grads = torch.autograd.grad((hidden * w).sum(), list(draft.parameters()), retain_graph=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), list(draft.parameters()))
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):  # fp32, relative to the gradient's scale
        scale = r.abs().max()
        torch.testing.assert_close(g / scale, r / scale, atol=1e-5, rtol=0, msg=name)


def test_a_block_sees_its_context_before_the_anchor_and_its_own_rows_only():
    policy, draft = _models(seed=2)
    ids, cu, pos = _batch(seed=3)
    anchors = torch.tensor([4, 12, 20])
    _, ctx, emb, hidden = _forward(policy, draft, ids, cu, pos, anchors)
    visible = context_visibility(cu, anchors, ids.shape[0])
    # another document's rows, rows at or after the anchor, and another block change nothing
    ctx2 = ctx.clone()
    ctx2[~visible[1]] += torch.randn_like(ctx2[~visible[1]])
    emb2 = emb.clone()
    emb2[0] += 1.0
    again = draft(ctx2, pos, emb2, pos[anchors], visible)
    torch.testing.assert_close(again[1], hidden[1], atol=0, rtol=0)
    # a context row it does see, and a row of its own block, change it
    ctx3 = ctx.clone()
    ctx3[int(cu[1])] += 1.0
    assert not torch.allclose(draft(ctx3, pos, emb, pos[anchors], visible)[1], hidden[1])
    emb3 = emb.clone()
    emb3[1, -1] += 1.0
    changed = draft(ctx, pos, emb3, pos[anchors], visible)[1]
    assert not torch.allclose(changed[0], hidden[1, 0])  # bidirectional: the anchor row sees the last row


def _reference_loss(block_logits, policy_logits, anchors, cu, mask, gamma):
    B = block_logits.shape[1]
    total = 0.0
    for k in range(1, B):
        num, count = 0.0, 0
        for n, a in enumerate(anchors.tolist()):
            end = int(cu[int((cu[1:] <= a).sum()) + 1])
            r = a + k - 1
            if r < end and mask[r] > 0:
                p = torch.softmax(policy_logits[r], -1)
                num = num - (p * torch.log_softmax(block_logits[n, k], -1)).sum()
                count += 1
        total = total + math.exp(-(k - 1) / gamma) * num / max(count, 1)
    return total


def test_the_loss_equals_its_definition_and_never_reaches_the_policy():
    policy, draft = _models(seed=4)
    ids, cu, pos = _batch(seed=5)
    mask = (torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(6)) > 0.3).float()
    anchors = sample_anchors(cu, mask, 2, torch.Generator().manual_seed(7))
    assert len(anchors) <= 6 and all(mask[a] > 0 for a in anchors)
    out, _, _, hidden = _forward(policy, draft, ids, cu, pos, anchors)
    block_logits = draft.logits(hidden, policy.lm_head.weight)
    res = dflash_draft_loss(block_logits, out.logits, anchors, cu, mask, gamma=4.0)
    ref = _reference_loss(block_logits, out.logits.detach(), anchors, cu, mask, 4.0)
    torch.testing.assert_close(res.loss, ref, atol=1e-5, rtol=1e-5)
    # the policy's gradients: identical with and without the draft term
    policy_loss = out.logits.float().logsumexp(-1).mean()
    only = torch.autograd.grad(policy_loss, list(policy.parameters()), retain_graph=True)
    both = torch.autograd.grad(policy_loss + res.loss, list(policy.parameters()), retain_graph=True,
                               allow_unused=True)
    for g, h in zip(only, both):
        assert torch.equal(g, h)
    assert all(p.grad is None for p in policy.parameters())
    drafted = torch.autograd.grad(res.loss, list(draft.parameters()), allow_unused=True)
    assert all(g is not None and g.abs().sum() > 0 for g in drafted)


def test_bad_shapes_and_configs_are_named():
    policy, draft = _models()
    with pytest.raises(ValueError, match="block_size=1 must be >= 2"):
        DFlashDraft.from_policy(policy, block_size=1)
    n = len(draft.config.taps) + 1
    with pytest.raises(ValueError, match=f"{n} taps given"):
        draft.context([torch.zeros(2, draft.config.hidden_size)] * n)
    with pytest.raises(ValueError, match="visible has shape"):
        H = draft.config.hidden_size
        draft(torch.zeros(5, H), torch.arange(5), torch.zeros(2, 4, H), torch.zeros(2, dtype=torch.long),
              torch.ones(3, 5, dtype=torch.bool))


def _zlab_checkpoint(path, H=64, I=128, heads=4, kv=2, D=16, layers=2, V=40, seed=8, extra_tensors=None):
    """A checkpoint written the way z-lab publishes one: its config keys at the top level (as z-lab's config.json
    files carry them) and its tensor names, listed here by hand."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    t = lambda *shape: 0.2 * torch.randn(*shape, generator=g)  # noqa: E731
    state = {"fc.weight": t(H, 3 * H), "hidden_norm.weight": 1 + t(H), "norm.weight": 1 + t(H)}
    for i in range(layers):
        p = f"layers.{i}."
        state |= {p + "self_attn.q_proj.weight": t(heads * D, H), p + "self_attn.k_proj.weight": t(kv * D, H),
                  p + "self_attn.v_proj.weight": t(kv * D, H), p + "self_attn.o_proj.weight": t(H, heads * D),
                  p + "self_attn.q_norm.weight": 1 + t(D), p + "self_attn.k_norm.weight": 1 + t(D),
                  p + "mlp.gate_proj.weight": t(I, H), p + "mlp.up_proj.weight": t(I, H),
                  p + "mlp.down_proj.weight": t(H, I), p + "input_layernorm.weight": 1 + t(H),
                  p + "post_attention_layernorm.weight": 1 + t(H)}
    state |= extra_tensors or {}
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H, "intermediate_size": I,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": D,
              "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
              "max_position_embeddings": 128, "vocab_size": V, "block_size": 4, "mask_token_id": 3,
              "target_layer_ids": [0, 1, 2], "attention_dropout": 0.0, "hidden_act": "silu"}
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    return state


def test_a_published_dflash_checkpoint_loads_and_gives_the_reference_blocks(tmp_path):
    from lightning_codraft.models.dflash_io import load_dflash, save_dflash

    raw = _zlab_checkpoint(tmp_path / "zlab")
    draft = load_dflash(tmp_path / "zlab")
    c = draft.config
    assert c.taps == (1, 2, 3) and c.block_size == 4 and c.mask_token_id == 3 and c.num_hidden_layers == 2
    params = dict(draft.named_parameters())
    assert set(params) == set(raw) and all(torch.equal(params[k], raw[k]) for k in raw)
    torch.manual_seed(9)
    policy = Policy(PolicyConfig.tiny(vocab_size=40, num_hidden_layers=4))
    ids, cu, pos = _batch(seed=10)
    anchors = torch.tensor([2, 10, 17])
    _, ctx, emb, hidden = _forward(policy, draft, ids, cu, pos, anchors)
    for n, a in enumerate(anchors.tolist()):
        doc = int((cu[1:] <= a).sum())
        ref = _reference_block(draft, ctx, pos, emb[n], int(pos[a]), torch.arange(int(cu[doc]), a))
        torch.testing.assert_close(hidden[n], ref, atol=1e-5, rtol=1e-5)
    # our export reads back the same, and vLLM's "model."-prefixed names load too
    again = load_dflash(save_dflash(draft, tmp_path / "ours"))
    assert again.config == draft.config and all(torch.equal(p, q) for p, q in zip(again.parameters(), draft.parameters()))
    import json

    exported = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert exported["dflash_config"] == {"target_layer_ids": [0, 1, 2], "block_size": 4, "mask_token_id": 3}


def test_a_dflash_checkpoint_with_an_embedding_of_its_own_is_refused_by_name(tmp_path):
    from lightning_codraft.models.dflash_io import load_dflash

    _zlab_checkpoint(tmp_path / "emb", extra_tensors={"embed_tokens.weight": torch.zeros(40, 64)})
    with pytest.raises(ValueError, match=r"\['embed_tokens.weight'\] are not a DFlash drafter's"):
        load_dflash(tmp_path / "emb")


def test_a_repeated_tap_is_refused_and_the_default_taps_are_distinct():
    policy, _ = _models()
    with pytest.raises(ValueError, match=r"repeats a tap"):
        DFlashDraft.from_policy(policy, taps=(1, 2, 2))
    taps = DFlashDraft.from_policy(policy).config.taps
    assert len(set(taps)) == len(taps)


def test_the_pool_fits_a_block_drafter_and_leaves_the_policy_alone():
    """distill.pool's one fit, for a block drafter: on the policy's own samples, through DFlash's term."""
    from lightning_codraft.config_sections import WarmStartConfig
    from lightning_codraft.distill.pool import fit_on_pool, sample_pool
    from lightning_codraft.training.module import CoDraftModule

    policy, draft = _models(seed=11, block=4, layers=1)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    prompts = [[int(t) for t in torch.randint(4, 40, (5,), generator=torch.Generator().manual_seed(i))] for i in range(8)]
    batches = sample_pool(policy, draft, prompts, WarmStartConfig(steps=40, batch_size=4), max_new_tokens=12,
                          temperature=1.0, top_p=1.0, seed=3, stop_ids=[], pad_id=0)
    seen = []
    module = CoDraftModule(policy, draft, block_anchors=4, block_gamma=4.0)
    losses = fit_on_pool(module, batches, 40, 3e-3, on_step=lambda i, loss, acc: seen.append(len(acc)))
    assert len(losses) == 40 and sum(losses[-5:]) < sum(losses[:5]) and seen == [3] * 40  # B - 1 positions
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
