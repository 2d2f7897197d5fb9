"""Behaviour probes for two vLLM-CPU sampling defects, and the fixes applied only where a probe finds one.

Both defects sit on vLLM's speculative path (the rejection sampler), so only tokens emitted inside speculative
rounds (accepted drafts and recovered tokens) are affected; the first token after a prompt and the bonus token
come from the plain sampler (upstream: vllm issue #55005; details in docs/design/vllm.md).

1. ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` expands per-request temperature / top-p / top-k to
   one value per draft token. On vllm-cpu 0.32 its CPU kernel stand-in (``cpu_triton_utils._expand_kernel_impl``)
   writes into an int64 *copy* of the output, so the function returns uninitialised memory: target
   probabilities are computed at a random temperature, and acceptance and recovered tokens are wrong.
   :func:`probe_expand` calls the installed function on small float32 / int32 inputs and compares with the
   definition; the fix is :func:`expand_batch_to_tokens` (pure torch).
2. ``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_only`` computes ``k.max()``, which raises on the empty
   tensor a speculative step with zero draft rows hands it, so ``top_k > 0`` crashes. :func:`probe_top_k_only`
   calls it with zero rows; the fix (:func:`guard_empty_rows`) returns zero-row logits unchanged.

Every probe takes the function under test as an argument (a unit test can hand it a simulated unfixed build);
:func:`apply_fixes` takes the two vLLM modules as arguments and patches an attribute only where its probe fails.
The fixes must run inside vLLM's worker process: ``lightning_codraft.rollout.vllm.worker`` calls
:func:`install_cpu_sampling_fixes` when vLLM imports it as the ``worker_extension_cls`` module, which happens
after vLLM registered its CPU kernel overrides and before the first sampling step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

FIXES_ENV = "CODRAFT_VLLM_CPU_FIXES"
"""Environment variable read by the worker process at import: ``"0"`` probes but applies no fix (the
``VLLMEngine(fix_cpu_sampling=False)`` switch, for tests that show the defect)."""

_PROBES = (  # (dtype, values, replace_from, replace_to): per-request values, one equal to replace_from
    (torch.float32, [0.25, 0.0, 1.75], 0, 1),
    (torch.int32, [3, -1, 7], -1, 5),
)
_PROBE_CU = [2, 5, 6]  # cumulative tokens per request: 2, 3 and 1 tokens


def expand_batch_to_tokens(
    x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int, replace_from: Any = 0, replace_to: Any = 0
) -> torch.Tensor:
    """Pure-torch ``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens``.

    Args:
        x: (B,) one value per request (temperature, top-p or top-k).
        cu_num_tokens: (B,) cumulative number of draft tokens up to and including each request.
        num_tokens: length of the result (vLLM passes ``cu_num_tokens[-1]``, the number of draft rows).
        replace_from, replace_to: values of ``x`` equal to ``replace_from`` become ``replace_to`` (vLLM maps the
            greedy temperature 0 to 1 this way).

    Returns:
        (num_tokens,) request ``b``'s value repeated for each of its tokens, in ``x``'s dtype and device; entries
        past ``cu_num_tokens[-1]`` (vLLM leaves them unwritten) are zero.
    """
    values = x.clone()
    values[x == replace_from] = replace_to
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    out = x.new_zeros(num_tokens)
    expanded = torch.repeat_interleave(values, counts)
    n = min(num_tokens, expanded.shape[0])
    out[:n] = expanded[:n]
    return out


def guard_empty_rows(apply_top_k_only: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable:
    """Wrap vLLM's ``apply_top_k_only(logits (N, V), k (N,))`` so that ``N == 0`` returns ``logits`` unchanged."""

    def guarded(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] == 0:
            return logits
        return apply_top_k_only(logits, k)

    guarded.__wrapped__ = apply_top_k_only
    guarded.__name__ = guarded.__qualname__ = "apply_top_k_only"
    guarded.codraft_fix = True
    return guarded


def _poison(n: int, dtype: torch.dtype, device: str | torch.device) -> None:
    """Leave freed memory of the output's size holding values no probe expects (NaN / a large negative int),
    so a function that never writes its ``new_empty`` output cannot pass by reusing an earlier result."""
    fill = math.nan if dtype.is_floating_point else -(2**30)
    buf = torch.full((n,), fill, dtype=dtype, device=device)
    del buf


def probe_expand(expand: Callable, device: str | torch.device = "cpu") -> str | None:
    """None if ``expand`` (the installed ``expand_batch_to_tokens``) matches its definition, else what it returned.

    Expands float32 and int32 per-request values over ``cu_num_tokens=[2, 5, 6]`` with one value replaced, and
    compares with the result written out by hand from the definition. A raising function is a defect too.
    """
    cu = torch.tensor(_PROBE_CU, dtype=torch.int32, device=device)
    counts = [b - a for a, b in zip([0] + _PROBE_CU[:-1], _PROBE_CU)]
    for dtype, values, replace_from, replace_to in _PROBES:
        expected = [replace_to if v == replace_from else v for v, c in zip(values, counts) for _ in range(c)]
        x = torch.tensor(values, dtype=dtype, device=device)
        _poison(len(expected), dtype, device)
        try:
            got = expand(x, cu, len(expected), replace_from=replace_from, replace_to=replace_to)
        except Exception as err:  # noqa: BLE001 - any failure is the finding
            return f"expand_batch_to_tokens({values}, cu_num_tokens={_PROBE_CU}) raised {type(err).__name__}: {err}"
        got_list = got.tolist() if isinstance(got, torch.Tensor) else list(got)
        if got_list != expected:
            got_list = [float(f"{v:.4g}") if isinstance(v, float) else v for v in got_list]
            return (
                f"expand_batch_to_tokens({values} {dtype}, cu_num_tokens={_PROBE_CU}, replace {replace_from}->"
                f"{replace_to}) returned {got_list}, expected {expected}"
            )
    return None


def probe_top_k_only(apply_top_k_only: Callable, device: str | torch.device = "cpu") -> str | None:
    """None if ``apply_top_k_only`` handles zero rows (a speculative step without draft rows), else the failure."""
    logits = torch.zeros(0, 8, device=device)
    k = torch.zeros(0, dtype=torch.int32, device=device)
    try:
        out = apply_top_k_only(logits, k)
    except Exception as err:  # noqa: BLE001 - any failure is the finding
        return f"apply_top_k_only on 0 rows raised {type(err).__name__}: {err}"
    if tuple(out.shape) != (0, 8):
        return f"apply_top_k_only on (0, 8) logits returned shape {tuple(out.shape)}"
    return None


def apply_fixes(
    rejection_sampler: ModuleType | Any,
    topk_topp_sampler: ModuleType | Any,
    enabled: bool = True,
    device: str | torch.device = "cpu",
) -> dict[str, str]:
    """Probe the two functions and replace each module attribute whose probe fails (when ``enabled``).

    Args:
        rejection_sampler: ``vllm.v1.sample.rejection_sampler`` (or any object with ``expand_batch_to_tokens``).
        topk_topp_sampler: ``vllm.v1.sample.ops.topk_topp_sampler`` (or any object with ``apply_top_k_only``).
        enabled: False probes and reports but patches nothing.
        device: where the probe tensors live (the platform's device).

    Returns:
        ``{function name: "ok" | "fixed: <what the probe saw>" | "defect, not fixed: <what the probe saw>"}``.

    Raises:
        RuntimeError: a patched function still fails its probe.
    """
    targets = (
        ("expand_batch_to_tokens", rejection_sampler, probe_expand, lambda fn: expand_batch_to_tokens),
        ("apply_top_k_only", topk_topp_sampler, probe_top_k_only, guard_empty_rows),
    )
    report = {}
    for name, module, probe, make_fix in targets:
        defect = probe(getattr(module, name), device)
        if defect is None:
            report[name] = "ok"
            continue
        if not enabled:
            report[name] = f"defect, not fixed: {defect}"
            continue
        setattr(module, name, make_fix(getattr(module, name)))
        still = probe(getattr(module, name), device)
        if still is not None:
            raise RuntimeError(f"the fix for vLLM's {name} did not take: {still}")
        report[name] = f"fixed: {defect}"
    return report


def install_cpu_sampling_fixes(enabled: bool = True) -> dict[str, str]:
    """:func:`apply_fixes` on the installed vLLM's modules, probing on the current platform's device.

    Call it inside vLLM's worker process, after vLLM registered its kernel overrides (the
    ``worker_extension_cls`` module's import is such a place); in any other process it fixes nothing that runs.
    """
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    return apply_fixes(rejection_sampler, topk_topp_sampler, enabled=enabled, device=current_platform.device_type)
