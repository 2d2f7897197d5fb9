"""``"auto"`` precision: bf16 where the device's bf16 matmuls are fast, fp32 where they are emulated.

bf16 pays only on hardware with bf16 matrix units: a CUDA GPU that supports it, or a CPU with AMX / AVX512-BF16.
On an AVX2-only CPU PyTorch falls back to a scalar kernel, so a recipe that hard-codes bf16 would run hundreds of
times slower there (figures: docs/design/measurements.md). :func:`resolve_dtype` and
:func:`resolve_precision` turn ``"auto"`` into the fast choice for a device: on CUDA by capability, on a CPU by
timing one small matmul in both dtypes, after one untimed call of each (once per process and device type, about a
second at worst).
"""

from __future__ import annotations

import functools
import time

import torch

AUTO = "auto"
MIN_SPEEDUP = 1.5
"""bf16 is chosen only when its matmul runs at least this much faster than fp32's (it costs accuracy)."""


def _best_time(fn, reps: int, give_up_s: float) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        if best > give_up_s:
            break
    return best


@functools.cache
def bf16_speedup(device_type: str = "cpu") -> float:
    """How many times faster a bf16 matmul runs than an fp32 one on ``device_type`` (inf on a CUDA device that
    supports bf16, 0 on one that does not; measured on a CPU, at the current thread count; cached).

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or another ``torch.device`` type (others than these two: 0, fp32).
    """
    if device_type == "cuda":
        return float("inf") if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 0.0
    if device_type != "cpu":
        return 0.0
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(128, 512, generator=g), torch.randn(512, 512, generator=g)
    a16, b16 = a32.bfloat16(), b32.bfloat16()
    with torch.inference_mode():
        return _speedup(lambda: torch.mm(a32, b32), lambda: torch.mm(a16, b16))


def _speedup(reference, candidate) -> float:
    """How many times faster ``candidate()`` runs than ``reference()``: each is called once untimed first (a first
    call pays the kernel's setup, which can make the faster kernel look the slower: docs/design/measurements.md),
    then timed at its best of a few calls."""
    reference()
    t_ref = _best_time(reference, reps=5, give_up_s=float("inf"))
    candidate()
    # an emulated kernel stays slow after its first call: stop as soon as it is clearly slower than the reference
    t_cand = _best_time(candidate, reps=4, give_up_s=t_ref * MIN_SPEEDUP)
    return t_ref / max(t_cand, 1e-12)


def fast_bf16(device: torch.device | str = "cpu") -> bool:
    """True when bf16 pays on ``device``: :func:`bf16_speedup` of its type is at least :data:`MIN_SPEEDUP`."""
    return bf16_speedup(torch.device(device).type) >= MIN_SPEEDUP


def resolve_dtype(name: str | None, device: torch.device | str = "cpu") -> str | None:
    """A dtype name with ``"auto"`` resolved for ``device`` (``"bfloat16"`` or ``"float32"``); others unchanged."""
    if name != AUTO:
        return name
    return "bfloat16" if fast_bf16(device) else "float32"


def resolve_precision(name: str, device: torch.device | str = "cpu") -> str:
    """A precision name with ``"auto"`` resolved for ``device`` (``"bf16-mixed"`` or ``"32-true"``); others
    unchanged."""
    if name != AUTO:
        return name
    return "bf16-mixed" if fast_bf16(device) else "32-true"
