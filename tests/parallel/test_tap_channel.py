import pytest
import torch
import torch.distributed as dist
from distributed import run_distributed

from lightning_codraft.parallel.tap_channel import TapChannel

T, H, M = 6, 5, 3


def _tap_value(coord: int, m: int, tap: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * coord + 10 * m + tap)
    return torch.randn(T, H, generator=g)


def _simulated_pipeline(stage, num_stages, coord, owners, channel, pipe_group, drain_first):
    """A fill-drain schedule with BLOCKING activation send/recv on the pipeline group: taps must not block it."""
    channel.begin(M, (T, H), torch.float32)
    got = {}
    act = torch.zeros(1)
    if drain_first:  # every stage sends all its taps before the last stage asks for any (a barrier between)
        for m in range(M):
            for tap in sorted(t for t, o in owners.items() if o == stage):
                channel.send(m, tap, _tap_value(coord, m, tap))
        dist.barrier(group=pipe_group)
        if channel.is_last:
            got = {m: channel.receive(m) for m in reversed(range(M))}
    else:
        for m in range(M):
            if stage > 0:
                dist.recv(act, group=pipe_group, group_src=stage - 1)
            for tap in sorted(t for t, o in owners.items() if o == stage):
                channel.send(m, tap, _tap_value(coord, m, tap))
            if stage < num_stages - 1:
                dist.send(act, group=pipe_group, group_dst=stage + 1)
            else:
                got[m] = channel.receive(m)
    channel.finish()
    return {m: {t: v.clone() for t, v in taps.items()} for m, taps in got.items()}, channel.bytes_sent


def _worker(rank, world_size):
    results = {}
    # layout A: 4 stages, one (dp, cp) coordinate; taps on the first, a middle and the last stage, none on stage 2
    pipe = dist.new_group(list(range(4)))
    taps = dist.new_group(list(range(4)))
    owners = {0: 0, 1: 0, 3: 1, 6: 3, 8: 3}
    for drain_first in (False, True):
        ch = TapChannel(owners, stage=rank, num_stages=4, group=taps)
        results[("A", drain_first)] = _simulated_pipeline(rank, 4, 0, owners, ch, pipe, drain_first)
    # layout B: pp=2 x cp=2, rank = pp_rank * cp + cp_rank; one channel per cp coordinate
    groups = {}
    for c in range(2):
        ranks = [p * 2 + c for p in range(2)]
        groups[c] = (dist.new_group(ranks), dist.new_group(ranks))
    p, c = divmod(rank, 2)
    owners_b = {2: 0, 4: 1, 5: 0}
    ch = TapChannel(owners_b, stage=p, num_stages=2, group=groups[c][1])
    results["B"] = _simulated_pipeline(p, 2, c, owners_b, ch, groups[c][0], False)
    return results


def test_taps_received_equal_taps_sent_on_any_layout_without_deadlock():
    results = run_distributed(_worker, world_size=4, timeout=120)
    owners = {0: 0, 1: 0, 3: 1, 6: 3, 8: 3}
    for drain_first in (False, True):
        got, _ = results[3][("A", drain_first)]
        assert sorted(got) == list(range(M))
        for m in range(M):
            assert list(got[m]) == sorted(owners)
            for tap in owners:
                torch.testing.assert_close(got[m][tap], _tap_value(0, m, tap), rtol=0, atol=0)
    # bytes: stage 0 ships 2 taps, stage 1 one, stage 2 none, the last stage keeps its taps local
    per_tap = T * H * 4 * M
    assert [results[r][("A", False)][1] for r in range(4)] == [2 * per_tap, per_tap, 0, 0]
    for rank in (2, 3):  # last stage of each cp coordinate
        got, _ = results[rank]["B"]
        for m in range(M):
            assert list(got[m]) == [2, 4, 5]
            for tap in (2, 4, 5):
                torch.testing.assert_close(got[m][tap], _tap_value(rank % 2, m, tap), rtol=0, atol=0)


def test_single_stage_passes_taps_locally_and_counts_no_bytes():
    ch = TapChannel({0: 0, 3: 0}, stage=0, num_stages=1)
    ch.begin(2, (T, H), torch.float32)
    x = torch.randn(T, H, requires_grad=True)
    for m in range(2):
        ch.send(m, 3, x * (m + 1))
        ch.send(m, 0, x)
    out = ch.receive(1)
    assert list(out) == [0, 3] and not out[3].requires_grad
    torch.testing.assert_close(out[3], 2 * x.detach())
    ch.finish()
    assert ch.bytes_sent == 0 and ch.bytes_received == 0


def test_clear_errors():
    with pytest.raises(ValueError, match="tap 4 is owned by stage 2, outside \\[0, 2\\)"):
        TapChannel({4: 2}, stage=0, num_stages=2)
    with pytest.raises(ValueError, match="needs a process group"):
        TapChannel({1: 0}, stage=0, num_stages=2)
    ch = TapChannel({1: 0}, stage=0, num_stages=1)
    with pytest.raises(RuntimeError, match="call begin\\(\\) first"):
        ch.send(0, 1, torch.zeros(T, H))
    ch.begin(1, (T, H), torch.float32)
    with pytest.raises(ValueError, match="tap 2 is not one of the channel's taps \\(1,\\)"):
        ch.send(0, 2, torch.zeros(T, H))
    with pytest.raises(ValueError, match="is \\(7, 5\\) torch.float32 but the channel was begun with \\(6, 5\\)"):
        ch.send(0, 1, torch.zeros(7, H))
    with pytest.raises(RuntimeError, match="was not sent before receive"):
        ch.receive(0)
    with pytest.raises(RuntimeError, match="never sent \\(microbatch, tap\\) \\[\\(0, 1\\)\\]"):
        ch.finish()


def _window_worker(rank, world_size, drain_first):
    pipe, taps = dist.new_group([0, 1]), dist.new_group([0, 1])
    owners = {0: 0, 1: 0, 2: 1}
    ch = TapChannel(owners, stage=rank, num_stages=2, group=taps)
    ch.begin(M, (T, H), torch.float32, window=1)
    posted, got, act = [], {}, torch.zeros(1)
    if ch.is_last:
        posted.append(len(ch._recvs))
    if drain_first:  # the sender runs every microbatch ahead: its sends wait for the window to reach them
        if rank == 0:
            for m in range(M):
                for tap in (0, 1):
                    ch.send(m, tap, _tap_value(0, m, tap))
        dist.barrier(group=pipe)
        if ch.is_last:
            for m in range(M):
                ch.send(m, 2, _tap_value(0, m, 2))
                got[m] = ch.receive(m)
                posted.append(len(ch._recvs))
    else:
        for m in range(M):
            if rank == 0:
                for tap in (0, 1):
                    ch.send(m, tap, _tap_value(0, m, tap))
                dist.send(act, group=pipe, group_dst=1)
            else:
                dist.recv(act, group=pipe, group_src=0)
                ch.send(m, 2, _tap_value(0, m, 2))
                got[m] = ch.receive(m)
                posted.append(len(ch._recvs))
    ch.finish()
    return posted, {m: {t: v.clone() for t, v in x.items()} for m, x in got.items()}


@pytest.mark.parametrize("drain_first", [False, True])
def test_a_receive_window_bounds_the_landing_buffers_and_loses_nothing(drain_first):
    _, (posted, got) = run_distributed(_window_worker, 2, args=(drain_first,), timeout=120)
    assert max(posted) <= 1  # never more than `window` microbatches' buffers on the last stage
    for m in range(M):
        for tap in (0, 1, 2):
            torch.testing.assert_close(got[m][tap], _tap_value(0, m, tap))
