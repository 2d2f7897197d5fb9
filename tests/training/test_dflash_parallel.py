"""The block drafters co-trained under every parallel layout equal one process: the joint loss, the block term's
per-position losses, its implied acceptance and EVERY gradient (policy and drafter, FSDP2 shards gathered) of one
step, on packed zigzag CP 2 and 4 (the context on the ring), dp = 2 with FSDP2, and PP = 2 (taps through the
TapChannel, the mask embedding sent by the first stage). DFlash, and DSpark (the Markov bias's tokens shifted across
CP ranks, its three terms and probabilistic acceptance, the Markov and confidence heads' gradients)."""

import pytest
import torch
from codraft_fixtures import concat_batches, make_batch, make_dflash_models, make_dspark_models
from distributed import run_distributed

from lightning_codraft.training.module import CoDraftModule

#: (drafter, mesh on 4 ranks, module overrides)
LAYOUTS = [
    ("dflash", dict(cp=4), {}),
    ("dflash", dict(dp=2, cp=2), {}),
    ("dflash", dict(pp=2, cp=2), dict(num_microbatches=2)),
    ("dflash", dict(dp=2, pp=2), dict(num_microbatches=2)),
    ("dspark", dict(cp=4), {}),
    ("dspark", dict(dp=2, cp=2), {}),
    ("dspark", dict(pp=2, cp=2), dict(num_microbatches=2)),
    ("dspark", dict(dp=2, pp=2), dict(num_microbatches=2)),
]
KEYS = ("loss", "draft/loss", "draft/loss_step0", "draft/loss_step2", "draft/implied_acceptance", "draft/acc_step1",
        "draft/prob_acceptance", "draft/predicted_acceptance", "draft/confidence_loss", "draft/l1",
        "draft/confidence_error")
MODELS = {"dflash": make_dflash_models, "dspark": make_dspark_models}


def _module(drafter="dflash", **overrides):
    policy, drafter = MODELS[drafter](block_size=4)
    return CoDraftModule(policy, drafter, block_anchors=5, kl_coef=0.05, temperature=0.7, **overrides)


def _batches():  # documents padded to a multiple of 2 * cp = 8
    return [make_batch(60 + r, num_docs=3, multiple_of=8, max_len=22) for r in range(2)]


def _grads(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in module.named_parameters() if p.grad is not None}


def _worker(rank, world_size, layouts):
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy

    out = []
    for kind, mesh, overrides in layouts:
        strategy = CoDraftStrategy(**mesh)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        dims = strategy.parallel_dims
        batch = _batches()[dims.dp_rank] if dims.dp > 1 else concat_batches(_batches())
        model = fabric.setup_module(_module(kind, **overrides))
        res = model(batch)
        if res.loss is not None:
            fabric.backward(res.loss)
        model.after_backward()
        out.append(({k: float(res.metrics[k]) for k in KEYS if k in res.metrics},
                    {n: g.numpy() for n, g in _grads(model.module).items()}))
    return out


@pytest.fixture(scope="module")
def runs():
    refs = {}
    for kind, _, overrides in LAYOUTS:
        key = (kind, *sorted(overrides.items()))
        if key not in refs:
            module = _module(kind, **overrides)
            res = module(concat_batches(_batches()))
            res.loss.backward()
            refs[key] = ({k: float(res.metrics[k]) for k in KEYS if k in res.metrics}, _grads(module))
    return refs, run_distributed(_worker, world_size=4, args=(LAYOUTS,), timeout=900)


@pytest.mark.parametrize("index", range(len(LAYOUTS)), ids=[f"{k}-{m}" for k, m, _ in LAYOUTS])
def test_block_drafter_layout_equals_one_process(runs, index):
    refs, results = runs
    kind, mesh, overrides = LAYOUTS[index]
    ref_metrics, ref_grads = refs[(kind, *sorted(overrides.items()))]
    assert ref_metrics["draft/implied_acceptance"] > 1.0
    if kind == "dspark":
        assert {"draft/prob_acceptance", "draft/predicted_acceptance", "draft/confidence_loss"} <= set(ref_metrics)
        assert any("markov_head" in n for n in ref_grads) and any("confidence_head" in n for n in ref_grads)
    seen_draft = set()
    for rank, per_rank in enumerate(results):
        metrics, grads = per_rank[index]
        assert set(metrics) == set(ref_metrics), (rank, mesh)
        for k, v in metrics.items():
            assert v == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-7), (rank, mesh, k)
        assert grads, (rank, mesh)
        for name, g in grads.items():
            ref = ref_grads[name]
            torch.testing.assert_close(torch.from_numpy(g), ref, rtol=0, atol=1e-5 * float(ref.abs().max()) + 1e-9,
                                       msg=lambda m: f"rank {rank} {mesh} {name}: {m}")
            seen_draft |= {name} if name.startswith("draft.") else set()
    assert seen_draft == {n for n in ref_grads if n.startswith("draft.")}, mesh
