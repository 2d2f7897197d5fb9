"""Bucketed refit: weights travel from the training state to an engine in fixed-size buckets, by reference.

A refit streams ``(name, tensor)`` pairs (the training state gathered one tensor at a time: ``parallel/stream.py``)
into flat buffers of at most ``bucket_bytes`` (a tensor larger than that gets a bucket of its own), cast to the
engine's dtype on the sender. Each :class:`WeightBucket` carries its manifest (name, byte offset, shape, dtype of
every tensor), the model it belongs to (``"policy"`` / ``"draft"``), its index, the weights' version (optimizer
steps) and a checksum of its bytes computed on the buffer's device as it is packed (:func:`bucket_checksum`: int64
sums over the buffer's words, two of them position-weighted, so a changed or reordered word moves it).

The receiver (:class:`BucketReceiver`) recomputes the checksum where the bucket lands, refuses a bucket of another
version (stale) or out of order, and at the end of a model's buckets refuses a push that lacked one (a dropped
bucket) or left a tensor of the engine unfilled (a lost draft). Buffers are reused: :func:`pack_buckets` keeps a
pool of two, so a refit holds at most two buckets beyond the engine's own weights, on the sender's device and, for
an engine in another process, in shared host memory (CPU) or a CUDA IPC handle (GPU) — never pickled bytes
(:func:`share_handle`, :func:`open_handle`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.multiprocessing.reductions import reduce_tensor

DEFAULT_BUCKET_BYTES = 256 * 2**20
"""Bytes per bucket unless a caller says otherwise (the refit's peak extra memory is two of them)."""


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a bucket."""

    name: str
    """The tensor's name in the model's state dict."""
    offset: int
    """Byte offset in the bucket's buffer (a multiple of 16)."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: torch.dtype
    """Its dtype in the bucket (the engine's, for floating tensors)."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class WeightBucket:
    """One bucket of a refit (see the module docstring)."""

    kind: str
    """``"policy"`` or ``"draft"``."""
    index: int
    """0, 1, ... within this push of ``kind``."""
    version: int
    """The weights' version: optimizer steps of the state they come from."""
    buffer: torch.Tensor
    """``(capacity,)`` uint8; the first :attr:`size` bytes hold the entries."""
    entries: list[BucketEntry] = field(default_factory=list)
    """The tensors it holds, in stream order."""
    size: int = 0
    """Bytes in use."""
    checksum: tuple[int, ...] = (0, 0, 0)
    """:func:`bucket_checksum` of the used bytes, computed by the sender."""
    last: bool = False
    """The last bucket of this push of ``kind``."""

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, view)`` of every entry: views into the buffer, valid until the buffer is reused."""
        for e in self.entries:
            yield e.name, self.buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def bucket_checksum(data: torch.Tensor) -> tuple[int, int, int]:
    """Three int64 sums of ``data``'s bytes (uint8, length a multiple of 8) read as int64 words in rows of 512, on
    its device: the plain sum, the row sums weighted by ``row + 1`` and the column sums weighted by ``column + 1``.
    Integer sums wrap around and do not depend on the order of addition, so the sender's and the receiver's agree
    exactly when the bytes do, whatever their thread counts; a changed word moves the plain sum, two words swapped
    move a weighted one. Two passes over the bytes at memory speed (no int64 copy is made)."""
    words = data.view(torch.int64)
    rows = words.numel() // 512
    body, tail = words[: rows * 512].view(rows, 512), words[rows * 512 :]
    row_sums = torch.cat([body.sum(dim=1), tail.sum().view(1)])
    col_sums = body.sum(dim=0)
    col_sums[: tail.numel()] += tail
    index = torch.arange(1, max(rows + 1, 512) + 1, device=words.device, dtype=torch.int64)
    return (int(row_sums.sum()), int((row_sums * index[: rows + 1]).sum()), int((col_sums * index[:512]).sum()))


def _align(n: int) -> int:
    return (n + 15) // 16 * 16


class BucketPool:
    """The two buffers a refit's buckets are packed into in turn, kept between refits (a fresh buffer pays its
    page faults on every refit) until :meth:`release` (the training phase: the RL loop frees them with the engine's
    copies)."""

    def __init__(self, shared: bool = False):
        self.shared = shared
        self.buffers: list[torch.Tensor] = []
        self.turn = 0

    def take(self, capacity: int, device: torch.device) -> torch.Tensor:
        """The next buffer, at least ``capacity`` bytes on ``device`` (replacing a smaller or foreign one)."""
        slot = self.turn % 2
        self.turn += 1
        if len(self.buffers) <= slot:
            self.buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self.buffers[slot].numel() < capacity or self.buffers[slot].device != device:
            self.buffers[slot] = torch.empty(0, dtype=torch.uint8, device=device)  # the old buffer is freed first
            if self.shared and device.type == "cpu":  # a fresh shared-memory file any process can map by name;
                storage = torch.UntypedStorage._new_using_filename_cpu(capacity)  # its pages cost once written
                self.buffers[slot] = torch.empty(0, dtype=torch.uint8).set_(storage)
            else:
                self.buffers[slot] = torch.empty(capacity, dtype=torch.uint8, device=device)
        return self.buffers[slot]

    def release(self) -> None:
        """Free both buffers."""
        self.buffers, self.turn = [], 0


def pack_buckets(
    items: Iterable[tuple[str, torch.Tensor]],
    kind: str,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device | str] = None,
    shared: bool = False,
    pool: Optional[BucketPool] = None,
) -> Iterator[WeightBucket]:
    """Pack a ``(name, tensor)`` stream into buckets of at most ``bucket_bytes`` (one oversized tensor: a bucket of
    its own), floating tensors cast to ``dtype`` (None: as they come), on ``device`` (None: each tensor's).

    Two buffers are reused in turn (``pool``, default a fresh one): consume (load) a bucket before asking for the
    one after the next. ``shared``: CPU buffers in shared memory, so another process can map them
    (:func:`share_handle`); a given ``pool`` decides it.
    """
    if bucket_bytes < 16:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 16")
    pool = pool if pool is not None else BucketPool(shared)
    buffer = pool.take

    def finish(bucket: WeightBucket, last: bool) -> WeightBucket:
        bucket.last = last
        bucket.checksum = bucket_checksum(bucket.buffer[: bucket.size])
        return bucket

    current: Optional[WeightBucket] = None
    index = 0
    for name, tensor in items:
        t = tensor.detach()
        if dtype is not None and torch.is_floating_point(t):
            t = t.to(dtype)
        dev = torch.device(device) if device is not None else t.device
        nbytes = t.numel() * t.element_size()
        if current is not None and (_align(current.size) + nbytes > bucket_bytes or current.buffer.device != dev):
            yield finish(current, last=False)
            current = None
        if current is None:
            current = WeightBucket(kind, index, int(version), buffer(max(bucket_bytes, _align(nbytes)), dev))
            index += 1
        offset = _align(current.size)
        current.buffer[current.size : offset].zero_()  # padding bytes are part of the checksum
        current.buffer[offset : offset + nbytes].view(t.dtype).view(t.shape).copy_(t)  # no view kept: see the pool
        current.entries.append(BucketEntry(name, offset, tuple(t.shape), t.dtype))
        current.size = _align(offset + nbytes)
        current.buffer[offset + nbytes : current.size].zero_()
    if current is None:  # an empty model still ends its push: the receiver checks completeness on it
        current = WeightBucket(kind, index, int(version), buffer(16, torch.device(device or "cpu")))
    yield finish(current, last=True)


def prefetched(buckets: Iterable[WeightBucket]) -> Iterator[WeightBucket]:
    """``buckets``, the next one packed in a background thread while the caller loads the current one: the
    sender's gather, cast and checksum overlap the engine's loading. With :func:`pack_buckets`' two buffers this is
    safe as long as the caller is done with a bucket when it asks for the next (the packing of bucket ``i + 2``,
    into bucket ``i``'s buffer, starts then). The stream's collectives, if any, all run in that one thread, in
    order; the thread works on the caller's current accelerator device."""
    items, done = iter(buckets), object()
    device = torch.accelerator.current_device_index() if torch.accelerator.is_available() else None

    def pack_next():
        if device is not None:
            torch.accelerator.set_device_index(device)
        return next(items, done)

    with ThreadPoolExecutor(1, thread_name_prefix="codraft-refit") as packer:
        pending = packer.submit(pack_next)
        while (bucket := pending.result()) is not done:
            pending = packer.submit(pack_next)
            yield bucket


class RefitError(RuntimeError):
    """A refit did not deliver the trainer's weights: a corrupted, stale, out-of-order or missing bucket, or a
    tensor of the engine that no bucket filled."""


class BucketReceiver:
    """The engine's side of a refit of one model: check each bucket as it lands, track what was filled.

    Args:
        kind: ``"policy"`` or ``"draft"``.
        version: the version this push must carry (None: take the first bucket's).
        expected: the names the engine needs filled (None: no completeness check).
        verify: recompute every bucket's checksum on arrival (``"buckets"``, default) or not (``"off"``).
    """

    def __init__(
        self,
        kind: str,
        version: Optional[int] = None,
        expected: Optional[Iterable[str]] = None,
        verify: str = "buckets",
    ):
        if verify not in ("buckets", "off"):
            raise ValueError(f"verify={verify!r} must be 'buckets' or 'off'")
        self.kind, self.version, self.verify = kind, version, verify
        self.expected = None if expected is None else set(expected)
        self.filled: set[str] = set()
        self.next_index = 0
        self.done = False

    def accept(self, bucket: WeightBucket) -> Iterator[tuple[str, torch.Tensor]]:
        """Check ``bucket`` and yield its ``(name, view)`` pairs to load; raises :class:`RefitError`."""
        if bucket.kind != self.kind:
            raise RefitError(f"a {bucket.kind} bucket arrived in the {self.kind} push")
        if self.done:
            raise RefitError(f"{self.kind}: bucket {bucket.index} arrived after the push's last bucket")
        if self.version is None:
            self.version = bucket.version
        if bucket.version != self.version:
            raise RefitError(
                f"{self.kind}: bucket {bucket.index} carries version {bucket.version}, the push is "
                f"version {self.version} (a stale bucket)"
            )
        if bucket.index != self.next_index:
            raise RefitError(
                f"{self.kind}: bucket {bucket.index} arrived where bucket {self.next_index} was due (a "
                f"dropped or reordered bucket)"
            )
        if self.verify == "buckets" and bucket_checksum(bucket.buffer[: bucket.size]) != tuple(bucket.checksum):
            raise RefitError(
                f"{self.kind}: bucket {bucket.index} (version {bucket.version}) does not match its "
                f"checksum: its bytes changed on the way"
            )
        self.next_index += 1
        self.done = bucket.last
        for name, view in bucket.tensors():
            self.filled.add(name)
            yield name, view

    def finish(self) -> None:
        """Raise :class:`RefitError` unless the push ended with its last bucket and filled every expected name."""
        if not self.done:
            raise RefitError(
                f"{self.kind}: the push of version {self.version} ended after {self.next_index} "
                f"buckets without its last one (a dropped bucket)"
            )
        missing = (self.expected or set()) - self.filled
        if missing:
            raise RefitError(
                f"{self.kind}: the push of version {self.version} left {len(missing)} tensors of the "
                f"engine unfilled, e.g. {sorted(missing)[:3]}"
            )


def copy_into(params: dict[str, torch.Tensor], pairs: Iterable[tuple[str, torch.Tensor]], bucket: WeightBucket) -> None:
    """Copy a bucket's ``(name, view)`` pairs into ``params`` (a module's ``state_dict(keep_vars=True)``) in place;
    a name the module does not have is a :class:`RefitError`."""
    with torch.no_grad():
        for name, view in pairs:
            if name not in params:
                raise RefitError(
                    f"{bucket.kind}: bucket {bucket.index} carries {name!r}, which the engine's "
                    f"{bucket.kind} does not have"
                )
            params[name].data.copy_(view)


def share_handle(bucket: WeightBucket) -> tuple:
    """A plain-data reference to ``bucket``'s buffer for another process (no bytes copied; picklable by any
    pickler): a CPU buffer must be in shared memory (``pack_buckets(shared=True)``) and travels by the name of its
    shared-memory file; a CUDA buffer travels as a CUDA IPC handle."""
    meta = dict(
        kind=bucket.kind,
        index=bucket.index,
        version=bucket.version,
        size=bucket.size,
        checksum=tuple(bucket.checksum),
        last=bucket.last,
        entries=[(e.name, e.offset, e.shape, str(e.dtype).removeprefix("torch.")) for e in bucket.entries],
    )
    if bucket.buffer.device.type == "cpu":
        if not bucket.buffer.is_shared():
            raise ValueError("the bucket's CPU buffer is not in shared memory; pack with shared=True")
        return "cpu_shm", bucket.buffer.untyped_storage()._share_filename_cpu_(), meta
    return "cuda_ipc", reduce_tensor(bucket.buffer), meta


def open_handle(handle: tuple) -> WeightBucket:
    """The :class:`WeightBucket` a :func:`share_handle` reference points to, mapped in this process."""
    how, ref, meta = handle
    if how == "cpu_shm":
        buffer = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared_filename_cpu(*ref))
    elif how == "cuda_ipc":
        rebuild, args = ref
        buffer = rebuild(*args)
    else:
        raise ValueError(f"unknown bucket handle kind {how!r}")
    entries = [BucketEntry(n, o, tuple(s), getattr(torch, d)) for n, o, s, d in meta["entries"]]
    return WeightBucket(
        meta["kind"],
        meta["index"],
        meta["version"],
        buffer,
        entries,
        meta["size"],
        tuple(meta["checksum"]),
        meta["last"],
    )
