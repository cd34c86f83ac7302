"""Checkpoints written atomically (``src/utils/io.py``) and read in both layouts, so a run under a non-sharded
strategy resumes from a ``trainer=fsdp`` checkpoint directory too."""
from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from src.utils.checkpoint_loading import is_distributed_checkpoint, load_training_checkpoint
from src.utils.io import atomic_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves with ``atomic_file``; loads a file or a distributed-checkpoint directory."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        with atomic_file(path, "wb") as f:
            torch.save(checkpoint, f)

    def load_checkpoint(self, path: str | os.PathLike, **kwargs: Any) -> dict[str, Any]:
        if is_distributed_checkpoint(path):
            return load_training_checkpoint(path)
        return super().load_checkpoint(path, **kwargs)
