"""Exporting a sharded, pipelined run: the policy as a Hugging Face checkpoint that transformers loads, the draft as
the vLLM EAGLE-3 checkpoint, both equal to the trained weights, written one tensor (and one file) at a time."""

import numpy as np
import pytest
import torch
from codraft_fixtures import make_batch, make_models
from distributed import run_distributed

from lightning_codraft.models import Eagle3Draft, Policy
from lightning_codraft.training.module import CoDraftModule


def _export_worker(rank, world_size, out, tied):
    from lightning_codraft.parallel.export import export_pretrained
    from lightning_codraft.parallel.strategy_core import CoDraftCore

    core = CoDraftCore(dp=2, pp=2)
    core.setup_mesh(world_size, "cpu")
    policy, draft = make_models(tied=tied)
    module = core.prepare_module(CoDraftModule(policy, draft, pp_schedule="gpipe"))
    optimizer, _ = module.build_optimizer()
    module(make_batch(core.dims.dp_rank))  # under PP the forward runs the backward too
    module.after_backward()
    optimizer.step()
    policy_state, draft_state = module.full_state_dicts()  # the trained weights, whole, on the first stage
    export_pretrained(module, out, max_shard_bytes=20_000)
    if policy_state is None:
        return None
    return ({k: v.numpy() for k, v in policy_state.items()}, {k: v.numpy() for k, v in draft_state.items()})


@pytest.mark.parametrize("tied", [False, True])
def test_export_from_fsdp_x_pp_equals_the_trained_weights_and_loads_in_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    results = run_distributed(_export_worker, 4, args=(str(tmp_path), tied), timeout=300)
    policy_state, draft_state = next(r for r in results if r is not None)
    files = sorted(p.name for p in (tmp_path / "policy").glob("*.safetensors"))
    assert any(f.startswith("model-pp00-") for f in files) and any(f.startswith("model-pp01-") for f in files)
    assert len(files) > 2  # 20 kB files: each stage's writer streamed several
    policy = Policy.from_pretrained(tmp_path / "policy")
    for name, value in policy.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), policy_state[name], err_msg=name)
    draft = Eagle3Draft.from_pretrained(tmp_path / "draft")
    for name, value in draft.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), draft_state[name], err_msg=name)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    ids = torch.tensor([[3, 9, 4, 17, 5]])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, policy(ids).logits, rtol=1e-4, atol=1e-5)
