import dataclasses
import typing

import pytest

from lightning_codraft.config import CoDraftConfig, ConfigError, config_from_dict, load_config, to_yaml


def test_defaults_and_overrides_round_trip(tmp_path):
    cfg = load_config(None, ["rl.steps=3", "draft.mode=frozen", "task.reward=pkg.mod:fn"])
    assert cfg.rl.steps == 3 and cfg.draft.mode == "frozen" and cfg.task.reward == "pkg.mod:fn"
    p = tmp_path / "c.yaml"
    p.write_text(to_yaml(cfg))
    again = load_config(p)
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    assert dataclasses.asdict(config_from_dict(dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)


@pytest.mark.parametrize("override, match", [
    ("rl.stepz=3", r"unknown config key 'rl.stepz'; valid keys under 'rl': async_level, clip_eps, .*steps"),
    ("bogus=1", r"unknown config key 'bogus'; valid keys: draft, model, parallel, rl, run, sft, task"),
    ("rl.steps=abc", r"rl.steps"),
    ("draft.mode=fast", r"draft.mode='fast' is not one of \('cotrain', 'frozen', 'none'\)"),
    ("parallel.cp=2", r"dp \* pp \* cp = 1\*1\*2 = 2 must equal devices \* num_nodes = 1\*1 = 1"),
    ("rl.group_size=1", r"rl.group_size=1 must be >= 2"),
    ("rl.max_new_tokens=500", r"rl.max_new_tokens=500 leaves no room"),
    ("rl", r"'rl' is not of the form key=value"),
    ("parallel.engine_dtype=bf16", r"parallel.engine_dtype='bf16' is not one of \('float32', 'bfloat16'"),
    ("draft.schedule=sometimes", r"draft.schedule='sometimes' is not one of \('every_step', 'every_n', 'adaptive'\)"),
    ("draft.train_every=2", r"draft.train_every=2 needs schedule=every_n"),
    ("draft.loss_type=kl", r"draft.loss_type='kl' must be one of \('ce', 'tv', 'lk_alpha', 'lk_lambda'\)"),
    ("draft.position_weights=linear", r"draft.position_weights='linear' must be one of"),
    ("draft.sample_every=0", r"draft.sample_every=0 must be >= 1"),
    ("draft.schedule_horizon=0", r"draft.schedule_horizon=0 must be >= 1"),
])
def test_bad_overrides_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_engine_dtype_needs_the_embedded_engine():
    assert load_config(None, ["parallel.engine_dtype=bfloat16"]).parallel.engine_dtype == "bfloat16"
    with pytest.raises(ConfigError, match="engine_dtype=bfloat16 needs parallel.engine=embedded"):
        load_config(None, ["parallel.engine_dtype=bfloat16", "parallel.engine=vllm", "draft.adaptive=false"])


def test_unknown_key_in_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  hidden_size: 32\n  num_layers: 2\n")
    with pytest.raises(ConfigError, match=r"'model.num_layers'.*num_hidden_layers"):
        load_config(p)
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_every_field_has_a_docstring():
    import ast
    import inspect

    import lightning_codraft.config as mod

    tree = ast.parse(inspect.getsource(mod))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and node.name != "CoDraftConfig" or (
                isinstance(node, ast.ClassDef) and node.name == "CoDraftConfig"):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), \
                        f"{node.name}.{stmt.target.id} has no docstring"
    assert typing.get_type_hints(CoDraftConfig)


@pytest.mark.parametrize("recipe", ["tiny-cpu", "smollm2-135m-cpu", "qwen3-8b-cluster"])
def test_recipes_validate(recipe):
    from conftest import REPO

    cfg = load_config(REPO / "recipes" / f"{recipe}.yaml")
    assert cfg.rl.steps >= 1
