"""RLBatch: packing, microbatch split, padding, zigzag shard and the within-document shift, from their definitions."""

import pytest
import torch
from distributed import run_distributed

from lightning_codraft.batch import RLBatch


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 40, (max(1, n // 3),), generator=g).tolist() for n in lengths]
    completions = [torch.randint(3, 40, (n - max(1, n // 3),), generator=g).tolist() for n in lengths]
    logprobs = [(-torch.rand(len(c), generator=g)).tolist() for c in completions]
    return RLBatch.pack(prompts, completions, logprobs, [float(i) - 1.5 for i in range(len(lengths))],
                        ref_logprobs=logprobs, multiple_of=4)


def _zigzag_rows(cu, rank, cp):
    rows = []
    for s, e in zip(cu[:-1], cu[1:]):
        c = (e - s) // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            rows.extend(range(s + chunk * c, s + (chunk + 1) * c))
    return rows


def test_shard_is_the_zigzag_definition_and_keeps_cu_seqlens_global():
    batch = _batch([7, 13, 4])
    cu = batch.cu_seqlens.tolist()
    for r in range(2):
        shard = batch.shard(r, 2)
        rows = _zigzag_rows(cu, r, 2)
        assert shard.cp_rank == r and shard.cp_size == 2 and shard.is_sharded
        assert shard.cu_seqlens is batch.cu_seqlens and shard.num_tokens == batch.num_tokens
        for name, t in shard.row_tensors().items():
            assert torch.equal(t, getattr(batch, name)[rows]), name
    assert batch.shard(0, 1) is batch


def test_split_deals_whole_documents_and_pad_appends_one_inert_document():
    batch = _batch([4, 8, 4, 12, 4])
    mbs = batch.split(2)
    assert [mb.cu_seqlens.tolist() for mb in mbs] == [[0, 4, 12, 16], [0, 12, 16]]
    assert torch.equal(torch.cat([mb.input_ids for mb in mbs]), batch.input_ids)
    assert mbs[0].cu_seqlens.dtype == torch.int32
    padded = mbs[1].pad_to(20)
    assert padded.cu_seqlens.tolist() == [0, 12, 16, 20] and padded.num_rows == 20
    assert padded.position_ids[-4:].tolist() == [0, 1, 2, 3]
    for name in ("valid", "loss_mask", "old_logprobs", "advantages", "draft_mask", "ref_logprobs"):
        assert not getattr(padded, name)[-4:].any(), name
    assert mbs[1].pad_to(16) is mbs[1]


def test_errors_name_the_problem():
    batch = _batch([4, 8])
    with pytest.raises(ValueError, match="2 documents into num_microbatches=3"):
        batch.split(3)
    with pytest.raises(ValueError, match="not a multiple of 8"):
        batch.shard(0, 4)
    with pytest.raises(ValueError, match="needs the whole batch, but this one is CP rank 1's shard"):
        batch.shard(1, 2).split(1)
    with pytest.raises(ValueError, match="cannot pad a batch of 12 tokens down to 8"):
        batch.pad_to(8)
    with pytest.raises(ValueError, match="RLBatch.advantages has shape \\(5,\\) but the batch has 12 rows"):
        RLBatch.from_dict({**batch.to_dict(), "advantages": torch.zeros(5)})
    with pytest.raises(KeyError, match="missing \\['old_logprobs'\\], unknown \\['note'\\]"):
        RLBatch.from_dict({**{k: v for k, v in batch.to_dict().items() if k != "old_logprobs"}, "note": 1})
    with pytest.raises(TypeError, match="expected an RLBatch"):
        RLBatch.coerce([1, 2])
    with pytest.raises(ValueError, match="needs the CP process group"):
        batch.shard(0, 2).shift_left(batch.shard(0, 2).input_ids, 1)


def test_dict_layout_round_trips():
    batch = _batch([5, 9])
    again = RLBatch.coerce(batch.to_dict())
    for name, t in batch.row_tensors().items():
        assert torch.equal(getattr(again, name), t)
    assert RLBatch.coerce(batch) is batch


def _shift_worker(rank, world_size, batch):
    import torch.distributed as dist

    shard = batch.shard(rank, world_size)
    return [shard.shift_left(shard.input_ids, k, group=dist.group.WORLD).tolist() for k in (1, 3, 5)]


def test_shift_left_on_shards_equals_the_shift_of_the_whole_batch():
    batch = _batch([8, 16, 8], seed=3)
    results = run_distributed(_shift_worker, 2, args=(batch,), timeout=120)
    cu = batch.cu_seqlens.tolist()
    for k_i, k in enumerate((1, 3, 5)):
        want = []  # by definition: y[i] = x[i + k] inside the document, else 0
        for s, e in zip(cu[:-1], cu[1:]):
            want += [int(batch.input_ids[i + k]) if i + k < e else 0 for i in range(s, e)]
        whole = batch.shift_left(batch.input_ids, k).tolist()
        assert whole == want
        for r in range(2):
            assert results[r][k_i] == [want[i] for i in _zigzag_rows(cu, r, 2)]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_every_nth_document_of_a_shard_is_the_shard_of_every_nth_document(cp):
    whole = _batch([12, 24, 12, 36, 24], seed=3)  # multiples of 2 cp
    chosen, rows = whole.every_nth_document(2)
    assert chosen.num_docs == 3 and chosen.cu_seqlens.tolist() == [0, 12, 24, 48]
    assert torch.equal(chosen.input_ids, whole.input_ids[rows])
    for r in range(cp):
        got, _ = whole.shard(r, cp).every_nth_document(2)
        want = chosen.shard(r, cp)
        for k, v in want.row_tensors().items():
            assert torch.equal(getattr(got, k), v), (r, k)
        assert torch.equal(got.cu_seqlens, want.cu_seqlens)
