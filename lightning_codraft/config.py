"""Run configuration: the recipe's sections as one dataclass, how a recipe becomes one, and the rules across sections.

``load_config("recipes/tiny-cpu.yaml", ["rl.steps=5"])`` reads the recipe with OmegaConf, applies ``key=value``
overrides, refuses unknown and moved keys (naming the key and the valid or new one), builds every section (each
checks itself: config_sections.py, task_config.py, distill/settings.py; a failed check is named by its path) and
then checks the rules that span sections (:func:`validate`). Configuration flows one way: YAML -> these
dataclasses -> constructors.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_codraft.config_sections import (  # noqa: F401
    BLOCK_DRAFTERS,
    DraftConfig,
    ModelConfig,
    ParallelConfig,
    RLConfig,
    RunConfig,
    SFTConfig,
    WarmStartConfig,
)
from lightning_codraft.task_config import RewardTermConfig, TaskConfig  # noqa: F401 - re-exported


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key, the value and what would be right."""


@dataclass
class CoDraftConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """The drafter (``draft.type``) and its training."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """Prompts and rewards."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm-up of the policy."""
    rl: RLConfig = field(default_factory=RLConfig)
    """GRPO."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Mesh and rollout engine."""
    run: RunConfig = field(default_factory=RunConfig)
    """Outputs, seed, checkpoints."""


#: keys that moved: old key -> what to write instead (listed in CHANGELOG)
RENAMED = {
    "model.dtype": "parallel.precision (32-true, bf16-mixed or bf16-true): fp32 master weights need bf16-mixed, not "
    "bfloat16 parameters",
    "draft.warmup_steps": "draft.warm_start.steps",
    "draft.warmup_batch_size": "draft.warm_start.batch_size",
    "draft.warmup_lr": "draft.warm_start.lr",
    "draft.warm_start_cache": "draft.warm_start.cache_dir",
}
#: the self-distillation settings moved one level down: draft.warm_start.<field> -> draft.warm_start.corpus.<field>
_MOVED_UNDER = {("draft", "warm_start"): "corpus"}


def _section_type(cls: type, key: str) -> Optional[type]:
    """The dataclass field ``key`` of ``cls`` holds (``X`` or ``Optional[X]``), else None."""
    hint = typing.get_type_hints(cls).get(key)
    for arg in (hint, *typing.get_args(hint)):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _list_item_type(cls: type, key: str) -> Optional[type]:
    """The dataclass a list field's entries are (``task.rewards``: :class:`RewardTermConfig`), else None."""
    hint = typing.get_type_hints(cls).get(key)
    for arg in typing.get_args(hint):  # Optional[list[X]] -> list[X]
        hint = arg if typing.get_origin(arg) is list else hint
    args = typing.get_args(hint) if typing.get_origin(hint) is list else ()
    return args[0] if args and dataclasses.is_dataclass(args[0]) else None


def _check_keys(node: Any, cls: type, prefix: str) -> None:
    """Refuse unknown keys (naming the valid ones) and moved keys (naming the new one), recursively."""
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping of {cls.__name__} fields, got {node!r}")
    valid = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if name in RENAMED:
            raise ConfigError(f"config key {name!r} was replaced by {RENAMED[name]}")
        if key not in valid:
            under = _MOVED_UNDER.get(tuple(prefix.split(".")))
            if under is not None and key in {f.name for f in dataclasses.fields(_section_type(cls, under))}:
                raise ConfigError(f"config key {name!r} moved to {prefix}.{under}.{key}")
            raise ConfigError(
                f"unknown config key {name!r}; valid keys{' under ' + repr(prefix) if prefix else ''}"
                f": {', '.join(sorted(valid))}"
            )
        sub = _section_type(cls, key)
        if sub is not None and value is not None:
            _check_keys(value, sub, name)
        item = _list_item_type(cls, key)
        if item is not None and isinstance(value, list):  # e.g. task.rewards: each entry checked under its own key
            for i, entry in enumerate(value):
                _check_keys(entry, item, f"{name}[{i}]")
                try:
                    OmegaConf.merge(OmegaConf.structured(item), entry)
                except OmegaConfBaseException as e:
                    raise ConfigError(
                        f"invalid config value at {name}[{i}].{getattr(e, 'full_key', '')}: {str(e).splitlines()[0]}"
                    ) from None


def _named(path: str, error: ValueError, section) -> ConfigError:
    """A section's failed check named from the recipe's root: ``path`` before the field the message starts with
    (``draft.`` + ``lr=0 must be > 0``), else ``path: message``."""
    msg = str(error)
    head = re.match(r"\w+", msg)
    if not path or (head and head.group(0) in {f.name for f in dataclasses.fields(section)}):
        return ConfigError(f"{path}{msg}")
    return ConfigError(f"{path[:-1]}: {msg}")


def _build(node: DictConfig, cls: type, path: str):
    """``cls`` from the merged ``node``, each nested section built first under its own path: a section's failed
    check is raised as a :class:`ConfigError` naming the key from the recipe's root."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        value, sub = node[f.name], _section_type(cls, f.name)
        if sub is not None and value is not None:
            kwargs[f.name] = _build(value, sub, f"{path}{f.name}.")
        else:
            kwargs[f.name] = OmegaConf.to_object(value) if OmegaConf.is_config(value) else value
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise _named(path, e, cls) from None


def _check_sections(obj, path: str = "") -> None:
    """Every section's own :meth:`check` (nested ones first), its message prefixed with the section's path."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and hasattr(value, "check"):
            _check_sections(value, f"{path}{f.name}.")
    if hasattr(obj, "check"):
        try:
            obj.check()
        except ValueError as e:
            raise _named(path, e, obj) from None


def validate(cfg: CoDraftConfig) -> CoDraftConfig:
    """Check every section (its own :meth:`check`), then the rules that span sections; raise :class:`ConfigError`
    naming the key and the fix."""
    _check_sections(cfg)
    return _check_across(cfg)


def _check_across(cfg: CoDraftConfig) -> CoDraftConfig:
    """The rules that span sections (each section has checked itself)."""
    p, r, d, m = cfg.parallel, cfg.rl, cfg.draft, cfg.model
    if p.num_microbatches > r.prompts_per_step // p.dp * r.group_size:
        raise ConfigError(
            f"parallel.num_microbatches={p.num_microbatches} exceeds the "
            f"{r.prompts_per_step // p.dp * r.group_size} samples each replica trains on per step"
        )
    if r.prompts_per_step % p.dp:
        raise ConfigError(f"rl.prompts_per_step={r.prompts_per_step} must be divisible by parallel.dp={p.dp}")
    if d.adaptive and p.engine == "vllm" and d.mode != "none":
        raise ConfigError(
            "draft.adaptive=true needs the embedded engine: vLLM has no per-round speculation length "
            "for EAGLE-3; set draft.adaptive=false with parallel.engine=vllm"
        )
    if d.type in BLOCK_DRAFTERS and d.mode != "none":
        _check_block_drafter_run(cfg)
    if r.async_level:
        _check_async_run(cfg)
    elif r.max_staleness is not None:
        raise ConfigError(
            f"rl.max_staleness={r.max_staleness} bounds an asynchronous run's staleness; rl.async_level=0 is "
            f"synchronous: set rl.async_level >= 1, or drop rl.max_staleness"
        )
    if r.inflight_updates and r.max_staleness is None:
        raise ConfigError(
            "rl.inflight_updates=true updates the weights of the bounded-staleness producer's engine mid-sequence: "
            "set rl.async_level >= 1 and rl.max_staleness"
        )
    if r.drop_uniform_groups and r.max_staleness is None:
        raise ConfigError(
            "rl.drop_uniform_groups=true replaces a dropped group by the next one, which only the bounded-staleness "
            "producer generates: set rl.async_level >= 1 and rl.max_staleness"
        )
    if r.max_new_tokens >= m.max_position_embeddings:
        raise ConfigError(
            f"rl.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in the context "
            f"model.max_position_embeddings={m.max_position_embeddings}"
        )
    t = cfg.task
    if t.name == "dataset" and t.solution_column is None and cfg.sft.steps > 0:
        raise ConfigError(
            f"sft.steps={cfg.sft.steps} fine-tunes on worked solutions, which task.name=dataset has only "
            f"with task.solution_column; set it, or sft.steps=0"
        )
    return cfg


def _check_async_run(cfg: CoDraftConfig) -> None:
    """What an asynchronous run (``rl.async_level > 0``) refuses (``ConfigError`` naming the keys)."""
    p = cfg.parallel
    if p.devices * p.num_nodes != 1 and cfg.rl.max_staleness is not None:
        raise ConfigError(
            f"rl.max_staleness={cfg.rl.max_staleness} (bounded staleness) runs in one process; parallel.devices x "
            f"num_nodes = {p.devices * p.num_nodes}: on a mesh, use the deterministic k-step-off (drop "
            f"rl.max_staleness; docs/multinode.md)"
        )
    if p.engine != "embedded":
        raise ConfigError(
            f"rl.async_level={cfg.rl.async_level} needs parallel.engine=embedded (vLLM's pause / refit / resume is "
            f"not wired into the producer yet)"
        )


def _check_block_drafter_run(cfg: CoDraftConfig) -> None:
    """What a run with a block drafter (``dflash``, ``dspark``) refuses across sections (``ConfigError`` naming the
    keys)."""
    d = cfg.draft
    if d.warm_start.corpus is not None:
        raise ConfigError(
            f"draft.type={d.type} with draft.warm_start.corpus: the cached corpus is EAGLE-3's feature cache; a block "
            "drafter warm-starts on the pool of the policy's samples (draft.warm_start.steps)"
        )
    if cfg.parallel.engine_dtype in ("bfloat16", "float16"):
        raise ConfigError(
            f"draft.type={d.type} with parallel.engine_dtype={cfg.parallel.engine_dtype}: the block engine decodes in "
            f"the training weights' dtype; set parallel.engine_dtype=null"
        )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> CoDraftConfig:
    """Read a YAML recipe (or only defaults when ``path`` is None), apply ``key=value`` overrides, validate.

    Raises:
        ConfigError: unknown or moved keys (with the valid or new ones), values of the wrong type, out-of-range
            values.
        FileNotFoundError: the recipe does not exist.
    """
    layers = []
    if path is not None:
        if not Path(path).exists():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist")
        layers.append(OmegaConf.load(path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. rl.steps=5)")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    for layer in layers:
        _check_keys(OmegaConf.to_container(layer, resolve=False), CoDraftConfig, "")
    return _from_layers(layers)


def _from_layers(layers: list) -> CoDraftConfig:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(CoDraftConfig), *layers)
        cfg = _build(merged, CoDraftConfig, "")
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config value at {getattr(e, 'full_key', '?')}: {str(e).splitlines()[0]}") from None
    return _check_across(cfg)  # _build constructed every section, and a section checks itself on construction


def to_yaml(cfg: CoDraftConfig) -> str:
    """The fully resolved config as YAML (written next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_dict(d: dict) -> CoDraftConfig:
    """Rebuild and validate a config from ``dataclasses.asdict`` output (checkpoints store this)."""
    _check_keys(d, CoDraftConfig, "")
    return _from_layers([d])
