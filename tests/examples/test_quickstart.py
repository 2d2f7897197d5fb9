import importlib.util
import math

from conftest import REPO
from lightning_codraft.models import Eagle3Draft


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_runs_for_a_few_steps_and_saves_a_loadable_draft(tmp_path):
    out = _quickstart().main(["--policy-steps", "3", "--max-steps", "4", "--log-every", "2",
                              "--tokens-per-batch", "128", "--sample-tokens", "4", "--ttt-steps", "2",
                              "--save", str(tmp_path / "draft")])
    assert out["steps"] == 4 and [h["step"] for h in out["history"]] == [2, 4]
    for h in out["history"]:
        assert len(h["acc"]) == 2 and all(0.0 <= a <= 1.0 for a in h["acc"])
        assert 1.0 <= h["acceptance_length"] <= 3.0 and math.isfinite(h["loss"])
    draft = Eagle3Draft.from_pretrained(tmp_path / "draft")
    assert draft.config.draft_vocab_size == draft.config.vocab_size
