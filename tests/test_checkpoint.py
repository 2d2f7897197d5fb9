"""Distributed checkpoints: written on FSDP2 dp=2 x cp=2 after 2 steps, resumed in fresh processes on the same mesh
and on other meshes (one process, pp=2, cp=2 with DDP), every continuation equal to the uninterrupted run; and a
checkpoint crafted to run code on load does not run it."""

import os
import pickle
import uuid

import pytest
import torch
from codraft_fixtures import concat_batches, full_state, make_models, step_batches
from distributed import run_distributed
from test_fabric import HPARAMS, STEPS, WEIGHT_ATOL, reference_run

from lightning_codraft.parallel import checkpoint as ckpt
from lightning_codraft.training.module import CoDraftModule

SAVE_AT = 2          # steps done before the checkpoint
DP = 2               # the writer's data-parallel size: every other mesh trains on the two replicas' batches joined


def _batches(mesh):
    """What this mesh's replicas read per step: the writer's two replica batches, or both joined (dp == 1)."""
    per_step = step_batches(STEPS, DP)
    return per_step if mesh.get("dp", 1) == DP else [[concat_batches(b)] for b in per_step]


def _fabric_run(rank, world_size, mesh, path, mode):
    """mode "save": train SAVE_AT steps then checkpoint; "resume": load, then train the remaining steps."""
    from lightning.fabric import Fabric

    from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step

    strategy = CoDraftStrategy(**mesh)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    policy, draft = make_models(seed=1 if mode == "resume" else 0)  # resume must not depend on the init
    overrides = dict(pp_schedule="gpipe") if mesh.get("pp", 1) > 1 else {}
    model = fabric.setup_module(CoDraftModule(policy, draft, **{**HPARAMS, **overrides}))
    optimizer, scheduler = model.build_optimizer()
    optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if mode == "resume":
        fabric.load(path, state)
    dp_rank = strategy.parallel_dims.dp_rank
    batches = [per_replica[dp_rank] for per_replica in _batches(mesh)]
    losses = []
    stop = SAVE_AT if mode == "save" else STEPS
    for step in range(state["step"], stop):
        losses.append(fabric_training_step(fabric, model, batches[step], optimizer, scheduler)["loss"])
        state["step"] = step + 1
    if mode == "save":
        fabric.save(path, state)
    return losses, full_state(model.module), state["step"]


def _check_weights(weights, ref_weights, where):
    for name, value in weights.items():
        torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(ref_weights[name]), rtol=1e-5,
                                   atol=WEIGHT_ATOL, msg=lambda m: f"{where} {name}: {m}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "step2"
    results = run_distributed(_fabric_run, world_size=4, args=(dict(dp=DP, cp=2), str(path), "save"), timeout=600)
    return path, results


def test_fsdp_checkpoint_is_dcp_and_loads_in_one_process(saved):
    path, first = saved
    ref_losses, ref_weights = reference_run(DP)
    assert first[0][0] == pytest.approx(ref_losses[:SAVE_AT], rel=1e-5)
    names = sorted(p.name for p in path.iterdir())
    assert ".metadata" in names and "codraft.json" in names
    assert sorted(n for n in names if n.endswith(".distcp")) == [f"__{r}_0.distcp" for r in range(4)]  # every rank
    policy, draft = make_models(seed=1)
    module = CoDraftModule(policy, draft, **HPARAMS)
    optimizer, scheduler = module.build_optimizer()
    state = {"model": module, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    assert ckpt.load_checkpoint(path, state) == {} and state["step"] == SAVE_AT
    losses = []
    for step in range(SAVE_AT, STEPS):
        optimizer.zero_grad()
        out = module(_batches({})[step][0])
        out.loss.backward()
        module.after_backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(out.metrics["loss"]))
    assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5)
    _check_weights(full_state(module), ref_weights, "one process")


@pytest.mark.parametrize("world_size, mesh", [(4, dict(dp=DP, cp=2)), (2, dict(pp=2)),
                                              pytest.param(2, dict(cp=2, sharding="ddp"), marks=pytest.mark.slow)])
def test_resume_in_fresh_processes_continues_identically(saved, world_size, mesh):
    """The writer's processes are gone (as after a kill); fresh ones on the same or another mesh pick it up."""
    path, _ = saved
    ref_losses, ref_weights = reference_run(DP)
    results = run_distributed(_fabric_run, world_size=world_size, args=(mesh, str(path), "resume"), timeout=600)
    for rank, (losses, weights, step) in enumerate(results):
        assert step == STEPS
        assert losses == pytest.approx(ref_losses[SAVE_AT:], rel=1e-5), f"rank {rank}"
        _check_weights(weights, ref_weights, f"rank {rank}")


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_tries_to_run_code_does_not_run_it(saved, tmp_path):
    import shutil

    path, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    marker = tmp_path / f"pwned-{uuid.uuid4().hex}"
    (bad / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    module = CoDraftModule(*make_models(), **HPARAMS)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load checkpoint metadata: it references "
                                                   "(posix|os).system"):
        ckpt.load_checkpoint(bad, {"model": module})
    assert not marker.exists()
    with pytest.raises(ckpt.CheckpointError, match="not a lightning_codraft checkpoint directory"):
        ckpt.load_checkpoint(tmp_path, {"model": module})
    with pytest.raises(ckpt.CheckpointError, match="has no entries \\['epoch'\\]"):
        ckpt.load_checkpoint(path, {"epoch": 0})


def test_a_fresh_optimizer_is_saved_and_restored_fresh(tmp_path):
    """DCP initialises an optimizer without state by a zero-gradient step (AdamW's step count becomes 1, so the first
    real update would shrink ~0.74x); a checkpoint taken before the first step must leave the training unchanged."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)

    def first_update(m, opt):
        before = m.weight.detach().clone()
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return m.weight.detach() - before

    ref_model = torch.nn.Linear(4, 3)
    ref_model.load_state_dict(model.state_dict())
    ref = first_update(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2))

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.save_checkpoint(tmp_path / "fresh", {"model": model, "optimizer": opt})
    assert not opt.state  # saving did not step it
    # a loaded fresh checkpoint also clears an optimizer that has stepped since
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    first_update(other, other_opt)
    assert other_opt.state
    ckpt.load_checkpoint(tmp_path / "fresh", {"model": other, "optimizer": other_opt})
    assert not other_opt.state
    for m, o in ((model, opt), (other, other_opt)):
        torch.testing.assert_close(first_update(m, o), ref, rtol=1e-6, atol=0)


def test_optimizer_state_loads_although_the_parameters_hold_gradients(tmp_path):
    """A load into a fresh optimizer whose parameters already hold gradients (a Trainer's setup leaves some) must
    restore the moments: torch only creates the state tensors it loads into when no gradient is present, and the
    load once restored nothing, silently (the resumed run then differed from the uninterrupted one)."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build()
    for _ in range(2):
        model(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    ckpt.save_checkpoint(tmp_path / "c", {"model": model, "optimizer": opt})
    fresh, fresh_opt = build()
    for p in fresh.parameters():
        p.grad = torch.ones_like(p)
    ckpt.load_checkpoint(tmp_path / "c", {"model": fresh, "optimizer": fresh_opt})
    want, got = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert len(got) == len(want) == 4
    for i in want:
        assert all(torch.equal(want[i][k], got[i][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in fresh.parameters())  # put back
