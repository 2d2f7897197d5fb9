"""`codraft fit` with draft.type=dflash: the block drafter warm-starts on the pool, co-trains in the RL step, drafts
the rollouts through the block engine, is scored beside its frozen start (the live A/B) per block position, and is
exported in the format vLLM's method dflash loads. The same for draft.type=dspark (with the confidence-chosen verify
length), whose steps log its probabilistic and predicted acceptance, exported in vLLM's method dspark layout."""

import math

import pytest
import torch
from test_loop import micro_config

from lightning_codraft.config import ConfigError
from lightning_codraft.models.dflash import DFlashDraft
from lightning_codraft.models.dflash_io import load_dflash
from lightning_codraft.models.dspark import DSparkDraft
from lightning_codraft.models.dspark_io import load_dspark
from lightning_codraft.rl.reports.run_log import read_metrics
from lightning_codraft.rl.run.loop import fit
from lightning_codraft.rl.run.run_dir import export_run, load_run

DFLASH = ["draft.type=dflash", "draft.block_size=4", "draft.num_speculative_tokens=3",
          "draft.warm_start.steps=6", "run.plots=false", "task.eval_prompts=0"]


@pytest.fixture(scope="module")
def dflash_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dflash")
    res = fit(micro_config(out, *DFLASH), print_fn=lambda s: None)
    return out, res


def test_a_dflash_run_cotrains_scores_and_drafts_with_the_block_drafter(dflash_run):
    out, res = dflash_run
    assert res.completed and len(res.rows) == 3
    rows = read_metrics(out / "metrics.csv")
    for r in rows:
        assert r["acceptance_length"] >= 1.0 and math.isfinite(r["draft_loss"])
        assert 1.0 <= r["implied_acceptance"] <= 4.0 and 1.0 <= r["reference_acceptance"] <= 4.0
    run = load_run(out)
    assert isinstance(run.draft, DFlashDraft) and run.draft.config.block_size == 4
    start = torch.load(out / "warm" / "weights.pt", weights_only=True)["draft"]
    moved = [k for k, v in run.draft.state_dict().items() if not torch.equal(v, start[k])]
    assert moved, "the co-trained drafter did not change during RL"


def test_a_dflash_run_exports_the_vllm_dflash_checkpoint(dflash_run, tmp_path):
    out, _ = dflash_run
    paths = export_run(out, tmp_path / "export")
    loaded, trained = load_dflash(paths["draft"]), load_run(out).draft
    assert loaded.config.taps == trained.config.taps and loaded.config.block_size == 4
    for k, v in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


@pytest.mark.parametrize("extra, match", [
    (["draft.num_speculative_tokens=4"], "proposals of a dflash block"),
    (["draft.verify_length=confidence"], "confidence head"),
    (["parallel.engine_dtype=bfloat16"], "engine_dtype"),
    (["draft.draft_vocab_size=10"], "draft_vocab_size"),
    (["draft.type=eagle4"], "eagle3"),
])
def test_a_dflash_recipe_refuses_what_it_cannot_do(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        micro_config(tmp_path, *DFLASH, *extra)


def test_arms_of_two_drafter_types_start_from_the_same_policy(tmp_path):
    """rl.reports.compare with EAGLE-3 and DFlash arms: each type warms up its own drafter, every arm the same SFT'd
    policy (so their step-1 rollouts and rewards are the same samples)."""
    import dataclasses

    from lightning_codraft.rl.reports.compare import run_side_by_side

    base = micro_config(tmp_path / "base", "rl.steps=1", "run.plots=false", "task.eval_prompts=0")
    dflash = micro_config(tmp_path / "base", *DFLASH, "rl.steps=1")
    arms = {"eagle3": base, "dflash": dflash, "dflash-frozen": dataclasses.replace(
        dflash, draft=dataclasses.replace(dflash.draft, mode="frozen"))}
    res = run_side_by_side(arms, tmp_path / "bench", base, print_fn=lambda s: None)
    warm = {n: torch.load(tmp_path / "bench" / n / "warm" / "weights.pt", weights_only=True)
            for n in ("eagle3", "dflash")}
    assert warm["eagle3"]["policy"].keys() == warm["dflash"]["policy"].keys()
    for k, v in warm["eagle3"]["policy"].items():
        assert torch.equal(v, warm["dflash"]["policy"][k]), k
    assert set(warm["eagle3"]["draft"]) != set(warm["dflash"]["draft"])  # each type's own drafter
    rewards = {n: res.results[n].rows[0]["reward"] for n in arms}
    assert rewards["eagle3"] == rewards["dflash"] == rewards["dflash-frozen"]


def test_a_dspark_run_cotrains_with_the_confidence_prefix_and_exports_for_vllm(tmp_path):
    out = tmp_path / "dspark"
    extra = ["draft.type=dspark", "draft.num_speculative_tokens=4", "draft.verify_length=confidence",
             "draft.markov_rank=8"]
    res = fit(micro_config(out, *DFLASH, *extra), print_fn=lambda s: None)
    assert res.completed and len(res.rows) == 3
    for r in read_metrics(out / "metrics.csv"):
        assert r["acceptance_length"] >= 1.0 and math.isfinite(r["draft_loss"])
        assert 1.0 <= r["prob_acceptance"] <= 5.0 and 1.0 <= r["predicted_acceptance"] <= 5.0
        assert 1.0 <= r["implied_acceptance"] <= 5.0
    run = load_run(out)
    assert isinstance(run.draft, DSparkDraft) and run.draft.num_proposals == 4
    start = torch.load(out / "warm" / "weights.pt", weights_only=True)["draft"]
    moved = {k.split(".")[0] for k, v in run.draft.state_dict().items() if not torch.equal(v, start[k])}
    assert {"markov_head", "confidence_head"} <= moved
    paths = export_run(out, tmp_path / "export")
    loaded = load_dspark(paths["draft"])
    for k, v in run.draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(ConfigError, match="proposals of a dspark block"):
        micro_config(tmp_path / "bad", *DFLASH, "draft.type=dspark", "draft.num_speculative_tokens=5")
