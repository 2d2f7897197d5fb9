import pytest
import torch

from lightning_codraft.training.objective import MicrobatchRecord, merge_microbatch_stats, step_metrics


def test_merge_microbatch_stats_sums_the_shares_of_the_step():
    merged = merge_microbatch_stats([{"pg_loss": 1.0, "num_tokens": 3.0}, {"pg_loss": 4.0, "num_tokens": 5.0}])
    assert merged == {"pg_loss": 5.0, "num_tokens": 8.0}
    assert merge_microbatch_stats([]) == {}


def test_step_metrics_sum_draft_counts_and_report_the_implied_acceptance_length():
    records = [MicrobatchRecord({"loss": torch.tensor(1.0)}, torch.tensor([3.0, 1.0]), torch.tensor([4.0, 4.0]),
                                torch.tensor([4.0, 3.0])),
               MicrobatchRecord({"loss": torch.tensor(3.0)}, torch.tensor([3.0, 2.0]), torch.tensor([4.0, 4.0]),
                                torch.tensor([3.0, 2.0]))]
    metrics, (correct, total) = step_metrics(records)
    assert correct.tolist() == [6.0, 3.0] and total.tolist() == [8.0, 8.0]
    assert metrics["loss"].item() == 4.0  # the shares of the step's loss add up
    assert metrics["draft/oov_share"].item() == pytest.approx(1 - 12 / 16)
    a0, a1 = 6 / 8, 3 / 8
    assert metrics["draft/acc_step0"].item() == pytest.approx(a0)
    assert metrics["draft/top1_acceptance"].item() == pytest.approx(1 + a0 + a0 * a1)
    metrics, counts = step_metrics([MicrobatchRecord({"loss": torch.tensor(1.0)})])
    assert counts is None and set(metrics) == {"loss"}
