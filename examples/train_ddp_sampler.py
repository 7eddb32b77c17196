"""A DDP training script with ``DistributedSampler``, moved from torch's ``DataLoader`` to
``SavableDataLoader``: the import and the class name change, and the checkpoint gains the
loader's state (docs/how-to/migrate.md shows the script before and after).

Run it on one machine with two ranks (gloo, CPU)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/train_ddp_sampler.py --ckpt /tmp/ckpt --epochs 3

Every ``--save-every`` steps rank 0 writes ``loader.msgpack`` (every rank's loader state,
gathered with ``save_state_global``) and ``model.pt`` (model, optimizer, epoch and step)
into ``--ckpt``. Started again with the same ``--ckpt``, the run continues from there: the
sampler gets the saved epoch and the loader the rest of that epoch. ``--stop-at K`` ends
every rank with ``os._exit`` right after step K, as a crash would. Each rank appends
``{"step", "epoch", "digest"}`` for every batch it trains on to ``batches_rank<r>.jsonl``
(``tests/test_examples.py`` compares two runs).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, DistributedSampler

from savable_loader import SavableDataLoader, load_state, save_state
from savable_loader.testing import digest


class NoisyPoints(Dataset):
    """Point ``i`` is ``(x_i, y_i + noise)``: the noise is a random augmentation drawn from
    the global torch generator of the worker that fetches the point."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.rand(size, 4, generator=generator)
        self.y = self.x @ torch.tensor([1.0, -2.0, 3.0, 0.5])

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], (self.y[index] + 0.1 * torch.randn(())).reshape(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--stop-at", type=int, help="os._exit right after this step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.ckpt.mkdir(parents=True, exist_ok=True)
    loader_file, model_file = args.ckpt / "loader.msgpack", args.ckpt / "model.pt"

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    dataset = NoisyPoints(50)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    loader = SavableDataLoader(dataset, batch_size=5, sampler=sampler, num_workers=1)

    # Resuming: rank 0 reads the files, the model checkpoint is broadcast and the loader
    # states are scattered (each rank receives its own).
    checkpoint = [None]
    if rank == 0 and model_file.exists():
        checkpoint = [torch.load(model_file, weights_only=True)]
    dist.broadcast_object_list(checkpoint, src=0)
    start_epoch, step = 0, 0
    if checkpoint[0] is not None:
        model.module.load_state_dict(checkpoint[0]["model"])
        optimizer.load_state_dict(checkpoint[0]["optimizer"])
        start_epoch, step = checkpoint[0]["epoch"], checkpoint[0]["step"]
        loader.restore_state_global(load_state(loader_file) if rank == 0 else None, src_rank=0)

    # Line-buffered, so that every line is written before an os._exit.
    with open(args.ckpt / f"batches_rank{rank}.jsonl", "a", buffering=1) as log:
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)  # after a restore: the saved epoch, the rest of it
            for x, y in loader:
                step += 1
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()  # DDP averages gradients
                optimizer.step()
                entry = {"step": step, "epoch": epoch, "digest": digest((x, y))}
                log.write(json.dumps(entry) + "\n")
                if step % args.save_every == 0:
                    states = loader.save_state_global(global_dst_rank=0)  # every rank calls it
                    if rank == 0:
                        save_state(states, loader_file)
                        checkpoint = {
                            "model": model.module.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "epoch": epoch,
                            "step": step,
                        }
                        torch.save(checkpoint, model_file.with_suffix(".tmp"))
                        os.replace(model_file.with_suffix(".tmp"), model_file)
                if step == args.stop_at:
                    os._exit(17)  # no cleanup at all, as in a crash
    loader.close()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step}, args.ckpt / "final.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
