"""Checkpoints written atomically (``src/utils/io.py``) and read in both layouts, so a run under a non-sharded
strategy resumes from a ``trainer=fsdp`` checkpoint directory too."""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from src.utils.checkpoint_loading import is_distributed_checkpoint, load_training_checkpoint
from src.utils.config_error import RunError
from src.utils.io import atomic_file


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves with ``atomic_file``; loads a file or a distributed-checkpoint directory."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        """Raises RunError: the file could not be written (a full disk: torch's error does not say which); the
        checkpoint already at ``path`` is kept, and the message says the space free and needed."""
        try:
            with atomic_file(path, "wb") as f:
                torch.save(checkpoint, f)
        except (OSError, RuntimeError) as err:
            need, free = _size(_tensor_bytes(checkpoint)), _size(shutil.disk_usage(Path(path).parent).free)
            reason = " ".join(str(err).split())[:200]
            kept = "the previous one there is kept" if Path(path).exists() else "no earlier one was at that path"
            raise RunError(f"The checkpoint {path} could not be written ({type(err).__name__}: {reason}); it needs "
                           f"about {need} and its disk has {free} free; {kept}. Free space (or move "
                           "callbacks.model_checkpoint.dirpath) and resume from the last checkpoint") from None

    def load_checkpoint(self, path: str | os.PathLike, **kwargs: Any) -> dict[str, Any]:
        if is_distributed_checkpoint(path):
            return load_training_checkpoint(path)
        return super().load_checkpoint(path, **kwargs)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a checkpoint's nested dicts and lists (what ``torch.save`` writes, give or take)."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
