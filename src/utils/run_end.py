"""How a training run that did not finish ends (docs/robustness.md, "How a run ends"): its tracker runs are marked
KILLED (a SIGINT or SIGTERM) or FAILED (an error) with an end time, never left RUNNING, and the log names the last
checkpoint and the command that resumes from it."""
from __future__ import annotations

import logging
import shlex
from pathlib import Path
from typing import Any

from src.utils.entrypoint import received_signal

log = logging.getLogger(__name__)


def end_status() -> str:
    """``KILLED`` when the process received SIGINT or SIGTERM, else ``FAILED`` (MLflow's run statuses)."""
    return "KILLED" if received_signal() else "FAILED"


def end_tracker_runs(loggers: list[Any], status: str) -> None:
    """End each logger's run with ``status`` (rank 0): an MLflow run gets the status and an end time (also when
    Lightning has already marked it FAILED, so a signal reads KILLED); other loggers are finalized as failed."""
    from lightning.pytorch.loggers import MLFlowLogger
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    for logger in loggers:
        try:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.set_terminated(logger.run_id, status)
            else:
                logger.finalize("failed")
        except Exception as err:  # the run's own error is the one to report
            log.warning("Could not end the %s run: %s", type(logger).__name__, err)


def resume_command(ckpt_path: str) -> str:
    """The command that resumes this run from ``ckpt_path``: the run's own overrides (from Hydra, when it launched
    the run) with ``ckpt_path`` replaced."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ["<your overrides>"]
    kept = [shlex.quote(o) for o in overrides if not o.lstrip("+~").startswith("ckpt_path=")]
    return " ".join(["python src/train.py", *kept, shlex.quote(f"ckpt_path={ckpt_path}")])


def last_checkpoint_message(trainer: Any, resumed_from: str | None) -> str:
    """Where the last checkpoint of the run is (its iteration and global step) and how to resume from it."""
    import torch

    callback = getattr(trainer, "checkpoint_callback", None) if trainer is not None else None
    path = getattr(callback, "last_model_path", None) or None
    if path is None or not Path(path).exists():
        if not resumed_from:
            return ("This run wrote no checkpoint (it stopped before its first save, at the end of an iteration); "
                    "nothing to resume from.")
        path = resumed_from
    where = ""
    if Path(path).is_file():
        head = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        where = f" (iteration {head.get('iteration')}, global step {head.get('global_step')})"
    return f"The last checkpoint is {path}{where}. Resume with:\n    {resume_command(str(path))}"
