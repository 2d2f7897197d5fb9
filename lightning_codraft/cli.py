"""The ``codraft`` command.

::

    codraft fit     --config recipes/tiny-cpu.yaml [key=value ...] [--dry-run]
    codraft rollout --config recipes/tiny-cpu.yaml [--prompt TEXT ...] [--num-prompts N] [key=value ...]
    codraft bench   --config recipes/tiny-cpu.yaml [--out docs/benchmarks] [key=value ...]
    codraft plan    --config recipes/qwen3-8b-cluster.yaml [--json] [--device-memory 80GiB] [key=value ...]
    codraft export  RUN_DIR OUT_DIR [--step N]

``fit`` runs the RL loop (resuming from the last checkpoint of ``run.out_dir``); ``rollout`` generates with
speculative decoding from the run's last checkpoint (or the fresh models when there is none) and prints the
acceptance statistics; ``bench`` runs the no-draft / frozen-draft / co-trained-draft comparison; ``plan`` prints
the per-rank memory of the training and the rollout phase against a device's memory (``lightning_codraft.plan``,
models built on the meta device: nothing is loaded); ``export`` writes a run's trained policy (Hugging Face, with its
tokenizer) and draft (vLLM EAGLE-3). ``--dry-run`` validates the config and prints the resolved run
and its memory plan without building anything.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Sequence

from lightning_codraft import __version__
from lightning_codraft.config import CoDraftConfig, ConfigError, load_config, to_yaml
from lightning_codraft.rl.run.preflight import preflight
from lightning_codraft.rl.tasks.rewards import RewardError

# The commands' own modules (torch, Lightning: seconds to import) are imported when a command runs, so that
# `codraft --version`, `--help` and a config error answer at once (tests/test_first_run.py times them).

DEFAULT_DEVICE_MEMORY = 80 * 2**30


class UsageError(ValueError):
    """A command-line argument is invalid (exit status 2, like a config error)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="codraft", description="Online EAGLE-3 draft co-training during RL post-training (lightning_codraft)."
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--debug", action="store_true", help="on an error, print the full traceback")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--config", "-c", help="YAML recipe (e.g. recipes/tiny-cpu.yaml); defaults if omitted")
        sp.add_argument("--dry-run", action="store_true", help="validate the config, print it, and exit")
        sp.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. rl.steps=5")

    common(sub.add_parser("fit", help="run the RL loop with online draft co-training"))
    r = sub.add_parser("rollout", help="generate with speculative decoding and print acceptance")
    common(r)
    r.add_argument("--prompt", action="append", default=None, help="a prompt text (repeatable); default: task prompts")
    r.add_argument("--num-prompts", type=int, default=8, help="task prompts to generate from (without --prompt)")
    r.add_argument("--temperature", type=float, default=None, help="default: rl.temperature")
    b = sub.add_parser("bench", help="no draft vs frozen vs co-trained draft, same seeds")
    common(b)
    b.add_argument("--out", default=None, help="write codraft_vs_frozen.md + PNG plots here (e.g. docs/benchmarks)")
    e = sub.add_parser(
        "export", help="write a run's policy (Hugging Face, with its tokenizer) and draft (vLLM EAGLE-3) to a directory"
    )
    e.add_argument("run_dir", help="the run directory (run.out_dir)")
    e.add_argument("out_dir", help="where to write policy/ and draft/")
    e.add_argument("--step", type=int, default=None, help="a checkpoint's RL step (default: the newest)")
    m = sub.add_parser("plan", help="per-rank memory of the training and rollout phases (meta device, no weights)")
    m.add_argument("--config", "-c", help="YAML recipe (e.g. recipes/qwen3-8b-cluster.yaml); defaults if omitted")
    m.add_argument("--json", action="store_true", help="print the plan as JSON")
    m.add_argument("--device-memory", default="80GiB", help="memory of one device, e.g. 80GiB, 141GB (default 80GiB)")
    m.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. parallel.pp=4")
    return p


def memory_plan(cfg: CoDraftConfig, device_memory: int = DEFAULT_DEVICE_MEMORY):
    """The recipe's :class:`~lightning_codraft.plan.MemoryPlan`; a split or vocabulary the model cannot take is a
    config error."""
    from lightning_codraft.plan import PlanSpec, plan_memory

    try:
        return plan_memory(PlanSpec.from_config(cfg), device_memory)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def dry_run(cfg: CoDraftConfig) -> str:
    """The report ``--dry-run`` prints: the resolved config and what the run would do."""
    p, d, r = cfg.parallel, cfg.draft, cfg.rl
    world = p.devices * p.num_nodes
    lines = [
        to_yaml(cfg).rstrip(),
        "---",
        f"mesh: world {world} = dp {p.dp} x pp {p.pp} x cp {p.cp} on {p.accelerator} "
        f"({p.num_nodes} node(s) x {p.devices} device(s)); rollout engine: {p.engine}",
        f"policy: {cfg.model.source} (precision {p.precision}, context {cfg.model.max_position_embeddings}); "
        f"task: {cfg.task.name}; {_rewards_line(cfg)}",
        f"draft: {d.mode}, K={d.num_speculative_tokens}, TTT depth {d.ttt_steps}, warm start "
        f"{'on a cached corpus' if d.warm_start.corpus else f'{d.warm_start.steps} steps on a pool'}; "
        f"SFT warm-up {cfg.sft.steps} steps",
        f"GRPO: {r.steps} steps x {r.prompts_per_step} prompts x {r.group_size} samples, "
        f"<= {r.max_new_tokens} new tokens; documents padded to multiples of 2*cp = {2 * p.cp}",
        _placement(cfg),
        *_memory_lines(cfg),
        "config OK (dry run: nothing was built)",
    ]
    return "\n".join(lines)


def _rewards_line(cfg: CoDraftConfig) -> str:
    """The rewards a run scores with, as the dry run names them (logged as ``reward/<name>``)."""
    t = cfg.task
    if t.rewards:
        return "rewards: " + " + ".join(
            f"{r.weight:g} x {r.label} ({r.fn}{', ' + str(r.kwargs) if r.kwargs else ''})" for r in t.rewards
        )
    return f"reward: {t.reward or 'the task built-in'} (on_reward_error={t.on_reward_error})"


def _memory_lines(cfg: CoDraftConfig) -> list[str]:
    """The dry run's memory section: each kind of rank's training and rollout phase (``codraft plan`` details)."""
    from lightning_codraft.plan import format_bytes

    try:
        plan = memory_plan(cfg)
    except (ConfigError, FileNotFoundError) as e:
        return [f"memory per rank: not planned ({e})"]
    lines = [f"memory per rank (`codraft plan` lists every term) against {format_bytes(plan.device_memory)}:"]
    lines += [
        f"  {r.label}: training phase {format_bytes(r.training_total)}, rollout phase {format_bytes(r.rollout_total)}"
        for r in plan.ranks
    ]
    worst = max(plan.worst_training.training_total, plan.worst_rollout.rollout_total)
    lines.append(f"  {'fits' if plan.fits else 'DOES NOT FIT'}: worst rank needs {format_bytes(worst)}")
    return lines


def _placement(cfg: CoDraftConfig) -> str:
    """Where the RL loop generates: every rank, each its share of its replica's requests."""
    p = cfg.parallel
    world = p.dp * p.pp * p.cp
    line = (
        f"rollouts: {world} {p.engine} engine(s), one on every rank; each of the {p.dp} data-parallel "
        f"replica(s) splits its requests over its {p.pp * p.cp} rank(s) and gathers the outputs"
    )
    whole = p.pp == 1 and ((p.sharding or "fsdp") == "ddp" or p.dp * p.cp == 1)
    if p.engine == "vllm":
        line += "; vLLM holds its own weights, updated (checksum-verified) before every rollout phase"
    elif not whole:
        line += (
            "; the engine decodes with whole copies of policy + draft whose storage is released while "
            "training runs and refilled from the pipeline stages / FSDP2 shards, one tensor at a time, "
            "before every rollout phase"
        )
    return line


def _cmd_plan(cfg: CoDraftConfig, device_memory: int, as_json: bool) -> int:
    from lightning_codraft.plan import plan_dict, render_text

    plan = memory_plan(cfg, device_memory)
    print(json.dumps(plan_dict(plan), indent=2) if as_json else render_text(plan))
    return 0


def _check_before_launch(cfg: CoDraftConfig) -> None:
    """:func:`~lightning_codraft.rl.run.preflight.preflight`: raise :class:`ConfigError` listing every problem."""
    problems = preflight(cfg)
    if problems:
        raise ConfigError("checked before launch:\n  " + "\n  ".join(problems))


def _cmd_fit(cfg: CoDraftConfig) -> int:
    from lightning_codraft.rl.run.loop import fit

    _check_before_launch(cfg)
    fit(cfg)
    return 0


def _cmd_rollout(cfg: CoDraftConfig, args) -> int:
    from lightning_codraft.models.tokenizer import encode_prompt
    from lightning_codraft.rl.run.loop import load_for_rollout
    from lightning_codraft.rollout.engine import AcceptanceStats

    run = load_for_rollout(cfg)
    tok = run.tokenizer
    if args.prompt is not None:
        texts = list(args.prompt)
        for i, t in enumerate(texts):
            if not t:
                raise UsageError(f"--prompt #{i} is empty; give a non-empty prompt text")
    else:
        if args.num_prompts < 1:
            raise UsageError(f"--num-prompts={args.num_prompts} must be >= 1")
        texts = [s.prompt for s in run.task.sample(args.num_prompts, seed=cfg.run.seed + 123)]
    prompts = run.fit_prompts([encode_prompt(tok, t) for t in texts])
    temperature = cfg.rl.temperature if args.temperature is None else args.temperature
    outs = run.worker.engine.generate(
        prompts,
        max_new_tokens=cfg.rl.max_new_tokens,
        temperature=temperature,
        top_p=cfg.rl.top_p,
        seed=cfg.run.seed,
        stop_token_ids=[tok.eos_token_id],
    )
    for t, o in zip(texts, outs):
        print(f"{t!r} -> {tok.decode(o.token_ids)!r}  (acceptance length {o.stats.acceptance_length:.2f})")
    total = AcceptanceStats.total(o.stats for o in outs)
    k = run.worker.engine.num_speculative_tokens
    print(
        f"K={k}: acceptance length {total.acceptance_length:.2f}, acceptance rate {total.acceptance_rate:.2f}, "
        f"per position {[round(x, 2) for x in total.per_position_rate()]}"
    )
    return 0


def _cmd_bench(cfg: CoDraftConfig, args) -> int:
    from lightning_codraft.rl.reports.compare import compare_arms, write_report

    res = compare_arms(cfg)
    print(res.table())
    if args.out:
        path = write_report(res, args.out)
        print(f"wrote {path}")
    return 0


def _cmd_export(args) -> int:
    from lightning_codraft.rl.run.run_dir import export_run

    paths = export_run(args.run_dir, args.out_dir, args.step)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    return 0


def _resume_hint(cfg: CoDraftConfig | None, args) -> str:
    """Where an interrupted ``fit`` stopped and how to go on, in one sentence."""
    if cfg is None or args.command != "fit":
        return "Nothing was saved."
    from lightning_codraft.rl.run.run_dir import RunCheckpoints

    last = RunCheckpoints(cfg.run.out_dir, fabric=None).last()  # a complete one: what a resume would load
    if last is None:
        return f"No checkpoint was written yet in {cfg.run.out_dir}; the same command starts over."
    step = last[0]
    return (
        f"The last checkpoint is step {step} in {cfg.run.out_dir}/checkpoints; the same command resumes from it"
        f"{'' if cfg.run.resume else ' (with run.resume=true)'}."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``codraft`` console script; returns the exit status.

    0: done (``plan``: whether or not the run fits). 2: the config or an argument is invalid, a check before
    launch failed (the message names the recipe key or the file and line), or a checkpoint cannot be read (named,
    with the fix). 3: a reward function failed
    (``task.on_reward_error=raise``) or a step's failures exceeded ``task.reward_failure_budget`` (``skip``).
    130: interrupted (Ctrl-C; one line says where ``fit`` stopped and how to resume). 1: anything else (the error
    and where it happened; ``--debug`` prints the full traceback).
    """
    args = _parser().parse_args(argv)
    cfg = None
    try:
        if args.command == "plan":
            from lightning_codraft.plan import parse_bytes

            try:
                device_memory = parse_bytes(args.device_memory)
            except ValueError as e:
                raise UsageError(f"--device-memory: {e}") from None
            return _cmd_plan(load_config(args.config, args.overrides), device_memory, args.json)
        if args.command == "export":
            return _cmd_export(args)
        cfg = load_config(args.config, args.overrides)
        if args.dry_run:
            if args.command == "fit":
                _check_before_launch(cfg)
            print(dry_run(cfg))
            return 0
        if args.command == "fit":
            return _cmd_fit(cfg)
        if args.command == "rollout":
            return _cmd_rollout(cfg, args)
        return _cmd_bench(cfg, args)
    except (ConfigError, UsageError, FileNotFoundError) as e:
        if args.debug:
            traceback.print_exc()
        kind = "config error" if isinstance(e, ConfigError) else "error"
        print(f"codraft {args.command}: {kind}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ncodraft {args.command}: interrupted. {_resume_hint(cfg, args)}", file=sys.stderr)
        return 130
    except RewardError as e:
        if args.debug:
            traceback.print_exc()
        print(
            f"codraft {args.command}: stopped: {e} (the last checkpoint in run.out_dir resumes the run)",
            file=sys.stderr,
        )
        return 3
    except Exception as e:  # noqa: BLE001 - the CLI reports every failure; --debug shows where
        if args.debug:
            traceback.print_exc()
            return 1
        checkpoints = sys.modules.get("lightning_codraft.parallel.safe_read")  # loaded when a checkpoint was read
        if checkpoints is not None and isinstance(e, checkpoints.CheckpointError):
            print(f"codraft {args.command}: error: {e}", file=sys.stderr)
            return 2
        where = traceback.extract_tb(e.__traceback__)[-1]
        print(
            f"codraft {args.command}: {type(e).__name__}: {e}\n  (raised at {where.filename}:{where.lineno}; "
            f"rerun with --debug for the full traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
