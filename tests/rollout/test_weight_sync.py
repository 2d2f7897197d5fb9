"""WeightSyncCallback / fabric_sync_weights push the current policy + draft every N optimizer steps."""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import LightningModule, Trainer
from rollout_helpers import make_policy, random_prompts

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.fabric import fabric_sync_weights
from lightning_codraft.pytorch import WeightSyncCallback
from lightning_codraft.rollout import SpeculativeEngine, full_state_dict


class _RecordingEngine:
    num_speculative_tokens = 2

    def __init__(self):
        self.pushes = []

    def generate(self, prompts, max_new_tokens, **kw):
        return []

    def update_weights(self, policy_state, draft_state):
        self.pushes.append(({k: v.clone() for k, v in policy_state.items()},
                            None if draft_state is None else {k: v.clone() for k, v in draft_state.items()}))


class _Module(LightningModule):
    def __init__(self):
        super().__init__()
        self.policy = make_policy(seed=0)
        self.draft = Eagle3Draft.from_policy(self.policy)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        out = self.policy(ids, taps=self.draft.config.taps)
        hidden, logits = self.draft.step(self.draft.fuse([t.detach() for t in out.taps]), self.policy.embed(ids).detach(),
                                         self.draft.allocate_kv_cache(ids.shape[0], ids.shape[1]))
        return out.logits.logsumexp(-1).mean() + logits.logsumexp(-1).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader(n):
    ids = torch.randint(0, 128, (n, 6))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=1)


def _fit(callback, batches, accumulate=1):
    module = _Module()
    trainer = Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[callback], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      accumulate_grad_batches=accumulate)
    trainer.fit(module, _loader(batches))
    return module


def test_callback_pushes_every_n_steps_with_gradient_accumulation():
    engine = _RecordingEngine()
    cb = WeightSyncCallback(engine, every_n_steps=2)
    module = _fit(cb, batches=8, accumulate=2)   # 4 optimizer steps -> pushes after steps 2 and 4
    assert len(engine.pushes) == 2 and len(cb.sync_seconds) == 2
    policy_state, draft_state = engine.pushes[-1]
    for k, v in module.policy.state_dict().items():
        assert torch.equal(policy_state[k], v)
    for k, v in module.draft.state_dict().items():
        assert torch.equal(draft_state[k], v)
    first_policy, _ = engine.pushes[0]
    assert not torch.equal(first_policy["lm_head.weight"], policy_state["lm_head.weight"])  # trained in between


def test_callback_keeps_a_real_engine_in_sync():
    engine = SpeculativeEngine(make_policy(seed=7), Eagle3Draft.from_policy(make_policy(seed=7)).eval(), 2)
    module = _fit(WeightSyncCallback(engine, every_n_steps=1), batches=2)
    prompts = random_prompts(3, 128, seed=3)
    got = engine.generate(prompts, 6, temperature=0.0)
    want = SpeculativeEngine(module.policy.eval(), None, 0).generate(prompts, 6, temperature=0.0)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for k, v in module.draft.state_dict().items():
        assert torch.equal(engine.draft.state_dict()[k], v)


def test_fabric_helper_and_full_state_dict():
    fabric = Fabric(accelerator="cpu", devices=1)
    policy = make_policy(seed=0)
    engine = _RecordingEngine()
    pushed = [fabric_sync_weights(fabric, engine, policy, None, step=s, every_n_steps=3) for s in range(1, 7)]
    assert [p is not None for p in pushed] == [False, False, True, False, False, True]
    assert len(engine.pushes) == 2 and engine.pushes[0][1] is None

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    state = full_state_dict(Wrapper(policy))
    assert set(state) == set(policy.state_dict())
    with pytest.raises(ValueError, match="every_n_steps=0"):
        WeightSyncCallback(engine, every_n_steps=0)
