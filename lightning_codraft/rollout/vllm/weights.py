"""How weights reach vLLM's workers, and the checksums that prove an engine holds the trainer's policy and draft
(docs/design/vllm.md).

Both sides reduce each parameter to float64 ``(sum, sum of squares)``, keyed by vLLM's parameter name:

* trainer side, :func:`expected_checksums` from the pushed state dicts (our checkpoint names; the parts vLLM
  fuses, q/k/v and gate/up, add up);
* engine side, :func:`engine_checksums` inside each vLLM worker. vLLM-CPU packs linear weights into oneDNN
  handles and empties ``.weight``, so those layers report the checksum of ``probe @ W.T + b`` for a fixed
  probe input (:func:`probe_input`), the only faithful view of what the layer computes.

:func:`compare_pushed` checks an engine report against pushed tensors; :func:`compare_resident` against an
earlier engine report (what a wake-up or a policy-only push must leave untouched, the draft included).

Pushes travel as safetensors bytes (tensors in ``collective_rpc`` arguments must), either through vLLM's native
weight-update session with the ``codraft_bytes`` transport or through the worker extension's ``reload_weights``
(:func:`resolve_update_path`, :func:`push_weights`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from safetensors.torch import load, save

TRANSFER_BACKEND = "codraft_bytes"
"""The weight-transfer backend ``vllm.worker`` registers in each worker."""
UPDATE_PATHS = ("auto", "native", "extension")

PROBE_ROWS = 4
"""Rows of the fixed probe input pushed through packed linear layers."""

_FUSED = {  # vLLM stacks these checkpoint parameters into one (their sums add up)
    ".q_proj.": ".qkv_proj.",
    ".k_proj.": ".qkv_proj.",
    ".v_proj.": ".qkv_proj.",
    ".gate_proj.": ".gate_up_proj.",
    ".up_proj.": ".gate_up_proj.",
}

Report = dict[str, tuple[str, float, float]]
"""An engine's checksums of one model: ``{key: (kind, sum, sum of squares)}``, kind ``"param"`` or ``"probe"``."""


def tensors_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """Serialise a state dict to safetensors bytes (CPU, contiguous)."""
    return save({k: v.detach().to("cpu").contiguous() for k, v in state.items()})


def bytes_to_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`tensors_to_bytes`."""
    return load(blob)


def checksum(t: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) in float64: additive over the parts vLLM concatenates into fused parameters."""
    t = t.detach().double()
    return float(t.sum()), float((t * t).sum())


def canonical_name(name: str, draft: bool) -> str | None:
    """Our (checkpoint) parameter name -> a key comparable with vLLM's parameter names, or None to skip."""
    if draft and name in ("t2d", "d2t"):
        return None  # vocabulary maps: t2d is not loaded by vLLM; d2t is an int buffer checked by shape only
    for part, fused in _FUSED.items():
        name = name.replace(part, fused)
    if draft:
        name = name.replace("midlayer.", "layers.0.").removeprefix("model.")
    return name.removeprefix("model.")


def probe_input(in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(PROBE_ROWS, in_features) deterministic probe (same on both sides of the RPC: seeded CPU randn)."""
    g = torch.Generator().manual_seed(1234 + in_features)
    return torch.randn(PROBE_ROWS, in_features, generator=g, dtype=torch.float64).to(dtype)


class ChecksumStream:
    """:func:`expected_checksums` of a state that streams past tensor by tensor (a bucketed refit): each tensor is
    reduced as it passes and never kept; a ``"probe"`` weight keeps only its ``(PROBE_ROWS, out)`` probe output until
    its bias (which may come in a later bucket) is known. The same math as over the whole state.

    Args:
        draft: whether the tensors are the drafter's; kinds: ``key -> "param" | "probe"`` from an engine report.
    """

    def __init__(self, draft: bool, kinds: Mapping[str, str]):
        self.draft, self.kinds = draft, dict(kinds)
        self._sums: dict[str, list[float]] = {}
        self._probed: dict[str, torch.Tensor] = {}
        self._biases: dict[str, torch.Tensor] = {}

    def add(self, name: str, t: torch.Tensor) -> None:
        key = canonical_name(name, self.draft)
        if key is None or not torch.is_floating_point(t):
            return
        if name.endswith(".bias"):
            self._biases[name] = t.detach().double().clone()
        elif self.kinds.get(key) == "probe":
            self._probed[name] = probe_input(t.shape[1], torch.float64) @ t.detach().double().T
        else:
            self._accumulate(key, *checksum(t))

    def _accumulate(self, key: str, s: float, q: float) -> None:
        acc = self._sums.setdefault(key, [0.0, 0.0])
        acc[0] += s
        acc[1] += q

    def result(self) -> dict[str, tuple[float, float]]:
        """``{key: (sum, sum of squares)}`` of everything added (parts that vLLM fuses add up)."""
        for name, y in self._probed.items():
            bias = self._biases.get(name[: -len("weight")] + "bias")
            self._accumulate(canonical_name(name, self.draft), *checksum(y if bias is None else y + bias))
        self._probed = {}
        return {k: (v[0], v[1]) for k, v in self._sums.items()}


def expected_checksums(
    state: Mapping[str, torch.Tensor], draft: bool, kinds: Mapping[str, str]
) -> dict[str, tuple[float, float]]:
    """Checksums of a pushed state dict, keyed and computed the way the engine reports them.

    ``kinds[key]`` is ``"param"`` (checksum of the parameter itself) or ``"probe"`` (checksum of
    ``probe @ W.T + b``). Parts that vLLM fuses (q/k/v, gate/up) add up.
    """
    stream = ChecksumStream(draft, kinds)
    for name, t in state.items():
        stream.add(name, t)
    return stream.result()


def engine_checksums(model: torch.nn.Module, draft: bool) -> Report:
    """``{key: (kind, sum, sum of squares)}`` of a vLLM model (run inside the worker), keyed like
    :func:`expected_checksums`."""
    out: Report = {}
    for mod_name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        key = canonical_name(f"{mod_name}.weight", draft)
        if key is None or weight is None:
            continue
        in_features = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
        if linear is not None and in_features:
            with torch.no_grad():
                x = probe_input(int(in_features), torch.float32)
                y = linear(x, weight, getattr(module, "bias", None))
            out[key] = ("probe", *checksum(y))
        elif isinstance(weight, torch.Tensor) and torch.is_floating_point(weight) and weight.numel() > 0:
            out[key] = ("param", *checksum(weight))
    return out


def _mismatch(s: float, q: float, a_s: float, a_q: float, rel: float) -> bool:
    scale = max(abs(q), 1e-12)
    return abs(a_q - q) > rel * scale or abs(a_s - s) > rel * (scale * PROBE_ROWS) ** 0.5 * 10


def compare_pushed(kind: str, state: Mapping[str, torch.Tensor], actual: Report, rel: float = 1e-4) -> list[str]:
    """Problems (empty if none) between an engine's report of ``kind`` (``"policy"`` / ``"draft"``) and the
    pushed ``state``."""
    kinds = {k: v[0] for k, v in actual.items()}
    return compare_expected(kind, expected_checksums(state, kind == "draft", kinds), actual, rel)


def compare_expected(
    kind: str, expected: Mapping[str, tuple[float, float]], actual: Report, rel: float = 1e-4
) -> list[str]:
    """:func:`compare_pushed` against checksums already computed (:class:`ChecksumStream`)."""
    kinds = {k: v[0] for k, v in actual.items()}
    problems = []
    for key, (s, q) in expected.items():
        if key not in actual:
            if key == "lm_head.weight" and "embed_tokens.weight" in actual:
                continue  # tied embeddings: vLLM keeps one tensor
            problems.append(f"{kind}: {key} not found in the engine")
            continue
        _, a_s, a_q = actual[key]
        if _mismatch(s, q, a_s, a_q, rel):
            problems.append(
                f"{kind}: {key} ({kinds[key]}) sum/sumsq in engine ({a_s:.6g}, {a_q:.6g}) != pushed ({s:.6g}, {q:.6g})"
            )
    return problems


SHARED_WITH_POLICY = frozenset({"embed_tokens.weight"})
"""The drafter's keys that are the target's tensors in vLLM (EAGLE-3 reads the target's token embedding): a policy
push changes them, and they are verified with the policy."""


def compare_resident(kind: str, before: Report, actual: Report, rel: float = 1e-4) -> list[str]:
    """Problems (empty if none) between an engine's report of ``kind`` now and the report ``before`` (taken when
    the engine last held verified weights); a draft's keys shared with the policy are the policy's to check."""
    problems = [f"{kind}: {key} is gone from the engine" for key in before if key not in actual]
    for key, (k, s, q) in before.items():
        if kind == "draft" and key in SHARED_WITH_POLICY:
            continue
        if key in actual and _mismatch(s, q, actual[key][1], actual[key][2], rel):
            problems.append(
                f"{kind}: {key} ({k}) sum/sumsq in engine ({actual[key][1]:.6g}, {actual[key][2]:.6g}) "
                f"!= last verified ({s:.6g}, {q:.6g})"
            )
    return problems


def resolve_update_path(requested: str, api: Mapping[str, Any], has_draft: bool) -> str:
    """``"native"`` or ``"extension"``: how weights reach the workers.

    Args:
        requested: ``"auto"`` (native where every worker can take it, for the draft too), ``"native"`` (raise
            if unavailable) or ``"extension"`` (the worker extension's ``reload_weights``).
        api: a worker's ``codraft_weight_api()`` report (``native``, ``native_draft``, ``backend``).
        has_draft: whether the engine runs a drafter (its native path needs ``start_draft_weight_update``).
    """
    if requested not in UPDATE_PATHS:
        raise ValueError(f"weight_update={requested!r}; use one of {UPDATE_PATHS}")
    native = bool(api.get("native")) and (bool(api.get("native_draft")) or not has_draft)
    if requested == "native" and not native:
        raise ValueError(
            f"weight_update='native' but the installed vLLM's workers report {dict(api)} (need "
            "start_weight_update / update_weights / finish_weight_update with a transfer backend"
            f"{', and start_draft_weight_update' if has_draft else ''}); use weight_update='auto'"
        )
    return "extension" if requested == "extension" or not native else "native"


def push_weights(llm: Any, path: str, policy_blob: bytes | None, draft_blob: bytes | None) -> None:
    """Load safetensors-bytes state dicts into every worker of ``llm`` by ``path`` (see :func:`resolve_update_path`)."""
    if path == "extension":
        llm.collective_rpc("codraft_load_weights", args=(policy_blob, draft_blob))
        return
    for start, blob in (("start_weight_update", policy_blob), ("start_draft_weight_update", draft_blob)):
        if blob is None:
            continue
        llm.collective_rpc(start)
        llm.collective_rpc("update_weights", kwargs={"update_info": {"blob": blob}})
        llm.collective_rpc("finish_weight_update")
