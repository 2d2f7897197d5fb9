import dataclasses
import math
import numpy as np
import pytest
import torch
from codraft_fixtures import VOCAB, make_batch, make_models

from lightning_codraft.attention.packing import shift_left_local
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.parallel.pipeline import Pruned
from lightning_codraft.rollout.refit.sync import full_state_dict
from lightning_codraft.training import CoDraftModule, CoDraftModuleConfig


def _grads(module, batch):
    module.zero_grad(set_to_none=True)
    out = module(batch)
    out.loss.backward()
    return out, {n: (p.grad.clone() if p.grad is not None else None) for n, p in module.named_parameters()}


def test_one_backward_keeps_the_two_losses_apart():
    batch = make_batch(3, num_docs=3)
    joint, g = _grads(CoDraftModule(*make_models(), draft_loss_weight=0.5), batch)
    rl_only, g_rl = _grads(CoDraftModule(*make_models(), freeze_draft=True), batch)
    m = CoDraftModule(*make_models(), draft_loss_weight=1.0)
    _, g_draft = _grads(m, batch)
    for name, grad in g.items():
        if name.startswith("policy."):  # the draft sees only detached policy tensors
            torch.testing.assert_close(grad, g_rl[name], rtol=1e-6, atol=1e-9)
    # lambda scales the draft gradient and nothing else (the policy part is identical: subtract it out)
    draft_names = [n for n in g if n.startswith("draft.")]
    assert draft_names and all(g_rl[n] is None for n in draft_names)
    for n in draft_names:
        torch.testing.assert_close(g[n], 0.5 * g_draft[n], rtol=1e-5, atol=1e-9)
    assert joint.metrics["loss"].item() == pytest.approx(
        rl_only.metrics["loss"].item() + 0.5 * joint.metrics["draft/loss"].item(), rel=1e-6)
    assert 1.0 <= joint.metrics["draft/top1_acceptance"].item() <= 4.0


def test_draft_loss_value_is_the_draft_loss_function():
    from lightning_codraft.training.draft_loss import ttt_draft_loss

    batch = make_batch(5)
    policy, draft = make_models()
    module = CoDraftModule(policy, draft, ttt_steps=2)
    out = module(batch)
    with torch.no_grad():
        pol = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids,
                     taps=module.configure_taps())
        # the token inputs by their definition: embeddings of the ids shifted left by k + 1 inside documents
        embeds = [policy.embed(shift_left_local(batch.input_ids, batch.cu_seqlens, k + 1)) for k in range(2)]
        steps = module.draft_step_logits(pol.taps, embeds, batch)
        want = ttt_draft_loss(steps, pol.logits, batch.cu_seqlens, batch.draft_mask, draft.d2t, draft.t2d)
    assert out.metrics["draft/loss"].item() == pytest.approx(want.loss.item(), rel=1e-6)
    assert out.metrics["draft/acc_step1"].item() == pytest.approx(want.accuracy[1].item())


@pytest.mark.parametrize("kwargs", [dict(draft_loss_weight=0.0), dict(freeze_draft=True)])
def test_baselines_do_not_train_the_draft_but_still_score_it(kwargs):
    module = CoDraftModule(*make_models(), **kwargs)
    assert not any(p.requires_grad for p in module.draft.parameters())
    optimizer, _ = module.build_optimizer()
    assert [g["name"] for g in optimizer.param_groups] == ["policy"]
    out = module(make_batch(1))
    assert "draft/acc_step0" in out.metrics and "grad_norm/draft" not in module.after_backward()
    silent = CoDraftModule(*make_models(), score_draft=False, **kwargs)
    assert not any(k.startswith("draft/") for k in silent(make_batch(1)).metrics)


def test_two_parameter_groups_with_their_own_schedules():
    module = CoDraftModule(*make_models(), policy_lr=1e-3, draft_lr=4e-3, policy_lr_warmup_steps=4, schedule="cosine",
                           total_steps=8)
    optimizer, scheduler = module.build_optimizer()
    names = [g["name"] for g in optimizer.param_groups]
    assert names == ["policy", "draft"]
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == {id(p) for p in module.draft.parameters()}
    lrs = []
    for _ in range(8):
        lrs.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx([0.25e-3, 4e-3])       # policy warming up, draft at its peak
    assert lrs[3] == pytest.approx([1e-3, 4e-3 * 0.5 * (1 + torch.cos(torch.tensor(3 / 8 * torch.pi)).item())])
    assert lrs[7][0] == pytest.approx(1e-3 * 0.5 * (1 + torch.cos(torch.tensor(3 / 4 * torch.pi)).item()))


def test_rl_loss_is_an_override_point():
    class NoRL(CoDraftModule):
        def rl_loss(self, logprobs, batch):
            loss = (logprobs * 0).sum()
            return loss, {"loss": loss.detach()}

    _, g = _grads(NoRL(*make_models()), make_batch(2))
    assert all(g[n] is None or torch.count_nonzero(g[n]) == 0 for n in g if n.startswith("policy."))
    assert any(torch.count_nonzero(g[n]) > 0 for n in g if n.startswith("draft."))


def test_clear_errors():
    policy, draft = make_models()
    with pytest.raises(ValueError, match="draft_loss_weight \\(lambda\\)=-0.1 must be >= 0"):
        CoDraftModule(policy, draft, draft_loss_weight=-0.1)
    with pytest.raises(ValueError, match="draft_loss_weight \\(lambda\\)=-1"):
        CoDraftModuleConfig(draft_loss_weight=-1)
    other = Policy(PolicyConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                     num_key_value_heads=2))
    with pytest.raises(ValueError, match="mismatched vocabularies: the policy has vocab_size=48 but the draft was "
                                         "built for vocab_size=64"):
        CoDraftModule(policy, Eagle3Draft.from_policy(other))
    with pytest.raises(TypeError, match="needs a policy and a draft nn.Module, got policy=Policy, draft=NoneType"):
        CoDraftModule(policy, None)
    with pytest.raises(ValueError, match="cannot split a batch of 2 documents into num_microbatches=3"):
        CoDraftModule(policy, draft, num_microbatches=3)(make_batch(0, num_docs=2))


# ----- pipeline parallelism: each rank keeps only its stage in memory
def _pp_models(tied: bool):
    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))
    return policy, Eagle3Draft.from_policy(policy)


def _param_bytes(module):
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _pp_memory_worker(rank, world_size, batch):
    import gc
    import weakref

    from lightning_codraft.parallel.strategy_core import CoDraftCore

    out = {}
    for tied in (False, True):
        core = CoDraftCore(pp=2)
        core.setup_mesh(world_size, "cpu")
        module = CoDraftModule(*_pp_models(tied), num_microbatches=2)
        before = [weakref.ref(p) for p in module.parameters()]
        module = core.prepare_module(module)
        gc.collect()
        policy_sd, draft_sd = module.full_state_dicts()  # gathered onto stage 0 for a rollout engine
        gathered = None if policy_sd is None else (
            {k: v.numpy().copy() for k, v in policy_sd.items()}, {k: v.numpy().copy() for k, v in draft_sd.items()})
        with pytest.raises(RuntimeError, match="holds only its pipeline stage"):
            full_state_dict(module.policy)
        alive = [r() for r in before if r() is not None]  # released tensors must really be freed
        alive_bytes = sum(p.numel() * p.element_size() for p in alive)
        del alive
        step = module(batch)
        module.after_backward()
        sizes = dict(stage_bytes=_param_bytes(module.policy), draft_bytes=_param_bytes(module.draft),
                     released=module.released_bytes, alive_bytes=alive_bytes)
        module.cpu()  # what Lightning does at teardown: a pruned module moves like any other
        module.to(torch.float64)
        out[tied] = dict(
            **sizes,
            loss=float(step.metrics["loss"]), owned=sorted(module.state_dict()),
            grads={n: p.grad.to(torch.float32).numpy().copy() for n, p in module.named_parameters(remove_duplicate=False)
                   if p.grad is not None},
            dtypes={str(p.dtype) for p in module.parameters()},
            pruned=sorted(n for n, m in module.named_modules() if isinstance(m, Pruned)),
            gathered=gathered)
        with pytest.raises(ValueError, match="holds only pipeline stage"):
            from lightning_codraft.parallel.parallel_dims import ParallelDims

            module.configure_parallel(ParallelDims())
    return out


def test_pipeline_ranks_hold_only_their_stage_and_train_like_one_process():
    from distributed import run_distributed

    batch = make_batch(7, num_docs=4)
    results = run_distributed(_pp_memory_worker, world_size=2, args=(batch,), timeout=300)
    for tied in (False, True):
        policy, draft = _pp_models(tied)
        full = _param_bytes(policy)
        ref = CoDraftModule(policy, draft, num_microbatches=2)
        ref_loss, ref_grads = _grads(ref, batch)
        first, last = results[0][tied], results[1][tied]
        emb = policy.model.embed_tokens.weight
        layer = sum(p.numel() * p.element_size() for p in policy.model.layers[0].parameters())
        head = _param_bytes(policy.lm_head) + _param_bytes(policy.model.norm)
        # stage 0: embeddings + layers 0-1; stage 1: layers 2-3 + norm + lm_head (the tied weight on both)
        assert first["stage_bytes"] == emb.numel() * emb.element_size() + 2 * layer
        assert last["stage_bytes"] == 2 * layer + head
        assert first["draft_bytes"] == 0 and last["draft_bytes"] == _param_bytes(draft)
        for r in (first, last):
            assert r["stage_bytes"] < 0.7 * full, (tied, r["stage_bytes"], full)
            assert r["alive_bytes"] == r["stage_bytes"] + r["draft_bytes"]  # nothing else keeps the old tensors
            assert r["released"] == full + _param_bytes(draft) - r["stage_bytes"] - r["draft_bytes"]
            assert r["dtypes"] == {"torch.float64"}
            assert r["loss"] == pytest.approx(ref_loss.metrics["loss"].item(), rel=1e-5)
        # with tied embeddings too, the first stage holds embed_tokens and the last lm_head (one weight, two stages)
        assert first["pruned"] == ["draft", "policy.lm_head", "policy.model.layers.2", "policy.model.layers.3",
                                   "policy.model.norm"]
        assert last["pruned"] == ["policy.model.embed_tokens", "policy.model.layers.0", "policy.model.layers.1"]
        assert last["gathered"] is None  # only the first stage receives the full state
        ref_policy, ref_draft = _pp_models(tied)  # the initial weights the ranks started from
        for got, want in zip(first["gathered"], (ref_policy.state_dict(), ref_draft.state_dict())):
            assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value.numpy(), err_msg=name)
        owned = set(first["owned"]) | set(last["owned"])
        assert owned == set(ref.state_dict()), sorted(owned ^ set(ref.state_dict()))[:4]
        for r in (first, last):
            for name, grad in r["grads"].items():
                if tied and name == "policy.lm_head.weight":  # the tied weight: one gradient, first and last stage
                    name = "policy.model.embed_tokens.weight"
                want = ref_grads[name]
                torch.testing.assert_close(torch.from_numpy(grad), want, rtol=1e-5, atol=1e-7, msg=lambda m: f"{tied} {name}: {m}")
        assert set(first["grads"]) | set(last["grads"]) >= {n for n, g in ref_grads.items() if g is not None}


# ----- override points apply under PP too: one objective for every schedule
class SquaredAdvantageRL(CoDraftModule):
    """A research subclass: its own RL loss (a REINFORCE-style term weighted by squared advantages)."""

    def rl_loss(self, logprobs, batch):
        base, stats = super().rl_loss(logprobs, batch)
        extra = -(logprobs * batch.advantages.pow(2) * batch.loss_mask).sum() / batch.loss_mask.sum().clamp(min=1)
        stats = {**stats, "extra": extra.detach()}
        return base + 0.5 * extra, stats


def _subclass_pp_worker(rank, world_size, batch):
    from lightning_codraft.parallel.strategy_core import CoDraftCore

    core = CoDraftCore(pp=2)
    core.setup_mesh(world_size, "cpu")
    module = core.prepare_module(SquaredAdvantageRL(*_pp_models(False), num_microbatches=2, pp_schedule="1f1b"))
    out = module(batch)
    module.after_backward()
    return {"metrics": {k: float(v) for k, v in out.metrics.items()},
            "grads": {n: p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}}


def test_a_subclass_rl_loss_gives_the_same_step_at_pp1_and_pp2():
    from distributed import run_distributed

    batch = make_batch(11, num_docs=4)
    single = SquaredAdvantageRL(*_pp_models(False), num_microbatches=2)
    out, ref_grads = _grads(single, batch)
    _, plain_grads = _grads(CoDraftModule(*_pp_models(False), num_microbatches=2), batch)
    name = "policy.model.layers.0.mlp.up_proj.weight"
    assert not torch.allclose(ref_grads[name], plain_grads[name], rtol=1e-3)  # the override bites
    results = run_distributed(_subclass_pp_worker, world_size=2, args=(batch,), timeout=300)
    for r in results:  # every stage reports the same metrics, the subclass's "extra" stat included
        assert r["metrics"]["policy/extra"] == pytest.approx(out.metrics["policy/extra"].item(), rel=1e-5)
        assert r["metrics"]["loss"] == pytest.approx(out.metrics["loss"].item(), rel=1e-5)
    grads = {**results[0]["grads"], **results[1]["grads"]}
    assert set(grads) == {n for n, g in ref_grads.items() if g is not None}
    for name, grad in grads.items():
        torch.testing.assert_close(torch.from_numpy(grad), ref_grads[name], rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name}: {m}")


def test_drift_metrics_are_zero_for_an_unchanged_policy_and_grow_after_a_step():
    """``track_drift``: the k3 KL of the policy from the reference (the start policy) on the batch's completions,
    and the share of completion rows whose greedy next tokens agree."""
    import copy

    policy, draft = make_models()
    module = CoDraftModule(policy, draft, reference=copy.deepcopy(policy), track_drift=True, num_microbatches=2,
                           policy_lr=3e-2, loss_aggregation="token")   # the KL logged as the step's token mean
    optimizer, _ = module.build_optimizer()
    batch = make_batch(5, num_docs=4)
    out = module(batch)
    assert out.metrics["policy/kl"].item() == 0.0 and out.metrics["drift/greedy_agreement"].item() == 1.0
    for _ in range(3):  # the policy moves away from the reference
        module.zero_grad(set_to_none=True)
        module(batch).loss.backward()
        optimizer.step()
    with torch.no_grad():
        moved = module(batch)
    kl, agree = moved.metrics["policy/kl"].item(), moved.metrics["drift/greedy_agreement"].item()
    assert kl > 1e-4 and 0.0 <= agree < 1.0
    # the KL is the k3 estimate over the completion tokens: recompute it from the two policies' log-probs
    from lightning_codraft.training.rl_loss import token_logprobs

    num = den = 0.0
    with torch.no_grad():
        for mb in batch.split(2):
            logits = [m(mb.input_ids, cu_seqlens=mb.cu_seqlens, position_ids=mb.position_ids).logits
                      for m in (module.policy, module.reference)]
            lp, ref = (token_logprobs(lg, mb.target_ids) for lg in logits)
            d = ref - lp
            k3 = (d.exp() - d - 1) * mb.loss_mask
            num, den = num + k3.sum().item(), den + mb.loss_mask.sum().item()
    assert kl == pytest.approx(num / den, rel=1e-4)  # the step's token mean, whatever the microbatching
    # without a reference the metric is refused, not silently zero
    with pytest.raises(ValueError, match="track_drift=True needs batch.ref_logprobs or a reference policy"):
        CoDraftModule(*make_models(), track_drift=True)(batch)


def test_an_off_step_leaves_the_draft_and_its_adam_moments_untouched():
    """``train_draft_this_step = False`` (draft.train_every > 1): the policy updates, the draft does not move and
    AdamW's draft moments do not advance, then the next on-step trains it as usual."""
    from lightning_codraft.training.step import optimizer_step

    module = CoDraftModule(*make_models(), draft_lr=1e-2, policy_lr=1e-2)
    optimizer, scheduler = module.build_optimizer()
    batch = make_batch(5, num_docs=4)

    def snapshot(m):
        return {n: p.detach().clone() for n, p in m.named_parameters()}

    optimizer_step(module, module, batch, optimizer, scheduler)  # an on-step: the draft has Adam state now
    draft_state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in module.draft.parameters()}
    before_policy, before_draft = snapshot(module.policy), snapshot(module.draft)
    module.train_draft_this_step = False
    metrics = optimizer_step(module, module, batch, optimizer, scheduler)
    assert "grad_norm/draft" not in metrics and math.isfinite(metrics["draft/loss"].item())  # scored, not trained
    assert any(not torch.equal(p, before_policy[n]) for n, p in module.policy.named_parameters())
    for n, p in module.draft.named_parameters():
        assert torch.equal(p, before_draft[n]), n
        for k, v in optimizer.state[p].items():
            assert torch.equal(v, draft_state[id(p)][k]), (n, k)
    module.train_draft_this_step = True
    optimizer_step(module, module, batch, optimizer, scheduler)
    assert any(not torch.equal(p, before_draft[n]) for n, p in module.draft.named_parameters())


def test_the_rl_loss_scores_tokens_at_the_rollouts_temperature():
    """Rollouts sampled at T record log softmax(logits / T): the first, on-policy step must see ratio 1 exactly
    (no clipping) with ``temperature=T``, and does not without it (the old untempered scoring)."""
    policy, draft = make_models()
    batch = make_batch(0, num_docs=2)
    with torch.no_grad():
        logits = policy(batch.input_ids, cu_seqlens=batch.cu_seqlens, position_ids=batch.position_ids).logits
        tempered = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, batch.target_ids[:, None])[:, 0]
    batch = dataclasses.replace(batch, old_logprobs=tempered * batch.loss_mask)
    on_policy = CoDraftModule(policy, draft, temperature=0.7, clip_eps=0.05)(batch).metrics
    assert on_policy["policy/ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert on_policy["policy/clip_frac"].item() == 0
    untempered = CoDraftModule(policy, draft, clip_eps=0.05)(batch).metrics
    assert abs(untempered["policy/ratio"].item() - 1.0) > 1e-3 and untempered["policy/clip_frac"].item() > 0
    with pytest.raises(ValueError, match="temperature=-1 must be >= 0"):
        CoDraftModuleConfig(temperature=-1)


def test_a_skipped_draft_runs_nothing_and_stays_bit_identical_with_its_optimizer_state():
    """``run_draft_this_step = False`` (the adaptive schedule's off step): no draft forward at all, the policy
    updates, the draft's weights and AdamW state stay bit-identical; the reference draft is still scored."""
    from lightning_codraft.training.step import optimizer_step

    module = CoDraftModule(*make_models(), draft_lr=1e-2, policy_lr=1e-2)
    module.set_reference_draft(module.draft)
    optimizer, scheduler = module.build_optimizer()
    batch = make_batch(5, num_docs=4)
    optimizer_step(module, module, batch, optimizer, scheduler)  # an on-step: the draft has Adam state now
    draft_state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in module.draft.parameters()}
    before = {n: p.detach().clone() for n, p in module.draft.named_parameters()}
    calls = []
    hook = module.draft.register_forward_pre_hook(lambda *a: calls.append(1))
    module.run_draft_this_step = module.train_draft_this_step = False
    metrics = optimizer_step(module, module, batch, optimizer, scheduler)
    hook.remove()
    assert calls == [] and "draft/loss" not in metrics and "draft/implied_acceptance" not in metrics
    assert math.isfinite(metrics["draft/reference_acceptance"].item())
    for n, p in module.draft.named_parameters():
        assert torch.equal(p, before[n]), n
        for k, v in optimizer.state[p].items():
            assert torch.equal(v, draft_state[id(p)][k]), (n, k)


def test_the_reference_draft_is_the_draft_as_it_was_and_outside_the_module_tree():
    """The A/B's reference equals the live draft's implied acceptance before any update, differs after the draft
    trains, and adds nothing to the state dict or the optimizer."""
    from lightning_codraft.training.step import optimizer_step

    module = CoDraftModule(*make_models(), draft_lr=3e-2, policy_lr=1e-3)
    keys = set(module.state_dict())
    module.set_reference_draft(module.draft)
    assert set(module.state_dict()) == keys
    optimizer, scheduler = module.build_optimizer()
    assert sum(p.numel() for g in optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in module.parameters() if p.requires_grad)
    batch = make_batch(5, num_docs=4)
    first = optimizer_step(module, module, batch, optimizer, scheduler)
    assert first["draft/implied_acceptance"].item() == first["draft/reference_acceptance"].item()
    for _ in range(3):
        later = optimizer_step(module, module, batch, optimizer, scheduler)
    assert later["draft/implied_acceptance"].item() != later["draft/reference_acceptance"].item()
    assert later["draft/reference_acceptance"].item() == pytest.approx(first["draft/reference_acceptance"].item(),
                                                                       abs=0.5)  # the reference did not train


def test_sample_every_trains_the_draft_on_every_nth_sample_only():
    """``sample_every=2``: the draft's gradient depends on samples 0, 2, ... only (changing the others moves the
    policy's gradient, never the draft's); with 1 it sees them all."""
    def grads(batch, every):
        module = CoDraftModule(*make_models(), sample_every=every)
        module.set_reference_draft(module.draft)
        out = module(batch)
        out.loss.backward()
        assert math.isfinite(out.metrics["draft/implied_acceptance"].item())
        return ({n: p.grad.clone() for n, p in module.draft.named_parameters()},
                {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None})

    batch = make_batch(5, num_docs=4)
    other = batch.input_ids.clone()
    cu = batch.cu_seqlens.long()
    for d in (1, 3):  # new tokens in samples 1 and 3 (their targets follow)
        other[int(cu[d]):int(cu[d + 1])] = (other[int(cu[d]):int(cu[d + 1])] + 1) % VOCAB
    changed = dataclasses.replace(batch, input_ids=other)
    d1, p1 = grads(batch, 2)
    d2, p2 = grads(changed, 2)
    assert all(torch.equal(d1[n], d2[n]) for n in d1)
    assert any(not torch.equal(p1[n], p2[n]) for n in p1)
    d3, _ = grads(changed, 1)
    assert any(not torch.equal(d2[n], d3[n]) for n in d2)


def test_acceptance_position_weights_follow_the_live_rates_and_never_go_nan():
    module = CoDraftModule(*make_models(), position_weights="acceptance", ttt_steps=3)
    assert torch.allclose(module.draft_step_weights(), torch.tensor([1.0, 0.8, 0.64]))  # decay until measured
    module.set_live_position_rates([0.5, float("nan"), 0.9])  # position 1 never reached on that step
    assert torch.equal(module.draft_step_weights(), torch.tensor([1.0, 0.5, 0.0]))
    module.set_live_position_rates([])  # nothing measured (a skipped step): unchanged
    assert torch.equal(module.draft_step_weights(), torch.tensor([1.0, 0.5, 0.0]))
