"""models/decode.py: the fused policy / draft decoders equal the module path (``Policy.forward(kv_cache=)``,
``Eagle3Draft.step``) and the dense full-sequence forward, values and cache contents, for ragged batches and every
Llama-family variant; subclasses keep the fused path, wrappers and sharded parameters fall back to the module path."""

import copy

import pytest
import torch

from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.models.decode import (
    DraftDecoder,
    ModuleDraftDecoder,
    ModulePolicyDecoder,
    PolicyDecoder,
    draft_decoder,
    policy_decoder,
)
from lightning_codraft.models.fused_decode import FusedDraftDecoder, FusedPolicyDecoder

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32, fused q/k/v and gate/up matmuls reassociate sums (hidden norms ~10)
VARIANTS = {
    "llama": {},
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM", o_proj_bias=True, mlp_bias=True),
    "llama3-rope-tied": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                             tie_word_embeddings=True),
}


def _policy(seed: int = 0, cls=Policy, **overrides) -> Policy:
    """A tiny policy with peaked logits, biases and norms perturbed (so every parameter matters)."""
    torch.manual_seed(seed)
    policy = cls(PolicyConfig.tiny(**overrides))
    policy.reset_parameters(std=0.2)
    _randomize_biases_and_norms(policy, seed)
    return policy.eval()


def _randomize_biases_and_norms(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _decode_and_compare(policy, decoder, lengths, taps):
    """Prefill ragged prompts, then 3 and 1 new tokens, through ``decoder``; compare with the full forward."""
    V = policy.config.vocab_size
    g = torch.Generator().manual_seed(0)
    B = len(lengths)
    seqs = [torch.randint(0, V, (n + 4,), generator=g) for n in lengths]  # prompt, then 3 + 1 decoded tokens
    with torch.inference_mode():
        cache = decoder.allocate_cache(B, 20)
        ids = torch.zeros(B, max(lengths), dtype=torch.long)
        for b, n in enumerate(lengths):
            ids[b, :n] = seqs[b][:n]
        lens = torch.tensor(lengths)
        last, _ = decoder.forward(ids, cache, taps, logit_rows=lens - 1)
        cache.lengths = lens
        new3 = torch.stack([s[n:n + 3] for s, n in zip(seqs, lengths)])
        logits3, taps3 = decoder.forward(new3, cache, taps)
        new1 = torch.stack([s[n + 3:n + 4] for s, n in zip(seqs, lengths)])
        logits1, _ = decoder.forward(new1, cache, None)
        assert cache.lengths.tolist() == [n + 4 for n in lengths]
        for b, n in enumerate(lengths):
            ref = policy(seqs[b][None], taps=taps)
            torch.testing.assert_close(last[b], ref.logits[0, n - 1], **TOL)
            torch.testing.assert_close(logits3[b], ref.logits[0, n:n + 3], **TOL)
            torch.testing.assert_close(logits1[b, 0], ref.logits[0, n + 3], **TOL)
            assert len(taps3) == len(taps)
            for mine, theirs in zip(taps3, ref.taps):
                torch.testing.assert_close(mine[b], theirs[0, n:n + 3], **TOL)


@pytest.mark.parametrize("lengths", [[5, 2, 7], [6]], ids=["ragged-batch", "one-row"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fused_policy_decode_equals_full_forward(variant, lengths):
    policy = _policy(seed=1, **VARIANTS[variant])
    decoder = policy.decoder(40)
    assert isinstance(decoder, FusedPolicyDecoder) and isinstance(decoder, PolicyDecoder)
    _decode_and_compare(policy, decoder, lengths, taps=(0, 2, policy.config.num_hidden_layers))


@pytest.mark.parametrize("lengths", [[5, 2, 7], [6]], ids=["ragged-batch", "one-row"])
def test_module_policy_decode_equals_full_forward(lengths):
    policy = _policy(seed=1, **VARIANTS["qwen3"])
    decoder = ModulePolicyDecoder(policy)  # the module-by-module reference path, not the fused one
    assert isinstance(decoder, PolicyDecoder) and not isinstance(decoder, FusedPolicyDecoder)
    _decode_and_compare(policy, decoder, lengths, taps=(1, 3))  # asserts logits, taps and cache lengths


@pytest.mark.parametrize("batch", [2, 1])
def test_fused_cache_matches_module_cache(batch):
    policy = _policy(seed=2)
    ids = torch.randint(0, policy.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        mine, theirs = policy.allocate_kv_cache(batch, 16), policy.allocate_kv_cache(batch, 16)
        logits, _ = policy.decoder(16).forward(ids, mine)
        ref = ModulePolicyDecoder(policy).forward(ids, theirs)[0]
    torch.testing.assert_close(logits, ref, **TOL)
    assert torch.equal(mine.lengths, theirs.lengths)
    for a, b in zip(mine.k + mine.v, theirs.k + theirs.v):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("draft_vocab,start", [(None, [3, 6]), (40, [3, 6]), (None, [5])])
def test_fused_draft_step_equals_module_step(draft_vocab, start):
    policy = _policy(seed=3)
    counts = torch.arange(policy.config.vocab_size, 0, -1).float() if draft_vocab else None
    torch.manual_seed(4)
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=draft_vocab, token_counts=counts).eval()
    _randomize_biases_and_norms(draft, seed=5)
    H = policy.config.hidden_size
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        fused, module = draft.decoder(32), ModuleDraftDecoder(draft)
        assert isinstance(fused, FusedDraftDecoder) and isinstance(fused, DraftDecoder)
        B = len(start)
        mine, theirs = fused.allocate_cache(B, 24), module.allocate_cache(B, 24)
        for cache in (mine, theirs):
            cache.lengths = torch.tensor(start)
        for S, rows in ((4, torch.tensor([3, 1][:B])), (1, None), (2, None)):
            taps = tuple(torch.randn(B, S, H, generator=g) for _ in range(3))
            emb = policy.embed(torch.randint(0, policy.config.vocab_size, (B, S), generator=g))
            torch.testing.assert_close(fused.fuse(taps), draft.fuse(taps), **TOL)
            hidden, logits = fused.step(fused.fuse(taps), emb, mine, logit_rows=rows)
            ref_hidden, ref_logits = module.step(draft.fuse(taps), emb, theirs, logit_rows=rows)
            torch.testing.assert_close(hidden, ref_hidden, **TOL)
            torch.testing.assert_close(logits, ref_logits, **TOL)
            assert torch.equal(mine.lengths, theirs.lengths)
        torch.testing.assert_close(mine.k[0], theirs.k[0], **TOL)
        torch.testing.assert_close(mine.v[0], theirs.v[0], **TOL)


def test_overflow_names_lengths_and_capacity():
    policy = _policy()
    cache = policy.allocate_kv_cache(1, 8)
    cache.lengths = torch.tensor([6])
    with torch.inference_mode(), pytest.raises(ValueError, match=r"length 6 \+ 3 new tokens needs 9 slots but "
                                                                  r"capacity is 8"):
        policy.decoder(64).forward(torch.zeros(1, 3, dtype=torch.long), cache)


class _GreetingPolicy(Policy):
    """A Policy subclass with an extra method: it inherits ``decoder``, so the engine decodes it fused."""

    def greet(self) -> str:
        return "hi"


def test_policy_subclass_gets_the_fused_decoder_and_loads_as_itself(tmp_path):
    policy = _policy(seed=7, cls=_GreetingPolicy)
    decoder = policy_decoder(policy, 40)
    assert isinstance(decoder, FusedPolicyDecoder)
    _decode_and_compare(policy, decoder, [4, 6], taps=(2,))
    policy.save_pretrained(tmp_path)
    assert type(_GreetingPolicy.from_pretrained(tmp_path)) is _GreetingPolicy


class _Wrapped(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, ids, **kw):
        return self.inner(ids, **kw)

    def embed(self, ids):
        return self.inner.embed(ids)

    def fuse(self, taps):
        return self.inner.fuse(taps)

    def step(self, hidden, embeds, kv_cache):
        return self.inner.step(hidden, embeds, kv_cache)


def test_modules_without_a_decoder_use_their_own_forward():
    policy = _policy()
    decoder = policy_decoder(_Wrapped(policy), 16)
    assert isinstance(decoder, ModulePolicyDecoder)
    ids = torch.randint(0, policy.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = decoder.allocate_cache(2, 8)                      # shaped from the wrapper's config
        assert (cache.num_layers, cache.k[0].shape) == (4, (2, 2, 8, 16))
        logits, _ = decoder.forward(ids, cache, logit_rows=torch.tensor([2, 0]))
        ref = policy(ids).logits
    torch.testing.assert_close(logits, torch.stack([ref[0, 2], ref[1, 0]]), **TOL)
    draft = Eagle3Draft.from_policy(policy)
    assert isinstance(draft_decoder(_Wrapped(draft), 16), ModuleDraftDecoder)
    assert isinstance(draft_decoder(draft, 16), FusedDraftDecoder)


class _ShardedLike(torch.Tensor):
    """A tensor subclass standing in for DTensor shards: the fused path must not read it as a plain weight."""


def test_non_plain_parameters_fall_back_to_the_module_path():
    policy = _policy()
    draft = Eagle3Draft.from_policy(policy)
    for module in (policy, draft):
        name, p = next(iter(module.named_parameters()))
        owner = module.get_submodule(name.rsplit(".", 1)[0])
        setattr(owner, name.rsplit(".", 1)[1], torch.nn.Parameter(p.detach().as_subclass(_ShardedLike)))
    assert isinstance(policy.decoder(16), ModulePolicyDecoder)
    assert isinstance(draft.decoder(16), ModuleDraftDecoder)


@pytest.mark.parametrize("variant", ["llama", "qwen3", "llama3-rope-tied"])
def test_decoders_in_another_dtype_equal_the_decoders_of_a_cast_copy(variant):
    """``decoder(capacity, dtype=bf16)`` casts the weights it packs: bit for bit what the decoder of a bf16 copy of
    the module computes (logits, taps, caches; RoPE tables from fp32 frequencies in both), with caches in bf16,
    while the module keeps its fp32 weights."""
    policy = _policy(seed=7, **VARIANTS[variant])
    torch.manual_seed(8)
    draft = Eagle3Draft.from_policy(policy).eval()
    _randomize_biases_and_norms(draft, seed=9)
    cast_policy, cast_draft = copy.deepcopy(policy).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16)
    # .to() also rounds the copies' RoPE frequencies to bf16; the casting decoders keep fp32 frequencies (only the
    # cos / sin tables are cast), so the copies get them back
    cast_policy.rotary, cast_draft.rotary_emb = policy.rotary, draft.rotary_emb
    ids = torch.randint(0, policy.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    taps_ids = tuple(int(t) for t in draft.config.taps)
    results = []
    with torch.inference_mode():
        for pdec, ddec in ((policy_decoder(policy, 16, torch.bfloat16), draft_decoder(draft, 16, torch.bfloat16)),
                           (cast_policy.decoder(16), cast_draft.decoder(16))):
            pcache, dcache = pdec.allocate_cache(2, 16), ddec.allocate_cache(2, 16)
            logits, taps = pdec.forward(ids, pcache, taps_ids)
            hidden, dlogits = ddec.step(ddec.fuse(taps), pdec.embed(ids), dcache)
            results.append((logits, *taps, hidden, dlogits, *pcache.k, *pcache.v, *dcache.k, *dcache.v))
    assert all(t.dtype == torch.bfloat16 for t in results[0])
    for mine, theirs in zip(*results):
        assert torch.equal(mine, theirs)
    assert next(policy.parameters()).dtype == torch.float32 and policy_decoder(policy, 16, torch.float32).dtype == \
        torch.float32


def test_a_module_path_decoder_refuses_another_dtype():
    policy = _policy()
    wrapped = ModulePolicyDecoder(policy)
    assert wrapped.module is policy

    class Wrapper(torch.nn.Module):  # a module without a decoder of its own: decoded through its forward
        def __init__(self):
            super().__init__()
            self.inner = policy

    with pytest.raises(ValueError, match="needs its fused policy decoder"):
        policy_decoder(Wrapper(), 16, torch.bfloat16)
    assert isinstance(policy_decoder(Wrapper(), 16, torch.float32), ModulePolicyDecoder)  # its own dtype: fine


@pytest.mark.parametrize("capacity,attends_all", [(24, True), (200, False)], ids=["small-slack", "large-slack"])
@pytest.mark.parametrize("lengths", [[5, 2, 7], [6]], ids=["ragged-batch", "one-row"])
def test_fused_decode_attends_the_whole_cache_only_when_its_slack_is_small(monkeypatch, lengths, capacity,
                                                                           attends_all):
    """A cache at most a block longer than its rows is attended whole (no copy of a slice on CPU), masked: slots
    past each row's length full of garbage change nothing."""
    import lightning_codraft.models.fused_decode as decode

    widths = []
    real = decode.decode_attention

    def spy(q, k, v, mask=None, scale=None):
        widths.append((k.shape[2], k.is_contiguous()))
        return real(q, k, v, mask, scale)

    monkeypatch.setattr(decode, "decode_attention", spy)
    policy = _policy(seed=1)
    decoder = policy.decoder(capacity)
    allocate = decoder.allocate_cache

    def garbage_cache(batch, _capacity):
        cache = allocate(batch, capacity)
        for t in cache.k + cache.v:
            t.normal_(0.0, 100.0)                                   # every slot: stale until written
        return cache

    decoder.allocate_cache = garbage_cache
    _decode_and_compare(policy, decoder, lengths, taps=(0, 2))
    assert widths
    if attends_all:
        assert all(w == (capacity, True) for w in widths)
    else:
        assert all(w < capacity for w, _ in widths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_logits_do_not_depend_on_the_caches_capacity(dtype):
    """Prefill, verify and decode steps over caches of other capacities (as engines with another K or batch
    allocate them) give bitwise the same logits: what keeps bf16 speculative decoding token-identical to plain."""
    policy = _policy(seed=4)
    g = torch.Generator().manual_seed(2)
    lengths = [150, 97, 120]
    ids = torch.randint(0, policy.config.vocab_size, (3, max(lengths) + 6), generator=g)
    results = []
    with torch.inference_mode():
        decoder = policy.decoder(256, dtype)
        for capacity in (max(lengths) + 6, max(lengths) + 40, 250):
            cache = decoder.allocate_cache(3, capacity)
            first, _ = decoder.forward(ids[:, :max(lengths)], cache, logit_rows=torch.tensor(lengths) - 1)
            cache.lengths = torch.tensor(lengths)
            verify, _ = decoder.forward(ids[:, :5], cache)
            cache.lengths = torch.tensor(lengths) + 1
            step, _ = decoder.forward(ids[:, 5:6], cache)
            results.append((first, verify[:, :2], step))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
