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
from lightning_codraft.rollout.refit.buckets import RefitError, pack_buckets


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
    module = _fit(cb, batches=8, accumulate=2)   # 4 optimizer steps -> pushes at the start, after steps 2 and 4
    assert len(engine.pushes) == 3 and len(cb.sync_seconds) == 3
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
    assert fabric_sync_weights(fabric, engine, policy, None, step=0, force=True) is not None  # at start / resume
    assert len(engine.pushes) == 3

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    state = full_state_dict(Wrapper(policy))
    assert set(state) == set(policy.state_dict())
    with pytest.raises(ValueError, match="every_n_steps=0"):
        WeightSyncCallback(engine, every_n_steps=0)


class _Checking(_Module):
    """Records, at its first training step, whether the engine holds exactly its (restored) weights."""

    def __init__(self, engine, seed):
        super().__init__()
        torch.manual_seed(seed)
        for p in self.parameters():  # weights other than the checkpoint's, overwritten by the restore
            torch.nn.init.normal_(p)
        self.engine, self.first_step_in_sync = engine, None

    def training_step(self, batch, batch_idx):
        if self.first_step_in_sync is None:
            pushed, _ = self.engine.pushes[-1] if self.engine.pushes else (None, None)
            self.first_step_in_sync = pushed is not None and all(
                torch.equal(pushed[k], v) for k, v in self.policy.state_dict().items())
        return super().training_step(batch, batch_idx)


def test_after_a_resume_the_engine_holds_the_restored_weights_before_the_first_step(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(engine, steps):
        return Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, default_root_dir=tmp_path,
                       callbacks=[WeightSyncCallback(engine, every_n_steps=100),
                                  ModelCheckpoint(dirpath=tmp_path, save_last=True)])

    first = _RecordingEngine()
    module = _Checking(first, seed=1)
    trainer(first, 3).fit(module, _loader(6))
    restored = {k: v.clone() for k, v in module.policy.state_dict().items()}
    engine = _RecordingEngine()
    resumed = _Checking(engine, seed=2)
    trainer(engine, 5).fit(resumed, _loader(6), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.first_step_in_sync  # no optimizer step was due (every 100), yet the engine was refilled
    pushed, _ = engine.pushes[0]
    assert all(torch.equal(pushed[k], v) for k, v in restored.items())


def test_the_embedded_engine_loads_a_bucketed_refit_in_place():
    from lightning_codraft.rollout import RolloutEngine
    from lightning_codraft.rollout.refit.sync import refill_parameters, release_parameters

    target = make_policy(seed=3)
    engine = SpeculativeEngine(make_policy(seed=0), None, 0)
    assert isinstance(engine, RolloutEngine) and not engine.keeps_own_weights and not engine.supports_sleep
    release_parameters(engine.policy)  # the worker's copies between rollout phases
    assert all(p.numel() == 0 for p in engine.policy.parameters())
    refill_parameters(engine.policy)
    engine.load_buckets(pack_buckets(target.state_dict().items(), "policy", 7, bucket_bytes=4096))
    for k, v in target.state_dict().items():
        assert torch.equal(engine.policy.state_dict()[k], v)
    assert engine.weight_versions["policy"] == 7
    assert engine.generate([[1, 2]], 2, temperature=0)[0].policy_version == 7
    with pytest.raises(RefitError, match="unfilled"):
        engine.load_buckets(pack_buckets(list(target.state_dict().items())[1:], "policy", 8, bucket_bytes=4096))
    with pytest.raises(RuntimeError, match="cannot sleep"):
        engine.sleep()
