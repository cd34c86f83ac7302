"""Checkpoints written atomically (``src/utils/io.py``): a crash mid-save never leaves a truncated file in place, and
the temporary file a killed save leaves behind is removed at the next start-up (``remove_stale_temp_files``)."""
from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from src.utils.io import atomic_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file (``.<name>.tmp<pid>``) in the same directory, fsync, then ``os.replace``
    onto the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        with atomic_file(path, "wb") as f:
            torch.save(checkpoint, f)
