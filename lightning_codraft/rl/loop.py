"""The RL loop: generate (speculative engine) -> reward -> GRPO + draft step (CoDraftModule) -> weight sync.

:func:`fit` runs a whole :class:`~lightning_codraft.config.CoDraftConfig`:

1. build tokenizer, policy, task and reward; resume from the last checkpoint in ``run.out_dir`` if any,
   else run the SFT warm-up of the policy and the offline warm-start of the draft (on the policy's own
   samples) and save checkpoint ``step-000000``;
2. per RL step ``s``: ``prompts_per_step`` prompts (a pure function of ``(seed, s)``), ``group_size`` samples
   each from the engine (sampling seed a function of ``(seed, s)``), rewards, group advantages, one packed
   next-token-aligned batch, one optimizer step of ``L_rl + lambda * L_draft``, weight sync to the engine,
   metrics to CSV / TensorBoard / progress bar, a checkpoint every ``run.checkpoint_every`` steps;
3. greedy accuracy before / after, the rollout speed-up of the final draft, PNG plots.

Everything a step consumes is derived from the seed, the step index and the checkpointed state, so a
killed run resumed from its last checkpoint reproduces the metrics of the uninterrupted run.

On a ``dp x pp x cp`` mesh one rank per data-parallel replica generates: the replica's *lead*, ``(pp_rank 0,
cp_rank 0)`` of its ``dp_rank`` (``ParallelDims.is_replica_lead``). Only the lead holds a rollout engine; its
outputs (token ids, log-probs, finish reasons, acceptance statistics) are broadcast over the replica's
``pp x cp`` ranks, which all build the identical RL batch. Sampling seeds depend on ``(seed, step, dp_rank)``
only, so a pp = 2 or cp = 2 run samples what the one-process run samples. Without PP the embedded engine
decodes with the lead's training modules themselves; under PP a rank holds only its pipeline stage, so the
lead keeps whole copies of policy and draft (made before the stages are released), and every weight sync
gathers the stages onto it (``CoDraftModule.full_state_dicts``, a collective) and loads them into the copies
(and into vLLM with ``parallel.engine=vllm``). Greedy evaluation and the final speed-up run on global rank 0
(the lead of replica 0), the accuracy broadcast to every rank.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_codraft.config import CoDraftConfig, to_yaml
from lightning_codraft.rl.build import build_policy, build_reward, build_task, encode_prompt
from lightning_codraft.rl.evaluate import SpeedupResult, greedy_accuracy, measure_speedup
from lightning_codraft.rl.experience import Rollout, build_rl_batch, group_advantages, sequence_weighted
from lightning_codraft.rl.logs import MetricsLogger, StepProgress, plot_curves, summarize
from lightning_codraft.rl.rewards import score_completions
from lightning_codraft.rl.warmup import draft_warmup, encode_samples, sft_warmup

_EVAL_SEED = 10**6          # eval prompts come from seeds the training steps never use
_DRAFT_POOL_SEED = 2 * 10**6


def step_seed(seed: int, step: int) -> int:
    """The seed of RL step ``step``'s prompts and sampling."""
    return seed * 100_003 + step + 1


@dataclass
class FitResult:
    """What a finished (or interrupted) run reports.

    Attributes:
        out_dir: the run directory.
        rows: per-step metrics (as in metrics.csv).
        eval_before, eval_after: greedy mean reward on held-out prompts (NaN when skipped).
        speedup: the final rollout speed-up measurement (None without a draft, and on every rank but 0).
        completed: False when the run stopped early (``stop_after``).
    """

    out_dir: Path
    rows: list[dict[str, float]] = field(default_factory=list)
    eval_before: float = math.nan
    eval_after: float = math.nan
    speedup: Optional[SpeedupResult] = None
    completed: bool = True


class CoDraftRun:
    """One RL run of a config; :meth:`run` executes it. Built by :func:`fit`.

    Args:
        cfg: the validated config.
        print_fn: where status lines go (rank 0 only).

    Attributes (after :meth:`setup`):
        dims: the (dp, pp, cp) layout of this process.
        engine: the rollout engine on the lead of each data-parallel replica, None on every other rank.
        rollout_policy, rollout_draft: on the lead, the whole modules the engine is built from (the training
            modules without PP, synced copies under PP); None elsewhere.
        last_rollouts: this replica's rollouts of the last RL step (identical on every rank of the replica).
    """

    def __init__(self, cfg: CoDraftConfig, print_fn: Callable[[str], None] = print):
        self.cfg = cfg
        self.out = Path(cfg.run.out_dir)
        self._print = print_fn
        self.fabric = None
        self.dims = None
        self.engine = None
        self.rollout_policy = None
        self.rollout_draft = None
        self.last_rollouts: list[Rollout] = []

    # ------------------------------------------------------------------ setup
    def log(self, msg: str) -> None:
        if self.fabric is None or self.fabric.global_rank == 0:
            self._print(msg)

    def _launch(self) -> None:
        from lightning.fabric import Fabric

        from lightning_codraft.fabric import CoDraftStrategy

        p = self.cfg.parallel
        self.fabric = Fabric(accelerator=p.accelerator, devices=p.devices, num_nodes=p.num_nodes,
                             strategy=CoDraftStrategy(dp=p.dp, pp=p.pp, cp=p.cp))
        self.fabric.launch()
        self.dims = self.fabric.strategy.parallel_dims
        if self.cfg.run.threads:
            torch.set_num_threads(self.cfg.run.threads)

    def _build_models(self):
        from lightning_codraft.models import Eagle3Draft
        from lightning_codraft.training.module import CoDraftModule, CoDraftModuleConfig

        cfg = self.cfg
        self.tokenizer, policy, self.context = build_policy(cfg.model, seed=cfg.run.seed)
        if cfg.parallel.pp > 1:  # an impossible split fails here, not after the warm-ups when setup_module splits
            from lightning_codraft.parallel.pipeline import StageLayout

            StageLayout.split(int(policy.num_layers), cfg.parallel.pp)
        self.task = build_task(cfg.task)
        self.reward_fn = build_reward(cfg.task, self.task)
        V = policy.config.vocab_size
        counts = None
        if cfg.draft.draft_vocab_size is not None and cfg.draft.draft_vocab_size < V:
            counts = torch.ones(V)  # placeholder mapping; the warm-up or the checkpoint sets the real one
        with torch.random.fork_rng():
            torch.manual_seed(cfg.run.seed + 1)
            draft = Eagle3Draft.from_policy(policy, draft_vocab_size=cfg.draft.draft_vocab_size, token_counts=counts)
        mode = cfg.draft.mode
        # each replica's batch is one microbatch (the objective of the one-process run); 1F1B needs >= pp of
        # them, and with a single microbatch GPipe runs the same forward and backward
        mcfg = CoDraftModuleConfig(
            draft_loss_weight=cfg.draft.loss_weight, freeze_draft=mode != "cotrain", score_draft=mode != "none",
            ttt_steps=cfg.draft.ttt_steps, clip_eps=cfg.rl.clip_eps, kl_coef=cfg.rl.kl_coef,
            policy_lr=cfg.rl.lr, draft_lr=cfg.draft.lr, grad_clip=1.0, num_microbatches=1,
            pp_schedule="gpipe" if cfg.parallel.pp > 1 else "1f1b")
        self.module = CoDraftModule(policy, draft, mcfg)

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def last_checkpoint(self) -> tuple[int, Path] | None:
        """``(step, path)`` of the newest complete checkpoint in the run directory, or None."""
        found = []
        for p in self._ckpt_dir().glob("step-*"):
            if (p / "COMPLETE").exists():
                found.append((int(p.name.split("-")[1]), p))
        return max(found) if found else None

    def save(self, step: int, extra: dict[str, Any]) -> Path:
        path = self._ckpt_dir() / f"step-{step:06d}"
        state = {"module": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler,
                 "step": step, **extra}
        if self.ref_policy is not None:
            state["ref_policy"] = self.ref_policy
        self.fabric.save(path, state)
        self.fabric.barrier()
        if self.fabric.global_rank == 0:
            (path / "COMPLETE").write_text(str(step))
        self.fabric.barrier()
        return path

    # ------------------------------------------------------------------ warm-ups
    def _warmups(self) -> dict[str, Any]:
        cfg = self.cfg
        module, tok = self.module, self.tokenizer
        policy = module.policy
        info: dict[str, Any] = {}
        if cfg.sft.steps > 0:
            t0 = time.perf_counter()
            every = max(1, cfg.sft.steps // 5)
            losses = sft_warmup(
                policy, tok, self.task.sample, cfg.sft.steps, cfg.sft.batch_size, cfg.sft.lr,
                seed=cfg.run.seed * 7919 + 3 * 10**6, context=self.context,
                on_step=lambda i, l: (i + 1) % every == 0 and self.log(f"  SFT step {i + 1}/{cfg.sft.steps}: "
                                                                        f"loss {l:.3f}"))
            info["sft_loss"] = losses[-1]
            self.log(f"SFT warm-up: {cfg.sft.steps} steps in {time.perf_counter() - t0:.0f}s, "
                     f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        if cfg.draft.mode != "none" and cfg.draft.warmup_steps > 0:
            t0 = time.perf_counter()
            batches = self._draft_pool()
            every = max(1, cfg.draft.warmup_steps // 5)
            losses = draft_warmup(
                module, batches, cfg.draft.warmup_steps, cfg.draft.warmup_lr,
                on_step=lambda i, l, a: (i + 1) % every == 0 and self.log(
                    f"  draft warm-up step {i + 1}/{cfg.draft.warmup_steps}: loss {l:.3f}, step-0 acc {a:.3f}"))
            info["draft_warmup_loss"] = losses[-1]
            self.log(f"draft warm-start: {cfg.draft.warmup_steps} steps in {time.perf_counter() - t0:.0f}s, "
                     f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        return info

    def _draft_pool(self) -> list[dict]:
        """Packed batches of the policy's OWN samples (the draft learns the distribution it will serve)."""
        from lightning_codraft.models.vocab import build_vocab_mapping
        from lightning_codraft.rollout.speculative import SpeculativeEngine

        cfg, tok = self.cfg, self.tokenizer
        policy, draft = self.module.policy, self.module.draft
        bs = cfg.draft.warmup_batch_size
        n_batches = max(1, min(cfg.draft.warmup_steps, 8))
        samples = self.task.sample(bs * n_batches, seed=cfg.run.seed + _DRAFT_POOL_SEED)
        prompts = self._fit_prompts([encode_prompt(tok, s.prompt) for s in samples])
        engine = SpeculativeEngine(policy, None, 0)
        outs = engine.generate(prompts, max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature,
                               top_p=cfg.rl.top_p, seed=cfg.run.seed + _DRAFT_POOL_SEED,
                               stop_token_ids=[tok.eos_token_id])
        rollouts = [Rollout(p, o.token_ids, [0.0] * len(o.token_ids), group=i) for i, (p, o) in
                    enumerate(zip(prompts, outs)) if o.token_ids]
        V = policy.config.vocab_size
        if draft.config.draft_vocab_size < V:
            ids = torch.tensor([t for r in rollouts for t in r.prompt_ids + r.completion_ids])
            d2t, t2d = build_vocab_mapping(torch.bincount(ids, minlength=V), draft.config.draft_vocab_size)
            draft.set_vocab_mapping(d2t, t2d)
        return [build_rl_batch(rollouts[i:i + bs], [0.0] * len(rollouts[i:i + bs]), pad_id=tok.pad_token_id)
                for i in range(0, len(rollouts), bs)]

    def _fit_prompts(self, prompts: list[list[int]]) -> list[list[int]]:
        room = self.context - self.cfg.rl.max_new_tokens
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty after tokenization")
            if len(p) > room:
                raise ValueError(f"prompt {i} has {len(p)} tokens but the context {self.context} minus "
                                 f"rl.max_new_tokens={self.cfg.rl.max_new_tokens} leaves {room}; raise "
                                 f"model.max_position_embeddings or lower rl.max_new_tokens")
        return prompts

    # ------------------------------------------------------------------ one RL step
    def _engine(self):
        """A rollout engine over :attr:`rollout_policy` / :attr:`rollout_draft` (call on a replica lead)."""
        d = self.cfg.draft
        k = 0 if d.mode == "none" else d.num_speculative_tokens
        draft = self.rollout_draft if k else None
        if self.cfg.parallel.engine == "vllm":  # a separate engine holding copies: synced after every step
            from lightning_codraft.rollout.vllm_engine import VLLMEngine

            workdir = self.out / ("vllm" if self.dims.dp == 1 else f"vllm-dp{self.dims.dp_rank}")
            return VLLMEngine.from_modules(self.rollout_policy, draft, k, workdir=workdir,
                                           max_num_seqs=self.cfg.parallel.engine_batch_size or 64)
        from lightning_codraft.rollout.speculative import SpeculativeEngine

        return SpeculativeEngine(self.rollout_policy, draft, k, max_batch_size=self.cfg.parallel.engine_batch_size)

    def _engine_holds_copies(self) -> bool:
        """Whether the engine decodes with weights of its own, refreshed by :meth:`sync_weights` after every
        optimizer step: vLLM always, the embedded engine under PP (where no rank holds the whole training
        module). Without PP the embedded engine decodes with the lead's training modules themselves."""
        return self.cfg.parallel.engine == "vllm" or self.dims.pp_enabled

    def _take_rollout_models(self) -> None:
        """On a replica lead, choose the whole modules rollouts decode with; call BEFORE ``setup_module``.

        Without PP these are the training modules. Under PP ``setup_module`` releases every parameter outside
        this rank's stage to the ``meta`` device, so the lead keeps deep copies (on its device), made now while
        the modules are whole and kept current by :meth:`sync_weights`; this costs one extra copy of policy +
        draft on each lead.
        """
        if not self.dims.is_replica_lead:
            return
        if not self.dims.pp_enabled:
            self.rollout_policy, self.rollout_draft = self.module.policy, self.module.draft
            return
        import copy

        policy, draft = copy.deepcopy((self.module.policy, self.module.draft))  # one memo: shared tensors stay shared
        device = self.fabric.device
        self.rollout_policy = policy.requires_grad_(False).to(device)
        self.rollout_draft = draft.requires_grad_(False).to(device)

    def _from_lead(self, value: Any) -> Any:
        """``value`` as the replica's lead holds it, on every rank of the replica (a broadcast over the
        replica's ``pp x cp`` group, lead = its rank 0; call on every rank)."""
        group = self.dims.replica_group
        if group is None:
            return value
        box = [value if self.dims.is_replica_lead else None]
        dist.broadcast_object_list(box, group=group, group_src=0)
        return box[0]

    def rl_step(self, step: int) -> dict[str, float]:
        cfg, tok = self.cfg, self.tokenizer
        dims = self.dims
        seed = step_seed(cfg.run.seed, step)
        t_start = time.perf_counter()
        samples = self.task.sample(cfg.rl.prompts_per_step, seed=seed)
        per_rank = cfg.rl.prompts_per_step // dims.dp
        mine = samples[dims.dp_rank * per_rank:(dims.dp_rank + 1) * per_rank]
        G = cfg.rl.group_size
        prompts = self._fit_prompts([encode_prompt(tok, s.prompt) for s in mine])
        requests = [p for p in prompts for _ in range(G)]
        from lightning_codraft.rollout.engine import AcceptanceStats

        generated = None
        if self.engine is not None:  # the replica's lead generates; its pp x cp peers receive the outputs
            self.rollout_policy.eval()
            t0 = time.perf_counter()
            outs = self.engine.generate(requests, max_new_tokens=cfg.rl.max_new_tokens,
                                        temperature=cfg.rl.temperature, top_p=cfg.rl.top_p,
                                        seed=seed * 131 + dims.dp_rank, stop_token_ids=[tok.eos_token_id])
            rollout_s = time.perf_counter() - t0
            acc = getattr(self.engine, "last_stats", None) or AcceptanceStats.total(o.stats for o in outs)
            generated = (outs, acc, rollout_s)
        outs, acc, rollout_s = self._from_lead(generated)
        texts = [tok.decode(o.token_ids) for o in outs]
        rewards, failed = score_completions(self.reward_fn, [s.prompt for s in mine for _ in range(G)], texts,
                                            [s.answer for s in mine for _ in range(G)],
                                            on_error=cfg.task.on_reward_error)
        if failed:
            self.log(f"step {step}: reward failed on samples {failed} (prompt of the first: "
                     f"{mine[failed[0] // G].prompt!r}); scored 0")
        r = torch.tensor(rewards).view(len(mine), G)
        adv = group_advantages(r, scale=cfg.rl.scale_advantages).view(-1).tolist()
        if cfg.rl.loss_aggregation == "sequence":
            adv = sequence_weighted(adv, [len(o.token_ids) for o in outs])
        rollouts = [Rollout(req, o.token_ids, o.logprobs, group=i // G, reward=rw)
                    for i, (req, o, rw) in enumerate(zip(requests, outs, rewards))]
        self.last_rollouts = rollouts
        batch = build_rl_batch(rollouts, adv, cp=dims.cp, pad_id=tok.pad_token_id,
                               ref_logprobs=self._ref_logprobs(rollouts))
        self.module.policy.train()
        t0 = time.perf_counter()
        from lightning_codraft.fabric import fabric_training_step

        m = fabric_training_step(self.fabric, self.model, batch, self.optimizer, self.scheduler)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.sync_weights()
        sync_s = time.perf_counter() - t0
        n_tok = sum(len(o.token_ids) for o in outs)
        local = torch.tensor([sum(rewards) / len(rewards), r.std(unbiased=False).item(),
                              sum(x >= 1.0 for x in rewards) / len(rewards), float(len(failed)), float(n_tok),
                              float(acc.accepted), float(acc.draft_steps), float(acc.drafted)], dtype=torch.float64)
        g = self.fabric.all_reduce(local, reduce_op="mean")
        return {
            "step": step + 1, "reward": float(g[0]), "reward_std": float(g[1]), "accuracy": float(g[2]),
            "reward_failures": float(g[3]), "completion_tokens": float(g[4]),
            "acceptance_length": 1.0 + float(g[5]) / float(g[6]) if g[6] > 0 else 1.0,
            "acceptance_rate": float(g[5]) / float(g[7]) if g[7] > 0 else 0.0,
            "draft_loss": m.get("draft/loss", math.nan), "draft_acc0": m.get("draft/acc_step0", math.nan),
            "policy_loss": m.get("policy/pg_loss", math.nan), "clip_frac": m.get("policy/clip_frac", math.nan),
            "kl": m.get("policy/kl", math.nan), "rollout_s": rollout_s, "train_s": train_s, "sync_s": sync_s,
            "step_s": time.perf_counter() - t_start, "tokens_per_s": float(n_tok) / max(rollout_s, 1e-9),
        }

    def _ref_logprobs(self, rollouts: list[Rollout]) -> list[list[float]] | None:
        if self.ref_policy is None:
            return None
        from lightning_codraft.training.rl_loss import token_logprobs

        b = build_rl_batch(rollouts, [0.0] * len(rollouts), pad_id=self.tokenizer.pad_token_id)
        with torch.no_grad():
            lp = token_logprobs(self.ref_policy(b["input_ids"], cu_seqlens=b["cu_seqlens"],
                                                position_ids=b["position_ids"]).logits, b["target_ids"])
        out, starts = [], b["cu_seqlens"][:-1].tolist()
        for r, s in zip(rollouts, starts):
            a = s + len(r.prompt_ids) - 1
            out.append(lp[a:a + len(r.completion_ids)].tolist())
        return out

    def sync_weights(self) -> None:
        """Push the updated policy (+ draft) to the rollout engine of every replica lead; call on every rank.

        Without PP the embedded engine decodes with the lead's training modules themselves (no copy), so after
        the optimizer step it already holds the new weights. Otherwise (vLLM, or any engine under PP) the
        engine holds copies: ``CoDraftModule.full_state_dicts`` (a collective over the pipeline group that
        gathers the stages onto the first one, where the lead is) gives the whole state dicts, which the lead
        loads into its copies and its engine (vLLM verifies the update itself).
        """
        if not self._engine_holds_copies():
            return
        policy_state, draft_state = self.module.full_state_dicts()
        if self.engine is None:  # not a replica lead: it took part in the gather only
            return
        self._push(policy_state, draft_state)

    def _push(self, policy_state: dict, draft_state: Optional[dict]) -> None:
        from lightning_codraft.rollout.weight_sync import engine_drafts

        eng = self.engine
        if self.dims.pp_enabled and getattr(eng, "policy", None) is not self.rollout_policy:
            self._load_rollout_copies(policy_state, draft_state)  # vLLM: the copies serve the final speed-up
        eng.update_weights(policy_state, draft_state if engine_drafts(eng) else None)

    def _load_rollout_copies(self, policy_state: dict, draft_state: Optional[dict]) -> None:
        """Load whole state dicts into the lead's copies (under PP; strict: every tensor must be there)."""
        self.rollout_policy.load_state_dict(policy_state)
        if draft_state is not None and self.rollout_draft is not None:
            self.rollout_draft.load_state_dict(draft_state)

    # ------------------------------------------------------------------ the run
    def setup(self) -> int:
        """Launch, build, warm up (or resume); returns the RL step to start from."""
        cfg = self.cfg
        self._launch()
        torch.manual_seed(cfg.run.seed)
        self._build_models()
        self.ref_policy = None
        if cfg.rl.kl_coef > 0:
            import copy

            self.ref_policy = copy.deepcopy(self.module.policy).requires_grad_(False)
        self.out.mkdir(parents=True, exist_ok=True)
        if self.fabric.global_rank == 0:
            (self.out / "config.yaml").write_text(to_yaml(cfg))
        last = self.last_checkpoint() if cfg.run.resume else None
        extra: dict[str, Any] = {}
        if last is None:  # warm-ups on every rank, on the whole modules (before setup_module releases stages)
            warm = cfg.run.init_from
            extra.update(self._load_warm(Path(warm)) if warm else self._warmups())
            if self.ref_policy is not None:
                self.ref_policy.load_state_dict(self.module.policy.state_dict())
            self._take_rollout_models()
            if self.dims.is_replica_lead:
                self.engine = self._engine()
            if "eval_before" not in extra:
                n_eval = cfg.task.eval_prompts
                extra["eval_before"] = self._evaluate(n_eval) if n_eval else math.nan
                self.log(f"greedy accuracy before RL: {extra['eval_before']:.3f} on {n_eval} held-out prompts")
            self._save_warm(extra)
        else:
            self._take_rollout_models()  # under PP: copies of the fresh modules, loaded from the checkpoint below
        self.model = self.fabric.setup_module(self.module)
        self.strategy = self.fabric.strategy
        self.optimizer, self.scheduler = self.module.build_optimizer()
        self.optimizer = self.fabric.setup_optimizers(self.optimizer)
        start = 0
        if last is None:
            self.save(0, extra)
        else:
            state = {"module": self.module, "optimizer": self.optimizer, "scheduler": self.scheduler}
            if self.ref_policy is not None:
                state["ref_policy"] = self.ref_policy
            rest = self.fabric.load(last[1], state)
            start = int(rest.get("step", last[0]))
            extra = {k: v for k, v in rest.items() if k != "step"}
            if self.dims.pp_enabled:  # each stage loaded its slice: gather them into the lead's copies
                policy_state, draft_state = self.module.full_state_dicts()
                if self.dims.is_replica_lead:
                    self._load_rollout_copies(policy_state, draft_state)
            if self.dims.is_replica_lead:
                self.engine = self._engine()
            self.log(f"resumed from {last[1]} (step {start})")
        self.extra = extra
        self.start = start
        self.logger = MetricsLogger(self.out, tensorboard=cfg.run.tensorboard, resume_step=start) \
            if self.fabric.global_rank == 0 else None
        self.result = FitResult(out_dir=self.out, eval_before=float(extra.get("eval_before", math.nan)))
        return start

    def _save_warm(self, extra: dict[str, Any]) -> None:
        """Write the warmed-up policy + draft to ``out_dir/warm`` (another run can start from them)."""
        if self.fabric.global_rank != 0:
            return
        warm = self.out / "warm"
        warm.mkdir(parents=True, exist_ok=True)
        torch.save({"policy": self.module.policy.state_dict(), "draft": self.module.draft.state_dict(),
                    "extra": extra}, warm / "weights.pt")

    def _load_warm(self, path: Path) -> dict[str, Any]:
        f = path / "weights.pt" if path.is_dir() else path
        if not f.is_file():
            raise FileNotFoundError(f"run.init_from={str(path)!r} has no weights.pt; point it at the 'warm' "
                                    f"directory of an earlier run")
        state = torch.load(f, map_location="cpu", weights_only=True)
        self.module.policy.load_state_dict(state["policy"])
        self.module.draft.load_state_dict(state["draft"])
        self.log(f"warm-started policy and draft from {f}")
        return dict(state.get("extra", {}))

    def end_step(self, step: int, metrics: dict[str, float]) -> None:
        """Record a finished step and checkpoint on schedule."""
        if self.logger is not None:
            self.logger.log(metrics)
        every = self.cfg.run.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == self.cfg.rl.steps:
            self.save(step + 1, self.extra)

    def finish(self, completed: bool = True) -> FitResult:
        """Close logs; when ``completed``: final evaluation, speed-up, plots and summary."""
        result = self.result
        result.completed = completed
        if self.logger is not None:
            self.logger.close()
            result.rows = self.logger.rows
        if completed:
            self._finish(result)
        return result

    def run(self, stop_after: Optional[int] = None) -> FitResult:
        """Execute the config; ``stop_after`` ends this call after that many RL steps with no final checkpoint
        and no evaluation, as a killed process would (used to test resume)."""
        cfg = self.cfg
        start = self.setup()
        done = 0
        with StepProgress(cfg.rl.steps, start, enabled=cfg.run.progress and self.fabric.global_rank == 0) as bar:
            for step in range(start, cfg.rl.steps):
                metrics = self.rl_step(step)
                if self.fabric.global_rank == 0:
                    bar.update(metrics)
                done += 1
                if stop_after is not None and done >= stop_after:
                    if self.logger is not None:
                        self.logger.log(metrics)
                    return self.finish(completed=False)
                self.end_step(step, metrics)
        return self.finish()

    def _evaluate(self, n: int) -> float:
        """Greedy accuracy on ``n`` held-out prompts: computed by global rank 0 (the lead of replica 0) with its
        engine, broadcast to every rank (call on every rank)."""
        value = None
        if self.fabric.global_rank == 0:
            samples = self.task.sample(n, seed=self.cfg.run.seed + _EVAL_SEED)
            self.rollout_policy.eval()
            value = greedy_accuracy(self.engine, self.tokenizer, samples, self.reward_fn, self.cfg.rl.max_new_tokens,
                                    on_error=self.cfg.task.on_reward_error)
        return float(self.fabric.broadcast(value, src=0))

    def _finish(self, result: FitResult) -> None:
        cfg = self.cfg
        if cfg.task.eval_prompts:
            result.eval_after = self._evaluate(cfg.task.eval_prompts)
        if cfg.draft.mode != "none" and self.fabric.global_rank == 0:  # rank 0 holds whole, current modules
            tok = self.tokenizer
            samples = self.task.sample(cfg.rl.prompts_per_step, seed=cfg.run.seed + _EVAL_SEED + 1)
            prompts = [encode_prompt(tok, s.prompt) for s in samples for _ in range(cfg.rl.group_size)]
            result.speedup = measure_speedup(self.rollout_policy, self.rollout_draft, cfg.draft.num_speculative_tokens,
                                             prompts, cfg.rl.max_new_tokens, cfg.rl.temperature, cfg.rl.top_p,
                                             seed=cfg.run.seed + _EVAL_SEED, stop_token_ids=[tok.eos_token_id],
                                             max_batch_size=cfg.parallel.engine_batch_size)
        if self.fabric.global_rank != 0:
            return
        if cfg.run.plots and result.rows:
            plot_curves({cfg.draft.mode: result.rows}, self.out / "curves.png",
                        title=f"{cfg.task.name}: reward and acceptance length per RL step")
        r0, r1 = summarize(result.rows, "reward")
        a0, a1 = summarize(result.rows, "acceptance_length")
        lines = [f"reward (mean of first / last steps): {r0:.3f} -> {r1:.3f}",
                 f"greedy accuracy on held-out prompts: {result.eval_before:.3f} -> {result.eval_after:.3f}"]
        if cfg.draft.mode != "none":
            lines.append(f"acceptance length (K={cfg.draft.num_speculative_tokens}): {a0:.2f} -> {a1:.2f}")
        if result.speedup is not None:
            s = result.speedup
            lines.append(f"rollout speed-up with the {cfg.draft.mode} draft: {s.speedup:.2f}x "
                         f"({s.spec_tokens_per_s:.0f} vs {s.plain_tokens_per_s:.0f} tokens/s without a draft, "
                         f"acceptance length {s.acceptance_length:.2f})")
        lines.append(f"outputs: {self.out} (metrics.csv, tb/, curves.png, checkpoints/)")
        summary = "\n".join(lines)
        (self.out / "summary.txt").write_text(summary + "\n")
        self.log(summary)


def fit(cfg: CoDraftConfig, stop_after: Optional[int] = None, print_fn: Callable[[str], None] = print) -> FitResult:
    """Run the config end to end (see the module docstring); returns the :class:`FitResult`. A rollout engine
    that runs its own processes (vLLM) is shut down before returning, also when the run fails."""
    run = CoDraftRun(cfg, print_fn=print_fn)
    try:
        return run.run(stop_after=stop_after)
    finally:
        close = getattr(run.engine, "close", None)
        if close is not None:
            close()


def load_for_rollout(cfg: CoDraftConfig, print_fn: Callable[[str], None] = print) -> CoDraftRun:
    """A run whose models hold the last checkpoint of ``run.out_dir`` (or its warm-up weights, or fresh
    weights when neither exists), with its engine ready: for ``codraft rollout``."""
    run = CoDraftRun(cfg, print_fn=print_fn)
    run._launch()
    torch.manual_seed(cfg.run.seed)
    run._build_models()
    last = run.last_checkpoint()
    if last is not None:
        run.fabric.load(last[1], {"module": run.module}, strict=False)
        run.log(f"loaded {last[1]}")
    elif (run.out / "warm" / "weights.pt").is_file():
        run._load_warm(run.out / "warm")
    else:
        run.log(f"no checkpoint in {run.out}: generating with freshly initialised models")
    run.module.policy.eval()
    run.rollout_policy, run.rollout_draft = run.module.policy, run.module.draft  # never set up: whole on every rank
    run.engine = run._engine()
    return run


def config_dict(cfg: CoDraftConfig) -> dict:
    """The config as plain data (recorded in benchmark outputs)."""
    return dataclasses.asdict(cfg)
