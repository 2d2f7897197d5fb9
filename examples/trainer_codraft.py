"""Co-train an EAGLE-3 draft inside a GRPO policy update with ``Trainer.fit``, on any (dp, pp, cp) mesh.

    python examples/trainer_codraft.py --devices 4 --dp 2 --cp 2
    python examples/trainer_codraft.py --devices 4 --pp 2 --cp 2        # pipeline x context parallel

Multi-node: run the same command on every node with ``--num-nodes N`` under torchrun or SLURM
(docs/multinode.md). Checkpoints are directories that load on any mesh: ``--resume last.ckpt``.

The RL experience is synthetic here (see examples/fabric_codraft.py); plug in your rollouts as a dataset of
packed RL batches, one batch per item.
"""

import argparse

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_codraft import CoDraftModule
from lightning_codraft.models import Eagle3Draft, Policy, PolicyConfig
from lightning_codraft.pytorch import CoDraftStrategy

from fabric_codraft import experience  # noqa: E402  (the same synthetic GRPO batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--dp", type=int, default=-1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default="runs/trainer_codraft")
    parser.add_argument("--resume", default=None, help="checkpoint directory written on any mesh")
    args = parser.parse_args()

    pl.seed_everything(0)  # identical initial weights on every rank
    policy = Policy(PolicyConfig.tiny())
    module = CoDraftModule(policy, Eagle3Draft.from_policy(policy), policy_lr=1e-4, draft_lr=1e-3,
                           num_microbatches=max(2, args.pp))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, max_steps=args.steps,
        strategy=CoDraftStrategy(dp=args.dp, pp=args.pp, cp=args.cp), default_root_dir=args.out,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=args.out, save_last=True)], log_every_n_steps=1)
    batches = [experience(i, args.cp, policy.config.vocab_size) for i in range(64)]
    trainer.fit(module, DataLoader(batches, batch_size=None), ckpt_path=args.resume)
    trainer.print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})


if __name__ == "__main__":
    main()
