"""The trained models out in one command: `codraft export RUN_DIR OUT_DIR` writes the policy as a Hugging Face model
(`transformers` loads it with the run's logits) and the draft as a vLLM EAGLE-3 checkpoint; `load_run` returns the
run's tokenizer, policy and draft, the weights of its newest checkpoint."""

import json

import pytest
import torch
from test_loop import micro_config

from lightning_codraft.cli import main
from lightning_codraft.models import Eagle3Draft
from lightning_codraft.rl.run.run_dir import CHAR_TOKENIZER_FILE, load_run
from lightning_codraft.rl.run.loop import CoDraftRun


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = micro_config(out, "task.eval_prompts=0", "run.plots=false", "draft.adaptive=false")
    run = CoDraftRun(cfg, print_fn=lambda s: None)
    run.run()
    return out, {k: v.detach().clone() for k, v in run.module.policy.state_dict().items()}, \
        {k: v.detach().clone() for k, v in run.module.draft.state_dict().items()}


def test_load_run_round_trips_the_trained_weights(trained):
    out, policy, draft = trained
    run = load_run(out)
    assert run.step == 3 and run.source.name == "step-000003"
    assert all(torch.equal(run.policy.state_dict()[k], v) for k, v in policy.items())
    assert all(torch.equal(run.draft.state_dict()[k], v) for k, v in draft.items())
    assert run.tokenizer.decode(run.tokenizer.encode("3+4=")) == "3+4="
    assert load_run(out, step=1).step == 1
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 9"):
        load_run(out, step=9)


def test_codraft_export_writes_a_transformers_policy_and_a_vllm_draft(trained, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, policy, draft = trained
    assert main(["export", str(out), str(tmp_path / "exported")]) == 0
    assert "policy:" in capsys.readouterr().out
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "exported" / "policy", attn_implementation="eager").eval()
    run = load_run(out)
    ids = torch.tensor([run.tokenizer.encode("3+4-2=")])
    with torch.no_grad():
        assert (hf(ids).logits - run.policy(ids).logits).abs().max() <= 1e-4
    alphabet = json.loads((tmp_path / "exported" / "policy" / CHAR_TOKENIZER_FILE).read_text())["alphabet"]
    assert alphabet == run.tokenizer.alphabet
    # the exported directory is a whole Hugging Face model: AutoTokenizer loads the tiny policy's tokenizer too
    tok = AutoTokenizer.from_pretrained(tmp_path / "exported" / "policy")
    text = "3+4-2=5,5 minus 2 is 3\n#3"
    assert tok.encode(text, add_special_tokens=False) == run.tokenizer.encode(text)
    assert tok.decode(run.tokenizer.encode(text)) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    again = Eagle3Draft.from_pretrained(tmp_path / "exported" / "draft", policy=run.policy)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in draft.items() if k in again.state_dict())
    assert json.loads((tmp_path / "exported" / "export.json").read_text())["step"] == 3


def test_export_of_a_directory_that_is_no_run_exits_2(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "x")]) == 2
    assert "no config.yaml" in capsys.readouterr().err


def test_export_needs_neither_the_reward_code_nor_the_data(trained, tmp_path, capsys):
    """A run trained with a reward module or a data file that this machine lacks still exports."""
    import shutil

    out, policy, _ = trained
    moved = tmp_path / "run"
    shutil.copytree(out, moved)
    text = (moved / "config.yaml").read_text()
    (moved / "config.yaml").write_text(text.replace("reward: null", "reward: not_installed_pkg.rewards:score", 1))
    assert "not_installed_pkg" in (moved / "config.yaml").read_text()
    run = load_run(moved)
    assert all(torch.equal(run.policy.state_dict()[k], v) for k, v in policy.items())
    assert main(["export", str(moved), str(tmp_path / "exported")]) == 0, capsys.readouterr().err
