"""Checkpoints at iteration boundaries that a crashed run can resume from (docs/usage.md#checkpoints-and-resuming).

Lightning's ``ModelCheckpoint`` (2.6) writes ``last.ckpt`` at an epoch end only when a top-k checkpoint was written
at the same step, which never happens with ``save_top_k=0``, and skips the final iteration when ``every_n_epochs``
does not divide ``max_epochs``.
"""
from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint


class IterationCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that writes ``last.ckpt`` after every ``every_n_epochs``-th iteration and after the last
    one (``trainer.max_epochs``), whatever ``save_top_k`` is.

    ``save_top_k=0`` keeps ``last.ckpt`` alone; ``save_top_k=-1`` also keeps ``iter_<n>.ckpt`` of every saved
    iteration. Nothing is saved mid-iteration: a half-updated iteration cannot be resumed exactly.
    """

    def __init__(self, dirpath: str | None, save_top_k: int, every_n_epochs: int, **kwargs) -> None:
        super().__init__(dirpath=dirpath, save_top_k=save_top_k, every_n_epochs=every_n_epochs,
                         **{"filename": "iter_{epoch:04d}", "save_last": True, "save_on_train_epoch_end": True,
                            "auto_insert_metric_name": False, **kwargs})

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._should_skip_saving_checkpoint(trainer) or not self._should_save_on_train_epoch_end(trainer):
            return
        done = trainer.current_epoch + 1  # iterations completed, this one included
        final = trainer.max_epochs is not None and trainer.max_epochs > 0 and done >= trainer.max_epochs
        on_schedule = self._every_n_epochs >= 1 and done % self._every_n_epochs == 0
        if not (on_schedule or final):
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)  # nothing with save_top_k=0
        self._save_last_checkpoint(trainer, candidates)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A run that stopped before ``max_epochs`` (``trainer.should_stop``) still leaves its last iteration."""
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
