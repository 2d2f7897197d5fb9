"""The weights side of :class:`~lightning_codraft.rollout.vllm.engine.VLLMEngine`: refits into vLLM's workers
(bucketed, by reference, through vLLM's native weight-update sessions or the worker extension), their
verification by checksums, and sleep / wake between rollouts (a woken engine is verified again).

A mixin of the engine: it reads the engine's ``llm``, ``num_speculative_tokens``, ``weight_update_path``,
``verify_updates``, ``weight_versions`` and its sleep state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from lightning_codraft.rollout.refit.buckets import RefitError, WeightBucket, share_handle
from lightning_codraft.rollout.vllm.weights import (
    ChecksumStream,
    compare_expected,
    compare_resident,
    expected_checksums,
    push_weights,
    tensors_to_bytes,
)


class VLLMWeights:
    """Refit, verify, sleep and wake a vLLM engine's policy and drafter."""

    keeps_own_weights = True
    """vLLM holds its weights in its own processes, apart from the modules it was exported from."""

    # ------------------------------------------------------------------ sleep / wake
    @property
    def supports_sleep(self) -> bool:
        """Whether :meth:`sleep` works: vLLM was started with sleep mode on a platform that has one."""
        return self._no_sleep_reason is None

    def sleep(self, level: int = 1) -> None:
        """Free the engine's device memory between rollouts (``LLM.sleep``): level 1 offloads the weights to host
        memory and drops the KV cache; level 2 drops both (:meth:`wake_up` must then be given the weights)."""
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}); use 1 (weights offloaded) or 2 (weights discarded)")
        if not self.supports_sleep:
            raise RuntimeError(f"this VLLMEngine cannot sleep: {self._no_sleep_reason}")
        self._live().sleep(level=level)
        self._asleep = level

    def wake_up(
        self,
        policy_state: Mapping[str, torch.Tensor] | None = None,
        draft_state: Mapping[str, torch.Tensor] | None = None,
        refit: bool = False,
    ) -> None:
        """Wake from :meth:`sleep`, load any given weights, and verify BOTH policy and draft (always).

        After level 1 the weights come back from host memory and must equal their last verified checksums;
        after level 2 they are gone, so ``policy_state`` (and ``draft_state`` with a drafter) are required.
        Raises RuntimeError naming the model (e.g. the draft, vllm #52487) that does not hold its weights;
        ``refit=True``: the caller refits both models next (the RL loop, after a level-2 sleep): no push here."""
        if self._asleep is None:
            raise RuntimeError("wake_up() on an engine that is not asleep; call sleep() first")
        if refit:  # a bucketed refit of both models follows at once (load_buckets pushes and checks them)
            self.llm.wake_up()
            self._asleep = None
            return
        if self._asleep == 2 and (policy_state is None or (self.num_speculative_tokens and draft_state is None)):
            raise ValueError(
                "level-2 sleep discarded the weights: pass wake_up(policy_state, draft_state) with "
                f"both states{'' if self.num_speculative_tokens else ' (policy only: no drafter)'}"
            )
        self.llm.wake_up()
        self._asleep = None
        self._push(policy_state, draft_state)
        self.verify(policy_state, draft_state)

    # ------------------------------------------------------------------ weights
    def _push(
        self, policy_state: Mapping[str, torch.Tensor] | None, draft_state: Mapping[str, torch.Tensor] | None
    ) -> None:
        if draft_state is not None and self.num_speculative_tokens == 0:
            raise ValueError("update_weights got a draft state but this VLLMEngine runs without a draft")
        if policy_state is None and draft_state is None:
            return
        llm = self._live()
        push_weights(
            llm,
            self.weight_update_path,
            None if policy_state is None else tensors_to_bytes(policy_state),
            None if draft_state is None else tensors_to_bytes(draft_state),
        )
        llm.reset_prefix_cache()

    def load_buckets(self, buckets: Iterable[WeightBucket], verify: str = "buckets") -> None:
        """Load a bucketed refit into every worker by reference (rollout/refit/buckets.py; buckets in CPU shared memory
        or on CUDA): each bucket's handle goes through vLLM's native weight-update session, one per model, and the
        worker checks it as it lands. With ``verify_updates`` both models are then fully verified against checksums
        streamed from the buckets as they pass (:class:`~lightning_codraft.rollout.vllm.weights.ChecksumStream`: no
        pushed tensor is kept on the host; the extension path, which takes whole states, keeps them)."""
        llm, session, pushed, kept, streams = self._live(), None, {}, {}, {}
        native = self.weight_update_path == "native"
        try:
            for bucket in buckets:
                if bucket.kind == "draft" and self.num_speculative_tokens == 0:
                    raise ValueError("load_buckets got a draft bucket but this VLLMEngine runs without a draft")
                if not native:
                    kept.setdefault(bucket.kind, {}).update((n, t.clone()) for n, t in bucket.tensors())
                if self.verify_updates:
                    stream = streams.setdefault(bucket.kind, self._checksum_stream(bucket.kind))
                    for name, t in bucket.tensors():
                        stream.add(name, t)
                if native and bucket.kind != session:
                    if session is not None:
                        llm.collective_rpc("finish_weight_update")
                    session = bucket.kind
                    llm.collective_rpc("start_weight_update" if session == "policy" else "start_draft_weight_update")
                if native:
                    llm.collective_rpc(
                        "update_weights", kwargs={"update_info": {"handle": share_handle(bucket), "verify": verify}}
                    )
                pushed[bucket.kind] = bucket.version
        finally:  # the session closes whatever happened; the workers' problems are asked for below
            if session is not None:
                llm.collective_rpc("finish_weight_update")
        problems = sorted({p for worker in llm.collective_rpc("codraft_refit_problems") for p in worker})
        if problems:
            raise RefitError(f"the refit did not reach vLLM intact: {'; '.join(problems)}")
        if not native:  # the extension path takes whole states
            self._push(kept.get("policy"), kept.get("draft"))
        llm.reset_prefix_cache()
        if self.verify_updates:
            self._verify({kind: stream.result() for kind, stream in streams.items()})
        self.weight_versions.update(pushed)

    def _checksum_stream(self, kind: str) -> ChecksumStream:
        """A stream keyed like the engine's last report of ``kind``."""
        return ChecksumStream(kind == "draft", self._resident_kinds(kind))

    def _resident_kinds(self, kind: str) -> dict[str, str]:
        """``key -> "param" | "probe"`` of the engine's last report of ``kind`` (how each of its layers is checked)."""
        report = self._resident[0].get(kind, {}) if self._resident else {}
        return {k: v[0] for k, v in report.items()}

    def update_weights(
        self, policy_state: Mapping[str, torch.Tensor] | None, draft_state: Mapping[str, torch.Tensor] | None
    ) -> None:
        """Load new weights into every vLLM worker in place and reset the prefix cache; with ``verify_updates``
        check both models (:meth:`verify`): the pushed ones against the pushed tensors, the other unchanged."""
        self._push(policy_state, draft_state)
        if self.verify_updates:
            self.verify(policy_state, draft_state)

    def verify(
        self,
        policy_state: Mapping[str, torch.Tensor] | None = None,
        draft_state: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Raise RuntimeError unless every worker holds exactly the expected policy and draft.

        A given state is compared with the engine's float64 sums / sums of squares of its tensors; a model
        whose state is None must equal its checksums at the last successful verification (or at start). On
        success those become the new reference.
        """
        expected = {}
        for kind, state in (("policy", policy_state), ("draft", draft_state)):
            if state is not None:
                expected[kind] = expected_checksums(state, kind == "draft", self._resident_kinds(kind))
        self._verify(expected)

    def _verify(self, expected: Mapping[str, Mapping[str, tuple[float, float]]]) -> None:
        """:meth:`verify` against checksums of the pushed states (``kind -> {key: (sum, sumsq)}``); a kind not in
        ``expected`` must be unchanged since the last verification."""
        reports = self._live().collective_rpc("codraft_checksums")
        kinds = ("policy", "draft") if self.num_speculative_tokens else ("policy",)
        problems: list[str] = []
        for rank, report in enumerate(reports):
            for kind in kinds:
                if kind not in report:
                    problems.append(f"worker {rank}: no {kind} model loaded")
                elif kind in expected:
                    problems += [f"worker {rank}: {p}" for p in compare_expected(kind, expected[kind], report[kind])]
                else:
                    before = self._resident[rank].get(kind, {}) if rank < len(self._resident) else {}
                    problems += [f"worker {rank}: {p}" for p in compare_resident(kind, before, report[kind])]
        if problems:
            failed = sorted({k for k in kinds if any(f": {k}" in p or f"no {k} " in p for p in problems)})
            raise RuntimeError(
                f"vLLM weights not verified for the {' and '.join(failed)} (the engine does not hold "
                "the expected weights):\n  " + "\n  ".join(problems[:20])
            )
        self._resident = reports
