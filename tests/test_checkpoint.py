"""Checkpoint at step n, stop the processes, resume on the same or another mesh: steps n+1.. are identical."""

import pytest
import torch
from codraft_fixtures import make_models, step_batches
from distributed import run_distributed
from test_fabric import HPARAMS, STEPS, WEIGHT_ATOL, reference_run

from lightning_codraft.parallel import checkpoint as ckpt
from lightning_codraft.training.module import CoDraftModule

SAVE_AT = 2          # steps done before the checkpoint
OVERRIDES = dict(num_microbatches=2)


def _fabric_run(rank, world_size, mesh, path, mode):
    """mode "save": train SAVE_AT steps then checkpoint; "resume": load, then train the remaining steps."""
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step

    strategy = CoDraftStrategy(**mesh)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    policy, draft = make_models(seed=1 if mode == "resume" else 0)  # resume must not depend on the init
    model = fabric.setup_module(CoDraftModule(policy, draft, **{**HPARAMS, **OVERRIDES}))
    optimizer, scheduler = model.build_optimizer()
    optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if mode == "resume":
        fabric.load(path, state)
    batches = [per_rank[0] for per_rank in step_batches(STEPS, 1)]  # dp == 1 in these meshes
    losses = []
    stop = SAVE_AT if mode == "save" else STEPS
    for step in range(state["step"], stop):
        losses.append(fabric_training_step(fabric, model, batches[step], optimizer, scheduler)["loss"])
        state["step"] = step + 1
    if mode == "save":
        fabric.save(path, state)
    weights = {k: v.detach().clone().numpy() for k, v in model.module.state_dict().items()}
    return losses, weights, state["step"]


def _check_weights(weights, ref_weights, where):
    for name, value in weights.items():
        torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(ref_weights[name]), rtol=1e-5,
                                   atol=WEIGHT_ATOL, msg=lambda m: f"{where} {name}: {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step2"
    results = run_distributed(_fabric_run, world_size=4, args=(dict(pp=2, cp=2), str(path), "save"), timeout=600)
    return path, results


@pytest.mark.slow
def test_resume_in_fresh_processes_on_another_mesh_continues_identically(saved):
    path, first = saved
    ref_losses, ref_weights = reference_run(1, **OVERRIDES)
    assert first[0][0] == pytest.approx(ref_losses[:SAVE_AT], rel=1e-5)
    # the processes that wrote the checkpoint are gone; two fresh ones (pp=1, cp=2) pick it up
    results = run_distributed(_fabric_run, world_size=2, args=(dict(cp=2), str(path), "resume"), timeout=600)
    for rank, (losses, weights, step) in enumerate(results):
        assert step == STEPS
        assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5), f"rank {rank}"
        _check_weights(weights, ref_weights, f"rank {rank}")


def test_pp2_cp2_checkpoint_loads_in_one_process(saved):
    path, _ = saved
    ref_losses, ref_weights = reference_run(1, **OVERRIDES)
    policy, draft = make_models(seed=1)
    module = CoDraftModule(policy, draft, **{**HPARAMS, **OVERRIDES})
    optimizer, scheduler = module.build_optimizer()
    state = {"model": module, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    rest = ckpt.load_checkpoint(path, state)
    assert state["step"] == SAVE_AT and rest == {}
    batches = [per_rank[0] for per_rank in step_batches(STEPS, 1)]
    losses = []
    for step in range(SAVE_AT, STEPS):
        optimizer.zero_grad()
        out = module(batches[step])
        out.loss.backward()
        module.after_backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(out.metrics["loss"]))
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
    _check_weights({k: v.detach().numpy() for k, v in module.state_dict().items()}, ref_weights, "single")


def test_checkpoint_layout_and_errors(saved, tmp_path):
    path, _ = saved
    assert sorted(p.name for p in path.iterdir()) == ["meta.pt", "stage0.pt", "stage1.pt"]
    merged = ckpt.read_checkpoint(path)
    policy, draft = make_models()
    full = CoDraftModule(policy, draft).state_dict()
    assert set(merged["modules"]["model"]) == set(full)  # the two stage files together are the whole model
    with pytest.raises(FileNotFoundError, match="not a lightning_codraft checkpoint"):
        ckpt.read_checkpoint(tmp_path)
    with pytest.raises(KeyError, match="has no entries \\['epoch'\\]"):
        ckpt.load_checkpoint(path, {"epoch": 0})
