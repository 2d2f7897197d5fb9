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
    assert float(out["acceptance_length"]) == pytest.approx(expected)
    m.reset()
    m.update(torch.zeros(3), torch.zeros(3))
    assert float(m.compute()["acceptance_length"]) == 1.0


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
        assert r["acceptance_length"] == pytest.approx(1 + acc0 + acc0 * acc1)
