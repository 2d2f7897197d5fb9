import math

import numpy as np
import pytest
import torch

from lightning_codraft.distill.cache import FeatureCache, build_feature_cache
from lightning_codraft.distill.compiled import compiled_draft
from lightning_codraft.distill.fit import (
    DraftFitConfig,
    draft_batch_loss,
    draft_unroll,
    evaluate_draft,
    fit_draft,
    implied_acceptance_length,
    lr_factor,
)
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.training.draft_loss import ttt_draft_loss

V, VD = 96, 40


def _policy(seed=0, sharpen=1.0):
    torch.manual_seed(seed)
    policy = Policy(PolicyConfig.tiny(vocab_size=V, num_hidden_layers=5))
    with torch.no_grad():
        policy.lm_head.weight.mul_(sharpen)
    return policy.eval()


def _draft(policy, seed=1):
    counts = torch.arange(V, 0, -1).float()  # the VD smallest ids form the draft vocabulary
    torch.manual_seed(seed)
    return Eagle3Draft.from_policy(policy, draft_vocab_size=VD, token_counts=counts)


def _docs(n, seed=0, lo=6, hi=20):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=g))
        prompt = int(torch.randint(1, length - 1, (1,), generator=g))
        docs.append((torch.randint(0, V, (length,), generator=g).tolist(), prompt - 1))
    return docs


def _target_ids(draft):
    return draft.draft_to_target(torch.arange(VD))


def _reference_unroll(policy, draft, docs, K):
    """A fresh policy forward (full (T, V) logits, taps) on the packed ``docs`` and the draft's K-step unroll on it:
    ``(policy output, step logits, cu_seqlens, loss mask on rows loss_start .. len - 2 of each document)``."""
    ids = torch.cat([torch.tensor(d) for d, _ in docs])
    lengths = [len(d) for d, _ in docs]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    mask = torch.cat([(torch.arange(n) >= s) & (torch.arange(n) <= n - 2) for (_, s), n in zip(docs, lengths)])
    with torch.no_grad():
        out = policy(ids, cu_seqlens=cu, position_ids=pos, taps=draft.config.taps)
    embeds = []
    for k in range(K):
        shifted = torch.cat([torch.cat([torch.tensor(d[k + 1:]), torch.zeros(k + 1, dtype=torch.long)])[:len(d)]
                             for d, _ in docs])
        embeds.append(policy.embed(shifted).detach())
    steps = [lg for lg, _ in draft.ttt_forward(list(out.taps), embeds, cu, pos)]
    return out, steps, cu, mask


def _reference_loss(policy, draft, docs, K):
    """The draft loss the way co-training computes it: a fresh policy forward, full (T, V) logits, the draft's
    own vocabulary map, and a loss mask on rows loss_start .. len - 2 of each document."""
    out, steps, cu, mask = _reference_unroll(policy, draft, docs, K)
    return ttt_draft_loss(steps, out.logits, cu, mask.float(), draft.d2t, draft.t2d)


@pytest.mark.parametrize("K", [1, 3])
def test_cached_loss_equals_full_logit_loss(tmp_path, K):
    policy, docs = _policy(sharpen=4.0), _docs(7)
    draft = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "c",
                                batch_tokens=40, dtype="float32")
    ref = _reference_loss(policy, draft, docs, K)
    assert 0 < ref.total[0] < sum(n - 1 - s for (d, s), n in zip(docs, [len(d) for d, _ in docs]))  # some tops outside
    ref_grads = torch.autograd.grad(ref.loss, list(draft.parameters()))
    got = draft_batch_loss(draft, policy.embed, cache.batch(list(range(len(docs)))), K)
    grads = torch.autograd.grad(got.loss, list(draft.parameters()))
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.per_step_loss, ref.per_step_loss, rtol=1e-5, atol=1e-5)
    assert got.correct.tolist() == ref.correct.tolist() and got.total.tolist() == ref.total.tolist()
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["tv", "lk_alpha", "lk_lambda"])
def test_every_draft_loss_on_the_cache_equals_it_on_full_logits(tmp_path, loss_type):
    """DraftFitConfig.loss_type: the offline fit's loss on the cache's compact logits is the co-training loss of
    that type on full logits, values and gradients, and it is not the cross-entropy."""
    policy, docs = _policy(sharpen=4.0), _docs(7, seed=2)
    draft = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "c",
                                batch_tokens=40, dtype="float32")
    out, steps, cu, mask = _reference_unroll(policy, draft, docs, 3)
    ref = ttt_draft_loss(steps, out.logits, cu, mask.float(), draft.d2t, draft.t2d, loss_type=loss_type)
    got = draft_batch_loss(draft, policy.embed, cache.batch(list(range(len(docs)))), 3, loss_type=loss_type)
    ce = draft_batch_loss(draft, policy.embed, cache.batch(list(range(len(docs)))), 3)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.per_step_loss, ref.per_step_loss, rtol=1e-5, atol=1e-5)
    assert abs(float(got.loss.detach()) - float(ce.loss.detach())) > 1e-2
    for a, b in zip(torch.autograd.grad(got.loss, list(draft.parameters())),
                    torch.autograd.grad(ref.loss, list(draft.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="loss_type='kl' must be one of"):
        DraftFitConfig(loss_type="kl")


def test_unroll_skips_prompt_rows_without_changing_loss_or_gradients(tmp_path):
    """Long prompts: the fit unrolls only the rows a loss row can reach (from K rows before each completion), yet
    its loss, accuracies and gradients are the full unroll's (the reference unrolls every row)."""
    g = torch.Generator().manual_seed(5)
    docs = []
    for n, p in [(30, 22), (18, 3), (26, 17), (12, 10)]:
        docs.append((torch.randint(0, V, (n,), generator=g).tolist(), p - 1))
    policy = _policy(sharpen=4.0)
    draft = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "c", dtype="float32")
    batch = cache.batch(list(range(len(docs))))
    K = 3
    steps, rows = draft_unroll(draft, policy.embed, batch, K)
    assert steps[0].shape[0] == rows["loss_mask"].shape[0] == (30 - 18) + 18 + (26 - 13) + (12 - 6)
    got = draft_batch_loss(draft, policy.embed, batch, K)
    ref = _reference_loss(policy, draft, docs, K)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert got.correct.tolist() == ref.correct.tolist() and got.total.tolist() == ref.total.tolist()
    grads = torch.autograd.grad(got.loss, list(draft.parameters()))
    for a, b in zip(grads, torch.autograd.grad(ref.loss, list(draft.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_target_temperature_matches_both_distributions_at_that_temperature(tmp_path):
    policy, docs = _policy(sharpen=4.0), _docs(6, seed=3)
    draft = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "c", dtype="float32")
    batch = cache.batch(list(range(len(docs))))
    out, steps, cu, mask = _reference_unroll(policy, draft, docs, 2)
    ref = ttt_draft_loss([z / 0.8 for z in steps], out.logits / 0.8, cu, mask.float(), draft.d2t, draft.t2d)
    got = draft_batch_loss(draft, policy.embed, batch, 2, target_temperature=0.8)
    plain = draft_batch_loss(draft, policy.embed, batch, 2)
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert abs(float(got.loss.detach()) - float(plain.loss.detach())) > 1e-2  # not the T = 1 loss
    assert got.correct.tolist() == plain.correct.tolist() == ref.correct.tolist()  # top-1 does not move
    for a, b in zip(torch.autograd.grad(got.loss, list(draft.parameters())),
                    torch.autograd.grad(ref.loss, list(draft.parameters()))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="target_temperature=0.0 must be > 0"):
        DraftFitConfig(target_temperature=0.0)


def test_bf16_mixed_loss_and_gradients_track_fp32(tmp_path):
    policy, docs = _policy(sharpen=4.0), _docs(6, seed=2)
    draft = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "c")
    batch = cache.batch(list(range(6)))
    outs = [draft_batch_loss(draft, policy.embed, batch, 3, precision=p) for p in ("32-true", "bf16-mixed")]
    grads = [torch.autograd.grad(o.loss, list(draft.parameters())) for o in outs]
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=2e-2, atol=2e-2)
    assert outs[1].loss.dtype == torch.float32
    for a, b in zip(*grads):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.98
    with pytest.raises(ValueError, match="precision='fp8'"):
        DraftFitConfig(precision="fp8")
    # the feature pass under bf16 autocast: the same cache up to bf16 rounding
    c16 = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "b",
                              precision="bf16-mixed")
    b16 = c16.batch(list(range(6)))
    torch.testing.assert_close(b16["taps"], batch["taps"], rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(b16["compact_logits"], batch["compact_logits"], rtol=5e-2, atol=5e-2)


def test_cache_round_trip_and_fp16(tmp_path):
    policy, docs = _policy(), _docs(5, seed=3)
    draft = _draft(policy)
    c32 = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "a", dtype="float32")
    c16 = FeatureCache(build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "b").path)
    assert c32.num_docs == 5 and c32.meta["loss_rows"] == sum(len(d) - 1 - s for d, s in docs)
    batch = c32.batch([3, 1])
    assert batch["input_ids"].tolist() == docs[3][0] + docs[1][0]
    with torch.no_grad():
        taps = policy(torch.tensor(docs[1][0]), cu_seqlens=torch.tensor([0, len(docs[1][0])], dtype=torch.int32),
                      taps=draft.config.taps).taps
    n3 = len(docs[3][0])
    for j in range(3):
        torch.testing.assert_close(batch["taps"][j][n3:], taps[j], rtol=1e-5, atol=1e-5)
    b16 = c16.batch([3, 1])
    torch.testing.assert_close(b16["taps"], batch["taps"], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(b16["compact_logits"], batch["compact_logits"], rtol=2e-3, atol=2e-3)
    assert 0.0 < c32.meta["argmax_coverage"] < 1.0 and c32.meta["entropy"] > 0
    assert not (tmp_path / "a.tmp").exists()


def test_incomplete_cache_and_bad_docs(tmp_path):
    policy = _policy()
    draft = _draft(policy)
    (tmp_path / "x").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete feature cache"):
        FeatureCache(tmp_path / "x")
    with pytest.raises(ValueError, match="loss_start=4"):
        build_feature_cache(policy, [([1, 2, 3, 4, 5], 4)], _target_ids(draft), draft.config.taps, tmp_path / "y")


def test_fit_raises_held_out_accuracy(tmp_path):
    policy = _policy(sharpen=6.0)
    draft = _draft(policy)
    docs = _docs(160, seed=5, lo=10, hi=30)
    cache = build_feature_cache(policy, docs, _target_ids(draft), draft.config.taps, tmp_path / "c", batch_tokens=256)
    cfg = DraftFitConfig(epochs=6, batch_tokens=256, lr=3e-3, ttt_steps=2, val_docs=24, eval_every=1000,
                         precision="bf16-mixed")
    reports = []
    val = list(range(160 - 24, 160))
    acc0 = evaluate_draft(draft, policy.embed, cache, val, cfg)
    res = fit_draft(draft, policy.embed, cache, cfg, log=reports.append)
    acc1 = res.history[-1]["val_accuracy"]
    # the accuracy counts every scored row: those whose policy top-1 the draft vocabulary lacks are misses
    assert len(acc1) == 2 and acc1[0] > acc0[0] + 0.1, (acc0, acc1)
    assert res.history[-1]["val_acceptance"] == pytest.approx(implied_acceptance_length(acc1))
    # a batch's loss divides by all its scored rows, so it varies with the batch's out-of-vocabulary share: compare
    # the untrained first batch with the last epochs' mean
    assert np.mean(res.losses[-20:]) < 0.8 * res.losses[0]
    assert res.tokens_seen > 4 * cache.meta["loss_rows"] * 0.5 and reports and "held-out step-0 acc" in reports[-1]



def test_held_out_reports_unroll_eval_steps_whatever_the_trained_depth(tmp_path):
    policy = _policy(sharpen=6.0)
    draft = _draft(policy)
    cache = build_feature_cache(policy, _docs(40, seed=2), _target_ids(draft), draft.config.taps, tmp_path / "c",
                                batch_tokens=128)
    cfg = DraftFitConfig(epochs=1, batch_tokens=128, ttt_steps=2, eval_steps=3, val_docs=8, eval_every=1000)
    res = fit_draft(draft, policy.embed, cache, cfg)
    acc = res.history[-1]["val_accuracy"]
    val = cache.split(8)[1]
    deeper = evaluate_draft(draft, policy.embed, cache, val, DraftFitConfig(batch_tokens=128, ttt_steps=3))
    assert len(acc) == 3 and acc == pytest.approx(deeper)             # the report unrolls 3 steps, trained 2
    assert res.history[-1]["val_acceptance"] == pytest.approx(implied_acceptance_length(deeper))
    with pytest.raises(ValueError, match="eval_steps"):
        DraftFitConfig(eval_steps=0)


def test_time_budget_stops_and_mismatch_raises(tmp_path):
    policy = _policy()
    draft = _draft(policy)
    cache = build_feature_cache(policy, _docs(12), _target_ids(draft), draft.config.taps, tmp_path / "c",
                                batch_tokens=30)
    evals = []
    res = fit_draft(draft, policy.embed, cache, DraftFitConfig(epochs=5, batch_tokens=30, time_budget_s=1e-9,
                                                                val_docs=2), on_eval=evals.append)
    assert res.steps == 1 and len(evals) == 1 and evals[0]["step"] == 1
    assert res.ended_by == "budget" and res.planned_steps > 1
    done = fit_draft(draft, policy.embed, cache, DraftFitConfig(epochs=1, batch_tokens=30, time_budget_s=600.0,
                                                                 val_docs=2))
    assert done.ended_by == "epochs" and done.steps == done.planned_steps
    torch.manual_seed(0)
    other = Eagle3Draft.from_policy(policy, draft_vocab_size=VD + 1, token_counts=torch.rand(V))
    with pytest.raises(ValueError, match="does not match the feature cache"):
        fit_draft(other, policy.embed, cache, DraftFitConfig())


def test_schedule_and_implied_acceptance():
    cfg = DraftFitConfig(lr=1.0, warmup_frac=0.1, min_lr_ratio=0.05)
    assert lr_factor(0.0, cfg) == 0.0 and lr_factor(0.05, cfg) == pytest.approx(0.5)
    assert lr_factor(0.1, cfg) == pytest.approx(1.0) and lr_factor(1.0, cfg) == pytest.approx(0.05)
    assert lr_factor(0.55, cfg) == pytest.approx(0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert implied_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1.875)
    assert implied_acceptance_length([]) == 1.0
    with pytest.raises(ValueError, match="ttt_steps=0"):
        DraftFitConfig(ttt_steps=0)


@pytest.mark.slow
def test_compiled_fit_equals_eager_and_leaves_the_module_as_it_was(tmp_path):
    from torch._dynamo.utils import counters

    policy, docs = _policy(sharpen=4.0), _docs(40, seed=3)
    probe = _draft(policy)
    cache = build_feature_cache(policy, docs, _target_ids(probe), probe.config.taps, tmp_path / "c")
    runs = []
    for compile_ in (False, True):
        counters.clear()
        draft = _draft(policy)
        cfg = DraftFitConfig(epochs=1, batch_tokens=96, lr=3e-3, ttt_steps=2, val_docs=4, eval_every=1000,
                             compile=compile_)
        runs.append((fit_draft(draft, policy.embed, cache, cfg), draft, sum(counters["stats"].values())))
    (eager, d_eager, n_eager), (comp, d_comp, n_comp) = runs
    assert n_eager == 0 and n_comp > 0  # the compiled run did go through dynamo
    assert comp.steps == eager.steps > 3
    np.testing.assert_allclose(comp.losses, eager.losses, rtol=1e-4, atol=1e-5)
    for a, b in zip(d_eager.parameters(), d_comp.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-5)
    assert not {"qkv", "finish"} & set(vars(d_comp.midlayer)) and "forward" not in vars(d_comp.norm)
    # an override somebody else set is neither compiled over nor removed
    mine = d_comp.midlayer.finish
    d_comp.midlayer.finish = mine
    with compiled_draft(d_comp):
        assert d_comp.midlayer.finish is mine and "qkv" in vars(d_comp.midlayer)
    assert d_comp.midlayer.finish is mine and "qkv" not in vars(d_comp.midlayer)


@pytest.mark.parametrize("speedup, same_as", [(0.02, "32-true"), (4.5, "bf16-mixed")])
def test_auto_precision_is_the_resolved_one(tmp_path, monkeypatch, speedup, same_as):
    """precision="auto" runs exactly as the precision it resolves to (fp32 on a CPU that emulates bf16), in the
    feature pass and in the fit."""
    from lightning_codraft.models import precision

    monkeypatch.setattr(precision, "bf16_speedup", lambda device_type="cpu": speedup)
    policy, docs = _policy(sharpen=4.0), _docs(12, seed=2)
    probe = _draft(policy)
    caches = [build_feature_cache(policy, docs, _target_ids(probe), probe.config.taps, tmp_path / p, precision=p)
              for p in ("auto", same_as)]
    a, b = (c.batch(list(range(12))) for c in caches)
    assert all(torch.equal(x, y) for x, y in zip(a["taps"], b["taps"]))
    assert torch.equal(a["compact_logits"], b["compact_logits"])
    drafts = []
    for p in ("auto", same_as):
        drafts.append(_draft(policy))
        fit_draft(drafts[-1], policy.embed, caches[1], DraftFitConfig(epochs=1, batch_tokens=64, ttt_steps=2,
                                                                     val_docs=2, precision=p))
    for (name, x), y in zip(drafts[0].state_dict().items(), drafts[1].state_dict().values()):
        assert torch.equal(x, y), name
