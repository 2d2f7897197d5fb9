"""Against verl's own functions (verl 0.9.1 ``trainer/ppo/core_algos.py``): the GRPO advantage, the clipped (and
dual-clipped) surrogate and every loss aggregation equal ours on the same inputs. verl installs with ``--no-deps``
(`.ci/run` set ``peers``); its package imports ray / tensordict at import time, which these functions never use, so
the missing ones are stood in by empty modules. Skipped where verl is not installed."""

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from lightning_codraft.batch import RLBatch
from lightning_codraft.rl.experience import group_advantages
from lightning_codraft.training.normalize import normalize_step
from lightning_codraft.training.rl_loss import policy_gradient_loss

pytestmark = pytest.mark.peers
_IMPORT_ONLY = ("ray", "tensordict", "codetiming", "pyarrow", "pandas", "hydra", "peft", "wandb", "pylatexenc",
                "torchdata", "liger_kernel", "flash_attn", "vllm", "sglang")


class _Stand(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for verl's import-time dependencies that are not installed."""

    def find_spec(self, name, path, target=None):
        root = name.split(".")[0]
        if root in _IMPORT_ONLY and name not in sys.modules and (
                "." in name or importlib.machinery.PathFinder.find_spec(root) is None):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock()
        module.__path__, module.__spec__, module.__name__ = [], spec, spec.name
        return module

    def exec_module(self, module):
        pass


@pytest.fixture(scope="module")
def core_algos():
    if importlib.util.find_spec("verl") is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    stand = _Stand()
    sys.meta_path.insert(0, stand)
    try:
        from verl.trainer.ppo import core_algos
    finally:
        sys.meta_path.remove(stand)
    return core_algos


def test_grpo_advantage_equals_verl(core_algos):
    g = torch.Generator().manual_seed(0)
    P, G = 5, 6
    rewards = torch.rand(P, G, generator=g).round(decimals=1)
    index = np.repeat(np.arange(P), G)
    mask = torch.ones(P * G, 3)
    for norm in (True, False):
        theirs, _ = core_algos.compute_grpo_outcome_advantage(
            torch.nn.functional.pad(rewards.view(-1, 1), (2, 0)), mask, index, norm_adv_by_std_in_grpo=norm)
        ours = group_advantages(rewards, scale=norm, std="sample")
        torch.testing.assert_close(ours.view(-1), theirs[:, 0], rtol=1e-6, atol=1e-6)


def _case():
    """Four samples of 1, 3, 4 and 2 completion tokens (one prompt token each), random log-probs and advantages."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 3, 4, 2]
    adv = torch.randn(4, generator=g).tolist()
    logp_old = [(-torch.rand(n, generator=g) * 2).tolist() for n in lengths]
    batch = RLBatch.pack([[1]] * 4, [[2] * n for n in lengths], logp_old, adv)
    logp = batch.old_logprobs + 0.5 * torch.randn(batch.num_tokens, generator=g) * batch.loss_mask
    L = max(lengths)
    rows = torch.zeros(4, L, dtype=torch.long)  # row index of each (sample, position) in the packed batch
    mat_mask = torch.zeros(4, L)
    for i, (s, n) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), lengths)):
        rows[i, :n] = torch.arange(s, s + n)
        mat_mask[i, :n] = 1
    return batch, logp, rows, mat_mask


@pytest.mark.parametrize("ours_agg,theirs_agg", [("token", "token-mean"), ("sequence", "seq-mean-token-mean"),
                                                 ("constant", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_and_aggregation_equal_verl(core_algos, ours_agg, theirs_agg, dual_clip):
    batch, logp, rows, mat_mask = _case()
    L_MAX = 8
    norm = normalize_step(batch, ours_agg, 1, max_new_tokens=L_MAX)
    ours, _ = policy_gradient_loss(logp, batch.old_logprobs, batch.advantages, batch.loss_mask, clip_eps=0.2,
                                   clip_eps_high=0.28, loss_weight=norm.loss_weight, dual_clip=dual_clip)
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28,
                             global_batch_info={"loss_scale_factor": L_MAX} if theirs_agg.endswith("norm") else {})
    config.get = lambda key, default=None: (dual_clip or 1e9) if key == "clip_ratio_c" else default
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        batch.old_logprobs[rows] * mat_mask, logp[rows] * mat_mask, batch.advantages[rows] * mat_mask, mat_mask,
        loss_agg_mode=theirs_agg, config=config)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("ours_agg", ["token", "sequence", "constant"])
@pytest.mark.parametrize("microbatches", [1, 2])
def test_clip_frac_and_kl_are_the_token_means_verl_and_trl_log(core_algos, ours_agg, microbatches):
    """Whatever the loss aggregation and microbatching: our ``clip_frac`` is verl's ``actor/pg_clipfrac`` (and TRL's
    ``clip_ratio/region_mean``), our ``kl`` verl's ``low_var_kl`` (TRL's k3 ``kl``) token mean — the step's shares
    of the microbatches add up to them."""
    from verl.utils.torch_functional import masked_mean

    batch, logp, rows, mat_mask = _case()
    ref = batch.old_logprobs - 0.3 * torch.rand(batch.num_tokens, generator=torch.Generator().manual_seed(3))
    batch = normalize_step(dataclasses.replace(batch, ref_logprobs=ref), ours_agg, 1, max_new_tokens=8)
    clip_frac = kl = 0.0
    for mb, rows_mb in zip(batch.split(microbatches), _split_rows(batch, microbatches)):
        _, stats = policy_gradient_loss(logp[rows_mb], mb.old_logprobs, mb.advantages, mb.loss_mask, clip_eps=0.2,
                                        clip_eps_high=0.28, ref_logprobs=mb.ref_logprobs, loss_weight=mb.loss_weight,
                                        num_tokens=batch.norm.tokens)
        clip_frac, kl = clip_frac + stats["clip_frac"], kl + stats["kl"]
    config = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, global_batch_info={})
    config.get = lambda key, default=None: 1e9 if key == "clip_ratio_c" else default
    _, metrics = core_algos.compute_policy_loss_vanilla(
        batch.old_logprobs[rows] * mat_mask, logp[rows] * mat_mask, batch.advantages[rows] * mat_mask, mat_mask,
        loss_agg_mode="token-mean", config=config)
    their_kl = masked_mean(core_algos.kl_penalty(logp[rows], ref[rows], "low_var_kl"), mat_mask)
    assert metrics["actor/pg_clipfrac"] > 0
    torch.testing.assert_close(float(clip_frac), metrics["actor/pg_clipfrac"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(float(kl), their_kl.item(), rtol=1e-6, atol=1e-7)


def _split_rows(batch, n):
    """The packed rows of each of ``batch.split(n)``'s microbatches (whole documents, in order)."""
    out, start = [], 0
    for mb in batch.split(n):
        out.append(torch.arange(start, start + mb.num_tokens))
        start += mb.num_tokens
    return out
