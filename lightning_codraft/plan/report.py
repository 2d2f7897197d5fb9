"""The memory plan as text and as JSON, and the byte sizes the command line takes (``80GiB``, ``141GB``)."""

from __future__ import annotations

import re
from typing import Any

from lightning_codraft.plan.memory import AFTER, BEFORE, BOTH, ROLLOUT, TRAINING, MemoryPlan, RankPlan

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; decimal (kB, MB, GB, TB) and binary (KiB, MiB, GiB, TiB) units, or bytes.

    Raises:
        ValueError: not a positive size with a known unit (the message names the value and the units).
    """
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"device memory {text!r} is not a size: write a number with a unit, e.g. 80GiB, 141GB or "
            f"24576MiB (units: B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"device memory {text!r} must be positive, e.g. 80GiB")
    return int(value)


def format_bytes(n: int) -> str:
    """Bytes in binary units with three significant digits, e.g. ``12.3 GiB``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_PHASE = {BOTH: "both", TRAINING: "train", BEFORE: "train*", AFTER: "train*", ROLLOUT: "rollout"}


def render_text(plan: MemoryPlan) -> str:
    """The plan as a table: one column per kind of rank, one row per term, the two phase totals and the verdict."""
    s = plan.spec
    ranks = plan.ranks
    head = (
        f"memory plan: {s.policy.architecture} (L={s.policy.num_hidden_layers}, H={s.policy.hidden_size}, "
        f"V={s.policy.vocab_size}); world {s.dp * s.pp * s.cp} = dp {s.dp} x pp {s.pp} x cp {s.cp}; "
        f"{'FSDP2 over ' + str(s.shards) + ' ranks' if s.fsdp else 'replicated (no FSDP2)'}; "
        f"precision {s.precision}"
    )
    mbs = f"{s.num_microbatches} microbatch{'es' if s.num_microbatches != 1 else ''}"
    batch = (
        f"step: {s.samples_per_replica} samples per replica of <= {s.seq_len} tokens, {mbs}"
        f"{' (' + s.pp_schedule + ')' if s.pp > 1 else ''}; engine: {s.engine}, "
        f"{s.engine_requests} request(s) per rank, {s.engine_concurrency} at once, K={s.speculative_tokens}"
    )
    keys: dict[str, tuple[str, str]] = {}
    for r in ranks:
        for line in r.lines:
            keys.setdefault(line.key, (line.label, line.phase))
    width = max(30, *(len(label) + 2 for label, _ in keys.values()))
    cols = [r.label for r in ranks]
    cw = max(14, *(len(c) + 2 for c in cols))
    rows = [head, batch, "", f"{'':{width}}{'phase':>8}" + "".join(f"{c:>{cw}}" for c in cols)]
    for key, (label, phase) in keys.items():
        values = [r.get(key) for r in ranks]
        if any(values):
            rows.append(f"{label:{width}}{_PHASE[phase]:>8}" + "".join(f"{format_bytes(v):>{cw}}" for v in values))
    for name, attr in (("TRAINING phase", "training_total"), ("ROLLOUT phase", "rollout_total")):
        rows.append(f"{name:{width}}{'':>8}" + "".join(f"{format_bytes(getattr(r, attr)):>{cw}}" for r in ranks))
    rows.append(
        f"{'tokens per microbatch / in flight':{width}}{'':>8}"
        + "".join(f"{f'{r.tokens} / {r.in_flight}':>{cw}}" for r in ranks)
    )
    rows += [
        "",
        _verdict(plan),
        "train*: the largest of the step, the reference forward before it and the AdamW update after it counts",
    ]
    rows += [f"note: {n}" for n in plan.notes]
    return "\n".join(rows)


def _verdict(plan: MemoryPlan) -> str:
    t, r = plan.worst_training, plan.worst_rollout
    dev = format_bytes(plan.device_memory)
    parts = [
        f"worst rank: training {format_bytes(t.training_total)} ({t.label}), rollout "
        f"{format_bytes(r.rollout_total)} ({r.label}) of {dev}"
    ]
    if plan.fits:
        parts.append(f"FITS (headroom {format_bytes(plan.device_memory - max(t.training_total, r.rollout_total))})")
    else:
        over = [
            f"{name} needs {format_bytes(v)}"
            for name, v in (("training", t.training_total), ("rollout", r.rollout_total))
            if v > plan.device_memory
        ]
        parts.append(f"DOES NOT FIT: {', '.join(over)} > {dev}")
    return "; ".join(parts)


def _rank_dict(r: RankPlan) -> dict[str, Any]:
    return {
        "label": r.label,
        "stages": list(r.stages),
        "tokens_per_microbatch": r.tokens,
        "in_flight": r.in_flight,
        "activations_per_microbatch": r.activations_per_microbatch,
        "bytes": {line.key: line.bytes for line in r.lines},
        "phase": {line.key: line.phase for line in r.lines},
        "training_total": r.training_total,
        "rollout_total": r.rollout_total,
    }


def plan_dict(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as JSON-ready data: the run, every kind of rank, the worst totals and the verdict."""
    s = plan.spec
    return {
        "model": {
            "architecture": s.policy.architecture,
            "num_hidden_layers": s.policy.num_hidden_layers,
            "hidden_size": s.policy.hidden_size,
            "vocab_size": s.policy.vocab_size,
        },
        "mesh": {
            "dp": s.dp,
            "pp": s.pp,
            "cp": s.cp,
            "fsdp_shards": s.shards,
            "sharding": "fsdp" if s.fsdp else "ddp",
            "precision": s.precision,
            "num_microbatches": s.num_microbatches,
            "pp_schedule": s.pp_schedule,
        },
        "step": {
            "samples_per_replica": s.samples_per_replica,
            "seq_len": s.seq_len,
            "engine": s.engine,
            "engine_requests_per_rank": s.engine_requests,
            "engine_concurrency": s.engine_concurrency,
            "speculative_tokens": s.speculative_tokens,
        },
        "ranks": [_rank_dict(r) for r in plan.ranks],
        "device_memory": plan.device_memory,
        "worst": {"training": plan.worst_training.training_total, "rollout": plan.worst_rollout.rollout_total},
        "fits": plan.fits,
        "notes": list(plan.notes),
    }
