"""The embedded engines' weights: both decode the modules they were given (EAGLE-3's ``SpeculativeEngine``, the
block drafter's ``BlockSpeculativeEngine``), so a refit writes into those modules, in place, bucket by bucket.

:class:`EmbeddedWeights` is that half of the ``RolloutEngine`` protocol (rollout/engine.py), written once: the
versions the engine decodes with (stamped on every output), full state dicts (:meth:`update_weights`), the bucketed
refit (:meth:`load_buckets`, every bucket checked as it lands), and the memory hooks an embedded engine does not
have (:meth:`sleep`, :meth:`wake_up`, :meth:`close`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from lightning_codraft.rollout.engine import RolloutOutput
from lightning_codraft.rollout.refit.buckets import BucketReceiver, WeightBucket, copy_into


class EmbeddedWeights:
    """Mixin of an engine with ``policy`` and ``draft`` modules (``draft`` may be None) and ``weight_versions``."""

    keeps_own_weights = False
    """The engine decodes the modules it was given: a weight update writes into them."""
    supports_sleep = False
    """The engine has no memory of its own to free; its modules' storage is the caller's (refit.sync)."""
    verify_updates = False
    """The engine checks every bucket as it lands (:meth:`load_buckets`) and decodes the tensors it was given: it
    has nothing more to verify, and ignores the flag."""

    def _weights_changed(self) -> None:
        """Called after every weight load (an engine drops what it derived from the old weights)."""

    def stamp(self, outputs: Sequence[RolloutOutput]) -> list[RolloutOutput]:
        """``outputs`` tagged with the versions the engine decoded them with."""
        for out in outputs:
            out.policy_version, out.draft_version = self.weight_versions["policy"], self.weight_versions["draft"]
        return list(outputs)

    def update_weights(
        self, policy_state: Mapping[str, torch.Tensor] | None, draft_state: Mapping[str, torch.Tensor] | None
    ) -> None:
        """Copy full HF-named policy / vLLM-named draft state dicts into the engine's modules (None: keep)."""
        for name, module, state in (("policy", self.policy, policy_state), ("draft", self.draft, draft_state)):
            if state is None:
                continue
            if module is None:
                raise ValueError(
                    f"update_weights got a {name} state but the engine has no {name} "
                    "(constructed with draft=None or num_speculative_tokens=0)"
                )
            result = module.load_state_dict(dict(state), strict=False)
            if result.missing_keys or result.unexpected_keys:
                raise ValueError(
                    f"{name} state does not match the engine's {name}: missing "
                    f"{list(result.missing_keys)[:5]}, unexpected {list(result.unexpected_keys)[:5]}"
                )
        self._weights_changed()

    def load_buckets(self, buckets: Iterable[WeightBucket], verify: str = "buckets") -> None:
        """Copy a bucketed refit into the engine's modules in place, each bucket checked as it lands
        (:class:`~lightning_codraft.rollout.refit.buckets.BucketReceiver`); the engine then holds the pushed versions."""
        receivers: dict[str, tuple[BucketReceiver, dict]] = {}
        for bucket in buckets:
            module = {"policy": self.policy, "draft": self.draft}.get(bucket.kind)
            if module is None:
                raise ValueError(f"load_buckets got a {bucket.kind!r} bucket but the engine has no such model")
            if bucket.kind not in receivers:
                params = module.state_dict(keep_vars=True)
                receivers[bucket.kind] = (BucketReceiver(bucket.kind, expected=params, verify=verify), params)
            receiver, params = receivers[bucket.kind]
            copy_into(params, receiver.accept(bucket), bucket)
        for kind, (receiver, _) in receivers.items():
            receiver.finish()
            self.weight_versions[kind] = int(receiver.version)
        self._weights_changed()

    def sleep(self, level: int = 1) -> None:
        raise RuntimeError(
            "the embedded engine cannot sleep (supports_sleep is False): release its modules' storage "
            "with rollout.refit.sync.release_parameters instead"
        )

    def wake_up(self, *, refit: bool = False) -> None:
        raise RuntimeError("the embedded engine cannot sleep (supports_sleep is False)")

    def close(self) -> None:
        """Nothing runs apart from the caller: a no-op (the protocol's)."""
