import pytest
import torch
from codraft_fixtures import make_batch, make_models

from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.training.module import CoDraftModule, CoDraftModuleConfig


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
    assert 1.0 <= joint.metrics["draft/acceptance_length"].item() <= 4.0


def test_draft_loss_value_is_the_draft_loss_function():
    from lightning_codraft.training.draft_loss import ttt_draft_loss

    batch = make_batch(5)
    policy, draft = make_models()
    module = CoDraftModule(policy, draft, ttt_steps=2)
    out = module(batch)
    with torch.no_grad():
        pol = policy(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], position_ids=batch["position_ids"],
                     taps=module.configure_taps())
        steps = module.draft_step_logits(pol.taps, batch)
        want = ttt_draft_loss(steps, pol.logits, batch["cu_seqlens"], batch["draft_mask"], draft.d2t, draft.t2d)
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
    module = CoDraftModule(*make_models(), policy_lr=1e-3, draft_lr=4e-3, policy_warmup_steps=4, schedule="cosine",
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


def test_microbatch_objective_is_the_mean_of_microbatch_losses():
    from lightning_codraft.parallel.strategy_core import split_microbatches

    batch = make_batch(7, num_docs=4)
    joint = CoDraftModule(*make_models(), num_microbatches=2, kl_coef=0.1)
    out, g = _grads(joint, batch)
    single = CoDraftModule(*make_models(), kl_coef=0.1)
    single.zero_grad()
    losses = [single(mb) for mb in split_microbatches(batch, 2)]
    (sum(o.loss for o in losses) / 2).backward()
    assert out.metrics["loss"].item() == pytest.approx(sum(o.metrics["loss"].item() for o in losses) / 2, rel=1e-6)
    for n, p in single.named_parameters():
        torch.testing.assert_close(g[n], p.grad, rtol=1e-6, atol=1e-9)


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
