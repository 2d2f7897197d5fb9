import pytest
import torch
from distributed import run_distributed

from lightning_codraft.training.metrics import DraftAcceptance


def test_accuracy_and_acceptance_length():
    m = DraftAcceptance(num_steps=3)
    m.update(torch.tensor([8, 3, 1]), torch.tensor([10, 6, 4]))
    m.update(torch.tensor([1, 2, 0]), torch.tensor([2, 2, 0]))
    out = m.compute()
    acc = [9 / 12, 5 / 8, 1 / 4]
    for k in range(3):
        assert float(out[f"acc/step{k}"]) == pytest.approx(acc[k])
    expected = 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2]
    assert float(out["top1_acceptance"]) == pytest.approx(expected)
    m.reset()
    m.update(torch.zeros(3), torch.zeros(3))
    assert float(m.compute()["top1_acceptance"]) == 1.0


def test_errors():
    with pytest.raises(ValueError, match="num_steps=0"):
        DraftAcceptance(num_steps=0)
    m = DraftAcceptance(num_steps=2)
    with pytest.raises(ValueError, match="num_steps=2"):
        m.update(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="correct <= total"):
        m.update(torch.tensor([2, 0]), torch.tensor([1, 1]))


def _worker(rank, world_size):
    m = DraftAcceptance(num_steps=2)
    # rank 0 sees few rows, rank 1 many: a mean of per-rank accuracies would be wrong
    if rank == 0:
        m.update(torch.tensor([1, 0]), torch.tensor([1, 1]))
    else:
        m.update(torch.tensor([3, 6]), torch.tensor([9, 9]))
    out = m.compute()
    return {k: float(v) for k, v in out.items()}


def test_reduction_across_two_processes():
    results = run_distributed(_worker, world_size=2, timeout=120)
    acc0, acc1 = 4 / 10, 6 / 10
    for r in results:
        assert r["acc/step0"] == pytest.approx(acc0)
        assert r["acc/step1"] == pytest.approx(acc1)
        assert r["top1_acceptance"] == pytest.approx(1 + acc0 + acc0 * acc1)


def test_a_renamed_metric_is_refused_by_its_new_name():
    """``draft/acceptance_length`` named the top-1-implied figure beside the engine's measured
    ``acceptance_length``: it is ``draft/top1_acceptance`` now, and asking for the old name says so."""
    from lightning_codraft.training.metrics import RENAMED_METRICS, check_metric_names

    assert RENAMED_METRICS == {"draft/acceptance_length": "draft/top1_acceptance"}
    check_metric_names(["draft/top1_acceptance", "acceptance_length", None], "test")
    with pytest.raises(KeyError, match="'draft/acceptance_length', renamed 'draft/top1_acceptance'"):
        check_metric_names(["loss", "draft/acceptance_length"], "a Trainer callback")
