"""TapChannel: ship detached target features ("taps") from the stages that compute them to the last stage.

Under pipeline parallelism the EAGLE-3 draft lives on the last stage, but the hidden states it consumes
(tap ``l`` = the hidden state ENTERING layer ``l``) are computed on whichever stage owns layer ``l``. The
pipeline schedule (GPipe, 1F1B) moves only the stage boundary activation between neighbours; TapChannel
moves the taps on a path of its own so the schedule is untouched:

* its own process group (``group``), separate from the pipeline's, holding the pipeline stages of ONE
  (dp, cp) coordinate in stage order (group rank ``s`` is stage ``s``); under CP every tensor is this
  rank's zigzag shard and the pairing by (dp, cp) keeps shards aligned;
* forward-only and detached: the draft loss never back-propagates into the policy, so nothing flows back;
* asynchronous: a stage that owns a tap ``isend``s it as soon as it is computed, keyed by
  ``(microbatch, tap)``; the last stage pre-posts every ``irecv`` into landing buffers at the start of the
  step (:meth:`TapChannel.begin`), so no send ever waits on the schedule and no schedule op waits on a tap
  (deadlock-free with any schedule that runs each stage's forwards in microbatch order);
* taps owned by the last stage pass locally (no copy, no communication).

The last stage calls :meth:`TapChannel.receive` for microbatch ``m`` (after its own forward of ``m``) and
gets the complete tap set; every stage calls :meth:`TapChannel.finish` after the schedule step to retire
its outstanding sends.

Messages between one pair of ranks are posted in the same order on both sides (microbatch-major, tap id
ascending) and carry the tag ``m * num_taps + index``, so they match under both tag-matching (gloo) and
order-matching (NCCL) transports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class TapChannel:
    """Forward-only, asynchronous transport of taps from their owning stages to the last stage.

    Args:
        owners: tap id -> index of the stage that computes it (tap ``l`` is computed by the stage holding
            layer ``l``; tap ``L`` by the last stage). Iteration order is irrelevant: taps are handled in
            ascending id order.
        stage: this rank's pipeline stage index.
        num_stages: number of pipeline stages.
        group: process group of the pipeline stages of this (dp, cp) coordinate, group rank == stage index;
            must be a group of its own (not the pipeline schedule's). ``None`` only with one stage.
    """

    def __init__(self, owners: Mapping[int, int], stage: int, num_stages: int, group: Optional[Any] = None):
        if num_stages < 1:
            raise ValueError(f"num_stages={num_stages} must be >= 1")
        if not 0 <= stage < num_stages:
            raise ValueError(f"stage={stage} is outside [0, {num_stages}) stages")
        for tap, owner in owners.items():
            if not 0 <= owner < num_stages:
                raise ValueError(f"tap {tap} is owned by stage {owner}, outside [0, {num_stages}) stages")
        if num_stages > 1:
            if group is None:
                raise ValueError(
                    f"a TapChannel over {num_stages} stages needs a process group (one rank per "
                    f"stage, group rank == stage), got group=None"
                )
            if dist.get_world_size(group) != num_stages:
                raise ValueError(
                    f"the TapChannel group has {dist.get_world_size(group)} ranks but there are "
                    f"{num_stages} stages; pass the group of this (dp, cp) coordinate's stages"
                )
            if dist.get_rank(group) != stage:
                raise ValueError(
                    f"this rank is group rank {dist.get_rank(group)} of the TapChannel group but "
                    f"stage {stage}; order the group's ranks by stage"
                )
        self.tap_ids: tuple[int, ...] = tuple(sorted(owners))
        self.owners = {t: owners[t] for t in self.tap_ids}
        self.stage = stage
        self.num_stages = num_stages
        self.group = group
        self.last = num_stages - 1
        self.local_taps = tuple(t for t in self.tap_ids if self.owners[t] == stage)
        self.bytes_sent = 0
        self.bytes_received = 0
        self._active = False
        self._num_microbatches = 0
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self._sends: list[tuple[Any, Tensor]] = []
        self._sent: set[tuple[int, int]] = set()
        self._recvs: dict[int, dict[int, tuple[Any, Tensor]]] = {}
        self._local: dict[int, dict[int, Tensor]] = {}
        self._received: set[int] = set()

    @property
    def is_last(self) -> bool:
        return self.stage == self.last

    def _tag(self, microbatch: int, tap: int) -> int:
        return microbatch * len(self.tap_ids) + self.tap_ids.index(tap)

    def begin(
        self,
        num_microbatches: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        window: Optional[int] = None,
    ) -> None:
        """Start a step: on the last stage, pre-post the receives of the first ``window`` microbatches.

        Args:
            num_microbatches: microbatches in this step (every stage must pass the same value).
            shape: shape of every tap of every microbatch, ``(T, H)`` tokens of this rank (its zigzag shard
                under CP); microbatches are padded to one length so the pipeline schedule can run them.
            dtype: dtype of the taps (the activation dtype).
            device: device of the landing buffers.
            window: microbatches whose landing buffers exist at once (receiving one posts the next); None: all.
                With 1F1B the first stage runs at most ``pp`` microbatches ahead of the last, so a window of ``pp``
                never makes a sender wait longer than the schedule does, and bounds the buffers to ``pp``
                microbatches instead of the step's ``M``.
        """
        if self._active:
            raise RuntimeError("TapChannel.begin() called twice without finish(); call finish() after every step")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches={num_microbatches} must be >= 1")
        self._active = True
        self._num_microbatches = num_microbatches
        self._shape = tuple(int(s) for s in shape)
        self._dtype = dtype
        self._sends, self._sent = [], set()
        self._recvs, self._local, self._received = {}, {}, set()
        self._device, self._posted = device, 0
        self._window = num_microbatches if window is None else max(1, int(window))
        if self.is_last:
            self._post_until(min(num_microbatches, self._window) - 1)

    def _post_until(self, microbatch: int) -> None:
        """Post the receives of every microbatch up to ``microbatch`` not posted yet, in order (the senders')."""
        while self._posted <= min(microbatch, self._num_microbatches - 1):
            m, posted = self._posted, {}
            for tap in self.tap_ids:  # microbatch-major, tap id ascending: the senders' order
                if self.owners[tap] == self.last:
                    continue
                buf = torch.empty(self._shape, dtype=self._dtype, device=self._device)
                work = dist.irecv(buf, group=self.group, group_src=self.owners[tap], tag=self._tag(m, tap))
                posted[tap] = (work, buf)
            self._recvs[m] = posted
            self._posted += 1

    def send(self, microbatch: int, tap: int, hidden: Tensor) -> None:
        """Hand over tap ``tap`` of ``microbatch`` as computed on this stage (detached, asynchronous).

        Args:
            microbatch: index of the microbatch in ``[0, num_microbatches)``.
            tap: tap id owned by this stage.
            hidden: ``(T, H)`` hidden state entering layer ``tap`` (this rank's shard under CP).
        """
        if not self._active:
            raise RuntimeError("TapChannel.send() outside a step: call begin() first")
        if tap not in self.owners:
            raise ValueError(f"tap {tap} is not one of the channel's taps {self.tap_ids}")
        if self.owners[tap] != self.stage:
            raise ValueError(f"tap {tap} is owned by stage {self.owners[tap]}, not by this stage {self.stage}")
        if not 0 <= microbatch < self._num_microbatches:
            raise ValueError(f"microbatch={microbatch} is outside [0, {self._num_microbatches})")
        if (microbatch, tap) in self._sent:
            raise RuntimeError(f"tap {tap} of microbatch {microbatch} was already sent in this step")
        if tuple(hidden.shape) != self._shape or hidden.dtype != self._dtype:
            raise ValueError(
                f"tap {tap} of microbatch {microbatch} is {tuple(hidden.shape)} {hidden.dtype} but the "
                f"channel was begun with {self._shape} {self._dtype}; pad every microbatch to one length"
            )
        self._sent.add((microbatch, tap))
        t = hidden.detach()
        if self.is_last:
            self._local.setdefault(microbatch, {})[tap] = t
            return
        t = t.contiguous()
        work = dist.isend(t, group=self.group, group_dst=self.last, tag=self._tag(microbatch, tap))
        self._sends = [(w, x) for w, x in self._sends if not w.is_completed()]  # release delivered taps
        self._sends.append((work, t))  # keep the tensor alive until the send completes
        self.bytes_sent += t.numel() * t.element_size()

    def receive(self, microbatch: int) -> dict[int, Tensor]:
        """On the last stage: the complete tap set of ``microbatch``, waiting for remote taps to land.

        Returns:
            tap id -> ``(T, H)`` detached tensor, for every tap of the channel.
        """
        if not self.is_last:
            raise RuntimeError(
                f"TapChannel.receive() on stage {self.stage}: only the last stage ({self.last}) receives taps"
            )
        if not self._active:
            raise RuntimeError("TapChannel.receive() outside a step: call begin() first")
        if not 0 <= microbatch < self._num_microbatches:
            raise ValueError(f"microbatch={microbatch} is outside [0, {self._num_microbatches})")
        self._post_until(microbatch)
        if microbatch in self._received:
            raise RuntimeError(f"taps of microbatch {microbatch} were already received in this step")
        out: dict[int, Tensor] = {}
        for tap, (work, buf) in self._recvs.pop(microbatch).items():
            work.wait()
            self.bytes_received += buf.numel() * buf.element_size()
            out[tap] = buf
        self._post_until(microbatch + self._window)  # the next microbatch's landing buffers
        local = self._local.pop(microbatch, {})
        for tap in self.local_taps:
            if tap not in local:
                raise RuntimeError(
                    f"tap {tap} of microbatch {microbatch} belongs to the last stage but was not "
                    f"sent before receive(); the stage forward must send it"
                )
            out[tap] = local[tap]
        self._received.add(microbatch)
        return {t: out[t] for t in self.tap_ids}

    def finish(self) -> None:
        """End the step: wait for this stage's outstanding sends; on the last stage drain unreceived taps.

        Raises:
            RuntimeError: a stage did not send every tap it owns for every microbatch.
        """
        if not self._active:
            return
        for work, _ in self._sends:
            work.wait()
        missing = [(m, t) for m in range(self._num_microbatches) for t in self.local_taps if (m, t) not in self._sent]
        if self.is_last:  # drain what was sent but not received (post the rest so every sender completes)
            self._post_until(self._num_microbatches - 1)
            for m, posted in self._recvs.items():
                if m not in self._received:
                    for work, _ in posted.values():
                        work.wait()
        self._sends, self._recvs, self._local = [], {}, {}
        self._active = False
        if missing:
            raise RuntimeError(
                f"stage {self.stage} never sent (microbatch, tap) {missing[:4]}"
                f"{' ...' if len(missing) > 4 else ''}; every owned tap must be sent once per "
                f"microbatch"
            )
