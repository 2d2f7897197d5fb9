import pytest
import torch

from lightning_codraft.distill.cache import build_feature_cache
from lightning_codraft.distill.calibration import calibrate_draft_temperature, draft_overlap
from lightning_codraft.distill.fit import DraftFitConfig, fit_draft
from lightning_codraft.rollout import SpeculativeEngine
from test_fit import _docs, _draft, _policy, _reference_loss, _reference_unroll, _target_ids

T = 0.8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny sharp policy, a draft fitted to it for a few steps, its cache (last 4 documents held out)."""
    policy, docs = _policy(sharpen=4.0), _docs(24)
    draft = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps,
                                tmp_path_factory.mktemp("cal") / "c", batch_tokens=64, dtype="float32")
    config = DraftFitConfig(epochs=3, batch_tokens=64, lr=3e-3, ttt_steps=3, val_docs=4, eval_every=1000)
    fit_draft(draft, policy.embed, cache, config)
    return policy, docs, draft, cache, config


def _direct_overlap(policy, draft, docs, K, scale):
    """Per-step overlap from a fresh policy forward with full logits and the draft's own map, row by row."""
    out = _reference_loss(policy, draft, docs, K)  # counted rows per step, the loss's own bookkeeping
    with torch.no_grad():
        pol, steps, cu, _ = _reference_unroll(policy, draft, docs, K)
    lengths = [len(d) for d, _ in docs]
    target_ids = _target_ids(draft)
    res = []
    for k in range(K):
        s, num, den = k + 1, 0.0, 0.0
        for d, (start, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
            prompt = docs[d][1]
            for i in range(start, start + n - s):
                row = i + s  # the policy's distribution there is step k's target at row i
                if row - start < prompt or row - start > n - 2:
                    continue  # not a completion row (loss mask)
                full = pol.logits[row]
                if not bool(draft.t2d[full.argmax()]):
                    continue  # the policy's top-1 is outside the draft vocabulary: not counted
                p = torch.softmax(full[target_ids] / T, -1)
                q = torch.softmax(steps[k][i] / (T * scale), -1)
                num += float(torch.minimum(p, q).sum())
                den += 1
        assert den == float(out.in_vocab[k])
        res.append(num / den)
    return res


def test_overlap_equals_a_direct_row_by_row_computation(setup):
    policy, docs, draft, cache, config = setup
    got, rows = draft_overlap(draft, policy.embed, cache, range(len(docs)), config, T, scales=(1.0, 0.5))
    for s, scale in enumerate((1.0, 0.5)):
        want = _direct_overlap(policy, draft, docs, config.ttt_steps, scale)
        torch.testing.assert_close(got[s], torch.tensor(want), atol=1e-5, rtol=1e-5)
    assert rows > 0
    assert not torch.allclose(got[0], got[1])  # the scale changes the proposals


def test_calibration_picks_the_best_scale_and_folds_it_into_lm_head(setup):
    policy, docs, draft, cache, config = setup
    draft = type(draft)(draft.config)
    draft.load_state_dict(setup[2].state_dict())
    with torch.no_grad():
        draft.lm_head.weight.mul_(0.25)  # a deliberately flat draft: sharpening must pay
    before = draft.lm_head.weight.detach().clone()
    val = range(len(docs) - 4, len(docs))
    cal = calibrate_draft_temperature(draft, policy.embed, cache, val, config, T, scales=(0.8, 0.5, 0.25))
    assert cal.scales[0] == 1.0 and len(cal.acceptance) == len(cal.scales) == 4
    best = max(range(4), key=lambda i: cal.acceptance[i])
    assert cal.scale == cal.scales[best] < 1.0 and cal.acceptance[best] > cal.acceptance[0]
    torch.testing.assert_close(draft.lm_head.weight, before / cal.scale)
    # the folded draft at scale 1 proposes what the unfolded one proposed at the chosen scale
    folded, _ = draft_overlap(draft, policy.embed, cache, val, config, T, scales=(1.0,))
    torch.testing.assert_close(folded[0], torch.tensor(cal.overlap[best]), atol=1e-6, rtol=1e-6)


def test_calibration_keeps_a_draft_that_sharpening_does_not_help(setup):
    policy, docs, draft, cache, config = setup
    draft = type(draft)(draft.config)
    draft.load_state_dict(setup[2].state_dict())
    with torch.no_grad():
        draft.lm_head.weight.mul_(20.0)  # already far sharper than the policy: every scale < 1 overlaps less
    before = draft.lm_head.weight.detach().clone()
    cal = calibrate_draft_temperature(draft, policy.embed, cache, range(len(docs) - 4, len(docs)), config, T)
    assert cal.scale == 1.0 and cal.acceptance[0] == max(cal.acceptance)
    assert torch.equal(draft.lm_head.weight, before)
    out = calibrate_draft_temperature(draft, policy.embed, cache, range(len(docs) - 4, len(docs)), config, T,
                                      scales=(0.5,), apply=False)
    assert torch.equal(draft.lm_head.weight, before) and out.scales == [1.0, 0.5]


def test_bad_arguments_are_refused(setup):
    policy, docs, draft, cache, config = setup
    with pytest.raises(ValueError, match="must be > 0"):
        draft_overlap(draft, policy.embed, cache, range(4), config, 0.0)
    with pytest.raises(ValueError, match="must be > 0"):
        calibrate_draft_temperature(draft, policy.embed, cache, range(4), config, T, scales=(0.5, -1.0))


def test_greedy_decoding_is_unchanged_by_calibration(setup):
    policy, docs, draft, cache, config = setup
    sharp = type(draft)(draft.config)
    sharp.load_state_dict(draft.state_dict())
    with torch.no_grad():
        sharp.lm_head.weight.div_(0.5)
    prompts = [d[:4] for d, _ in docs[:3]]
    a = SpeculativeEngine(policy, draft, 3).generate(prompts, max_new_tokens=8, temperature=0.0)
    b = SpeculativeEngine(policy, sharp, 3).generate(prompts, max_new_tokens=8, temperature=0.0)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.stats.accepted for x in a] == [x.stats.accepted for x in b]
