import numpy as np
import pytest
import torch

from lightning_codraft.distill.cache import build_feature_cache
from lightning_codraft.distill.capture import FeatureRecorder
from lightning_codraft.distill.fit import draft_batch_loss
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.rollout import SpeculativeEngine

V, VD, STOPS = 96, 40, list(range(8))


def _models():
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=V, num_hidden_layers=5)).eval()
    with torch.no_grad():
        policy.lm_head.weight.mul_(3.0)
    torch.manual_seed(1)
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=VD, token_counts=torch.arange(V, 0, -1).float())
    return policy, draft


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, V, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _sample(engine, recorder, prompts, chunk, **kw):
    """Sample in calls of ``chunk`` prompts (as the warm start does), recording every call."""
    outs = []
    for c in range(0, len(prompts), chunk):
        recorder.request_offset = c
        outs += engine.generate(prompts[c:c + chunk], max_new_tokens=14, stop_token_ids=STOPS, seed=3,
                                observer=recorder, **kw)
    return [(p + o.token_ids, len(p) - 1) for p, o in zip(prompts, outs)]


@pytest.mark.parametrize("speculative", [False, True])
def test_recorded_features_equal_a_second_pass(tmp_path, speculative):
    """The features kept while sampling (plain decoding, or a K=3 speculative engine whose verify forwards see
    rejected and past-the-stop positions) equal the feature pass over the sampled documents: the same ids and
    targets, the same taps except each document's last (never fed: zeros), the same entropy and coverage."""
    policy, draft = _models()
    engine = SpeculativeEngine(policy, draft if speculative else None, 3 if speculative else 0, max_batch_size=3)
    recorder = FeatureRecorder(policy, draft.config.taps, temperature=0.8, dtype="float32",
                               spill_dir=tmp_path / "spill")
    prompts = _prompts(7)
    docs = _sample(engine, recorder, prompts, chunk=4, temperature=1.0)
    lengths = [len(d) for d, _ in docs]
    assert len(set(lengths)) > 2 and any(d[-1] in STOPS for d, _ in docs)  # stops and budgets both end documents
    target_ids = draft.draft_to_target(torch.arange(VD))
    got = recorder.write(docs, list(range(len(docs))), target_ids, tmp_path / "captured", docs_per_write=3)
    ref = build_feature_cache(policy, docs, target_ids, draft.config.taps, tmp_path / "ref", dtype="float32",
                              temperature=0.8, batch_tokens=40)
    np.testing.assert_array_equal(got.ids, ref.ids)
    np.testing.assert_array_equal(got.loss_offsets, ref.loss_offsets)
    last = np.asarray(got.doc_offsets[1:]) - 1
    fed = np.setdiff1d(np.arange(len(got.ids)), last)
    np.testing.assert_allclose(got.taps[fed], ref.taps[fed], rtol=1e-4, atol=1e-5)
    assert not np.asarray(got.taps[last]).any()
    np.testing.assert_allclose(got.targets[:, :-1], ref.targets[:, :-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got.targets[:, -1], ref.targets[:, -1])
    assert got.meta["entropy"] == pytest.approx(ref.meta["entropy"], rel=1e-5)
    assert got.meta["argmax_coverage"] == ref.meta["argmax_coverage"]
    assert 0 < got.meta["argmax_coverage"] < 1  # both sides of the outside flag are exercised
    # the wide records went to disk as they came: taps of every fed position, fp32 last-layer outputs of loss rows
    H, fed_rows, loss_rows = policy.config.hidden_size, len(got.ids) - len(docs), len(got.targets)
    assert (tmp_path / "spill" / "taps.bin").stat().st_size >= fed_rows * 3 * H * 4
    assert (tmp_path / "spill" / "hidden.bin").stat().st_size >= loss_rows * H * 4
    recorder.close()
    assert not (tmp_path / "spill").exists()
    np.testing.assert_array_equal(got.ids, ref.ids)  # the cache does not depend on the spilled records


def test_recorded_cache_gives_the_same_loss_and_gradients(tmp_path):
    """The zero taps of each document's last token change nothing: the draft loss, accuracies and gradients on
    the recorded cache equal those on the feature pass's cache."""
    policy, draft = _models()
    target_ids = draft.draft_to_target(torch.arange(VD))
    with FeatureRecorder(policy, draft.config.taps, dtype="float32") as recorder:
        docs = _sample(SpeculativeEngine(policy, None, 0), recorder, _prompts(6, seed=1), chunk=6, temperature=1.0)
        captured = recorder.write(docs, list(range(len(docs))), target_ids, tmp_path / "captured")
    assert not recorder.spill_dir.exists()  # a temporary spill directory, removed on exit
    caches = [captured,
              build_feature_cache(policy, docs, target_ids, draft.config.taps, tmp_path / "ref", dtype="float32")]
    results = []
    for cache in caches:
        out = draft_batch_loss(draft, policy.embed, cache.batch(list(range(len(docs)))), 3)
        results.append((out, torch.autograd.grad(out.loss, list(draft.parameters()))))
    (got, got_grads), (ref, ref_grads) = results
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert got.correct.tolist() == ref.correct.tolist()
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_recorder_names_what_it_did_not_see(tmp_path):
    """Documents whose forwards were not recorded (a call without the observer, a wrong request offset) are a
    clear error, never a cache with zero targets."""
    policy, draft = _models()
    recorder = FeatureRecorder(policy, draft.config.taps, spill_dir=tmp_path / "spill")
    engine = SpeculativeEngine(policy, None, 0)
    prompts = _prompts(4, seed=2)
    docs = _sample(engine, recorder, prompts[:2], chunk=2, temperature=1.0)
    out = engine.generate(prompts[2:], max_new_tokens=5, temperature=1.0, seed=1)  # not recorded
    docs += [(p + o.token_ids, len(p) - 1) for p, o in zip(prompts[2:], out)]
    target_ids = draft.draft_to_target(torch.arange(VD))
    with pytest.raises(ValueError, match="loss rows"):
        recorder.write(docs, [0, 1, 2, 3], target_ids, tmp_path / "c")
    with pytest.raises(ValueError, match="request indices"):
        recorder.write(docs[:2], [0], target_ids, tmp_path / "c")
    recorder.write(docs[:2], [0, 1], target_ids, tmp_path / "c")  # the recorded ones alone are complete
    with pytest.raises(ValueError, match="3 tap ids"):
        FeatureRecorder(policy, (1, 2))


@pytest.mark.parametrize("adaptive", [False, True])
def test_observer_leaves_outputs_unchanged(adaptive):
    """Observing the forwards changes no token and no log-prob (greedy and coupled sampling, with a draft, at a
    fixed or adaptive speculation length; adaptive: log-probs to rounding, as between any two adaptive calls)."""
    policy, draft = _models()
    engine = SpeculativeEngine(policy, draft, 3, adaptive=adaptive)
    prompts = _prompts(5, seed=4)
    for temperature in (0.0, 1.0):
        plain = engine.generate(prompts, max_new_tokens=10, temperature=temperature, seed=2)
        with FeatureRecorder(policy, draft.config.taps) as recorder:
            seen = engine.generate(prompts, max_new_tokens=10, temperature=temperature, seed=2, observer=recorder)
        assert [o.token_ids for o in plain] == [o.token_ids for o in seen]
        if not adaptive:
            assert [o.logprobs for o in plain] == [o.logprobs for o in seen]
        else:  # k follows measured times, so a position's log-prob may come from a verify of another shape
            for a, b in zip(plain, seen):
                np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
