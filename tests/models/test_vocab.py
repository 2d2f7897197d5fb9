import pytest
import torch

from lightning_codraft.models.vocab import build_vocab_mapping, count_tokens


def test_most_frequent_tokens_are_chosen_in_id_order():
    counts = torch.tensor([5, 0, 9, 1, 9, 3, 0, 7])
    d2t, t2d = build_vocab_mapping(counts, 4)
    # top-4 by count: ids 2 (9), 4 (9), 7 (7), 0 (5)  -> sorted 0, 2, 4, 7
    assert t2d.tolist() == [True, False, True, False, True, False, False, True]
    assert d2t.dtype == torch.int64
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 4, 7]
    assert (torch.arange(4) + d2t).tolist() == t2d.nonzero().flatten().tolist()


def test_ties_prefer_smaller_ids_and_full_vocab_is_identity():
    d2t, t2d = build_vocab_mapping(torch.ones(6), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2]
    d2t, t2d = build_vocab_mapping(torch.rand(6), 6)
    assert d2t.tolist() == [0] * 6 and bool(t2d.all())


def test_random_mapping_is_consistent():
    g = torch.Generator().manual_seed(1)
    counts = torch.randint(0, 1000, (300,), generator=g)
    d2t, t2d = build_vocab_mapping(counts, 40)
    targets = torch.arange(40) + d2t
    assert targets.unique().numel() == 40 and bool(t2d[targets].all()) and int(t2d.sum()) == 40
    # every chosen token is at least as frequent as every rejected one
    assert counts[t2d].min() >= counts[~t2d].max()


def test_count_tokens_and_errors():
    assert count_tokens(torch.tensor([[0, 2], [2, 2]]), 4).tolist() == [1, 0, 3, 0]
    with pytest.raises(ValueError, match="vocab_size=4"):
        count_tokens(torch.tensor([4]), 4)
    with pytest.raises(ValueError, match=r"draft_vocab_size=7 must be in \[1, vocab_size=6\]"):
        build_vocab_mapping(torch.ones(6), 7)
    with pytest.raises(ValueError, match="draft_vocab_size=0"):
        build_vocab_mapping(torch.ones(6), 0)
    with pytest.raises(ValueError, match="1-D"):
        build_vocab_mapping(torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match="non-negative"):
        build_vocab_mapping(torch.tensor([1.0, -1.0]), 1)
