"""DecodeStep: the engine's lean policy / draft decode forwards equal the dense full-sequence forward (policy)
and the module's ``Eagle3Draft.step`` (draft), values and cache contents, for ragged batches and every
Llama-family variant; wrappers fall back to the modules' own path."""

import pytest
import torch
from rollout_helpers import make_policy

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rollout.decode_step import DecodeStep, ModuleStep, decode_step

TOL = dict(atol=1e-4, rtol=1e-4)  # fp32, fused q/k/v and gate/up matmuls reassociate sums (hidden norms ~10)
VARIANTS = {
    "llama": {},
    "qwen2": dict(architecture="Qwen2ForCausalLM"),
    "qwen3": dict(architecture="Qwen3ForCausalLM", o_proj_bias=True, mlp_bias=True),
    "llama3-rope-tied": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                             tie_word_embeddings=True),
}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _randomize_biases_and_norms(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("lengths", [[5, 2, 7], [6]], ids=["ragged-batch", "one-row"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_policy_decode_equals_full_forward(variant, lengths):
    policy = make_policy(seed=1, **VARIANTS[variant])
    _randomize_biases_and_norms(policy)
    V, L = policy.config.vocab_size, policy.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    B = len(lengths)
    seqs = [torch.randint(0, V, (n + 4,), generator=g) for n in lengths]  # prompt, then 3 + 1 decoded tokens
    taps = (0, 2, L)
    with torch.inference_mode():
        step = DecodeStep(policy, None, capacity=40)
        cache = policy.allocate_kv_cache(B, 20)
        ids = torch.zeros(B, max(lengths), dtype=torch.long)
        for b, n in enumerate(lengths):
            ids[b, :n] = seqs[b][:n]
        lens = torch.tensor(lengths)
        last, _ = step.policy(ids, cache, taps, logit_rows=lens - 1)
        cache.lengths = lens
        new3 = torch.stack([s[n:n + 3] for s, n in zip(seqs, lengths)])
        logits3, taps3 = step.policy(new3, cache, taps)
        new1 = torch.stack([s[n + 3:n + 4] for s, n in zip(seqs, lengths)])
        logits1, _ = step.policy(new1, cache, None)
        assert cache.lengths.tolist() == [n + 4 for n in lengths]
        for b, n in enumerate(lengths):
            ref = policy(seqs[b][None], taps=taps)
            torch.testing.assert_close(last[b], ref.logits[0, n - 1], **TOL)
            torch.testing.assert_close(logits3[b], ref.logits[0, n:n + 3], **TOL)
            torch.testing.assert_close(logits1[b, 0], ref.logits[0, n + 3], **TOL)
            for mine, theirs in zip(taps3, ref.taps):
                torch.testing.assert_close(mine[b], theirs[0, n:n + 3], **TOL)


@pytest.mark.parametrize("batch", [2, 1])
def test_policy_cache_matches_module_cache(batch):
    policy = make_policy(seed=2)
    ids = torch.randint(0, policy.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        mine, theirs = policy.allocate_kv_cache(batch, 16), policy.allocate_kv_cache(batch, 16)
        DecodeStep(policy, None, 16).policy(ids, mine)
        policy(ids, kv_cache=theirs)
    assert torch.equal(mine.lengths, theirs.lengths)
    for a, b in zip(mine.k + mine.v, theirs.k + theirs.v):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("draft_vocab,start", [(None, [3, 6]), (40, [3, 6]), (None, [5])])
def test_draft_step_equals_module_step(draft_vocab, start):
    policy = make_policy(seed=3)
    counts = torch.arange(policy.config.vocab_size, 0, -1).float() if draft_vocab else None
    torch.manual_seed(4)
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=draft_vocab, token_counts=counts).eval()
    _randomize_biases_and_norms(draft, seed=5)
    H = policy.config.hidden_size
    g = torch.Generator().manual_seed(6)
    with torch.inference_mode():
        step = DecodeStep(policy, draft, 32)
        B = len(start)
        mine, theirs = draft.allocate_kv_cache(B, 24), draft.allocate_kv_cache(B, 24)
        for cache in (mine, theirs):
            cache.lengths = torch.tensor(start)
        for S, rows in ((4, torch.tensor([3, 1][:B])), (1, None), (2, None)):
            taps = tuple(torch.randn(B, S, H, generator=g) for _ in range(3))
            emb = policy.embed(torch.randint(0, policy.config.vocab_size, (B, S), generator=g))
            hidden, logits = step.draft_step(step.fuse(taps), emb, mine, logit_rows=rows)
            ref_hidden, ref_logits = draft.step(draft.fuse(taps), emb, theirs)
            if rows is not None:
                ref_hidden, ref_logits = ref_hidden[torch.arange(B), rows], ref_logits[torch.arange(B), rows]
            torch.testing.assert_close(hidden, ref_hidden, **TOL)
            torch.testing.assert_close(logits, ref_logits, **TOL)
            assert torch.equal(mine.lengths, theirs.lengths)
        torch.testing.assert_close(mine.k[0], theirs.k[0], **TOL)
        torch.testing.assert_close(mine.v[0], theirs.v[0], **TOL)


def test_overflow_names_lengths_and_capacity():
    policy = make_policy()
    cache = policy.allocate_kv_cache(1, 8)
    cache.lengths = torch.tensor([6])
    with torch.inference_mode(), pytest.raises(ValueError, match=r"length 6 \+ 3 new tokens needs 9 slots but "
                                                                  r"capacity is 8"):
        DecodeStep(policy, None, 64).policy(torch.zeros(1, 3, dtype=torch.long), cache)


class _Wrapped(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, ids, **kw):
        return self.inner(ids, **kw)

    def embed(self, ids):
        return self.inner.embed(ids)


def test_other_modules_use_their_own_forward():
    policy = make_policy()
    assert isinstance(decode_step(policy, None, 16), DecodeStep)
    step = decode_step(_Wrapped(policy), None, 16)
    assert isinstance(step, ModuleStep)
    ids = torch.randint(0, policy.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        logits, _ = step.policy(ids, policy.allocate_kv_cache(2, 8), logit_rows=torch.tensor([2, 0]))
        ref = policy(ids).logits
    torch.testing.assert_close(logits, torch.stack([ref[0, 2], ref[1, 0]]), **TOL)
