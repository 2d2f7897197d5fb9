"""Asynchronous RL (deterministic k-step-off) on a mesh equals the one-process asynchronous run: every rank runs a
producer thread that decodes its share of its replica's requests and gathers them on the replica's own producer group
(never interleaving with the trainer's collectives), the refit runs on the trainer's thread, and the checkpoint holds
every replica's finished rollouts (a resume repeats the run). Tolerances as in test_loop_parallel.py."""

import pytest
from distributed import run_distributed
from test_loop_parallel import (
    _every_rank_generates,
    _fit_worker,
    _same_rollouts,
    _same_rows,
    _weights_close,
    loop_config,
)

from lightning_codraft.config import ConfigError

ASYNC = ("rl.async_level=1",)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("async_1proc")
    return run_distributed(_fit_worker, world_size=1, args=(loop_config(out, *ASYNC),), timeout=300)[0]


def _resumed_equal(reports, ref):
    """A resumed run that generated no rollout of its own (they were in the checkpoint) repeats the reference."""
    for r in reports:
        _same_rollouts(r["rollouts"], ref["rollouts"])
    _same_rows(reports[0]["rows"], ref["rows"])
    _weights_close(reports[0]["policy"], ref["policy"])
    _weights_close(reports[0]["draft"], ref["draft"])


def test_the_reference_trains_on_stale_rollouts(reference):
    rows = reference["rows"]
    assert [r["policy_version"] for r in rows] == [0.0, 0.0] and [r["staleness"] for r in rows] == [0.0, 1.0]
    assert rows[1]["is_weight"] != 1.0  # corrected


def test_cp2_fsdp_async_equals_one_process_and_resumes(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.cp=2", *ASYNC)
    reports = run_distributed(_fit_worker, world_size=2, args=(cfg, 1), timeout=300)
    _every_rank_generates(reports, reference)
    assert all(not r["engine_models_are_training"] for r in reports)  # the producer decodes copies
    # killed after step 1 (its checkpoint holds step 2's rollouts, generated while step 1 trained): the resume
    # takes them and repeats step 2
    _resumed_equal([r["resumed"] for r in reports], reference)


def test_dp2_async_replicas_each_produce_their_own_prompts(reference, tmp_path):
    cfg = loop_config(tmp_path, "parallel.devices=2", "parallel.dp=2", *ASYNC)
    a, b = run_distributed(_fit_worker, world_size=2, args=(cfg, 1), timeout=300)
    _same_rollouts(a["rollouts"] + b["rollouts"], reference["rollouts"])
    assert a["rollouts"] != b["rollouts"] and [r["staleness"] for r in a["rows"]] == [0.0, 1.0]
    for name in ("policy", "draft"):
        _weights_close(a[name], reference[name])
    # each replica's finished rollouts are in the checkpoint: the resumed replicas train on the same ones
    _same_rollouts(a["resumed"]["rollouts"] + b["resumed"]["rollouts"], reference["rollouts"])
    _weights_close(a["resumed"]["policy"], reference["policy"])


def test_bounded_staleness_refuses_a_mesh(tmp_path):
    with pytest.raises(ConfigError, match="k-step-off"):
        loop_config(tmp_path, "parallel.devices=2", "parallel.dp=2", *ASYNC, "rl.max_staleness=1")
