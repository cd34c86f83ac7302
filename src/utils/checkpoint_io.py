"""Checkpoints written atomically: a crash mid-save never leaves a truncated file in place, and the temporary file
a killed save leaves behind is removed at the next start-up (``remove_stale_temp_files``)."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO


log = logging.getLogger(__name__)

# ``.<name>.tmp<pid>``: the temporary file AtomicCheckpointIO writes before renaming it onto ``<name>``.
_TEMP_FILE = re.compile(r"^\..+\.tmp(?P<pid>\d+)$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def remove_stale_temp_files(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files of checkpoint saves that never finished (the writer was killed, e.g. SIGKILL
    mid-save: a file as large as a checkpoint stays behind, while the previous checkpoint is intact).

    A file counts as stale when its name is ``.<name>.tmp<pid>`` and no process ``<pid>`` runs on this machine, so
    the save in progress of a live run in the same directory is left alone. A missing directory is fine.
    Returns the deleted paths.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.iterdir():
        match = _TEMP_FILE.match(path.name)
        if match and path.is_file() and not _alive(int(match["pid"])):
            size = path.stat().st_size
            path.unlink(missing_ok=True)
            removed.append(path)
            log.warning("Removed %s (%.1f MB), left by a checkpoint save that did not finish", path, size / 1e6)
    return removed


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` to a temporary file (``.<name>.tmp<pid>``) in the same directory, fsync, then ``os.replace``
    onto the target."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
