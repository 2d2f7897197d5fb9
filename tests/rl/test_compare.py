import math

from lightning_codraft.config import load_config
from lightning_codraft.rl.reports.compare import CompareResult, isolated, write_report
from lightning_codraft.rl.run.loop import FitResult


def _rows(tokens, rollout_s, step_s, accept, rewards):
    return [{"step": i + 1.0, "reward": r, "acceptance_length": accept, "completion_tokens": tokens,
             "rollout_s": rollout_s, "step_s": step_s} for i, r in enumerate(rewards)]


def test_speedups_are_token_throughput_ratios(tmp_path):
    cfg = load_config(None, ["rl.steps=4"])
    res = CompareResult(cfg=cfg)
    res.results["none"] = FitResult(tmp_path, _rows(100, 2.0, 3.0, 1.0, [0.2, 0.3, 0.2, 0.3]), 0.4, 0.5)
    res.results["frozen"] = FitResult(tmp_path, _rows(100, 1.0, 2.0, 3.0, [0.3, 0.2, 0.3, 0.2]), 0.4, 0.5)
    res.results["cotrain"] = FitResult(tmp_path, _rows(120, 1.0, 2.0, 3.5, [0.2, 0.2, 0.3, 0.3]), 0.4, 0.6)
    assert res.speedups("frozen") == (2.0, 1.5)
    ro, e2e = res.speedups("cotrain")
    assert math.isclose(ro, 2.4) and math.isclose(e2e, 1.8)
    table = res.table()
    assert "| co-trained draft | 0.250 | 0.300 | 0.400 -> 0.600 | 3.50 | 3.50 | 120.0 | 2.40x | 60.0 | 1.80x |" in table
    path = write_report(res, tmp_path / "docs")
    text = path.read_text()
    assert "| 4 | 0.300 / 1.00 | 0.200 / 3.00 | 0.300 / 3.50 |" in text
    # paired per-step statistics: co-trained - frozen acceptance over the last half (steps 3, 4: +0.5 each)
    assert "- acceptance length, co-trained - frozen, last half: +0.500 (95% CI +0.500 .. +0.500; sd 0.000; 2/2" in text
    d = res.paired("cotrain", "frozen", "reward", last_half=False)
    assert (d.n, d.wins) == (4, 1) and math.isclose(d.mean, 0.0, abs_tol=1e-12)
    assert path.name == "codraft_vs_frozen.md" and (tmp_path / "docs" / "codraft_vs_frozen_curves.png").stat().st_size > 1000


def test_isolated_gives_each_arm_its_own_run(tmp_path):
    cfg = load_config(None, ["draft.mode=cotrain", "run.checkpoint_every=3"])
    a = isolated(cfg, tmp_path / "frozen", init_from="w")
    assert a.draft.mode == "cotrain" and a.run.out_dir == str(tmp_path / "frozen") and a.run.init_from == "w"
    assert a.run.resume is False and a.run.checkpoint_every == 0 and cfg.run.checkpoint_every == 3
