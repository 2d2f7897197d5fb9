"""Per-round cost of the embedded engine now vs at an earlier commit, side by side in one process.

    python benchmarks/engine_before_after.py --warm runs/<run>/warm [--before 72a8112] [--repeats 5]

Loads the policy + draft of a tiny-cpu run's ``warm/weights.pt`` (``codraft fit --config recipes/tiny-cpu.yaml``
writes it), imports ``lightning_codraft/rollout/speculative.py`` as it was at ``--before`` (``git show``) next to
the current one, and decodes the same arithmetic prompts with both, plain (K=0) and speculative (K=4), at the RL
recipe's settings (engine batch 1, temperature 1, 40 new tokens), round-robin ``--repeats`` times. Prints a
markdown table: tokens/s, ms per round (one policy forward + its draft steps), tokens per round, and the ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lightning_codraft.config import load_config  # noqa: E402
from lightning_codraft.models import Eagle3Draft  # noqa: E402
from lightning_codraft.rl.build import build_policy, build_task, encode_prompt  # noqa: E402
from lightning_codraft.rollout.speculative import SpeculativeEngine  # noqa: E402


def engine_at(commit: str):
    """The ``SpeculativeEngine`` class of ``commit``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:lightning_codraft/rollout/speculative.py"],
                         check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"speculative_{commit}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"speculative_{commit}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SpeculativeEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", required=True, help="a run's warm/ directory (or its weights.pt)")
    ap.add_argument("--config", default=str(ROOT / "recipes" / "tiny-cpu.yaml"))
    ap.add_argument("--before", default="72a8112")
    ap.add_argument("--prompts", type=int, default=8, help="task prompts, each sampled 4 times")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config, [])
    tok, policy, _ = build_policy(cfg.model)
    warm = Path(args.warm)
    state = torch.load(warm / "weights.pt" if warm.is_dir() else warm, map_location="cpu", weights_only=True)
    policy.load_state_dict(state["policy"])
    draft = Eagle3Draft.from_policy(policy, draft_vocab_size=state["draft"]["d2t"].numel())
    draft.load_state_dict(state["draft"])
    policy.eval(), draft.eval()
    samples = build_task(cfg.task).sample(args.prompts, seed=1)
    prompts = [encode_prompt(tok, s.prompt) for s in samples for _ in range(4)]
    old = engine_at(args.before)
    engines = {(name, k): cls(policy, draft if k else None, k, max_batch_size=1)
               for name, cls in ((f"before ({args.before})", old), ("after", SpeculativeEngine)) for k in (0, args.k)}
    secs = {key: 0.0 for key in engines}
    toks = {key: 0 for key in engines}
    rounds = {key: 0 for key in engines}
    for r in range(args.repeats):
        for key, eng in engines.items():
            start = time.perf_counter()
            outs = eng.generate(prompts, max_new_tokens=cfg.rl.max_new_tokens, temperature=cfg.rl.temperature,
                                seed=r, stop_token_ids=[tok.eos_token_id])
            secs[key] += time.perf_counter() - start
            toks[key] += sum(len(o.token_ids) for o in outs)
            rounds[key] += sum(o.stats.policy_forwards for o in outs)
    tps = {key: toks[key] / secs[key] for key in engines}
    names = list(dict.fromkeys(name for name, _ in engines))
    print(f"{len(prompts)} sequences x {args.repeats} repeats, engine batch 1, T={cfg.rl.temperature}, "
          f"{cfg.rl.max_new_tokens} new tokens, round-robin in one process")
    print("| engine | K | tokens/s | ms / round | tokens / round | speed-up over K=0 | after / before |")
    print("|---|---|---|---|---|---|---|")
    for name, k in engines:
        key = (name, k)
        print(f"| {name} | {k} | {tps[key]:.1f} | {1000 * secs[key] / rounds[key]:.2f} | "
              f"{toks[key] / rounds[key]:.2f} | {tps[key] / tps[(name, 0)]:.2f}x | "
              f"{tps[key] / tps[(names[0], k)]:.2f}x |")


if __name__ == "__main__":
    main()
