"""FSDP2 and mixed precision: each rank holds its share of parameters and optimizer state, bf16-mixed keeps fp32
masters that small updates still move (bf16-true does not, and says so)."""

import pytest
import torch
from codraft_fixtures import make_batch, make_models
from distributed import run_distributed

from lightning_codraft.training.module import CoDraftModule


def _local_bytes(tensors) -> int:
    """Bytes of the local data of ``tensors``, each storage counted once (tied weights)."""
    seen, total = set(), 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def _bytes_worker(rank, world_size):
    from lightning_codraft.parallel.strategy_core import CoDraftCore

    core = CoDraftCore(dp=world_size)
    core.setup_mesh(world_size, "cpu")
    module = core.prepare_module(CoDraftModule(*make_models(layers=8), num_microbatches=1))
    optimizer, _ = module.build_optimizer()
    out = module(make_batch(rank, num_docs=2))
    out.loss.backward()
    module.after_backward()
    optimizer.step()
    state = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    layer = _local_bytes(module.policy.model.layers[0].parameters())  # this rank's shard of one layer
    return {"params": _local_bytes(module.parameters()), "optim": _local_bytes(state),
            "sharded": all(hasattr(p, "to_local") for p in module.parameters()), "layer_shard": layer}


def test_dp4_each_rank_holds_a_quarter_of_parameters_and_optimizer_state():
    policy, draft = make_models(layers=8)
    whole = sum(p.numel() * p.element_size() for p in CoDraftModule(policy, draft).parameters())
    results = run_distributed(_bytes_worker, 4, timeout=300)
    for r in results:
        assert r["sharded"]
        # FSDP2 pads every parameter's dim 0 to a multiple of 4: at most 3 rows per parameter, far below one layer
        assert abs(r["params"] - whole / 4) <= r["layer_shard"], (r["params"], whole / 4)
        assert abs(r["optim"] - 2 * whole / 4) <= 2 * r["layer_shard"], (r["optim"], 2 * whole / 4)
    assert sum(r["params"] for r in results) >= whole  # nothing is lost (padding may add a little)


def _fabric_step(precision, lr, steps=1):
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step

    fabric = Fabric(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), precision=precision)
    fabric.launch()
    module = CoDraftModule(*make_models(), policy_lr=lr, draft_lr=lr)
    model = fabric.setup_module(module)  # bf16-true converts the parameters here
    before = {n: p.detach().float().clone() for n, p in module.policy.named_parameters()}
    optimizer, scheduler = module.build_optimizer()
    optimizer = fabric.setup_optimizers(optimizer)
    for s in range(steps):
        fabric_training_step(fabric, model, make_batch(s, num_docs=2), optimizer, scheduler)
    changed = sum(int((p.detach().float() != before[n]).sum()) for n, p in module.policy.named_parameters())
    total = sum(p.numel() for p in module.policy.parameters())
    return module, optimizer, changed / total


def test_bf16_mixed_keeps_fp32_masters_that_small_updates_move_and_bf16_true_does_not():
    lr = 2e-6  # below bf16's resolution of weights ~0.02 (spacing 2^-7 * 0.02 ~ 1.6e-4)
    mixed, optimizer, moved = _fabric_step("bf16-mixed", lr)
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}
    assert {t.dtype for s in optimizer.state.values() for t in s.values() if t.dim() > 0} == {torch.float32}
    assert moved > 0.9  # fp32 masters take Adam's ~lr-sized update almost everywhere
    with pytest.warns(RuntimeWarning, match="precision='bf16-true' with learning rate 2e-06: bf16 weights of typical "
                                            "size .* move in steps of .* updates of ~2e-06 round away"):
        true_bf16, optimizer, moved_bf16 = _fabric_step("bf16-true", lr)
    assert {p.dtype for p in true_bf16.parameters()} == {torch.bfloat16}
    assert moved_bf16 < 0.05, moved_bf16  # the same updates round away in bf16


def test_bf16_mixed_computes_in_bf16():
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=CoDraftStrategy(), precision="bf16-mixed")
    fabric.launch()
    module = CoDraftModule(*make_models())
    model = fabric.setup_module(module)
    seen = []
    handle = module.policy.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model(make_batch(0))
    handle.remove()
    assert seen == [torch.bfloat16]


def _mixed_fsdp_worker(rank, world_size):
    from lightning_codraft.parallel.strategy_core import CoDraftCore

    core = CoDraftCore(dp=world_size)
    core.setup_mesh(world_size, "cpu")
    module = core.prepare_module(CoDraftModule(*make_models()), precision="bf16-mixed")
    seen = []
    module.policy.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    optimizer, _ = module.build_optimizer()
    out = module(make_batch(rank))
    out.loss.backward()
    module.after_backward()
    optimizer.step()
    return {"compute": seen[0], "masters": {p.to_local().dtype for p in module.parameters()},
            "grads": {p.grad.to_local().dtype for p in module.parameters() if p.grad is not None},
            "optim": {t.dtype for s in optimizer.state.values() for t in s.values() if t.dim() > 0}}


def test_fsdp_bf16_mixed_has_fp32_masters_grads_and_state_and_bf16_compute():
    for r in run_distributed(_mixed_fsdp_worker, 2, timeout=300):
        assert r["compute"] == torch.bfloat16
        assert r["masters"] == r["grads"] == r["optim"] == {torch.float32}


def _pp_mixed_worker(rank, world_size):
    import math

    from lightning_codraft.parallel.strategy_core import CoDraftCore

    core = CoDraftCore(dp=2, pp=2)
    core.setup_mesh(world_size, "cpu")
    module = core.prepare_module(CoDraftModule(*make_models(tied=True), num_microbatches=2), precision="bf16-mixed")
    optimizer, _ = module.build_optimizer()
    out = module(make_batch(core.dims.dp_rank, num_docs=4))
    module.after_backward()
    optimizer.step()
    return math.isfinite(float(out.metrics["loss"])), module.pipeline.activation_dtype


def test_fsdp_x_pp_bf16_mixed_ships_bf16_activations_and_taps():
    for finite, dtype in run_distributed(_pp_mixed_worker, 4, timeout=300):
        assert finite and dtype == torch.bfloat16
