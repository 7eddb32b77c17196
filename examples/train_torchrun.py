"""A data-parallel training run over torchrun that saves and resumes its data stream exactly.

Run it on one machine with two ranks (gloo, CPU)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        examples/train_torchrun.py --ckpt /tmp/ckpt --steps 20

Every ``--save-every`` steps, and at the last step, rank 0 writes ``loader.msgpack`` (every
rank's loader state, gathered with ``save_state_global``) and ``model.pt`` (model,
optimizer and step) into ``--ckpt``. Started again with the same ``--ckpt``, the run
continues from the saved step: rank 0 reads both files, the model checkpoint is broadcast
and the loader states are scattered, one per rank. ``--stop-at K`` ends every rank with
``os._exit`` right after step K, as a crash would; the steps after the last save are
trained again on the same batches. Each rank appends ``{"step", "digest"}`` for every
batch it trains on to ``batches_rank<r>.jsonl``, so two runs can be compared
(``tests/test_examples.py`` does).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from savable_loader import SavableDataLoader, SavableDataset, load_state, save_state
from savable_loader.testing import digest


class NoisyPoints(SavableDataset):
    """Points ``(x, y)`` with ``y = x @ [1, -2, 3, 0.5] + noise``; x from torch, noise from numpy.

    Item ``i`` of an epoch belongs to the (rank, worker) shard ``i % num_shards``.
    """

    def __init__(self, size: int) -> None:
        self.size, self.pos = size, 0
        self.shard, self.shards = 0, 1

    def setup(self, context):  # before restore_state, in every worker
        self.shard, self.shards = context.shard_index, context.num_shards

    def config(self):
        return {"type": "NoisyPoints", "size": self.size}

    def __iter__(self):
        weights = torch.tensor([1.0, -2.0, 3.0, 0.5])
        while self.pos < self.size:
            index, self.pos = self.pos, self.pos + 1
            if index % self.shards == self.shard:
                x = torch.rand(4)
                y = x @ weights + float(np.random.normal(scale=0.1))
                yield x, y.reshape(1)
        self.pos = 0  # the next iteration is the next epoch

    def save_state(self):
        return {"pos": self.pos}

    def restore_state(self, state):
        self.pos = state["pos"] if state else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--steps", type=int, required=True, help="train until this step")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--stop-at", type=int, help="os._exit right after this step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args.ckpt.mkdir(parents=True, exist_ok=True)
    loader_file, model_file = args.ckpt / "loader.msgpack", args.ckpt / "model.pt"

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = SavableDataLoader(NoisyPoints(64), batch_size=4, num_workers=2, seed=0)

    # Only rank 0 reads files. The model checkpoint goes to the others in memory, and
    # the list of loader states is scattered: each rank receives its own state.
    checkpoint = [None]
    if rank == 0 and model_file.exists():
        checkpoint = [torch.load(model_file, weights_only=True)]
    dist.broadcast_object_list(checkpoint, src=0)
    step = 0
    if checkpoint[0] is not None:
        model.module.load_state_dict(checkpoint[0]["model"])
        optimizer.load_state_dict(checkpoint[0]["optimizer"])
        step = checkpoint[0]["step"]
        states = load_state(loader_file) if rank == 0 else None
        loader.restore_state_global(states, src_rank=0)

    # Line-buffered, so that every line is written before an os._exit.
    with loader, open(args.ckpt / f"batches_rank{rank}.jsonl", "a", buffering=1) as log:
        while step < args.steps:
            for x, y in loader:  # one epoch, or the rest of the restored one
                step += 1
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()  # DDP averages gradients
                optimizer.step()
                log.write(json.dumps({"step": step, "digest": digest((x, y))}) + "\n")

                if step % args.save_every == 0 or step == args.steps:
                    states = loader.save_state_global(global_dst_rank=0)  # every rank calls it
                    if rank == 0:
                        # Two files, two writes: a crash between them leaves the loader
                        # state one save ahead of the model. Give each save its own folder
                        # if that has to be survivable.
                        save_state(states, loader_file)
                        _save_atomically(
                            {
                                "model": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(),
                                "step": step,
                            },
                            model_file,
                        )
                if step == args.stop_at:
                    os._exit(17)  # no cleanup at all, as in a crash
                if step == args.steps:
                    break
    dist.destroy_process_group()


def _save_atomically(checkpoint: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
