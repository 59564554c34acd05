"""Checkpoint callbacks (gspo_lab.callbacks) with a real Lightning Trainer and a throwaway one-weight module."""

import signal

import lightning as L
import torch
from torch.utils.data import DataLoader

from gspo_lab.callbacks import GracefulStop, RLStepCheckpoint


class OneWeight(L.LightningModule):
    """One optimizer step per batch, so its `rl_step` (what RLStepCheckpoint counts) is Lightning's global step;
    at RL step `stop_at` it asks `stop` to end the run, as a SIGTERM would."""

    def __init__(self, stop: GracefulStop, stop_at: int | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.stop, self.stop_at = stop, stop_at

    @property
    def rl_step(self) -> int:
        return self.trainer.global_step

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step + 1 == self.stop_at:  # the signal lands during this step
            self.stop.received = signal.SIGTERM
        return (self.weight - batch).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.ones(100, 1), batch_size=1)


def fit(dirpath, stop_at: int | None = None, ckpt_path=None) -> None:
    """Ten RL steps with a checkpoint every 5 (as train.ckpt_every=5 with conf/callbacks/default.yaml)."""
    stop = GracefulStop(str(dirpath))
    checkpoint = RLStepCheckpoint(every_n_rl_steps=5, dirpath=dirpath, filename="{rl_step}", save_last=True,
                                  save_top_k=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=10, callbacks=[stop, checkpoint], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(OneWeight(stop, stop_at), ckpt_path=ckpt_path, weights_only=True)


def test_last_ckpt_stays_the_newest_after_a_stop_before_the_first_periodic_checkpoint(tmp_path):
    """GracefulStop writes last.ckpt at RL step 3, before RLStepCheckpoint has written anything: Lightning's version
    counter then took last.ckpt for someone else's and wrote last-v1.ckpt (step 3 again), and after resuming
    last-v2.ckpt (step 10), so ckpt_path=last and gspo-export kept loading step 3."""
    fit(tmp_path, stop_at=3)
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["last.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 3
    fit(tmp_path, ckpt_path=tmp_path / "last.ckpt")  # ckpt_path=last
    assert sorted(path.name for path in tmp_path.glob("*.ckpt")) == ["last.ckpt", "rl_step=10.ckpt"]
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 10
