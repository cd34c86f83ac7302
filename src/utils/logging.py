"""Experiment tracking helpers: loggers, the resolved config, run tags, checkpoints and validation episodes."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

import hydra
from filelock import FileLock
from lightning.pytorch.loggers import Logger, MLFlowLogger
from omegaconf import DictConfig, OmegaConf

from src.utils.io import write_text_atomic

_SQLITE = "sqlite:///"
# MLFlowLogger.log_hyperparams stores str(value)[:250]
MLFLOW_PARAM_CHARS = 250
# Creating a fresh store, migrating it and creating the experiment can wait this long for another run.
STORE_LOCK_TIMEOUT_S = 600

log = logging.getLogger(__name__)


def store_lock(tracking_uri: str | None) -> contextlib.AbstractContextManager:
    """A file lock beside a local sqlite MLflow store (``sqlite:///logs/mlflow.db`` → ``logs/mlflow.db.lock``);
    a no-op context for any other tracking URI (a tracking server serialises its own writes)."""
    if not tracking_uri or not str(tracking_uri).startswith(_SQLITE):
        return contextlib.nullcontext()
    db = Path(str(tracking_uri)[len(_SQLITE):])
    db.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(f"{db}.lock", timeout=STORE_LOCK_TIMEOUT_S)


def build_logger(conf: DictConfig) -> Logger:
    """Instantiate one logger config; an MLflow logger's experiment and run are created under ``store_lock``, as
    runs started together on a fresh sqlite store otherwise race to create and migrate its tables."""
    with store_lock(conf.get("tracking_uri")):
        logger = hydra.utils.instantiate(conf)
        if isinstance(logger, MLFlowLogger):
            _ = logger.run_id  # creates the experiment (if new) and this run
    return logger


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a/b": 1}`` (lists kept as their string form)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def log_config(cfg: DictConfig, loggers: list[Logger]) -> None:
    """Log every resolved config value as a parameter and the whole YAML as ``config.yaml``.

    Parameter values have length limits in MLflow, so the artifact is the faithful copy. A resume continued in its
    MLflow run cannot change a parameter (MLflow refuses): a changed one keeps its first value, the new one becomes
    the tag ``resumed/<key>`` (with a warning), and the YAML goes to ``config.resumed-<n>.yaml``.
    """
    container = OmegaConf.to_container(cfg, resolve=True)
    params = flatten({k: v for k, v in container.items() if k != "hydra"})
    text = OmegaConf.to_yaml(cfg, resolve=True)
    for logger in loggers:
        if not isinstance(logger, MLFlowLogger):
            logger.log_hyperparams(params)
            continue
        client, run_id = logger.experiment, logger.run_id
        run = client.get_run(run_id)
        logged = run.data.params
        log.info("MLflow run %s (%s)%s", run_id, run.info.run_name, ": continued" if logged else "")
        new = {k: v for k, v in params.items() if k not in logged}
        changed = {k: v for k, v in params.items()
                   if k in logged and logged[k] != str(v)[:MLFLOW_PARAM_CHARS]}
        logger.log_hyperparams(new)
        for key, value in changed.items():
            client.set_tag(run_id, f"resumed/{key}", str(value)[:5000])
        if changed:
            log.warning("MLflow run %s already has %d of these parameters with other values (%s); they keep their "
                        "first values and the new ones are the tags resumed/<key>", run_id, len(changed),
                        ", ".join(sorted(changed)[:8]) + (" ..." if len(changed) > 8 else ""))
        name = "config.yaml"
        if logged:
            n = sum(1 for a in client.list_artifacts(run_id) if a.path.startswith("config.resumed-"))
            name = f"config.resumed-{n + 1}.yaml"
        client.log_text(run_id, text, name)


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (e.g. ``"AMD EPYC"``), else ``platform.processor()``."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine_description() -> str:
    """What ran a run, for its ``machine`` tag: the CUDA device's name and count, else the CPU model, core count
    and bf16 support, e.g. ``"AMD EPYC, 2 cores (AVX512, AVX512-BF16)"``."""
    import os

    import torch

    from src.utils.precision_choice import cpu_features

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} × {torch.cuda.device_count()}"
    return f"{cpu_model()}, {os.cpu_count()} cores ({cpu_features()})"


def set_tags(loggers: list[Logger], tags: dict[str, Any]) -> None:
    """Set run tags (e.g. ``precision_used``) on every MLflow run; other loggers get them as parameters."""
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            for key, value in tags.items():
                logger.experiment.set_tag(logger.run_id, key, str(value))
        else:
            logger.log_hyperparams(tags)


def log_checkpoint(path: str | None, loggers: list[Logger]) -> None:
    """Upload a checkpoint file to each MLflow run's ``checkpoints/`` artifacts."""
    if not path or not Path(path).exists():
        return
    for logger in loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, path, artifact_path="checkpoints")
            log.info("Logged %s to MLflow run %s", path, logger.run_id)


EPISODES_FILE = "validation_episodes.csv"
EPISODE_COLUMNS = ("iteration", "task", "episode", "score", "success", "steps", "failed")


def task_text(task: dict[str, Any]) -> str:
    """A task dict as one JSON line (the tip tables' and the validation episodes' ``task`` column)."""
    return json.dumps(task, sort_keys=True, default=str)


def episode_rows(episodes: Iterable, iteration: int) -> list[dict[str, Any]]:
    """One row per ``src.data.rollout.Episode`` (``EPISODE_COLUMNS``; the episode id is its number among all
    ranks' episodes of the evaluation)."""
    return [{"iteration": int(iteration), "task": task_text(e.task), "episode": int(e.id), "score": float(e.score),
             "success": int(bool(e.success)), "steps": len(e.steps), "failed": int(bool(e.failed))} for e in episodes]


def append_rows(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Add ``rows`` to the CSV at ``path`` (created with its header when missing), rewriting it atomically."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=EPISODE_COLUMNS, lineterminator="\n")
    if not old:
        writer.writeheader()
    writer.writerows({c: row[c] for c in EPISODE_COLUMNS} for row in rows)
    write_text_atomic(path, old + buf.getvalue())


def log_validation_episodes(trainer, rows: Sequence[dict[str, Any]]) -> None:
    """Add a validation's rows (all ranks') to ``<run dir>/validation_episodes.csv`` and log the file as an MLflow
    artifact; rank 0 only, nothing during the sanity check."""
    if not trainer.is_global_zero or trainer.sanity_checking:
        return
    path = Path(trainer.default_root_dir) / EPISODES_FILE
    append_rows(path, rows)
    for logger in trainer.loggers:
        if isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, str(path))
