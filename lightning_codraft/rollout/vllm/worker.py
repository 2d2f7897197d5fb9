"""Code that runs inside vLLM's worker process: the worker extension, the CPU sampling fixes, a bytes weight
transport for vLLM's native weight-update API (docs/design/vllm.md).

vLLM imports this module in every worker because :class:`~lightning_codraft.rollout.vllm.engine.VLLMEngine`
names :class:`CoDraftWorkerExtension` as ``worker_extension_cls``; that import happens after vLLM registered its
CPU kernel overrides and before the model loads, so at import this module

* probes vLLM's sampling functions and fixes the defective ones (:mod:`~lightning_codraft.rollout.vllm.cpu_fixes`;
  the environment variable ``CODRAFT_VLLM_CPU_FIXES=0`` keeps them unfixed), recorded in :data:`CPU_FIXES`;
* registers :class:`BytesWeightTransferEngine` as vLLM's weight-transfer backend ``"codraft_bytes"``, so the
  native ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` session (and
  ``start_draft_weight_update`` for the drafter) works where vLLM ships no transport for the device (its own
  backends, NCCL and CUDA IPC, need a GPU).

Imports vLLM at the top: only vLLM's worker (and tests run in the vLLM environment) import this module.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass

import torch
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
from vllm.model_executor.model_loader.reload.inplace import reload_weights
from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

from lightning_codraft.rollout.refit.buckets import BucketReceiver, RefitError, open_handle
from lightning_codraft.rollout.vllm.cpu_fixes import FIXES_ENV, install_cpu_sampling_fixes
from lightning_codraft.rollout.vllm.weights import TRANSFER_BACKEND, Report, bytes_to_tensors, engine_checksums


def _split_draft_state(
    state: dict[str, torch.Tensor], draft: torch.nn.Module
) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Our draft state dict -> (what vLLM's EAGLE-3 ``load_weights`` accepts, the lm_head weight (Vd, H) or None).

    ``t2d`` is not a vLLM parameter; ``d2t`` only exists in vLLM for a reduced draft vocabulary; the lm_head is
    loaded by :func:`_install_draft_head` (vLLM may share it with the target's)."""
    state = {k: v for k, v in state.items() if k != "t2d"}
    head = state.pop("lm_head.weight", None)
    names = [n for n, _ in draft.named_buffers()] + [n for n, _ in draft.named_parameters()]
    if not any(n.endswith("draft_id_to_target_id") for n in names):
        state.pop("d2t", None)  # full-vocabulary draft: vLLM has no d2t and refuses one
    return state, head


def _load_head(head: torch.nn.Module, weight: torch.Tensor) -> None:
    """Copy ``weight`` (Vd, H) into vLLM's ``ParallelLMHead`` (rows past Vd are padding) and rebuild its GEMM."""
    with torch.no_grad():
        head.weight.data.zero_()
        head.weight.data[: weight.shape[0]].copy_(weight.to(dtype=head.weight.dtype, device=head.weight.device))
    head.quant_method.process_weights_after_loading(head)


def _install_draft_head(target: torch.nn.Module, draft: torch.nn.Module, weight: torch.Tensor) -> None:
    """Load the draft's lm_head ``weight`` (Vd, H). vLLM shares the target's lm_head with a draft whose head was
    identical at load time (a draft built by ``Eagle3Draft.from_policy``): loading into it would overwrite the
    policy's head, so the first push gives the draft its own copy."""
    if draft.lm_head is getattr(target, "lm_head", None):
        new = copy.deepcopy(target.lm_head)
        new.weight = torch.nn.Parameter(torch.zeros_like(target.lm_head.weight), requires_grad=False)
        _load_head(new, weight)
        draft.lm_head = new
    else:
        _load_head(draft.lm_head, weight)


KV_NAMES = re.compile(r"layers\.(\d+)\.self_attn\.([kv])_proj\.weight")
"""A block drafter's context K / V projections in the pushed state (our names: models/dflash.py)."""


def _rebuild_drafter_buffers(draft: torch.nn.Module, kv: dict[str, torch.Tensor]) -> None:
    """Rebuild what vLLM's block drafters (DFlash, DSpark) derive from their weights at load time
    (``_build_fused_kv_buffers``: the context's fused K/V projection, the norms' references), after a refit.

    vLLM-CPU defect: a layerwise reload builds them inside ``load_weights``, before the layer holds its new weights,
    and once it does, the CPU linear layers keep their weights packed (``weight`` is empty): the first round after a
    refit then fails (``size mismatch ... vec (0)``). The fused projection is rebuilt here from the pushed dense
    K / V weights ``kv`` (name -> tensor, every layer's), as vLLM builds it at load time. EAGLE-3 derives nothing."""
    inner = getattr(draft, "model", None)
    rebuild = getattr(inner, "_build_fused_kv_buffers", None)
    if not callable(rebuild):
        return
    rebuild()
    fused = getattr(inner, "_fused_kv_weight", None)
    if fused is None or fused.numel() > 0:
        return
    n = len(inner.layers)
    missing = [f"layers.{i}.self_attn.{p}_proj.weight" for i in range(n) for p in "kv"]
    missing = [k for k in missing if k not in kv]
    if missing:
        raise RuntimeError(f"a block drafter's refit lacks {missing[:4]}: its context K/V projection cannot be rebuilt")
    rows = [kv[f"layers.{i}.self_attn.{p}_proj.weight"] for i in range(n) for p in "kv"]
    inner._fused_kv_weight = torch.cat(rows).to(inner._hidden_norm_weight).contiguous()


def _kv_part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The context K / V projections of a pushed drafter state, copied (the bucket's buffer is reused)."""
    return {k: v.detach().clone() for k, v in state.items() if KV_NAMES.fullmatch(k)}


def _own_pending(storage: torch.UntypedStorage) -> int:
    """Clone every tensor that vLLM's layerwise reload still buffers (a layer whose weights are not all loaded
    yet, e.g. one split across two buckets) and that lies in ``storage``, a bucket's buffer the sender is about to
    reuse; returns how many were cloned. The other tensors of the bucket were copied into their layers already."""
    ptr, cloned = storage.data_ptr(), 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() == ptr:
                    bound.arguments[key] = value.clone()
                    cloned += 1
    return cloned


class BucketSession:
    """The worker's side of one model's bucketed refit (rollout/refit/buckets.py) in a weight-update session: each bucket
    checked as it lands and loaded from the shared buffer without a copy (:meth:`receive` / :meth:`loaded`);
    problems (a corrupted, stale, dropped or missing bucket) are recorded, never raised inside vLLM's session, so
    the session always closes; the engine asks for them (``codraft_refit_problems``)."""

    problems: list[str] = []
    """Problems since the engine last asked (kept across sessions of this process)."""

    def __init__(self):
        self.receiver: BucketReceiver | None = None
        self.buffer: torch.Tensor | None = None

    def receive(self, handle: tuple, verify: str) -> dict[str, torch.Tensor]:
        """The bucket's tensors as views into its shared buffer, valid until :meth:`loaded`; nothing when the
        bucket fails its checks."""
        bucket = open_handle(handle)
        if self.receiver is None:
            self.receiver = BucketReceiver(bucket.kind, verify=verify)
        self.buffer = bucket.buffer
        try:
            return dict(self.receiver.accept(bucket))
        except RefitError as err:
            BucketSession.problems = [*BucketSession.problems, str(err)]
            return {}

    def loaded(self) -> None:
        """The bucket is loaded: what vLLM's layerwise reload still holds of it (a layer waiting for its other
        weights in the next bucket) is copied out, since the sender reuses the buffer for a later bucket."""
        if self.buffer is not None:
            _own_pending(self.buffer.untyped_storage())
        self.buffer = None

    def close(self) -> None:
        """End the push: record it when it lacked its last bucket or left a tensor unfilled."""
        if self.receiver is not None:
            try:
                self.receiver.finish()
            except RefitError as err:
                BucketSession.problems = [*BucketSession.problems, str(err)]
        self.receiver = None


def _register_transport() -> type | None:
    """Define and register :class:`BytesWeightTransferEngine`; None where vLLM has no weight-transfer API."""
    try:
        from vllm.distributed.weight_transfer.base import (
            WeightTransferEngine,
            WeightTransferInitInfo,
            WeightTransferUpdateInfo,
        )
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return None

    @dataclass
    class BytesInitInfo(WeightTransferInitInfo):
        """No connection to set up: the bytes travel in the ``update_weights`` RPC itself."""

    @dataclass
    class BytesUpdateInfo(WeightTransferUpdateInfo):
        blob: bytes | None = None
        """A safetensors-serialised state dict in our checkpoint names (``vllm.weights.tensors_to_bytes``)."""
        handle: tuple | None = None
        """Or a bucket of a bucketed refit, by reference (``rollout.refit.buckets.share_handle``: shared memory on CPU,
        a CUDA IPC handle on GPU); the buckets of one session arrive in order."""
        verify: str = "buckets"
        """``"buckets"``: recompute each bucket's checksum where it lands; ``"off"``."""

    class BytesWeightTransferEngine(WeightTransferEngine[BytesInitInfo, BytesUpdateInfo]):
        """vLLM weight-transfer backend whose update info carries the tensors as safetensors bytes.

        A session loads checkpoint-format weights layer by layer (vLLM's layerwise reload, as its NCCL backend
        does); in a draft session (``start_draft_weight_update``) the draft's lm_head is installed after the
        reload, un-shared from the target's when vLLM shared them.
        """

        init_info_cls = BytesInitInfo
        update_info_cls = BytesUpdateInfo

        def init_transfer_engine(self, init_info: BytesInitInfo) -> None:
            pass

        def start_weight_update(self) -> None:
            self._draft_head, self._draft_kv = None, {}
            self._buckets = BucketSession()
            initialize_layerwise_reload(self.model)

        def update_weights(self, update_info: dict) -> None:
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: BytesUpdateInfo) -> None:
            if update_info.handle is not None:
                state = self._buckets.receive(update_info.handle, update_info.verify)
            else:
                state = bytes_to_tensors(update_info.blob)
            if self.model is not self._default_model:  # a draft session
                state, head = _split_draft_state(state, self.model)
                self._draft_kv.update(_kv_part(state))
                if head is not None:
                    self._draft_head = head.clone()  # installed at the session's end; the bucket is reused
            self.model.load_weights(iter(state.items()))
            self._buckets.loaded()

        def finish_weight_update(self) -> None:
            self._buckets.close()  # the session always closes; what went wrong is asked for afterwards
            finalize_layerwise_reload(self.model, self.model_config)
            if self.model is not self._default_model:
                _rebuild_drafter_buffers(self.model, self._draft_kv)
                if self._draft_head is not None:
                    _install_draft_head(self._default_model, self.model, self._draft_head)
            self._draft_head, self._draft_kv = None, {}

        def shutdown(self) -> None:
            pass

    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, BytesWeightTransferEngine)
    return BytesWeightTransferEngine


BytesWeightTransferEngine = _register_transport()

CPU_FIXES: dict[str, str] = install_cpu_sampling_fixes(enabled=os.environ.get(FIXES_ENV, "1") != "0")
"""What the sampling probes found in this process and what was fixed (see ``vllm.cpu_fixes.apply_fixes``)."""


class CoDraftWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``): weight loads, checksums, reports."""

    def _codraft_models(self) -> dict[str, torch.nn.Module]:
        runner = self.model_runner
        models = {"policy": runner.get_model()}
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and getattr(drafter, "model", None) is not None:
            models["draft"] = drafter.model
        return models

    def codraft_load_weights(self, policy_blob: bytes | None, draft_blob: bytes | None) -> list[str]:
        """The fallback update path: load safetensors bytes in place through vLLM's ``reload_weights``."""
        models = self._codraft_models()
        loaded = []
        for kind, blob in (("policy", policy_blob), ("draft", draft_blob)):
            if blob is None:
                continue
            if kind not in models:
                raise RuntimeError("a draft state was pushed but this vLLM engine has no drafter")
            state, head = bytes_to_tensors(blob), None
            if kind == "draft":
                state, head = _split_draft_state(state, models["draft"])
            reload_weights(self.vllm_config, models[kind], iter(state.items()), None, True)
            if kind == "draft":
                _rebuild_drafter_buffers(models["draft"], _kv_part(state))
            if head is not None:
                _install_draft_head(models["policy"], models["draft"], head)
            loaded.append(kind)
        return loaded

    def codraft_refit_problems(self) -> list[str]:
        """The bucketed refits' problems since the last call (and forget them)."""
        problems, BucketSession.problems = BucketSession.problems, []
        return problems

    def codraft_checksums(self) -> dict[str, Report]:
        """``{"policy": report, "draft": report}`` (no ``"draft"`` without a drafter)."""
        return {kind: engine_checksums(model, kind == "draft") for kind, model in self._codraft_models().items()}

    def codraft_weight_api(self) -> dict[str, bool]:
        """Whether this worker can take vLLM's native weight-update session, for the policy and for the draft."""
        engine = getattr(self, "weight_transfer_engine", None)
        native = engine is not None and all(
            callable(getattr(self, m, None)) for m in ("start_weight_update", "update_weights", "finish_weight_update")
        )
        draft_check = getattr(self, "supports_draft_weight_updates", None)
        draft = (
            native
            and callable(getattr(self, "start_draft_weight_update", None))
            and bool(draft_check() if callable(draft_check) else getattr(engine, "supports_draft_weight_update", False))
        )
        return {
            "native": native,
            "native_draft": draft,
            "backend": type(engine).__name__ if engine is not None else None,
        }

    def codraft_cpu_fixes(self) -> dict[str, str]:
        """:data:`CPU_FIXES` of this worker process."""
        return dict(CPU_FIXES)
