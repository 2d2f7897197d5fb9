"""CoDraftStrategy under Fabric: every mesh trains exactly like one process on the concatenated batch."""

from pathlib import Path

import pytest
import torch
from codraft_fixtures import concat_batches, make_models, step_batches
from distributed import run_distributed

from lightning_codraft.training.module import CoDraftModule

STEPS = 3
# Weights after 3 Adam steps (lr 1e-3, 2e-3) agree to fp32 reduction-order noise: Adam's normalisation turns a
# near-zero gradient's last-bit difference into at most ~0.5% of one step, i.e. <= 5e-6 absolute
WEIGHT_ATOL = 5e-6
# adam_eps=1e-6: Adam divides by sqrt(v) + eps, which turns the reduction-order noise of a near-zero gradient
# into a visible step with eps=1e-8; 1e-6 keeps the comparison about the gradients, not about that amplification
HPARAMS = dict(policy_lr=1e-3, draft_lr=2e-3, kl_coef=0.05, policy_warmup_steps=2, schedule="cosine",
               total_steps=STEPS, adam_eps=1e-6)


def _weights(module) -> dict:
    return {k: v.detach().clone().numpy() for k, v in module.state_dict().items()}


_REFERENCE: dict = {}


def reference_run(dp: int, steps: int = STEPS, order=None, **overrides) -> tuple[list[float], dict]:
    """Cached :func:`_reference_run` (several tests compare against the same single-process run)."""
    key = (dp, steps, None if order is None else tuple(order), tuple(sorted(overrides.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_run(dp, steps, order, **overrides)
    return _REFERENCE[key]


def _reference_run(dp: int, steps: int = STEPS, order=None, **overrides) -> tuple[list[float], dict]:
    """One process, the dp replicas' batches concatenated per step (with num_microbatches > 1: dp == 1).

    ``order``: the sampler's permutation of the flat list of ``steps * dp`` batches (replica r reads
    ``order[r::dp]``, as DistributedSampler does); None = in order.
    """
    policy, draft = make_models()
    module = CoDraftModule(policy, draft, **{**HPARAMS, **overrides})
    optimizer, scheduler = module.build_optimizer()
    losses = []
    flat = [b for per_rank in step_batches(steps, dp) for b in per_rank]
    order = list(range(len(flat))) if order is None else list(order)
    for s in range(steps):
        per_rank = [flat[order[s * dp + r]] for r in range(dp)]
        optimizer.zero_grad()
        out = module(concat_batches(per_rank))
        out.loss.backward()
        module.after_backward()
        optimizer.step()
        scheduler.step()
        losses.append(float(out.metrics["loss"]))
    return losses, _weights(module)


def _fabric_worker(rank, world_size, layouts):
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step

    results = []
    for mesh, overrides in layouts:
        strategy = CoDraftStrategy(**mesh)
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
        fabric.launch()
        dp = strategy.parallel_dims.dp
        policy, draft = make_models()
        model = fabric.setup_module(CoDraftModule(policy, draft, **{**HPARAMS, **overrides}))
        optimizer, scheduler = model.build_optimizer()
        optimizer = fabric.setup_optimizers(optimizer)
        flat = [b for per_rank in step_batches(STEPS, dp) for b in per_rank]
        loader = fabric.setup_dataloaders(DataLoader(flat, batch_size=None, shuffle=False))
        losses = [fabric_training_step(fabric, model, batch, optimizer, scheduler)["loss"] for batch in loader]
        dims = strategy.parallel_dims
        cp_sum = (fabric.all_reduce(torch.tensor(float(rank)), group=dims.cp_group, reduce_op="sum")
                  if dims.cp_group is not None else torch.tensor(float(rank)))  # None would mean the world
        reduced = [float(cp_sum),
                   float(fabric.all_reduce(torch.tensor(float(rank))))]  # world mean
        results.append((losses, {k: v.detach().clone().numpy() for k, v in model.module.state_dict().items()},
                        reduced, dims.coordinates))
    return results


# (mesh, module overrides): under PP the objective is the mean over M microbatches (M >= pp for 1F1B).
# One spawn of 4 processes per group: the default suite runs the CP and PP x CP meshes, -m slow the others.
LAYOUTS = {"default": [(dict(dp=2, cp=2), {}), (dict(pp=2, cp=2), dict(num_microbatches=2))],
           "slow": [(dict(dp=4), {}), (dict(pp=4), dict(num_microbatches=4))]}
_RESULTS: dict = {}


def _results(group):
    if group not in _RESULTS:
        _RESULTS[group] = run_distributed(_fabric_worker, world_size=4, args=(LAYOUTS[group],), timeout=900)
    return _RESULTS[group]


def _check_layout(group, index):
    mesh, overrides = LAYOUTS[group][index]
    dp = 4 // (mesh.get("pp", 1) * mesh.get("cp", 1))
    ref_losses, ref_weights = reference_run(dp, **overrides)
    covered = set()
    for rank, per_layout in enumerate(_results(group)):
        losses, weights, reduced, coords = per_layout[index]
        cp = mesh.get("cp", 1)
        cp_peers = [rank - coords[2] + c for c in range(cp)]
        assert reduced == [float(sum(cp_peers)) if cp > 1 else float(rank), 1.5]  # over the cp group; world mean
        assert losses == pytest.approx(ref_losses, rel=1e-5), f"rank {rank}"
        for name, value in weights.items():  # under PP every rank holds (and is compared on) its stage's slice
            torch.testing.assert_close(torch.from_numpy(value), torch.from_numpy(ref_weights[name]), rtol=1e-5,
                                       atol=WEIGHT_ATOL, msg=lambda m: f"rank {rank} {name}: {m}")
            covered.add(name)
    assert covered == set(ref_weights), f"no rank holds {sorted(set(ref_weights) - covered)[:3]}"


@pytest.mark.parametrize("index", range(2), ids=[str(m) for m, _ in LAYOUTS["default"]])
def test_fabric_mesh_equals_single_process(index):
    _check_layout("default", index)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(2), ids=[str(m) for m, _ in LAYOUTS["slow"]])
def test_fabric_mesh_equals_single_process_dp4_pp4(index):
    _check_layout("slow", index)


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
    assert sorted(f.name for f in (tmp_path / "checkpoint").iterdir()) == ["meta.pt", "stage0.pt", "stage1.pt"]
