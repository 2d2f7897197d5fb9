"""CoDraftStrategy under Fabric: every mesh (FSDP2 or DDP) trains exactly like one process on the concatenated batch:
the same losses, the same gradients (gathered to full tensors and compared directly, every step) and weights."""

from pathlib import Path

import pytest
import torch
from codraft_fixtures import concat_batches, full_state, make_models, step_batches
from distributed import run_distributed

from lightning_codraft.training.module import CoDraftModule

STEPS = 3
# Weights after 3 Adam steps (lr 1e-3, 2e-3) agree to fp32 reduction-order noise: Adam's normalisation turns a
# near-zero gradient's last-bit difference into at most ~0.5% of one step, i.e. <= 5e-6 absolute
WEIGHT_ATOL = 5e-6
# adam_eps=1e-6: Adam divides by sqrt(v) + eps, which turns the reduction-order noise of a near-zero gradient
# into a visible step with eps=1e-8; 1e-6 keeps the comparison about the gradients, not about that amplification
HPARAMS = dict(policy_lr=1e-3, draft_lr=2e-3, kl_coef=0.05, policy_lr_warmup_steps=2, schedule="cosine",
               total_steps=STEPS, adam_eps=1e-6)
GRAD_RTOL = 1e-5
"""The first step's gradients (same weights on both sides) agree to this fraction of each tensor's largest entry."""
LATER_GRAD_RTOL = 3e-5
"""Later steps start from weights that already differ by fp32 reduction-order noise (amplified by Adam, see
WEIGHT_ATOL), so their gradients get a little more room."""


def _grads(module) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone().numpy()
            for n, p in module.named_parameters() if p.grad is not None}


_REFERENCE: dict = {}


def reference_run(dp: int, steps: int = STEPS, order=None, with_grads: bool = False, tied: bool = False,
                  **overrides):
    """Cached :func:`_reference_run` (several tests compare against the same single-process run)."""
    key = (dp, steps, None if order is None else tuple(order), tied, tuple(sorted(overrides.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_run(dp, steps, order, tied, **overrides)
    losses, weights, grads = _REFERENCE[key]
    return (losses, weights, grads) if with_grads else (losses, weights)


def _reference_run(dp: int, steps: int = STEPS, order=None, tied: bool = False, **overrides):
    """One process, the dp replicas' batches concatenated per step (with num_microbatches > 1: dp == 1).

    ``order``: the sampler's permutation of the flat list of ``steps * dp`` batches (replica r reads
    ``order[r::dp]``, as DistributedSampler does); None = in order. Returns losses, final weights and the
    gradients of every step.
    """
    policy, draft = make_models(tied=tied)
    module = CoDraftModule(policy, draft, **{**HPARAMS, **overrides})
    optimizer, scheduler = module.build_optimizer()
    losses, grads = [], []
    flat = [b for per_rank in step_batches(steps, dp) for b in per_rank]
    order = list(range(len(flat))) if order is None else list(order)
    for s in range(steps):
        per_rank = [flat[order[s * dp + r]] for r in range(dp)]
        optimizer.zero_grad()
        out = module(concat_batches(per_rank))
        out.loss.backward()
        module.after_backward()
        grads.append(_grads(module))
        optimizer.step()
        scheduler.step()
        losses.append(float(out.metrics["loss"]))
    return losses, full_state(module), grads


def _fabric_worker(rank, world_size, layouts):
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from lightning_codraft.fabric import CoDraftStrategy

    results = []
    for mesh, overrides in layouts:
        mesh = dict(mesh)
        tied = mesh.pop("tied", False)
        strategy = CoDraftStrategy(**mesh)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        dp = strategy.parallel_dims.dp
        policy, draft = make_models(tied=tied)
        model = fabric.setup_module(CoDraftModule(policy, draft, **{**HPARAMS, **overrides}))
        optimizer, scheduler = model.build_optimizer()
        optimizer = fabric.setup_optimizers(optimizer)
        flat = [b for per_rank in step_batches(STEPS, dp) for b in per_rank]
        loader = fabric.setup_dataloaders(DataLoader(flat, batch_size=None, shuffle=False))
        losses, grads = [], []
        for batch in loader:  # fabric_training_step's steps, with the gradients recorded before the update
            optimizer.zero_grad(set_to_none=True)
            out = model(batch)
            if out.loss is not None:
                fabric.backward(out.loss)
            model.after_backward()
            grads.append(_grads(model.module))
            optimizer.step()
            scheduler.step()
            losses.append(float(out.metrics["loss"]))
        dims = strategy.parallel_dims
        cp_sum = (fabric.all_reduce(torch.tensor(float(rank)), group=dims.cp_group, reduce_op="sum")
                  if dims.cp_group is not None else torch.tensor(float(rank)))  # None would mean the world
        reduced = [float(cp_sum),
                   float(fabric.all_reduce(torch.tensor(float(rank))))]  # world mean
        sharded = sum(hasattr(p, "full_tensor") for p in model.module.parameters())
        results.append((losses, full_state(model.module), reduced, dims.coordinates, grads, sharded))
    return results


# (mesh, module overrides): the objective does not depend on M (M >= pp for 1F1B; tests/test_layouts_grid.py checks
# every M against one process and one microbatch); the reference process uses the layout's M too.
# FSDP2 is the default whenever dp * cp > 1; the "ddp" layouts run replicated weights. One spawn per group.
LAYOUTS = {"default": [(dict(dp=2, cp=2), {}), (dict(pp=2, cp=2), dict(num_microbatches=2)),
                       (dict(dp=2, pp=2), dict(pp_schedule="gpipe")), (dict(dp=2, cp=2, sharding="ddp"), {})],
           "slow": [(dict(dp=4), {}), (dict(pp=4), dict(num_microbatches=4)),
                    (dict(pp=2, cp=2, sharding="ddp"), dict(num_microbatches=2))],
           "slow8": [(dict(dp=2, pp=2, cp=2), dict(pp_schedule="gpipe"))],
           "tied": [(dict(dp=2, pp=2, tied=True), dict(pp_schedule="gpipe"))]}
_RESULTS: dict = {}


def _results(group):
    if group not in _RESULTS:
        world = 8 if group == "slow8" else 4
        _RESULTS[group] = run_distributed(_fabric_worker, world_size=world, args=(LAYOUTS[group],), timeout=900)
    return _RESULTS[group]


def _check_layout(group, index):
    mesh, overrides = LAYOUTS[group][index]
    dp = (8 if group == "slow8" else 4) // (mesh.get("pp", 1) * mesh.get("cp", 1))
    ref_losses, ref_weights, ref_grads = reference_run(dp, with_grads=True, tied=mesh.get("tied", False), **overrides)
    covered = set()
    fsdp = mesh.get("sharding", "fsdp") == "fsdp" and dp * mesh.get("cp", 1) > 1
    tied = mesh.get("tied", False)
    for rank, per_layout in enumerate(_results(group)):
        losses, weights, reduced, coords, grads, sharded = per_layout[index]
        assert (sharded > 0) == fsdp, (rank, sharded)
        cp = mesh.get("cp", 1)
        cp_peers = [rank - coords[2] + c for c in range(cp)]
        world_mean = (len(_results(group)) - 1) / 2
        assert reduced == [float(sum(cp_peers)) if cp > 1 else float(rank), world_mean]  # the cp group; world
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        for step, (got, want) in enumerate(zip(grads, ref_grads)):  # the gradients themselves, every step
            if tied:  # one weight: the last stage names it lm_head, the one process embed_tokens
                got = {("policy.model.embed_tokens.weight" if n == "policy.lm_head.weight" else n): g
                       for n, g in got.items()}
            assert got and set(got) <= set(want), (rank, sorted(set(got) - set(want))[:3])
            for name, g in got.items():  # relative to the tensor's largest entry (fp32 reduction-order noise)
                err = float(abs(g - want[name]).max() / max(abs(want[name]).max(), 1e-12))
                tol = GRAD_RTOL if step == 0 else LATER_GRAD_RTOL
                assert err <= tol, f"rank {rank} step {step} grad {name}: relative error {err:.2e}"
        for name, value in weights.items():  # under PP every rank holds (and is compared on) its stage's slice
            torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(ref_weights[name]), rtol=1e-5,
                                       atol=WEIGHT_ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
            covered.add(name)
    assert covered == set(ref_weights), f"no rank holds {sorted(set(ref_weights) - covered)[:3]}"


@pytest.mark.parametrize("index", range(4), ids=[str(m) for m, _ in LAYOUTS["default"]])
def test_fabric_mesh_equals_single_process(index):
    _check_layout("default", index)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3), ids=[str(m) for m, _ in LAYOUTS["slow"]])
def test_fabric_mesh_equals_single_process_slow(index):
    _check_layout("slow", index)


def test_fabric_fsdp_pp_with_tied_embeddings_equals_single_process():
    """The first stage's embed_tokens and the last stage's lm_head are one weight: their FSDP shards sum exactly."""
    _check_layout("tied", 0)


@pytest.mark.slow
def test_fabric_fsdp_dp2_pp2_cp2_equals_single_process():
    _check_layout("slow8", 0)


@pytest.mark.slow
def test_two_node_torchrun_launch_trains(tmp_path):
    """torchrun --nnodes=2 with two node ranks on localhost: pp=2 x cp=2, the pipeline spans both "nodes"."""
    import os
    import subprocess
    import sys

    from distributed import free_port

    repo = Path(__file__).resolve().parent.parent
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         str(repo / "examples" / "fabric_codraft.py"), "--devices", "2", "--num-nodes", "2", "--pp", "2", "--cp", "2",
         "--steps", "2", "--out", str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in range(2)]
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for node, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"node {node} failed:\n{out[-3000:]}"
    assert "step 1: loss" in outputs[0]
    files = sorted(f.name for f in (tmp_path / "checkpoint").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "codraft.json"]
