"""GracefulStop: Ctrl-C, SIGTERM or SIGUSR1 (a cluster's end-of-slot warning) end the run at the next RL-step
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
