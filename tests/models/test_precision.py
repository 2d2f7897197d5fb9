import time

import pytest
import torch

from lightning_codraft.models import precision
from lightning_codraft.models.precision import bf16_speedup, fast_bf16, resolve_dtype, resolve_precision


@pytest.fixture
def bf16_is(monkeypatch):
    """``bf16_is(speedup)``: pretend bf16 matmuls run ``speedup`` times faster than fp32 on every device."""
    def set_speedup(speedup: float):
        monkeypatch.setattr(precision, "bf16_speedup", lambda device_type="cpu": speedup)
    return set_speedup


def test_auto_resolves_by_the_measured_speedup(bf16_is):
    bf16_is(4.5)  # a Xeon with AMX
    assert resolve_dtype("auto") == "bfloat16" and resolve_precision("auto") == "bf16-mixed" and fast_bf16("cpu")
    bf16_is(0.02)  # an AVX2-only CPU: emulated bf16
    assert resolve_dtype("auto") == "float32" and resolve_precision("auto") == "32-true" and not fast_bf16()
    bf16_is(1.2)  # faster, but not enough to pay for bf16's rounding
    assert resolve_precision("auto") == "32-true"
    for explicit in ("bfloat16", "float16", "float32", None):
        assert resolve_dtype(explicit) == explicit
    for explicit in ("32-true", "bf16-mixed"):
        assert resolve_precision(explicit) == explicit


def test_probe_measures_this_cpu_and_caches():
    s = bf16_speedup("cpu")
    assert 0 < s < float("inf")
    t = time.perf_counter()
    assert bf16_speedup("cpu") == s and time.perf_counter() - t < 0.01  # cached: measured once per process
    assert bf16_speedup("meta") == 0.0  # no bf16 timing on other device types: fp32
    assert resolve_dtype("auto", "meta") == "float32"
    assert bf16_speedup("cuda") == (float("inf") if torch.cuda.is_available() and torch.cuda.is_bf16_supported()
                                    else 0.0)


def test_probe_gives_up_on_a_slow_kernel():
    calls = []

    def slow():
        calls.append(1)
        time.sleep(0.02)

    assert precision._best_time(slow, reps=5, give_up_s=0.01) >= 0.02 and len(calls) == 1
    calls.clear()
    assert precision._best_time(slow, reps=3, give_up_s=1.0) >= 0.02 and len(calls) == 3


def test_probe_does_not_count_a_first_call_setup():
    """A kernel that pays a one-off setup on its first call (bf16 on a Zen 4 EPYC: 12 ms, then 0.2 ms) is timed by
    its later calls: counting the setup made bf16 look 20x slower than fp32 there when it is 3x faster."""
    calls = {"ref": 0, "cand": 0}

    def reference():
        calls["ref"] += 1
        time.sleep(0.006)

    def candidate():
        calls["cand"] += 1
        time.sleep(0.08 if calls["cand"] == 1 else 0.002)

    assert precision._speedup(reference, candidate) > 2.0

    def emulated():  # slow on every call: the probe stops early and reports it slower
        calls["cand"] += 1
        time.sleep(0.05)

    calls["cand"] = 0
    assert precision._speedup(reference, emulated) < 0.2 and calls["cand"] == 2


def test_engine_dtype_auto(bf16_is):
    from lightning_codraft.models import Policy, PolicyConfig
    from lightning_codraft.rollout import SpeculativeEngine

    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=32, num_hidden_layers=2)).eval()
    bf16_is(4.0)
    assert SpeculativeEngine(policy, None, 0, dtype="auto").dtype == torch.bfloat16
    bf16_is(0.01)
    engine = SpeculativeEngine(policy, None, 0, dtype="auto")
    assert engine.dtype == torch.float32
    ref = SpeculativeEngine(policy, None, 0).generate([[1, 2, 3]], max_new_tokens=5, temperature=0.0)
    assert engine.generate([[1, 2, 3]], max_new_tokens=5, temperature=0.0)[0].token_ids == ref[0].token_ids
    with pytest.raises(ValueError, match="must be None, 'auto' or one of"):
        SpeculativeEngine(policy, None, 0, dtype="fast")


def test_config_accepts_auto_engine_dtype():
    from lightning_codraft.config import ConfigError, load_config

    assert load_config(None, ["parallel.engine_dtype=auto"]).parallel.engine_dtype == "auto"
    with pytest.raises(ConfigError, match="engine_dtype=auto needs parallel.engine=embedded"):
        load_config(None, ["parallel.engine_dtype=auto", "parallel.engine=vllm", "draft.adaptive=false"])
