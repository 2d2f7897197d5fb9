"""The optimizer step's non-finite guard: a step whose loss or gradient is not finite changes nothing, is named, and
too many in a row stop training; no checkpoint is written from a non-finite state."""

import math

import pytest
import torch
from codraft_fixtures import make_batch, make_models

from lightning_codraft.parallel import checkpoint as ckpt
from lightning_codraft.training import CoDraftModule, optimizer_step
from lightning_codraft.training.step import NonFiniteError


class PoisonedRL(CoDraftModule):
    """The RL loss is NaN on microbatches whose first token is the poison id."""

    poison = None

    def rl_loss(self, logprobs, batch):
        loss, stats = super().rl_loss(logprobs, batch)
        if self.poison is not None and int(batch.input_ids[0]) == self.poison:
            loss = loss * float("nan")
            stats = {**stats, "loss": stats["loss"] * float("nan")}
        return loss, stats


def _snapshot(module, optimizer):
    return ({k: v.clone() for k, v in module.state_dict().items()},
            {k: {n: t.clone() for n, t in s.items()} for k, s in optimizer.state_dict()["state"].items()})


def test_a_nonfinite_microbatch_skips_the_update_and_names_it():
    module = PoisonedRL(*make_models(), num_microbatches=2, max_nonfinite_steps=2)
    optimizer, scheduler = module.build_optimizer()
    good, bad = make_batch(1, num_docs=4), make_batch(2, num_docs=4)
    optimizer_step(module, module, good, optimizer, scheduler)  # a normal step: Adam state exists
    weights, state = _snapshot(module, optimizer)
    lr_step = scheduler.last_epoch
    second = bad.split(2)[1]
    module.poison = int(second.input_ids[0])  # microbatch 1 of `bad` is poisoned
    with pytest.warns(RuntimeWarning, match="optimizer step 1: non-finite loss in microbatch 1 \\(nan\\); skipped"):
        metrics = optimizer_step(module, module, bad, optimizer, scheduler)
    assert float(metrics["skipped"]) == 1.0 and scheduler.last_epoch == lr_step
    after_w, after_s = _snapshot(module, optimizer)
    assert all(torch.equal(weights[k], after_w[k]) for k in weights)  # nothing moved
    assert all(torch.equal(state[k][n], after_s[k][n]) for k in state for n in state[k])
    assert all(p.grad is None for p in module.parameters())
    metrics = optimizer_step(module, module, good, optimizer, scheduler)  # a finite step resets the count
    assert float(metrics["skipped"]) == 0.0 and module.nonfinite_guard.in_a_row == 0
    with pytest.warns(RuntimeWarning), pytest.raises(NonFiniteError, match="2 optimizer steps in a row had a "
                                                                           "non-finite loss or gradient"):
        for _ in range(2):
            optimizer_step(module, module, bad, optimizer, scheduler)
    assert [s for s, _ in module.nonfinite_guard.skipped] == [1, 3, 4]


def test_a_nonfinite_gradient_is_named_by_its_parameter_group():
    module = CoDraftModule(*make_models())
    optimizer, scheduler = module.build_optimizer()
    module.draft.fc.weight.register_hook(lambda g: g * float("inf"))
    with pytest.warns(RuntimeWarning, match="non-finite gradient of the 'draft' parameters"):
        metrics = optimizer_step(module, module, make_batch(3), optimizer, scheduler)
    assert float(metrics["skipped"]) == 1.0 and math.isfinite(float(metrics["loss"]))


def test_no_checkpoint_from_a_nonfinite_state(tmp_path):
    module = CoDraftModule(*make_models())
    with torch.no_grad():
        module.policy.model.norm.weight[0] = float("nan")
    with pytest.raises(ckpt.CheckpointError, match="refusing to write a checkpoint from a non-finite state.*"
                                                   "model.policy.model.norm.weight"):
        ckpt.save_checkpoint(tmp_path / "c", {"model": module, "step": 1})
    assert not (tmp_path / "c" / "codraft.json").exists()
