import contextlib

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from savable_loader.integrations.lightning import (
    LightningSavableDataLoader,
    SavableLoaderCallback,
)


class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return index, torch.tensor([float(index)]) + torch.rand(1)  # a random augmentation


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return LightningSavableDataLoader(
            Items(), batch_size=4, shuffle=True, num_workers=2, seed=0
        )


class Crash(Exception):
    pass


class Model(pl.LightningModule):
    def __init__(self, crash_at=None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.crash_at, self.seen = crash_at, []

    def training_step(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise Crash
        ids, x = batch
        loss = self.layer(x).pow(2).mean()
        self.seen.append((ids.tolist(), x.flatten().tolist(), loss.item()))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def train(folder, crash_at=None, resume=False):
    model = Model(crash_at)
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        callbacks=[
            ModelCheckpoint(dirpath=folder, save_last=True, every_n_train_steps=5),
            SavableLoaderCallback(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with contextlib.suppress(Crash):
        trainer.fit(model, datamodule=Data(), ckpt_path="last" if resume else None)
    return model.seen


uninterrupted = train("run-a")
before_crash = train("run-b", crash_at=13)  # steps 0 to 12; last.ckpt holds step 10
after_resume = train("run-b", resume=True)  # the next process: from last.ckpt
# The same item ids, augmented values and losses, step for step:
assert before_crash[:10] + after_resume == uninterrupted
