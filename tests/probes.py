"""Lightning callbacks that tests add to a real run through its config (``+callbacks.<name>._target_=probes.<Class>``;
``tests/`` is on ``sys.path`` under pytest): an injected crash, and a record of the checkpoint on disk."""
from __future__ import annotations

from pathlib import Path

import torch
from lightning import Callback


class CrashAtIteration(Callback):
    """Raise inside iteration ``iteration``, after its first optimizer step: a run killed mid-iteration, its weights
    half-updated."""

    def __init__(self, iteration: int) -> None:
        self.iteration, self.start_step = int(iteration), -1

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.current_epoch == self.iteration and trainer.global_step > self.start_step:
            raise RuntimeError(f"injected crash in iteration {self.iteration} at global step {trainer.global_step}")


class LastCheckpointProbe(Callback):
    """``seen[k]``: the global step of ``last.ckpt`` on disk when iteration k starts (None: no checkpoint yet)."""

    def __init__(self) -> None:
        self.seen: list[int | None] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        path = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        step = torch.load(path, map_location="cpu", weights_only=True)["global_step"] if path.exists() else None
        self.seen.append(step)


class BatchRecorder(Callback):
    """``batches``: a copy of every training micro-batch as the update receives it (before its training step)."""

    def __init__(self) -> None:
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        import copy

        self.batches.append(copy.deepcopy(batch))
