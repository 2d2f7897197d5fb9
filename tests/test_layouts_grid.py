"""The objective does not depend on the layout: for every loss aggregation, with and without the KL term, the loss
and every gradient of one step equal the single-process, one-microbatch result for num_microbatches in {1, 2, one
sample per microbatch} x dp in {1, 2} and under pp = 2 (TRL and verl are invariant in the same way)."""

import pytest
import torch
from codraft_fixtures import concat_batches, make_batch, make_models
from distributed import run_distributed

from lightning_codraft.training.module import CoDraftModule

DOCS = 4  # per replica batch; M = DOCS is one sample per microbatch
CONFIGS = [(agg, kl) for agg in ("token", "sequence", "constant") for kl in (0.0, 0.1)]
LAYOUTS = [(dict(dp=2), 1), (dict(dp=2), 2), (dict(dp=2), DOCS), (dict(pp=2), 2), (dict(pp=2), 2 * DOCS)]
"""(mesh on 2 ranks, num_microbatches). Under pp = 2 one replica trains on both batches."""


def _module(agg, kl, M):
    return CoDraftModule(*make_models(draft_vocab=24), loss_aggregation=agg, kl_coef=kl, num_microbatches=M,
                         max_new_tokens=16)


def _batches():
    return [make_batch(40 + r, num_docs=DOCS) for r in range(2)]


def _grads(module):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in module.named_parameters() if p.grad is not None}


def _worker(rank, world_size, layouts, configs):
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy

    out = []
    for mesh, M in layouts:
        strategy = CoDraftStrategy(**mesh)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        dp_rank = strategy.parallel_dims.dp_rank
        batch = _batches()[dp_rank] if mesh.get("dp", 1) > 1 else concat_batches(_batches())
        for agg, kl in configs:
            model = fabric.setup_module(_module(agg, kl, M))
            res = model(batch)
            if res.loss is not None:
                fabric.backward(res.loss)
            model.after_backward()
            out.append((float(res.metrics["loss"]), {n: g.numpy() for n, g in _grads(model.module).items()}))
    return out


@pytest.fixture(scope="module")
def grid():
    refs = []
    for agg, kl in CONFIGS:
        module = _module(agg, kl, 1)
        res = module(concat_batches(_batches()))
        res.loss.backward()
        refs.append((float(res.metrics["loss"]), _grads(module)))
    return refs, run_distributed(_worker, world_size=2, args=(LAYOUTS, CONFIGS), timeout=900)


def test_every_layout_equals_one_process_one_microbatch(grid):
    refs, results = grid
    worst_loss = worst_grad = 0.0
    for rank, per_rank in enumerate(results):
        i = 0
        for mesh, M in LAYOUTS:
            for c, (agg, kl) in enumerate(CONFIGS):
                loss, grads = per_rank[i]
                i += 1
                ref_loss, ref_grads = refs[c]
                where = f"rank {rank} {mesh} M={M} {agg} kl={kl}"
                worst_loss = max(worst_loss, abs(loss - ref_loss) / abs(ref_loss))
                assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-9), where
                assert grads and set(grads) <= set(ref_grads), where
                for name, g in grads.items():
                    g = torch.from_numpy(g)
                    err = float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-12))
                    worst_grad = max(worst_grad, err)
                    assert err <= 1e-5, f"{where} {name}: relative error {err:.2e}"
    print(f"largest relative difference over the grid: loss {worst_loss:.1e}, gradient {worst_grad:.1e}")
