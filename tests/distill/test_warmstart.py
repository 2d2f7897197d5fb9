import dataclasses
import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import numpy as np
import pytest
import torch

from lightning_codraft.distill import warmstart as draft_warmstart
from lightning_codraft.distill.cache import FeatureCache
from lightning_codraft.distill.fit import DraftFitConfig
from lightning_codraft.distill.stages import state_fingerprint
from lightning_codraft.distill.warmstart import WarmStartSettings, split_prompts, warm_start_draft
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.models.tokenizer import CharTokenizer
from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask, TaskSample

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@dataclass
class FixedTask:
    """A task with a fixed problem list, like GSM8KTask (``samples``)."""

    samples: list[TaskSample] = field(default_factory=lambda: ArithmeticTask(max_terms=4).sample(20, seed=3))


def _models(seed=0):
    tok = CharTokenizer()
    torch.manual_seed(seed)
    policy = Policy(PolicyConfig.tiny(vocab_size=tok.vocab_size, num_hidden_layers=5, max_position_embeddings=64))
    torch.manual_seed(seed + 1)
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=24, token_counts=torch.ones(tok.vocab_size))
    return tok, policy.eval(), draft


def _settings(**kw):
    fit = DraftFitConfig(epochs=2, batch_tokens=64, lr=3e-3, ttt_steps=2, val_docs=2, eval_every=2)
    return WarmStartSettings(num_prompts=12, heldout_prompts=5, max_new_tokens=10, generation_batch=5, fit=fit, **kw)


def test_held_out_prompts_are_disjoint_and_fixed():
    task, s = FixedTask(), _settings()
    train, held = split_prompts(task, s)
    assert held == [x.prompt for x in task.samples[-5:]]
    assert len(train) == 12 and not set(train) & set(held)
    assert split_prompts(task, WarmStartSettings(num_prompts=100, heldout_prompts=5))[0].__len__() == 15
    assert split_prompts(task, WarmStartSettings(seed=1, num_prompts=12, heldout_prompts=5))[0] != train
    with pytest.raises(ValueError, match="leaves no training prompt"):
        split_prompts(task, WarmStartSettings(heldout_prompts=20))
    task.heldout = 6  # a task that reserves more problems than the warm start holds out
    with pytest.raises(ValueError, match="heldout_prompts=5 is below task.heldout=6"):
        split_prompts(task, s)


def test_warm_start_trains_caches_and_keys_on_the_policy(tmp_path):
    tok, policy, draft = _models()
    evals, lines = [], []
    task, settings = FixedTask(), _settings()
    rep = warm_start_draft(policy, tok, task, draft, settings, tmp_path, log=lines.append, on_eval=evals.append)
    assert not rep.cache_hit and rep.prompts == 12 and rep.generated_tokens > 12
    assert rep.val_accuracy and rep.val_acceptance >= 1.0 and 0 < rep.argmax_coverage <= 1 and rep.entropy > 0
    assert evals and all(e["warmstart_seconds"] >= e["seconds"] for e in evals)
    assert any("held-out step-0 acc" in line for line in lines)
    # the corpus is the policy's own responses to training prompts only
    corpus = json.loads(next(tmp_path.glob("corpus-*/samples.json")).read_text())
    held = {tuple(tok.encode(s.prompt)) for s in task.samples[-5:]}
    assert len(corpus) == 12 and not {tuple(p) for p, _ in corpus} & held
    # the draft vocabulary is the corpus' most frequent completion tokens
    counts = torch.bincount(torch.tensor([t for _, c in corpus for t in c]), minlength=tok.vocab_size)
    chosen = draft.draft_to_target(torch.arange(24))
    assert counts[chosen].min() >= counts[~draft.t2d].max()
    trained = {k: v.clone() for k, v in draft.state_dict().items()}

    # same policy, a fresh draft: a cache hit restores the trained weights without generating
    _, same_policy, fresh = _models()
    hit = warm_start_draft(same_policy, tok, task, fresh, settings, tmp_path, log=lines.append)
    assert hit.cache_hit and hit.draft_dir == rep.draft_dir and hit.val_acceptance == rep.val_acceptance
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, trained[k]), k

    # one weight of the policy changed: a miss, a new draft directory
    _, changed, fresh2 = _models()
    with torch.no_grad():
        changed.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    assert state_fingerprint(changed) != state_fingerprint(policy)
    miss = warm_start_draft(changed, tok, task, fresh2, settings, tmp_path, log=lines.append)
    assert not miss.cache_hit and miss.draft_dir != rep.draft_dir
    # a bf16 copy samples the corpus: other responses (a new corpus), the same machinery
    bf16 = dataclasses.replace(settings, generation_dtype="bfloat16")
    rep16 = warm_start_draft(policy, tok, task, _models()[2], bf16, tmp_path, log=lines.append)
    assert not rep16.cache_hit and rep16.prompts == 12 and next(policy.parameters()).dtype == torch.float32
    # other fit settings: a new draft, but this policy's corpus and features are reused
    refit = dataclasses.replace(settings, fit=DraftFitConfig(epochs=1, batch_tokens=64, ttt_steps=2, val_docs=2))
    lines.clear()
    other = warm_start_draft(policy, tok, task, _models()[2], refit, tmp_path, log=lines.append)
    assert not other.cache_hit and other.draft_dir not in (rep.draft_dir, miss.draft_dir)
    assert any("cached responses" in line for line in lines) and not any("features" in line and "tokens (" in line
                                                                            for line in lines)
    assert [len(list(tmp_path.glob(g))) for g in ("corpus-*", "features-*", "draft-*")] == [3, 3, 4]


def test_features_kept_from_sampling_equal_the_feature_pass(tmp_path):
    """By default the features come from the forwards that sampled the corpus (no second pass); they equal the
    feature pass's (capture_features=False) on the same corpus, except each document's never-fed last token."""
    caches, lines = [], []
    for capture in (True, False):
        tok, policy, draft = _models()
        warm_start_draft(policy, tok, FixedTask(), draft, _settings(capture_features=capture, feature_dtype="float32"),
                         tmp_path / str(capture), log=lines.append)
        caches.append(FeatureCache(next((tmp_path / str(capture)).glob("features-*"))))
    got, ref = caches
    assert got.meta.get("source") == "sampling" and "source" not in ref.meta
    assert any("kept from the sampling forwards" in line for line in lines)
    assert not list((tmp_path / "True").glob("capture-*"))  # the spilled records are gone once the cache is written
    np.testing.assert_array_equal(got.ids, ref.ids)
    fed = np.setdiff1d(np.arange(len(got.ids)), np.asarray(got.doc_offsets[1:]) - 1)
    np.testing.assert_allclose(got.taps[fed], ref.taps[fed], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.targets, ref.targets, rtol=1e-4, atol=1e-4)


def test_warm_start_folds_the_calibrated_proposal_temperature(tmp_path, monkeypatch):
    tok, policy, draft = _models()
    task, lines = FixedTask(), []
    plain = _models()[2]
    off = warm_start_draft(policy, tok, task, plain, _settings(calibrate_temperature=False), tmp_path)
    assert off.calibration == {}
    real = draft_warmstart.calibrate_draft_temperature

    def flat_then_calibrate(d, *args, **kw):  # this tiny fit is not underconfident: make it so, then calibrate
        with torch.no_grad():
            d.lm_head.weight.mul_(0.25)
        return real(d, *args, **kw)

    monkeypatch.setattr(draft_warmstart, "calibrate_draft_temperature", flat_then_calibrate)
    rep = warm_start_draft(policy, tok, task, draft, _settings(), tmp_path, log=lines.append)
    assert off.draft_dir != rep.draft_dir
    cal = rep.calibration
    assert cal["scales"][0] == 1.0 and cal["scale"] < 1.0 and cal["rows"] > 0
    assert max(cal["acceptance"]) == cal["acceptance"][cal["scales"].index(cal["scale"])] > cal["acceptance"][0]
    assert any("proposal temperature scale" in line for line in lines)
    # the same fit, then lm_head divided by the chosen scale (saved so: a cache hit restores it); nothing else
    monkeypatch.setattr(draft_warmstart, "calibrate_draft_temperature", real)
    hit = _models()[2]
    assert warm_start_draft(policy, tok, task, hit, _settings(), tmp_path).cache_hit
    for k, v in hit.state_dict().items():
        want = plain.state_dict()[k] * 0.25 / cal["scale"] if k == "lm_head.weight" else plain.state_dict()[k]
        torch.testing.assert_close(v, want, rtol=1e-6, atol=1e-7, msg=k)


def test_auto_precision_is_resolved_before_the_cache_keys(tmp_path, monkeypatch):
    """"auto" dtypes resolve for the policy's device (here: a CPU that emulates bf16 -> fp32) before the keys are
    taken: the draft is the one the explicit fp32 settings build (a cache hit), and the report says what ran."""
    from lightning_codraft.models import precision

    monkeypatch.setattr(precision, "bf16_speedup", lambda device_type="cpu": 0.02)
    tok, policy, draft = _models()
    auto = _settings(generation_dtype="auto", feature_precision="auto")
    auto.fit.precision = "auto"
    lines = []
    rep = warm_start_draft(policy, tok, FixedTask(), draft, auto, tmp_path, log=lines.append)
    assert rep.precision == dict(generation_dtype="float32", feature_precision="32-true", fit_precision="32-true")
    assert any("sampling in float32, features 32-true, fit 32-true" in line for line in lines)
    explicit = _settings(generation_dtype="float32", feature_precision="32-true")
    hit = warm_start_draft(policy, tok, FixedTask(), _models()[2], explicit, tmp_path, log=lines.append)
    assert hit.cache_hit and hit.draft_dir == rep.draft_dir
    with pytest.raises(ValueError, match="feature_precision='bf16' must be"):
        WarmStartSettings(feature_precision="bf16")


def test_time_budget_bounds_generation_and_fit(tmp_path):
    tok, policy, draft = _models()
    rep = warm_start_draft(policy, tok, FixedTask(), draft, _settings(time_budget_s=1e-3), tmp_path, log=lambda s: None)
    assert rep.prompts == 5  # one generation batch, then the budget is spent
    assert rep.fit["steps"] == 1 and len(rep.fit["history"]) == 1 and rep.fit["ended_by"] == "budget"
    lines = []  # a budget the corpus cannot fill: the fit ends at its epochs and the warm start says so
    rep = warm_start_draft(policy, tok, FixedTask(), draft, _settings(time_budget_s=3600.0), tmp_path / "long",
                           log=lines.append)
    assert rep.fit["ended_by"] == "epochs" and rep.fit["steps"] == rep.fit["planned_steps"]
    assert any("ran its 2 epochs" in s and "of the budget left" in s for s in lines), lines


def test_benchmark_smoke(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "draft_warmstart.py"), "--smoke",
                          "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    md = (tmp_path / "draft_warmstart.md").read_text()
    assert "acceptance length" in md and "tokens seen" in md and "entropy" in md
    assert (tmp_path / "draft_warmstart.png").is_file()
    assert "acceptance" in out.stdout


def test_smollm2_recipe_reads_the_cache_the_warmstart_benchmark_fills(monkeypatch):
    """The recipe's draft.warm_start.corpus (and draft vocabulary) equal benchmarks/draft_warmstart.py's defaults, so the
    benchmark's run is the cache the recipe loads; and both hold out the recipe's evaluation problems."""
    import importlib.util

    from conftest import REPO
    from lightning_codraft.config import load_config

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as when run as a script: its folder's pages.py
    spec = importlib.util.spec_from_file_location("draft_warmstart_bench", REPO / "benchmarks" / "draft_warmstart.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args([])
    cfg = load_config(REPO / "recipes" / "smollm2-135m-cpu.yaml")
    ours, theirs = cfg.draft.warm_start.corpus, bench.warm_start_settings(args)
    # the cache key hashes the settings' JSON, where 3480 and 3480.0 differ (a recipe writing an int missed the
    # benchmark's cache): compare that, not only dataclass equality
    assert json.dumps(asdict(ours), sort_keys=True) == json.dumps(asdict(theirs), sort_keys=True)
    assert cfg.draft.draft_vocab_size == args.draft_vocab and cfg.run.seed + 1 == 1  # the benchmark's draft seed
    from lightning_codraft.rl.tasks.gsm8k import gsm8k_source

    assert cfg.task.heldout <= args.heldout and gsm8k_source(cfg.task.source) == str(args.gsm8k)  # the same file


def test_each_stage_owns_its_cache_key():
    """A fit setting changes only the draft's key; a sampling setting the corpus' key and so every later one; the
    feature storage dtype only the features' key."""
    from dataclasses import replace

    from dataclasses import asdict

    from lightning_codraft.distill.stages import GENERATION_FIELDS, _digest, corpus_key, draft_key, features_key

    torch.manual_seed(0)
    policy = Policy(PolicyConfig.tiny(vocab_size=40, num_hidden_layers=4))
    draft = Eagle3Draft.from_policy(policy)
    base = WarmStartSettings(num_prompts=4)
    ids, prompts = torch.arange(40), [[1, 2, 3]]

    def keys(s):
        c = corpus_key(state_fingerprint(policy), prompts, s)
        return c, features_key(c, ids, draft.config.taps, s), draft_key(c, draft, s)

    c0, f0, d0 = keys(base)
    c1, f1, d1 = keys(replace(base, fit=replace(base.fit, lr=base.fit.lr * 2)))
    assert (c1, f1) == (c0, f0) and d1 != d0
    c2, f2, d2 = keys(replace(base, temperature=base.temperature / 2))
    assert "temperature" in GENERATION_FIELDS and c2 != c0 and f2 != f0 and d2 != d0
    c3, f3, _ = keys(replace(base, feature_dtype="float32"))
    assert c3 == c0 and f3 != f0
    # the draft loss: a new key only when it is not the default (drafts fitted before the setting keep theirs)
    _, _, d4 = keys(replace(base, fit=replace(base.fit, loss_type="tv")))
    assert d4 != d0
    legacy = asdict(base)
    del legacy["fit"]["loss_type"]
    assert d0 == _digest(c0, asdict(draft.config), legacy)


def test_cache_keys_survive_the_settings_move():
    """The settings moved to distill/settings.py and the corpus' fields are read from field metadata: every key of
    a cache written before stays what it was (these digests were computed by the code before the move)."""
    from dataclasses import dataclass

    from lightning_codraft.distill.settings import DraftFitConfig
    from lightning_codraft.distill.stages import FEATURE_FIELDS, GENERATION_FIELDS, corpus_key, draft_key, features_key

    @dataclass
    class Config:
        a: int = 1

    class Draft:
        config = Config()

    assert set(GENERATION_FIELDS) == {"num_prompts", "heldout_prompts", "max_new_tokens", "temperature", "top_p",
                                      "generation_batch", "generation_budget_s", "generation_dtype", "seed",
                                      "time_budget_s", "generation_share"}
    assert FEATURE_FIELDS == ("feature_dtype", "feature_precision")
    out = []
    for s in (WarmStartSettings(num_prompts=7, generation_budget_s=30, fit=DraftFitConfig(epochs=3, loss_type="tv")),
              WarmStartSettings()):
        c = corpus_key("pol", [[1, 2], [3]], s)
        out += [c, features_key(c, torch.arange(5), (1, 2), s), draft_key(c, Draft(), s)]
    assert out == ["59679c4ba22ea35dcd51f3c7", "7971d1ff81cefbd7beed0c79", "f44fd6ee4084406309f0e0b0",
                   "1ed6e3438e27c9f0a7c7bd82", "dc09db9abfe3f888ac1ca18d", "5fe819c1bb4daebf2e083077"]
