"""How a training run that did not finish ends (docs/robustness.md, "How a run ends"): its tracker runs are marked
KILLED (a SIGINT or SIGTERM) or FAILED (an error) with an end time, never left RUNNING, and the log names the last
checkpoint and the command that resumes from it."""
from __future__ import annotations

import contextlib
import logging
import shlex
from pathlib import Path
from typing import Any, Iterator

from src.utils.console import CONSOLE
from src.utils.entrypoint import received_signal
from src.utils.io import pid_alive, tagged_process

log = logging.getLogger(__name__)


def end_status() -> str:
    """``KILLED`` when the process received SIGINT or SIGTERM, else ``FAILED`` (MLflow's run statuses)."""
    return "KILLED" if received_signal() else "FAILED"


def error_text(err: BaseException) -> str:
    """``<type>: <message>`` of an exception, one line of at most 1,000 characters."""
    return " ".join(f"{type(err).__name__}: {err}".split())[:1000]


def end_tracker_runs(loggers: list[Any], status: str, error: BaseException | None = None) -> None:
    """End each logger's run with ``status`` (rank 0), with ``error`` as an MLflow run's ``error`` tag (also when
    Lightning has already marked it FAILED, so a signal reads KILLED); other loggers are finalized as failed."""
    from lightning.pytorch.loggers import MLFlowLogger
    from lightning.pytorch.utilities import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    for logger in loggers:
        try:
            if isinstance(logger, MLFlowLogger):
                if error is not None:
                    logger.experiment.set_tag(logger.run_id, "error", error_text(error))
                logger.experiment.set_terminated(logger.run_id, status)
            else:
                logger.finalize("failed")
        except Exception as err:  # the run's own error is the one to report
            log.warning("Could not end the %s run: %s", type(logger).__name__, err)


def resume_command(ckpt_path: str, run_id: str | None = None) -> str:
    """The command that resumes this run from ``ckpt_path``: the run's own overrides (from Hydra, when it launched
    the run) with ``ckpt_path`` replaced and, with ``run_id``, ``+logger.mlflow.run_id`` (the curves continue in the
    same MLflow run)."""
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else ["<your overrides>"]
    replaced = ("ckpt_path=", "logger.mlflow.run_id=")
    kept = [shlex.quote(o) for o in overrides if not o.lstrip("+~").startswith(replaced)]
    run = [shlex.quote(f"+logger.mlflow.run_id={run_id}")] if run_id else []
    return " ".join(["python src/train.py", *kept, *run, shlex.quote(f"ckpt_path={ckpt_path}")])


def end_stale_runs(loggers: list[Any]) -> list[str]:
    """Mark as FAILED the runs of each MLflow logger's experiment that are RUNNING although the process that made them
    (tags ``host`` and ``pid``) is gone from this host (SIGKILL, a machine down); returns their ids."""
    import socket

    from lightning.pytorch.loggers import MLFlowLogger

    ended = []
    host = socket.gethostname()
    for logger in loggers:
        if not isinstance(logger, MLFlowLogger):
            continue
        client = logger.experiment
        for run in client.search_runs([logger.experiment_id], filter_string="attributes.status = 'RUNNING'"):
            pid = tagged_process(run.data.tags)
            if run.info.run_id == logger.run_id or pid is None or pid_alive(pid):
                continue
            reason = f"its process {pid} on {host} ended without ending the run (SIGKILL, or a machine down)"
            client.set_tag(run.info.run_id, "error", reason)
            client.set_terminated(run.info.run_id, "FAILED")
            ended.append(run.info.run_id)
            log.warning("MLflow run %s (%s) was RUNNING but its process %s on this host is gone: marked FAILED",
                        run.info.run_id, run.info.run_name, pid)
    return ended


def last_checkpoint_message(trainer: Any, resumed_from: str | None) -> str:
    """Where the last checkpoint of the run is (its iteration and global step) and how to resume from it."""
    import torch
    from lightning.pytorch.loggers import MLFlowLogger

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
    loggers = getattr(trainer, "loggers", None) or []
    run_id = next((logger.run_id for logger in loggers if isinstance(logger, MLFlowLogger)), None)
    return f"The last checkpoint is {path}{where}. Resume with:\n    {resume_command(str(path), run_id)}"


@contextlib.contextmanager
def no_run_dir_on_refusal() -> Iterator[None]:
    """Around an entry point's work: a ``ConfigError`` (a refusal at start-up) leaves no run directory behind: the
    one Hydra made is removed when it holds nothing but Hydra's own files (``.hydra/`` and the log)."""
    import shutil

    from hydra.core.hydra_config import HydraConfig

    from src.utils.config_error import ConfigError

    try:
        yield
    except ConfigError:
        run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None
        if run_dir and run_dir.is_dir() and all(p.name == ".hydra" or p.suffix == ".log" for p in run_dir.iterdir()):
            shutil.rmtree(run_dir, ignore_errors=True)
            log.info("Removed the run directory %s: the run was refused before it wrote anything.", run_dir,
                     extra=CONSOLE)
        raise
