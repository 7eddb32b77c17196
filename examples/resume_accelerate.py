import os

import torch
from accelerate import Accelerator

from savable_loader.integrations.accelerate import AccelerateSavableDataLoader


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return index, torch.tensor([float(index)]) + torch.rand(1)  # a random augmentation


class Progress:
    """The loop's counters, saved in the checkpoint beside the loader."""

    def __init__(self):
        self.epoch, self.step = 0, 0

    def state_dict(self):
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state):
        self.epoch, self.step = state["epoch"], state["step"]


def train(folder, crash_at=None, resume=False):
    accelerator = Accelerator(cpu=True)  # cpu=True: every process trains, on CPUs too
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = AccelerateSavableDataLoader(Items(), batch_size=4, shuffle=True, num_workers=2, seed=0)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    progress = Progress()
    accelerator.register_for_checkpointing(loader, progress)
    if resume:
        last = max(int(name.removeprefix("step_")) for name in os.listdir(folder))
        accelerator.load_state(f"{folder}/step_{last}")
    seen = []
    while progress.epoch < 2:
        for ids, x in loader:
            if progress.step == crash_at:
                return seen  # a crash: the run ends here
            loss = model(x).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            seen.append((ids.tolist(), x.flatten().tolist(), loss.item()))
            progress.step += 1
            if progress.step % 5 == 0:
                accelerator.save_state(f"{folder}/step_{progress.step}")
        progress.epoch += 1
    return seen


uninterrupted = train("run-a")
before_crash = train("run-b", crash_at=13)  # steps 0 to 12; the last checkpoint: step 10
after_resume = train("run-b", resume=True)  # the next process: from step_10
# The same item ids, augmented values and losses, step for step:
assert before_crash[:10] + after_resume == uninterrupted
