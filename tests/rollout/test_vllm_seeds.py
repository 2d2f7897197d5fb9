"""VLLMEngine's per-request seeds against a fake ``vllm.LLM`` (no vLLM needed): each request's SamplingParams.seed
is ``request_seeds[i]``, or ``request_seed(seed, i)`` with a call-wide seed, or None (vLLM's own randomness)."""

import sys
from types import SimpleNamespace

import pytest
from test_vllm_control import FakeLLM, engine_on, models

from lightning_codraft.rollout.sampling.noise import request_seed


class EchoLLM(FakeLLM):
    """Records the sampling parameters of each request and emits two tokens for it."""

    def generate(self, prompts, sampling, use_tqdm=False):
        self.sampling = sampling
        step = lambda t: {t: SimpleNamespace(logprob=-1.0)}  # noqa: E731
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2], logprobs=[step(1), step(2)])])
                for _ in prompts]


def test_each_request_gets_its_seed(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: kw))
    llm = EchoLLM(*models())
    engine = engine_on(llm)
    prompts = [[1, 2], [3], [4, 5, 6]]
    engine.generate(prompts, 2, seed=5)
    assert [s["seed"] for s in llm.sampling] == [request_seed(5, i) for i in range(3)]
    outs = engine.generate(prompts, 2, request_seeds=[7, 0, 2 ** 63 - 1])
    assert [s["seed"] for s in llm.sampling] == [7, 0, 2 ** 63 - 1]
    assert [o.token_ids for o in outs] == [[1, 2]] * 3
    engine.generate(prompts, 2)
    assert [s["seed"] for s in llm.sampling] == [None] * 3
    with pytest.raises(ValueError, match="request_seeds has 2 entries for 3 prompts"):
        engine.generate(prompts, 2, request_seeds=[1, 2])
    with pytest.raises(ValueError, match="both seed=1 and request_seeds"):
        engine.generate(prompts, 2, seed=1, request_seeds=[1, 2, 3])
