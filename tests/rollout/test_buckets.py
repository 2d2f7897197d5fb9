"""rollout/refit/buckets.py: a bucketed refit delivers the trainer's tensors bit for bit in the engine's dtype, in at most
two reused buffers, by reference across processes; a corrupted, stale, dropped or incomplete push fails loudly."""

import subprocess
import sys
import threading

import pytest
import torch

from lightning_codraft.rollout.refit.buckets import (BucketReceiver, RefitError, bucket_checksum, open_handle,
                                               pack_buckets, prefetched, share_handle)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(50, 24, generator=g), "layers.0.w": torch.randn(24, 24, generator=g),
            "layers.0.b": torch.randn(24, generator=g), "big": torch.randn(300, 40, generator=g),
            "d2t": torch.arange(7, dtype=torch.int64), "norm.weight": torch.randn(24, generator=g)}


def _receive(buckets, kind="policy", expected=None, version=None):
    rec, out = BucketReceiver(kind, version=version, expected=expected), {}
    for b in buckets:
        for name, view in rec.accept(b):
            out[name] = view.clone()
    rec.finish()
    return out


@pytest.mark.parametrize("bucket_bytes", [64, 4096, 10**6])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_refit_delivers_every_tensor_bit_for_bit_in_the_engines_dtype(bucket_bytes, dtype):
    state = _state()
    got = _receive(pack_buckets(state.items(), "policy", 3, bucket_bytes, dtype=dtype), expected=state)
    assert list(got) == list(state)
    for name, t in state.items():
        want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


def test_at_most_two_buffers_whatever_the_number_of_buckets():
    """Two buffers reused in turn; an oversized tensor replaces one of them (the old one is freed), so at every
    bucket at most two buffers are alive."""
    import gc
    import weakref

    state = {f"w{i}": torch.randn(20, 20) for i in range(12)}
    ptrs = {b.buffer.data_ptr() for b in pack_buckets(state.items(), "policy", 0, bucket_bytes=4096)}
    assert len(ptrs) == 2
    alive, n = [], 0
    for b in pack_buckets(_state().items(), "policy", 0, bucket_bytes=4096):
        alive.append(weakref.ref(b.buffer))
        del b
        gc.collect()
        assert len({id(r()) for r in alive if r() is not None}) <= 2
        n += 1
    assert n >= 4


def test_a_corrupted_stale_dropped_or_incomplete_push_fails():
    state = _state()
    buckets = list(b for b in pack_buckets(state.items(), "draft", 5, bucket_bytes=4096))
    # materialise each bucket (the pool reuses two buffers): a copy per bucket for this test
    copies = []
    for b in pack_buckets(state.items(), "draft", 5, bucket_bytes=4096):
        b.buffer = b.buffer.clone()
        copies.append(b)
    assert len(buckets) == len(copies) >= 3
    bad = copies[1].buffer.clone()
    bad[copies[1].entries[0].offset] ^= 1        # one bit flipped on the way
    corrupted = [copies[0], type(copies[1])(**{**copies[1].__dict__, "buffer": bad}), *copies[2:]]
    with pytest.raises(RefitError, match="does not match its checksum"):
        _receive(corrupted, "draft")
    with pytest.raises(RefitError, match="stale"):
        _receive(copies, "draft", version=6)  # the engine expects the current version
    with pytest.raises(RefitError, match="dropped or reordered"):
        _receive([copies[0], *copies[2:]], "draft")
    with pytest.raises(RefitError, match="without its last one"):
        _receive(copies[:-1], "draft")
    lost = {k: v for k, v in state.items() if k != "norm.weight"}
    with pytest.raises(RefitError, match="unfilled"):  # e.g. a draft tensor no bucket carried
        _receive(pack_buckets(lost.items(), "draft", 5, 4096), "draft", expected=state)
    with pytest.raises(RefitError, match="in the policy push"):
        _receive(copies, "policy")


@pytest.mark.parametrize("n", [64, 8 * 512 * 3 + 48])
def test_the_checksum_moves_with_any_changed_or_swapped_word(n):
    x = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    base = bucket_checksum(x)
    pairs = [(0, 1), (0, 512), (3, 700), (2, n // 8 - 1)]   # word pairs: same row, same column, neither, the tail
    for a, b in [(a, b) for a, b in pairs if b < n // 8]:
        y = x.clone().view(torch.int64)
        y[[a, b]] = y[[b, a]]
        got = bucket_checksum(y.view(torch.uint8))
        assert got[0] == base[0] and got != base, (a, b)   # the plain sum stays, a weighted one moves
    y = x.clone()
    y[10] += 1
    assert bucket_checksum(y)[0] != base[0]
    assert bucket_checksum(x.clone()) == base


def test_a_shared_bucket_is_read_by_another_process_without_copying_bytes():
    state = _state()
    handles, sums = [], []
    for b in pack_buckets(state.items(), "policy", 2, bucket_bytes=10**6, shared=True):
        handles.append(share_handle(b))
        sums.append(b.checksum)
    assert len(handles) == 1
    code = ("import pickle, sys, torch\n"
            "from lightning_codraft.rollout.refit.buckets import open_handle, bucket_checksum\n"
            "b = open_handle(pickle.loads(sys.stdin.buffer.read()))\n"
            "print(bucket_checksum(b.buffer[:b.size]), b.version, [n for n, _ in b.tensors()])\n")
    import pickle

    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(handles[0]), capture_output=True,
                         check=True).stdout.decode()
    assert out.strip() == f"{tuple(sums[0])} 2 {list(state)}"
    with pytest.raises(ValueError, match="shared memory"):
        share_handle(next(pack_buckets(state.items(), "policy", 2)))
    assert open_handle(handles[0]).checksum == sums[0]


def test_prefetched_packs_the_next_bucket_while_the_caller_loads_this_one_and_never_two_ahead():
    """The sender's packing overlaps the engine's loading, but bucket i + 2 (which reuses bucket i's buffer) is
    packed only once the caller asked for bucket i + 1, i.e. is done with bucket i."""
    started, packed = [], {i: threading.Event() for i in range(5)}
    threads = set()

    def source():
        for i in range(5):
            started.append(i)
            threads.add(threading.current_thread().name)
            packed[i].set()
            yield i

    stream = prefetched(source())
    for i in range(5):
        assert next(stream) == i
        if i + 1 < 5:
            assert packed[i + 1].wait(10), f"bucket {i + 1} was not packed while the caller held bucket {i}"
        assert max(started) == min(i + 1, 4)  # never two ahead
    assert list(stream) == [] and all(t.startswith("codraft-refit") for t in threads)


def test_prefetched_buckets_equal_the_plain_stream_and_a_packing_error_reaches_the_caller():
    state = _state(3)
    plain = _receive(pack_buckets(state.items(), "policy", 1, 4096))
    assert all(torch.equal(v, plain[k]) for k, v in _receive(prefetched(pack_buckets(state.items(), "policy", 1,
                                                                                     4096))).items())

    def broken():
        yield "embed.weight", state["embed.weight"]
        raise OSError("the gather failed")

    with pytest.raises(OSError, match="the gather failed"):
        list(prefetched(pack_buckets(broken(), "policy", 1, 64)))
