import contextlib

import torch
from transformers import TrainerCallback, TrainingArguments

from savable_loader.integrations.hf_trainer import SavableTrainer


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        x = torch.tensor([float(index)]) + torch.rand(1)  # a random augmentation
        return {"ids": index, "x": x}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.seen = []

    def forward(self, ids, x):
        loss = self.layer(x).pow(2).mean()
        self.seen.append((ids.tolist(), x.flatten().tolist(), loss.item()))
        return {"loss": loss}


class Crash(Exception):
    pass


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Crash


def train(folder, crash_at=None, resume=False):
    model = Model()
    args = TrainingArguments(
        output_dir=folder,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        save_steps=5,
        dataloader_num_workers=2,
        ignore_data_skip=True,
        use_cpu=True,  # on CPUs: under torchrun, every process trains (DDP over gloo)
        report_to="none",
        disable_tqdm=True,
        logging_strategy="no",
    )
    trainer = SavableTrainer(
        model=model, args=args, train_dataset=Items(), callbacks=[CrashAt(crash_at)]
    )
    with contextlib.suppress(Crash):
        trainer.train(resume_from_checkpoint=resume)
    return model.seen


uninterrupted = train("run-a")
before_crash = train("run-b", crash_at=13)  # steps 0 to 12; checkpoint-10 is the last
after_resume = train("run-b", resume=True)  # the next process: from checkpoint-10
# The same item ids, augmented values and losses, step for step:
assert before_crash[:10] + after_resume == uninterrupted
