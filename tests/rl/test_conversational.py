"""S3: a TRL conversational prompt column (a list of ``{"role", "content"}`` messages) goes through the tokenizer's
chat template as TRL renders it (never its Python repr), rewards receive TRL's conversational completions, and a
tokenizer without a chat template refuses such a column before launch."""

import json

import pytest
from test_loop import micro_config

from lightning_codraft.config import ConfigError
from lightning_codraft.models.tokenizer import CharTokenizer, encode_prompt
from lightning_codraft.rl.run.build import HFTokenizer

TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
"""A chat template over the tiny policy's characters."""
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4="}]


def _chat_tokenizer():
    tok = CharTokenizer().to_transformers()
    tok.chat_template = TEMPLATE
    return tok


def _trl_ids(tok, messages):
    """TRL's rendering of a conversational prompt: the chat template as text (generation prompt added), then the
    tokenizer without special tokens."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_messages_go_through_the_chat_template_as_trl_renders_them():
    tok = _chat_tokenizer()
    ids = encode_prompt(HFTokenizer(tok), MESSAGES)
    assert ids == _trl_ids(tok, MESSAGES)
    assert tok.decode(ids) == "system: be brief\nuser: 3+4=\nassistant:"
    with pytest.raises(ValueError, match="has no chat template"):
        encode_prompt(CharTokenizer(), MESSAGES)


def _data(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"{a}+{b}="}],
             "answer": str(a + b)} for a in range(4) for b in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_conversational_column_reaches_the_policy_through_the_template(tmp_path, monkeypatch):
    from lightning_codraft.rl.run.build import build_policy
    from lightning_codraft.rl.run.loop import CoDraftRun
    from lightning_codraft.rl.rollout_worker import RolloutWorker
    from lightning_codraft.rl.step import step_prompts

    _, policy, _ = build_policy(micro_config(tmp_path / "x").model)
    model_dir = tmp_path / "model"
    policy.save_pretrained(model_dir)
    tok = _chat_tokenizer()
    tok.save_pretrained(model_dir)
    cfg = micro_config(tmp_path / "run", f"model.source={model_dir}", "task.name=dataset",
                       f"task.source={_data(tmp_path)}", "task.heldout=4", "task.eval_prompts=0", "sft.steps=0",
                       "draft.warm_start.steps=0", "rl.steps=1", "run.log_completions=4",
                       "task.rewards=[{fn: 'rewards_for_tests:conversational_only'}]")
    requests = []
    generate = RolloutWorker.generate
    monkeypatch.setattr(RolloutWorker, "generate", lambda self, reqs, seeds, **kwargs: (requests.append(reqs),
                                                                            generate(self, reqs, seeds))[1])
    run = CoDraftRun(cfg, print_fn=lambda s: None)
    try:
        res = run.run()
    finally:
        run.close()
    assert res.completed and res.rows[0]["reward_failures"] == 0  # the reward saw TRL's conversational form
    samples = step_prompts(run.task, cfg, 0)
    assert requests[0] == [_trl_ids(tok, s.prompt) for s in samples for _ in range(cfg.rl.group_size)]
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert logged[0]["prompt"] == samples[0].prompt and logged[0]["prompt"][0] == {"role": "system",
                                                                                   "content": "be brief"}


def test_a_tokenizer_without_a_template_refuses_messages_before_launch(tmp_path, capsys):
    from conftest import REPO

    from lightning_codraft.cli import main
    from lightning_codraft.rl.run.build import build_parts

    over = ["task.name=dataset", f"task.source={_data(tmp_path)}", "task.heldout=4", "sft.steps=0",
            "task.rewards=[{fn: 'rewards_for_tests:conversational_only'}]"]
    assert main(["fit", "--config", str(REPO / "recipes" / "tiny-smoke.yaml"), "--dry-run", *over]) == 2
    err = capsys.readouterr().err
    assert "task.prompt_column='prompt' holds chat messages" in err and "no chat template" in err
    with pytest.raises(ConfigError, match="holds chat messages: the prompt is a list of chat messages but the "
                                          "tokenizer \\(CharTokenizer\\) has no chat template"):
        build_parts(micro_config(tmp_path / "run", *over))  # the same from Python, before any work
