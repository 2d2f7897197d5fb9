"""Co-train an EAGLE-3 draft inside a GRPO policy update with Fabric, on any (dp, pp, cp) mesh.

One machine, 4 processes, 2-way data x 2-way context parallel::

    python examples/fabric_codraft.py --devices 4 --dp 2 --cp 2

Two nodes of 2 processes each (run on every node, node rank 0 and 1; see docs/multinode.md)::

    torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 2 --master-addr $MASTER --master-port 29500 \
        examples/fabric_codraft.py --devices 2 --num-nodes 2 --pp 2 --cp 2

The RL experience here is synthetic (random completions and rewards) so the file runs anywhere; replace
``experience()`` with your rollouts (``lightning_codraft.rl`` packs them with ``build_rl_batch``).
"""

import argparse
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

from lightning_codraft import CoDraftModule, RLBatch
from lightning_codraft.fabric import CoDraftStrategy, fabric_training_step
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.rl.experience import Rollout, build_rl_batch, group_advantages


def experience(step: int, cp: int, vocab: int, prompts: int = 4, group: int = 2) -> RLBatch:
    """One packed GRPO batch: ``prompts`` prompts x ``group`` completions, documents padded to 2*cp."""
    g = torch.Generator().manual_seed(step)
    rollouts = []
    for p in range(prompts):
        prompt = torch.randint(1, vocab, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group):
            completion = torch.randint(1, vocab, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g)
            rollouts.append(Rollout(prompt, completion.tolist(), [-float(torch.log(torch.tensor(vocab)))] *
                                    len(completion), group=p, reward=float(torch.rand(1, generator=g))))
    rewards = torch.tensor([r.reward for r in rollouts]).view(prompts, group)
    return build_rl_batch(rollouts, group_advantages(rewards).flatten().tolist(), cp=cp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--dp", type=int, default=-1, help="-1: devices * num_nodes // (pp * cp)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--sharding", default=None, choices=("fsdp", "ddp"), help="default: FSDP2 when dp*cp > 1")
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed (fp32 masters, bf16 compute)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/fabric_codraft")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    strategy = CoDraftStrategy(dp=args.dp, pp=args.pp, cp=args.cp, sharding=args.sharding)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
                    precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)  # identical initial weights on every rank

    policy = Policy(PolicyConfig.tiny())  # or Policy.from_pretrained("path/to/hf_checkpoint")
    draft = Eagle3Draft.from_policy(policy)
    module = CoDraftModule(policy, draft, policy_lr=1e-4, draft_lr=1e-3, draft_loss_weight=1.0,
                           num_microbatches=max(2, args.pp))
    model = fabric.setup_module(module)           # CP groups installed, PP stage split, FSDP2 over dp x cp
    optimizer, scheduler = model.build_optimizer()  # two parameter groups: policy and draft
    optimizer = fabric.setup_optimizers(optimizer)

    dims = strategy.parallel_dims
    batches = [experience(s * dims.dp + r, args.cp, policy.config.vocab_size)
               for s in range(args.steps) for r in range(dims.dp)]
    loader = fabric.setup_dataloaders(DataLoader(batches, batch_size=None))  # one batch per dp replica

    ckpt = Path(args.out) / "checkpoint"
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    if ckpt.exists():
        fabric.load(ckpt, state)  # a torch.distributed.checkpoint directory written on any mesh
    for step, batch in enumerate(loader):
        if step < state["step"]:
            continue
        metrics = fabric_training_step(fabric, model, batch, optimizer, scheduler)
        state["step"] = step + 1
        fabric.print(f"step {step}: loss {metrics['loss']:.4f}  policy {metrics['policy/loss']:+.4f}  "
                     f"draft {metrics['draft/loss']:.4f}  acceptance length {metrics['draft/top1_acceptance']:.3f}")
    fabric.save(ckpt, state)
    fabric.print(f"saved {ckpt}")


if __name__ == "__main__":
    main()
