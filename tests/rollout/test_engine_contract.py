"""The draft that generates is the draft that trains: a subclass that changes the decode math decodes through its
own methods; one that changes only the training math, a draft without the EAGLE-3 decode contract and FSDP2-sharded
modules are refused when the engine is built, with a message naming the fix."""

import pytest
import torch
from distributed import run_distributed
from rollout_helpers import make_policy, random_prompts

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.models.decode import ModuleDraftDecoder, ModulePolicyDecoder
from lightning_codraft.rollout import SpeculativeEngine


class ScaledFuse(Eagle3Draft):
    """A research draft that rescales its fused features: training and decoding must both use it."""

    calls = 0

    def fuse(self, taps):
        ScaledFuse.calls += 1
        return 0.5 * super().fuse(taps)


def test_an_overridden_fuse_generates_through_the_override():
    policy = make_policy(seed=0)
    torch.manual_seed(1)
    draft = ScaledFuse(Eagle3Draft.from_policy(policy).config)
    assert isinstance(draft.decoder(16), ModuleDraftDecoder)
    ScaledFuse.calls = 0
    engine = SpeculativeEngine(policy, draft.eval(), 2)
    out = engine.generate(random_prompts(2, 128, seed=4), 6, temperature=0.0)
    assert ScaledFuse.calls > 0 and all(len(o.token_ids) == 6 for o in out)
    # lossless whatever the draft: the same tokens as plain greedy decoding
    plain = SpeculativeEngine(policy, None, 0).generate(random_prompts(2, 128, seed=4), 6, temperature=0.0)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]


def test_a_policy_subclass_with_its_own_forward_decodes_through_it():
    policy = make_policy(seed=0)

    class Counting(type(policy)):
        calls = 0

        def forward(self, *args, **kwargs):
            Counting.calls += 1
            return super().forward(*args, **kwargs)

    counting = Counting(policy.config)
    counting.load_state_dict(policy.state_dict())
    assert isinstance(counting.decoder(16), ModulePolicyDecoder)
    SpeculativeEngine(counting.eval(), None, 0).generate(random_prompts(1, 128, seed=5), 3, temperature=0.0)
    assert Counting.calls > 0


def test_overriding_only_the_training_math_is_refused():
    class TrainOnly(Eagle3Draft):
        def ttt_forward(self, *args, **kwargs):
            return super().ttt_forward(*args, **kwargs)

    draft = TrainOnly(Eagle3Draft.from_policy(make_policy(seed=0)).config)
    with pytest.raises(ValueError, match="overrides ttt_forward .* but not step"):
        SpeculativeEngine(make_policy(seed=0), draft, 2).generate(random_prompts(1, 128, seed=1), 2, temperature=0.0)


def test_a_draft_without_the_decode_contract_is_refused_at_build():
    class NotEagle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

    with pytest.raises(TypeError, match=r"lacks \['config', 'draft_to_target', 'fuse', 'step'\].*subclass"):
        SpeculativeEngine(make_policy(seed=0), NotEagle(), 2)


def _fsdp_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    policy = make_policy(seed=0)
    fully_shard(policy, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        SpeculativeEngine(policy, None, 0)
    except ValueError as e:
        return str(e)
    return None


def test_an_engine_over_fsdp2_shards_is_refused_with_the_supported_patterns():
    for message in run_distributed(_fsdp_worker, world_size=2, timeout=120):
        assert message and "FSDP2 / DTensor shards" in message and "full_state_dicts()" in message


def test_the_engine_protocol_declares_what_the_rollout_worker_calls():
    """rl/rollout_worker.py calls only what rollout/engine.py's RolloutEngine declares (no hasattr there): the
    embedded engine implements all of it, and the worker's calls are the protocol's."""
    import ast
    import inspect

    import lightning_codraft.rl.rollout_worker as worker
    from lightning_codraft.rollout.engine import RolloutEngine

    engine = SpeculativeEngine(make_policy(seed=0), None, 0)
    assert isinstance(engine, RolloutEngine)
    engine.close()  # a no-op for the embedded engine
    declared = set(RolloutEngine.__dict__) | set(RolloutEngine.__annotations__)
    tree = ast.parse(inspect.getsource(worker))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "engine"}
    assert used and used <= declared, used - declared
    assert "hasattr" not in inspect.getsource(worker)
    with pytest.raises(RuntimeError, match="cannot sleep"):
        engine.wake_up(refit=True)
