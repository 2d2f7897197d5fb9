"""Offline draft distillation: warm-starting an EAGLE-3 draft on a frozen policy's own features before RL.

One home for the offline path (the online co-training objective is ``training``):

- ``cache``: the policy's taps and soft targets over a corpus, computed once into memory-mapped files;
- ``capture``: the same features recorded while the rollout engine samples the corpus (no second forward);
- ``fit``: the TTT fit of the draft on a cache (the online objective's loss, ``training.draft_loss``);
- ``calibration``: the proposal temperature of highest implied acceptance, folded into ``lm_head``;
- ``compiled``: the compiled draft unroll the fit uses where ``torch.compile`` pays;
- ``settings``: what the warm start generates and how it fits, each field naming the cache key it enters;
- ``stages``: the warm start's stages (corpus, vocabulary, features, draft), each owning its cache key;
- ``warmstart``: runs them, from the task's prompts to a cached, calibrated draft (``draft.warm_start``).
"""

from typing import TYPE_CHECKING

from lightning_codraft._lazy import lazy_exports

if TYPE_CHECKING:  # what IDEs and type checkers see; at run time the names load on first use
    from lightning_codraft.distill.cache import FeatureCache, build_feature_cache
    from lightning_codraft.distill.calibration import calibrate_draft_temperature
    from lightning_codraft.distill.capture import FeatureRecorder
    from lightning_codraft.distill.fit import fit_draft
    from lightning_codraft.distill.settings import DraftFitConfig, WarmStartSettings
    from lightning_codraft.distill.warmstart import warm_start_draft

_LAZY = {
    "FeatureCache": "lightning_codraft.distill.cache",
    "build_feature_cache": "lightning_codraft.distill.cache",
    "FeatureRecorder": "lightning_codraft.distill.capture",
    "DraftFitConfig": "lightning_codraft.distill.settings",
    "fit_draft": "lightning_codraft.distill.fit",
    "calibrate_draft_temperature": "lightning_codraft.distill.calibration",
    "WarmStartSettings": "lightning_codraft.distill.settings",
    "warm_start_draft": "lightning_codraft.distill.warmstart",
}

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)

__all__ = list(_LAZY)
