"""One small launcher for multi-process tests: spawn N gloo ranks on this machine.

Usage::

    def _worker(rank, world_size, tmp):   # module-level, picklable
        ...                               # torch.distributed is initialised (gloo)
        return some_picklable_value

    results = run_distributed(_worker, world_size=4, args=(tmp,))   # list indexed by rank

Each rank runs with ``torch.set_num_threads(1)``; an exception on any rank fails the test with that
rank's traceback; a hang fails after ``timeout`` seconds instead of blocking the suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # plain pickle copies tensors' bytes: the queue's own pickler shares their storage by a file descriptor
        # that the parent can only fetch while this process lives (it may have exited by then: FileNotFoundError)
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return per-rank results."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise TimeoutError(f"distributed test did not finish in {timeout}s "
                               f"({len(results)} of {world_size} ranks returned)")
        if queue.empty():
            if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                time.sleep(0.5)
                if queue.empty():
                    for p in procs:
                        p.kill()
                    raise RuntimeError(f"a rank died: exit codes {[p.exitcode for p in procs]}")
            time.sleep(0.02)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors.append(f"rank {rank}:\n{payload}")
            break
    if errors:
        for p in procs:
            p.kill()
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():  # returned its result but hangs on exit (e.g. a child it started): never block the suite
            p.kill()
    return [results[r] for r in range(world_size)]
