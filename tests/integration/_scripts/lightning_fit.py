"""An unmodified Lightning script for ``perfsdk run``: a Linear layer on 28 random samples in
batches of 8, 6 optimizer steps (2 epochs, 1 validation run of 2 batches, the sanity check)."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(28, 4, generator=g), torch.randn(28, 2, generator=g))
    return DataLoader(data, batch_size=8)


trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=2)
trainer.fit(Tiny(), loader(), loader())
print("optimizer steps:", trainer.global_step)
