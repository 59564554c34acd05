"""Checkpoints on RL steps, and GracefulStop.

RLStepCheckpoint writes a checkpoint every `train.ckpt_every` RL steps and `last.ckpt` at the end of the run.

GracefulStop: Ctrl-C, SIGTERM or SIGUSR1 (a cluster's end-of-slot warning) end the run at the next RL-step
boundary with a checkpoint, so `ckpt_path=last` resumes it exactly.

The signal only records a request; after the current RL step has been logged, every rank agrees (any rank
asked -> all stop), `checkpoints/last.ckpt` is written and the trainer stops. A second Ctrl-C while waiting
for the step to end interrupts at once, without a checkpoint.

Under SLURM, Lightning installs its auto-requeue handler for SIGUSR1 before training starts: it saves
`hpc_ckpt_<n>.ckpt` in the trainer's default_root_dir (the run dir) and runs `scontrol requeue <job id>`, and
a job started again with the same run dir restores that checkpoint by itself. This callback takes SIGUSR1
over like the other signals and runs Lightning's handler at the step boundary, after `last.ckpt` is written,
so the requeued job continues from a whole RL step.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class GracefulStop(L.Callback):
    def __init__(self, dirpath: str) -> None:
        self.dirpath = Path(dirpath)
        self.received: int | None = None  # the signal that asked us to stop
        self.checkpoint: Path | None = None  # where the stop checkpoint went
        self.requeued = False  # Lightning's SLURM auto-requeue handler ran after the checkpoint
        self._previous: dict[int, object] = {}

    def _request(self, signum, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # second Ctrl-C: stop now
        self.received = signum
        log.warning("received %s: stopping with a checkpoint after the current RL step", signal.Signals(signum).name)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.received, self.checkpoint, self.requeued = None, None, False
        for signum in SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._request)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.strategy.reduce_boolean_decision(self.received is not None, all=False):
            self.checkpoint = self.dirpath / "last.ckpt"
            trainer.save_checkpoint(self.checkpoint)
            trainer.should_stop = True
            self.received = self.received or signal.SIGTERM  # another rank's signal
            self._requeue(trainer)

    def _requeue(self, trainer: L.Trainer) -> None:
        """Run the SIGUSR1 handler this callback replaced, if there was one: under SLURM with auto-requeue,
        Lightning's, which saves its hpc checkpoint and requeues the job (the `scontrol` call on rank 0 only).
        Every rank runs it when any rank got SIGUSR1, since saving a checkpoint is collective."""
        asked = trainer.strategy.reduce_boolean_decision(self.received == signal.SIGUSR1, all=False)
        handler = self._previous.get(signal.SIGUSR1)
        if asked and callable(handler):  # without SLURM it is SIG_DFL, a number
            handler(signal.SIGUSR1, None)
            self.requeued = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}


class RLStepCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, triggered by RL steps (the module's `rl_step`) instead of optimizer steps.

    An RL step makes `train.minibatches` optimizer steps, fewer when an update is skipped for a non-finite loss or
    gradient, so after one skip Lightning's step counter is never again a multiple of `ckpt_every x minibatches`
    and `every_n_train_steps` would write nothing more. Here every `every_n_rl_steps`-th RL step writes
    `rl_step=<k>.ckpt` (the filename's `{rl_step}`) and `last.ckpt`, and the end of training writes `last.ckpt`
    of the final step, so `ckpt_path=last` always resumes from the newest step. Epoch and validation ends save
    nothing (one epoch is the whole run; evaluation runs inside the RL step).
    `last.ckpt` is always overwritten, also when another writer put it there (GracefulStop, a run stopped by
    skipped updates): Lightning's version counter would take it for a stranger's file and write `last-v1.ckpt`.
    """

    def __init__(self, every_n_rl_steps: int, **kwargs) -> None:
        super().__init__(every_n_train_steps=0, every_n_epochs=0, **kwargs)
        if every_n_rl_steps < 0:
            raise ValueError(f"train.ckpt_every={every_n_rl_steps!r} is invalid: it must be >= 0 (0: only last.ckpt)")
        self.every_n_rl_steps = every_n_rl_steps
        self.last_rl_step_saved: int | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = pl_module.rl_step
        if self.every_n_rl_steps > 0 and step > 0 and step % self.every_n_rl_steps == 0:
            self._save_rl_step(trainer, step, periodic=True)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: see the class docstring."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: see the class docstring."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_rl_step(trainer, pl_module.rl_step, periodic=False)

    def _save_rl_step(self, trainer: L.Trainer, step: int, periodic: bool) -> None:
        if step == self.last_rl_step_saved or trainer.sanity_checking or trainer.fast_dev_run:
            return
        candidates = self._monitor_candidates(trainer)
        candidates["rl_step"] = torch.tensor(step)
        if periodic:
            self._save_topk_checkpoint(trainer, candidates)
        self.last_model_path = self.format_checkpoint_name(candidates, self.CHECKPOINT_NAME_LAST)  # ours: no -v1
        self._save_last_checkpoint(trainer, candidates)
        self.last_rl_step_saved = step
